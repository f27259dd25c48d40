"""WorkerGroup end to end on real Dask worker processes (the foundation contract)."""

from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch
from conftest import CLICluster, wait_for_workers
from distributed import Client, Future
from workers import AddWorker, CollectiveWorker

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    DispatchError,
    GroupBrokenError,
    RankError,
    WorkerGroup,
    WorldSizeError,
)


@pytest.fixture
def group(client4):
    with WorkerGroup(client4, ClassWithInitArgs(AddWorker, x=2), world_size=4) as wg:
        yield wg


def test_one_to_all_replicates_arguments(group):
    assert group.foo(x=1, y=2) == [5, 5, 5, 5]


def test_all_to_all_gives_each_rank_its_item(group):
    assert group.foo_all(x=[1, 2, 3, 4], y=[5, 6, 7, 8]) == [8, 10, 12, 14]


def test_execute_rank_zero_returns_a_scalar(group):
    assert group.foo_rank_zero(x=1, y=2) == 5


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]),
        (1, [0]),
        (8, [0, 0, 1, 1, 2, 2, 3, 3]),
    ],
)
def test_dp_compute_proto_pads_and_unpads_uneven_batches(group, rows, expected):
    data = DataProto.from_dict({"a": torch.zeros(rows)})
    out = group.add_rank(data)
    assert out.batch["a"].tolist() == expected


def test_dp_compute_proto_leaves_the_callers_batch_unchanged(group):
    data = DataProto.from_dict({"a": torch.zeros(10)}, non_tensors={"id": list(range(10))})
    group.add_rank(data)
    assert len(data) == 10
    assert data.batch["a"].tolist() == [0.0] * 10
    assert list(data.non_tensor_batch["id"]) == list(range(10))


def test_non_blocking_dp_call_returns_an_unpadded_future(group):
    future = group.add_rank_async(DataProto.from_dict({"a": torch.zeros(10)}))
    assert isinstance(future, DataProtoFuture)
    assert future.get().batch["a"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]


def test_data_proto_future_feeds_the_next_call_without_the_driver(group):
    first = group.add_rank_async(DataProto.from_dict({"a": torch.zeros(8)}))
    second = group.add_rank_async(first)
    assert second.get().batch["a"].tolist() == [0, 0, 2, 2, 4, 4, 6, 6]


def test_every_rank_sees_its_rank_environment(group):
    envs = group.environment()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert envs[0]["MASTER_ADDR"] == "127.0.0.1"
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}


def test_two_groups_get_different_master_ports(client4):
    with (
        WorkerGroup(client4, AddWorker, world_size=4) as a,
        WorkerGroup(client4, AddWorker, world_size=4) as b,
    ):
        port_a = a.environment()[0]["MASTER_PORT"]
        port_b = b.environment()[0]["MASTER_PORT"]
    assert port_a != port_b


def test_worker_env_reaches_every_rank(client4):
    with WorkerGroup(client4, AddWorker, world_size=2, worker_env={"EXTRA": "yes"}) as wg:
        assert [e["EXTRA"] for e in wg.environment()] == ["yes", "yes"]


def test_gloo_and_nccl_sockets_use_the_interface_of_the_workers_dask_address(group):
    # The workers listen on 127.0.0.1, which the loopback interface holds.
    envs = group.environment()
    assert [(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in envs] == [("lo", "lo")] * 4


def test_worker_env_chooses_the_socket_interface_over_daskwg(client4):
    with WorkerGroup(client4, AddWorker, world_size=2, worker_env={"GLOO_SOCKET_IFNAME": "eth7"}) as wg:
        envs = wg.environment()
    assert [(e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"]) for e in envs] == [("eth7", "lo")] * 2


def test_worker_env_may_not_override_rank_variables(client4):
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        WorkerGroup(client4, AddWorker, world_size=4, worker_env={"WORLD_SIZE": "9"})


def test_gloo_all_gather_inside_the_group(client4):
    with WorkerGroup(client4, CollectiveWorker, world_size=4) as wg:
        assert wg.init_process_group() == [True] * 4
        assert wg.all_gather_rank() == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4
        wg.destroy()


def test_non_blocking_calls_run_in_issue_order_on_every_worker(group):
    futures = [group.record(i) for i in range(20)]
    assert all(isinstance(f, Future) for fs in futures for f in fs)
    assert group.get_log() == [list(range(20))] * 4


def test_blocking_and_non_blocking_calls_keep_one_order(group):
    for i in range(10):
        group.record(i, delay=0.01 if i % 3 == 0 else 0.0)
        group.foo(x=i, y=0)
    assert group.get_log() == [list(range(10))] * 4


def test_a_rank_that_raises_gives_rank_error(group):
    with pytest.raises(RankError, match="boom") as info:
        group.fail_on(rank=2)
    assert info.value.rank == 2
    assert info.value.address == group.workers[2]
    assert info.value.method == "fail_on"
    assert "ValueError" in info.value.remote_traceback


def test_group_keeps_working_after_a_rank_error_outside_collectives(group):
    with pytest.raises(RankError):
        group.fail_on(rank=1)
    assert group.foo(x=1, y=2) == [5, 5, 5, 5]


def test_dp_compute_rejects_a_list_of_the_wrong_length_before_running(group):
    with pytest.raises(DispatchError, match="length 3"):
        group.foo_all(x=[1, 2, 3], y=[1, 2, 3, 4])
    assert group.get_log() == [[]] * 4


def test_dp_compute_proto_rejects_a_non_dataproto(group):
    with pytest.raises(DispatchError, match="DataProto"):
        group.add_rank([1, 2, 3])


def test_world_size_larger_than_the_cluster_says_what_it_found(client4):
    with pytest.raises(WorldSizeError, match="asked for 8 ranks, the cluster has 4 workers"):
        WorkerGroup(client4, AddWorker, world_size=8)


def test_unknown_method_name_is_a_clear_error(group):
    with pytest.raises(AttributeError, match="not decorated with @register"):
        group.not_registered()
    with pytest.raises(AttributeError, match="no method 'nope'"):
        group.execute_all_sync("nope")


def test_a_thread_that_made_blocking_calls_ends_without_pending_tasks(group, caplog):
    # Each driver thread's blocking calls run on a private event loop; when the thread ends
    # its call streams' reader tasks must end with it, not be destroyed pending (asyncio
    # logs "Task was destroyed but it is pending!", seen at a benchmark child's exit).
    def work():
        for _ in range(2):
            assert group.foo(x=1, y=2) == [5] * group.world_size

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for _ in range(3):
            thread = threading.Thread(target=work)
            thread.start()
            thread.join(timeout=60)
            assert not thread.is_alive()
        gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def test_calls_after_shutdown_raise(client4):
    wg = WorkerGroup(client4, AddWorker, world_size=2)
    wg.shutdown()
    with pytest.raises(GroupBrokenError, match="shut down"):
        wg.foo(x=1, y=2)


def test_execute_all_splits_lists_of_world_size(group):
    assert group.execute_all_sync("foo", [1, 2, 3, 4], [0, 0, 0, 0]) == [3, 4, 5, 6]
    assert [f.result() for f in group.execute_all_async("foo", 1, 2)] == [5, 5, 5, 5]
    assert group.execute_rank_zero_sync("foo", 1, 2) == 5


def test_group_on_a_cluster_started_with_the_dask_command_line():
    cluster = CLICluster(4)
    try:
        with Client(cluster.address, timeout=60) as client:
            wait_for_workers(client, 4)
            with WorkerGroup(client, ClassWithInitArgs(AddWorker, x=2), world_size=4) as wg:
                assert wg.foo(x=1, y=2) == [5, 5, 5, 5]
    finally:
        cluster.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("call", "why"),
    [
        (lambda wg: wg.foo(1), "missing a required argument: 'y'"),
        (lambda wg: wg.foo(1, 2, 3), "too many positional arguments"),
        (lambda wg: wg.foo(1, 2, z=2), "got an unexpected keyword argument 'z'"),
        (lambda wg: wg.foo_rank_zero(x=1), "missing a required argument: 'y'"),
    ],
)
def test_arguments_the_method_does_not_take_are_refused_before_any_rank_runs(group, call, why):
    with pytest.raises(
        TypeError, match=rf"AddWorker\.\w+\(x, y\) cannot take the arguments of this call \({why}\)"
    ):
        call(group)
    assert group.foo(1, 2) == [5, 5, 5, 5]  # nothing was queued: the next call answers


@pytest.mark.timeout(60)
def test_init_arguments_the_class_does_not_take_are_refused_before_any_rank_is_built(client4):
    with pytest.raises(
        TypeError, match=r"AddWorker\(x: .int. = 2\) cannot be built .*unexpected keyword argument 'y'"
    ):
        WorkerGroup(client4, ClassWithInitArgs(AddWorker, y=3), world_size=2)
