"""What importing daskwg loads, process by process: the driver's ``import daskwg`` and the
scheduler's daskwg plugins never import torch; the names of ``daskwg.__all__`` come on
first use; Dask's serializers are registered wherever daskwg's values meet Dask."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest
import scheduler_probes
import torch
from conftest import CLICluster, wait_for_workers
from distributed import Client
from distributed.protocol import pickle as dask_pickle
from test_dashboard import dashboard_root, fetch, wait_for
from workers import AddWorker

import daskwg
from daskwg import ClassWithInitArgs, DataProto, WorkerGroup
from daskwg.scheduler.dashboard import DashboardPlugin
from daskwg.scheduler.release import ReleaseOnClientExit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str, stdin: bytes = b"") -> str:
    """Run ``code`` in a fresh interpreter with this checkout's daskwg first on its path;
    its stdout. Fails the test with its stderr if it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


# ---- import daskwg --------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_import_daskwg_alone_does_not_import_torch():
    out = run_fresh(
        """
        import sys
        import daskwg
        print(sorted(m for m in ("torch", "tensordict") if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


@pytest.mark.timeout(300)
def test_import_daskwg_loads_its_dask_config_defaults():
    out = run_fresh(
        """
        import dask
        import daskwg
        print(daskwg.__version__, dask.config.get("daskwg.poll-interval"))
        """
    )
    assert out.split() == [daskwg.__version__, str(__import__("dask").config.get("daskwg.poll-interval"))]


@pytest.mark.timeout(300)
def test_every_name_of_all_is_imported_on_first_use_in_a_fresh_interpreter():
    out = run_fresh(
        """
        import daskwg
        from daskwg import WorkerGroup
        from daskwg.groups.group import WorkerGroup as defined
        assert WorkerGroup is defined
        for name in daskwg.__all__:
            getattr(daskwg, name)
        print(daskwg.protocol.DataProto is daskwg.DataProto, sorted(dir(daskwg)) == sorted([*daskwg.__all__, "__version__"]))
        """
    )
    assert out.split() == ["True", "True"]


def test_an_unknown_name_of_daskwg_raises_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        daskwg.NoSuchThing  # noqa: B018


def test_the_lazy_names_are_all_and_the_type_checking_imports():
    # daskwg/__init__.py names each public name three times: __all__, the map __getattr__
    # reads and the imports type checkers see; they must agree.
    tree = ast.parse(open(os.path.join(ROOT, "daskwg", "__init__.py")).read())
    checked = next(
        n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    typed = {(f".{node.module}", a.name) for node in checked.body for a in node.names}
    lazy = {(module, name) for module, names in daskwg._NAMES_BY_MODULE.items() for name in names}
    assert typed == lazy
    assert sorted(name for _, name in lazy) == sorted(daskwg.__all__)


# ---- the scheduler side -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_scheduler_plugins_unpickle_without_torch():
    # What the scheduler receives from install_plugins (daskwg.groups.install): the
    # scheduler plugins, pickled by Dask. The worker plugin reaches it as bytes, which it
    # only forwards to the workers.
    pickled = dask_pickle.dumps([ReleaseOnClientExit(), DashboardPlugin()])
    out = run_fresh(
        """
        import pickle, sys
        import daskwg.scheduler.dashboard, daskwg.scheduler.release
        plugins = pickle.loads(sys.stdin.buffer.read())
        print([type(p).__name__ for p in plugins])
        print(sorted(m for m in ("torch", "tensordict") if m in sys.modules))
        """,
        stdin=pickled,
    )
    names, loaded = out.split("\n")[:2]
    assert names == "['ReleaseOnClientExit', 'DashboardPlugin']"
    assert loaded == "[]"


@pytest.mark.timeout(600)
def test_a_scheduler_without_torch_serves_a_group_and_its_dashboard_page(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('no torch on this scheduler')\n")
    cluster = CLICluster(2, scheduler_path=str(tmp_path))
    try:
        with Client(cluster.address, timeout=120) as client:
            wait_for_workers(client, 2)
            with pytest.raises(Exception, match="no torch on this scheduler"):
                client.run_on_scheduler(scheduler_probes.import_torch)
            with WorkerGroup(client, ClassWithInitArgs(AddWorker, x=10), world_size=2) as wg:
                plugins = client.run_on_scheduler(scheduler_probes.plugin_names)
                assert {"daskwg-dashboard", "daskwg-release"} <= set(plugins)
                assert wg.foo(x=1, y=2) == [13, 13]
                out = wg.add_rank(DataProto.from_dict({"a": torch.zeros(4)}))
                assert out.batch["a"].tolist() == [0.0, 0.0, 1.0, 1.0]
                assert client.gather(wg.record(7)) == [7, 7]  # a task the scheduler unpickles
                root = dashboard_root(client)
                assert wait_for(lambda: wg.name in fetch(f"{root}/daskwg"))
                assert client.run_on_scheduler(
                    scheduler_probes.loaded, ["daskwg.scheduler.dashboard", "torch"]
                ) == ["daskwg.scheduler.dashboard"]
    finally:
        cluster.close()


# ---- Dask registrations ------------------------------------------------------------------

_REGISTERED = """
    import torch
    from dask.sizeof import sizeof
    from distributed.protocol.serialize import dask_serialize
    from daskwg.serialization.pickling import Packed
    print(dask_serialize.dispatch(torch.Tensor).__module__, sizeof(Packed(b"x" * 10, [bytes(1000)])))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "imported",
    [
        "from daskwg import WorkerGroup",  # the driver
        "import daskwg.plugin.host",  # a worker, unpickling the host plugin
        "import daskwg.plugin.task",  # a worker, running a task-path call
    ],
)
def test_dask_serializers_are_registered_where_daskwg_values_meet_dask(imported):
    out = run_fresh(imported + "\n" + textwrap.dedent(_REGISTERED))
    assert out.split() == ["daskwg.serialization.registration", "1010"]


@pytest.mark.timeout(300)
def test_the_snapshot_reference_counts_are_measured_on_first_use_not_at_import():
    out = run_fresh(
        """
        import torch
        from daskwg.serialization import snapshots
        before = snapshots._calibrated
        packed = snapshots.snapshot({"a": torch.zeros(4)})
        print(before, snapshots._calibrated, len(packed.buffers))
        """
    )
    assert out.split() == ["False", "True", "1"]
