"""Ranks on in-process workers (``local_cluster(processes=False)``): one process has one
``os.environ``, so a group is refused where two ranks would share it; a rank in the driver's
own process sees its variables during its calls and leaves the driver's environment as it
was; results reach ``client.gather`` and tasks as values."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import Client

import daskwg
from daskwg import DataProto, Dispatch, RankError, Worker, WorkerGroup, register
from daskwg.cluster import gpu_count

pytestmark = pytest.mark.skipif(
    gpu_count() > 0, reason="this machine has GPUs: local_cluster() picks LocalCUDACluster"
)

#: Ranks whose __init__ ran (the workers run in this process).
STARTED: list[int] = []

_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DASKWG_TEST_FOO")


class EnvWorker(Worker):
    def __init__(self):
        super().__init__()
        STARTED.append(self.rank)
        self.at_init = {k: os.environ.get(k) for k in ("RANK", "DASKWG_TEST_FOO")}

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def env(self):
        return self.at_init, {k: os.environ.get(k) for k in ("RANK", "DASKWG_TEST_FOO")}

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    async def env_async(self):
        return os.environ.get("RANK"), os.environ.get("DASKWG_TEST_FOO")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def value(self, x):
        return {"rank": self.rank, "x": x}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def total(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"s": data.batch["y"].sum(dim=0, keepdim=True).expand(len(data))})


@pytest.fixture(scope="module")
def inproc():
    with (
        daskwg.local_cluster(n_workers=3, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        yield client


def _driver_env() -> dict:
    return {k: os.environ.get(k) for k in _KEYS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_group_of_several_in_process_ranks_is_refused_before_any_rank_runs(inproc, world_size):
    before, STARTED[:] = _driver_env(), []
    with pytest.raises(ValueError, match=r"would run in one process .*one os.environ.*processes=False"):
        WorkerGroup(inproc, EnvWorker, world_size=world_size, worker_env={"DASKWG_TEST_FOO": "bar"})
    assert STARTED == []
    assert _driver_env() == before


def test_a_pool_of_in_process_workers_is_refused_the_same_way(inproc):
    pool = daskwg.ResourcePool(inproc, world_size=2)
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] would run in one process"):
        WorkerGroup(inproc, EnvWorker, workers=pool)


def test_an_in_process_rank_sees_its_variables_and_the_driver_keeps_its_own(inproc):
    before = _driver_env()
    with WorkerGroup(inproc, EnvWorker, world_size=1, worker_env={"DASKWG_TEST_FOO": "bar"}) as wg:
        assert _driver_env() == before
        assert wg.env() == [
            ({"RANK": "0", "DASKWG_TEST_FOO": "bar"}, {"RANK": "0", "DASKWG_TEST_FOO": "bar"})
        ]
        assert wg.env_async() == [("0", "bar")]
        assert _driver_env() == before


def test_an_in_process_rank_leaves_a_variable_the_driver_set_as_the_driver_set_it(inproc, monkeypatch):
    monkeypatch.setenv("DASKWG_TEST_FOO", "driver's")
    with WorkerGroup(inproc, EnvWorker, world_size=1, worker_env={"DASKWG_TEST_FOO": "bar"}) as wg:
        assert wg.env()[0][1] == {"RANK": "0", "DASKWG_TEST_FOO": "bar"}
        assert os.environ["DASKWG_TEST_FOO"] == "driver's"


def test_two_in_process_workers_do_not_host_ranks_at_once(inproc):
    workers = daskwg.ResourcePool(inproc).workers
    with WorkerGroup(inproc, EnvWorker, workers=[workers[0]]) as first:
        STARTED[:] = []
        with pytest.raises(RankError, match=r"another Dask worker of this process .* one os.environ"):
            WorkerGroup(inproc, EnvWorker, workers=[workers[1]])
        assert STARTED == []
        # A second group on the same worker shares its host thread: calls take turns.
        with WorkerGroup(
            inproc, EnvWorker, workers=[workers[0]], worker_env={"DASKWG_TEST_FOO": "b"}
        ) as second:
            assert second.env()[0][1] == {"RANK": "0", "DASKWG_TEST_FOO": "b"}
            assert first.env()[0][1] == {"RANK": "0", "DASKWG_TEST_FOO": None}
    # Once the first worker hosts nothing, another one may.
    with WorkerGroup(inproc, EnvWorker, workers=[workers[1]]) as wg:
        assert wg.env()[0][1]["RANK"] == "0"


def test_client_gather_and_tasks_get_values_of_in_process_results(inproc):
    with WorkerGroup(inproc, EnvWorker, world_size=1) as wg:
        futures = wg.value(7)
        assert inproc.gather(futures) == [{"rank": 0, "x": 7}]
        assert inproc.submit(lambda v: type(v).__name__, futures[0]).result() == "dict"
        assert daskwg.get(futures) == [{"rank": 0, "x": 7}]


def test_in_process_data_proto_futures_resolve_to_batches(inproc):
    with WorkerGroup(inproc, EnvWorker, world_size=1) as wg:
        future = wg.make(DataProto.from_dict({"x": torch.arange(6)}))
        assert torch.equal(future.get().batch["y"], torch.arange(6) * 2)
        assert wg.total(future).batch["s"].tolist() == [30] * 6
        assert all(isinstance(v, DataProto) for v in inproc.gather(future.futures))
