"""local_cluster(): LocalCUDACluster with GPUs and dask-cuda, else a process LocalCluster."""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest
from distributed import Client, LocalCluster
from workers import AddWorker

import daskwg
from daskwg.cluster import gpu_count

needs_gpu = pytest.mark.skipif(
    gpu_count() == 0 or importlib.util.find_spec("dask_cuda") is None,
    reason="needs an NVIDIA GPU and dask-cuda (pip install 'daskwg[cuda]')",
)


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has GPUs: local_cluster() picks LocalCUDACluster")
def test_local_cluster_without_gpus_is_one_process_per_worker_with_one_thread():
    samplers = _samplers()
    with daskwg.local_cluster(n_workers=2, dashboard_address=":0") as cluster, Client(cluster) as client:
        assert isinstance(cluster, LocalCluster)
        workers = client.scheduler_info(n_workers=-1)["workers"].values()
        assert [w["nthreads"] for w in workers] == [1, 1]
        pids = client.run(lambda: __import__("os").getpid())
        assert len(set(pids.values())) == 2
        with daskwg.WorkerGroup(client, AddWorker, world_size=2) as wg:
            assert wg.foo(x=1, y=2) == [5, 5]
        # Dask's statistical profiler is off: no 10 ms sampling callback on the workers'
        # event loops, and no thread sampling the loop of this process's servers
        # (scheduler, nannies; distributed starts none on Python 3.11 anyway).
        assert client.run(_profiling) == {w: (False, False) for w in wg.workers}
        assert _samplers() == samplers
        # Event loops' responsiveness is measured once a second, not every 20 ms: on the
        # workers, and on the scheduler this process runs.
        assert set(client.run(_tick_interval).values()) == {1.0}
        assert cluster.scheduler._tick_interval == 1.0


def _tick_interval(dask_worker=None) -> float:
    return dask_worker._tick_interval


def _samplers() -> int:
    """Threads of this process sampling an event loop for Dask's profiler."""
    return sum(t.name == "Profile" for t in threading.enumerate())


def _profiling(dask_worker=None) -> tuple[bool, bool]:
    import dask.config

    return (
        dask.config.get("distributed.worker.profile.enabled"),
        "profile" in dask_worker.periodic_callbacks,
    )


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has GPUs: local_cluster() picks LocalCUDACluster")
def test_local_cluster_keeps_dask_s_profiler_when_the_caller_asks_for_it():
    keep = {"distributed": {"worker": {"profile": {"enabled": True}}}}
    samplers = _samplers()
    with (
        daskwg.local_cluster(n_workers=1, dashboard_address=":0", config=keep) as cluster,
        Client(cluster) as client,
    ):
        assert list(client.run(_profiling).values()) == [(True, True)]
        # distributed samples its servers' loop in a thread, except on Python 3.11
        assert _samplers() == samplers + (sys.version_info[:2] != (3, 11))


@needs_gpu
def test_local_cluster_with_gpus_is_a_local_cuda_cluster_with_ranks_per_gpu():
    from dask_cuda import LocalCUDACluster

    n = gpu_count()
    with daskwg.local_cluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        assert isinstance(cluster, LocalCUDACluster)
        with daskwg.WorkerGroup(client, AddWorker, world_size=n) as wg:
            devices = wg.execute_all_sync("get_cuda_visible_devices")
    assert [d.split(",")[0] for d in devices] == [str(i) for i in range(n)]


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has GPUs: local_cluster() picks LocalCUDACluster")
@pytest.mark.parametrize("kwargs", [{"config": {"distributed.worker.daemon": False}}, {"env": {"A": "1"}}])
def test_local_cluster_in_process_refuses_nanny_only_arguments_before_starting(kwargs):
    # Dask's own LocalCluster(processes=False, config=...) fails with a TypeError from
    # deep inside Server.__init__, after the scheduler started.
    threads = set(threading.enumerate())
    with pytest.raises(ValueError, match=rf"processes=False\) got {next(iter(kwargs))}=.*dask.config.set"):
        daskwg.local_cluster(n_workers=1, processes=False, dashboard_address=":0", **kwargs)
    assert set(threading.enumerate()) <= threads


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has GPUs: local_cluster() picks LocalCUDACluster")
def test_local_cluster_in_process_runs_a_group():
    with (
        daskwg.local_cluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        daskwg.WorkerGroup(client, AddWorker, world_size=1) as wg,
    ):
        assert wg.foo(x=1, y=2) == [5]
