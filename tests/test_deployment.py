"""Groups on a cluster started with the ``dask`` command line, as the README's recipe
starts one (``dask worker ... --nthreads 1``, no ``--name``): restart, and workers whose
daskwg, torch or wire format differ from the driver's."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import dask_cli, free_port, wait_for_workers
from distributed import Client
from hang_workers import HangWorker

from daskwg import VersionMismatchError, WorkerGroup
from daskwg.groups.install import version_of
from daskwg.wire import messages as wire

TESTS_DIR = os.path.dirname(__file__)


def _fake_versions(directory: str, versions: dict[str, str]) -> str:
    """A directory whose distribution metadata claims ``versions`` (put first on a
    worker's ``PYTHONPATH``, it is what ``importlib.metadata`` finds there, while the
    code imported stays this checkout's)."""
    for name, version in versions.items():
        info = os.path.join(directory, f"{name}-{version}.dist-info")
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return directory


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``dask scheduler`` and two ``dask worker`` processes started without ``--name``
    (named by their addresses): one as installed, one whose environment says daskwg
    0.0.9 and torch 1.13.1."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    old = _fake_versions(str(tmp_path_factory.mktemp("old")), {"daskwg": "0.0.9", "torch": "1.13.1"})
    worker = [
        *dask_cli(),
        "worker",
        address,
        "--nthreads",
        "1",
        "--dashboard-address",
        ":0",
        "--host",
        "127.0.0.1",
    ]
    procs = [
        subprocess.Popen(
            [
                *dask_cli(),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dashboard-address",
                ":0",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    client = Client(address, timeout=60)
    try:
        wait_for_workers(client, 1)
        (plain,) = client.scheduler_info(n_workers=-1)["workers"]
        old_env = {**env, "PYTHONPATH": os.pathsep.join([old, env["PYTHONPATH"]])}
        procs.append(
            subprocess.Popen(worker, env=old_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        wait_for_workers(client, 2)
        (skewed,) = set(client.scheduler_info(n_workers=-1)["workers"]) - {plain}
        yield client, plain, skewed
    finally:
        client.close()
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _plain(client: Client, skewed: str) -> str:
    """The worker that is not the skewed one (its address changes when it restarts)."""
    (plain,) = set(client.scheduler_info(n_workers=-1)["workers"]) - {skewed}
    return plain


def test_a_worker_with_another_daskwg_and_torch_is_refused_naming_both_versions(cli):
    client, _, skewed = cli
    with pytest.raises(VersionMismatchError) as info:
        WorkerGroup(client, HangWorker, workers=[skewed])
    message = str(info.value)
    assert f"daskwg 0.0.9 there, {version_of('daskwg')} here" in message, message
    assert f"torch 1.13.1 there, {version_of('torch')} here" in message, message
    assert skewed in message and "Install the same daskwg wheel" in message


def _speak_wire_format(number: int | None) -> None:
    """Make this worker's host answer as if it spoke wire format ``number`` (``None``: its own)."""
    from daskwg.wire import messages as wire

    own = wire.__dict__.setdefault("_own_wire_format", wire.WIRE_FORMAT)
    wire.WIRE_FORMAT = own if number is None else number


def test_a_worker_speaking_another_wire_format_refuses_to_build_the_rank(cli):
    client, _, skewed = cli
    plain = _plain(client, skewed)
    with WorkerGroup(client, HangWorker, workers=[plain]):
        pass  # the host plugin is in place
    client.run(_speak_wire_format, 0, workers=[plain])
    try:
        with pytest.raises(VersionMismatchError) as info:
            WorkerGroup(client, HangWorker, workers=[plain])
    finally:
        client.run(_speak_wire_format, None, workers=[plain])
    assert f"the driver speaks daskwg wire format {wire.WIRE_FORMAT}" in str(info.value)
    assert "this worker wire format 0" in str(info.value)
    with WorkerGroup(client, HangWorker, workers=[plain]) as wg:
        assert len(wg.pid()) == 1


@pytest.mark.timeout(300)
def test_restart_brings_back_cli_workers_started_without_a_name(cli):
    # Such workers are named by their address, and come back on a new port: the restart
    # finds them by their Nanny, whose address stays.
    client, _, skewed = cli
    wg = WorkerGroup(client, HangWorker, workers=[_plain(client, skewed)])
    try:
        old_address, old_pid = wg.workers[0], wg.pid()[0]
        t0 = time.monotonic()
        wg.restart()
        print(f"\n[restart] CLI worker without --name: back after {time.monotonic() - t0:.2f} s")
        assert wg.pid()[0] != old_pid and not wg.is_broken
        print(f"[restart] its address {old_address} -> {wg.workers[0]}")
        assert wg.sleep(0) == [0]
    finally:
        wg.shutdown()
