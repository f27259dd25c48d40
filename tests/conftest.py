"""Shared fixtures: real Dask clusters (worker processes), never a mock of Dask."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import dask.config
import pytest
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster

from daskwg.plugin.ports import reserve_port
from daskwg.transport.streams import CallStreams

# Worker processes import the test modules' Worker classes by reference.
sys.path.insert(0, os.path.dirname(__file__))

# A LocalCluster closes the Nanny of a worker that has not re-registered within
# distributed.deploy.lost-worker-timeout (15 s) of its removal. A restarted worker whose
# process needs longer to start (importing torch on a loaded 2-core machine) would lose its
# Nanny for good, and the restart would wait for a worker that never comes back.
dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"})

# A timeout's thread dump goes into the failing test's report (tests/timeout_report.py).
pytest_plugins = ["timeout_report"]

_FIGURES = pytest.StashKey[list]()

#: wg.restart()'s own bound (daskwg.restart-timeout), before it is scaled by busy_factor().
RESTART_TIMEOUT = 120.0


def busy_factor() -> float:
    """How many times longer than on an idle machine starting worker processes may take now:
    the load average per core over the last minute, at least 1 (a 2-core machine at load 40
    gives 20). Bounds that wait for processes to start are multiplied by it, so a busy CI box
    makes a run slower, never a failure."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test's pytest-timeout bound and wg.restart()'s wait, scaled by :func:`busy_factor`
    as the test starts (before pytest-timeout reads the bound)."""
    factor = busy_factor()
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        try:
            seconds = item.config.getini("timeout")
        except ValueError:  # pytest-timeout is not loaded
            seconds = None
    if seconds and factor > 1.0:
        item.add_marker(pytest.mark.timeout(float(seconds) * factor), append=False)
    dask.config.set({"daskwg.restart-timeout": RESTART_TIMEOUT * factor})
    yield


@pytest.fixture(scope="session")
def figure(pytestconfig):
    """``figure(text)``: print a measured figure and list it again at the end of the run
    (measurements are printed, never asserted)."""
    lines = pytestconfig.stash.setdefault(_FIGURES, [])

    def record(text: str) -> None:
        print(text)
        lines.append(text)

    return record


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_FIGURES, [])
    if lines:
        terminalreporter.write_sep("-", "measured figures")
        for line in lines:
            terminalreporter.write_line(line)


def process_cluster(n_workers: int, **kwargs) -> LocalCluster:
    """A LocalCluster of ``n_workers`` processes with one thread each, dashboards on free ports."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        worker_dashboard_address=":0",
        **kwargs,
    )


@pytest.fixture(scope="session")
def cluster4():
    """A 4-worker process cluster shared by tests that leave its workers alive."""
    with process_cluster(4) as cluster:
        yield cluster


@pytest.fixture
def client4(cluster4):
    with Client(cluster4) as client:
        yield client


@pytest.fixture
def fresh_cluster4():
    """A 4-worker cluster of its own, for tests that kill or break workers."""
    with process_cluster(4) as cluster, Client(cluster) as client:
        yield cluster, client


@pytest.fixture
def messages(monkeypatch):
    """How many messages the driver writes on its call streams (our own code, counted): the
    step-plan tests check a replay is one message per worker with it."""
    sent = {"n": 0}
    original = CallStreams.send

    async def counting(self, *args, **kwargs):
        sent["n"] += 1
        return await original(self, *args, **kwargs)

    original_now = CallStreams.send_now

    def counting_now(self, *args, **kwargs):  # written by the calling thread itself
        written = original_now(self, *args, **kwargs)
        sent["n"] += written
        return written

    monkeypatch.setattr(CallStreams, "send", counting)
    monkeypatch.setattr(CallStreams, "send_now", counting_now)
    return sent


def gpu_spec_cluster(devices: list[str], **worker_options) -> SpecCluster:
    """A cluster whose workers see the given ``CUDA_VISIBLE_DEVICES`` strings, as
    dask-cuda sets them (simulated GPUs: nothing touches CUDA)."""
    workers = {
        f"w{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": {"CUDA_VISIBLE_DEVICES": dev},
                "dashboard_address": ":0",
                **worker_options,
            },
        }
        for i, dev in enumerate(devices)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=scheduler)


def free_port() -> int:
    """A port free on every address, below the kernel's ephemeral range (as daskwg draws
    MASTER_PORTs), so no connection's own end takes it before the server binds it."""
    return reserve_port("tcp://127.0.0.1:0", set(), None)


def dask_cli() -> list[str]:
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "dask"]


class CLICluster:
    """``dask scheduler`` and ``dask worker`` started as separate processes."""

    def __init__(
        self,
        n_workers: int,
        extra_scheduler: list[str] = (),
        extra_worker: list[str] = (),
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        scheduler_path: str | None = None,
    ):
        """``scheduler_path``: a directory put first on the scheduler's ``PYTHONPATH``
        only (e.g. one whose ``torch`` package fails to import)."""
        port = free_port()
        url_host = f"[{host}]" if ":" in host else host
        self.address = f"{protocol}://{url_host}:{port}"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
        }
        scheduler_env = env
        if scheduler_path is not None:
            scheduler_env = {**env, "PYTHONPATH": os.pathsep.join([scheduler_path, env["PYTHONPATH"]])}
        self.procs = [
            subprocess.Popen(
                [
                    *dask_cli(),
                    "scheduler",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--dashboard-address",
                    ":0",
                    "--protocol",
                    protocol,
                    *extra_scheduler,
                ],
                env=scheduler_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        self.procs.append(
            subprocess.Popen(
                [
                    *dask_cli(),
                    "worker",
                    self.address,
                    "--nworkers",
                    str(n_workers),
                    "--nthreads",
                    "1",
                    "--dashboard-address",
                    ":0",
                    "--host",
                    host,
                    *extra_worker,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def cli_cluster4():
    cluster = CLICluster(4)
    try:
        yield cluster
    finally:
        cluster.close()


def wait_for_workers(client: Client, n: int, timeout: float = 60) -> None:
    """Until ``client``'s cluster has ``n`` workers, waiting at most ``timeout`` seconds
    times :func:`busy_factor` (worker processes start slowly on a busy machine)."""
    timeout *= busy_factor()
    deadline = time.monotonic() + timeout
    client.wait_for_workers(n, timeout=timeout)
    while len(client.scheduler_info(n_workers=-1)["workers"]) < n and time.monotonic() < deadline:
        time.sleep(0.1)
