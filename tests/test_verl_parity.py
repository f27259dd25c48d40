"""verl's own single-controller tests (``verl/tests/single_controller``) that need no GPU,
ported to daskwg's API with the same expected values. Each docstring names the verl test.

Sizes that verl spreads over 8 GPUs are scaled to the 4 workers of the shared cluster.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from distributed import Client
from roles import (
    BasicsActor,
    DecoratorTestWorker,
    GetenvActor,
    HighLevelActor,
    HybridWorker,
    ModelActor,
    NestedActor,
    PaddingActor,
    SplitActor,
    TransferWorker,
    VerlActor,
    VerlCritic,
)
from tensordict import TensorDict

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    ResourcePool,
    Worker,
    WorkerGroup,
    create_colocated_worker_cls,
)


def add_one(data):
    return data + 1


def test_worker_group_basics(cluster4):
    """verl test_worker_group_basics.py::test_basics (and its ``remote_call_wg``, which
    reattaches to the group by name from another driver)."""
    name = f"worker_group_basic-{uuid.uuid4().hex[:6]}"
    with Client(cluster4) as client:
        wg = WorkerGroup(client, ClassWithInitArgs(BasicsActor, x=2), world_size=4, name=name, detached=True)
        try:
            assert wg.execute_all_sync("foo", y=3) == [5, 5, 5, 5]
            assert client.gather(wg.execute_all_async("foo", y=4)) == [6, 6, 6, 6]
            assert client.gather(wg.foo_one_to_all(x=1, y=2)) == [5, 5, 5, 5]
            assert client.gather(wg.foo_all_to_all(x=[1, 2, 3, 4], y=[5, 6, 7, 8])) == [8, 10, 12, 14]
            with Client(cluster4) as other:
                remote = WorkerGroup.attach(other, name)
                assert remote.foo_custom(x=[1, 2], y=[5, 6]) == [8, 10, 8, 10]
                assert remote.foo_rank_zero(x=1, y=2) == 5
                assert remote.workers == wg.workers
            torch.testing.assert_close(
                wg.execute_func_rank_zero(add_one, torch.ones(2, 2)), torch.ones(2, 2) + 1
            )
        finally:
            wg.shutdown()


def test_auto_padding(client4):
    """verl test_auto_padding_on_cpu.py::test_auto_padding (padding is always on in daskwg,
    so ``DataProtoConfig.auto_padding`` and the per-DataProto flag are not needed)."""
    chunk_size = 4
    for test_size in range(4, 20):
        local_data = DataProto.from_dict(
            {"a": torch.zeros(test_size)}, {"na": np.zeros(test_size, dtype=object)}
        )
        padding_size = (chunk_size - (test_size % chunk_size)) if (test_size % chunk_size > 0) else 0
        local_data.padding(padding_size)  # in place, as in verl
        assert len(local_data) == test_size + padding_size and len(local_data) % chunk_size == 0
        chunked = local_data.chunk(chunk_size)
        assert len(chunked) == chunk_size
        assert all(len(dp) == test_size // chunk_size + bool(test_size % chunk_size) for dp in chunked)

    with WorkerGroup(client4, PaddingActor, world_size=chunk_size) as actor_wg:
        for size in (10, 1, 8):
            na = np.array([str(i) for i in range(size)], dtype=object)
            assert len(actor_wg.add(DataProto.from_dict({"a": torch.zeros(size)}, {"na": na}))) == size
            assert len(actor_wg.add(data=DataProto.from_dict({"a": torch.zeros(size)}, {"na": na}))) == size
            single = DataProto.from_single_dict({"a": torch.zeros(size), "na": na}, auto_padding=True)
            assert len(actor_wg.add(single)) == size
            assert len(actor_wg.add(data=single)) == size


@pytest.fixture
def decorator_wg(client4):
    with WorkerGroup(client4, ClassWithInitArgs(DecoratorTestWorker, initial_value=10), world_size=2) as wg:
        yield wg


def test_decorator_dp_compute(decorator_wg):
    """verl test_decorator_on_cpu.py::test_decorator_dp_compute."""
    data = DataProto(batch=TensorDict({"input": torch.arange(4, dtype=torch.float32)}, batch_size=[4]))
    output = decorator_wg.dp_compute(data)
    assert isinstance(output, DataProto) and "output" in output.batch.keys() and len(output) == 4
    expected = torch.cat([torch.tensor([0.0, 1.0]) + 10 + 0, torch.tensor([2.0, 3.0]) + 10 + 1])
    torch.testing.assert_close(output.batch["output"], expected)


def test_decorator_async_function(client4):
    """verl test_decorator_on_cpu.py::test_decorator_async_function."""
    with WorkerGroup(client4, ClassWithInitArgs(DecoratorTestWorker, initial_value=5), world_size=2) as wg:
        data = DataProto(batch=TensorDict({"input": torch.arange(4, dtype=torch.float32)}, batch_size=[4]))
        future = wg.async_dp_compute(data)
        assert isinstance(future, DataProtoFuture)
        result = future.get()
        assert isinstance(result, DataProto) and len(result) == 4
        expected = torch.cat([torch.tensor([0.0, 1.0]) * 2 + 5 + 0, torch.tensor([2.0, 3.0]) * 2 + 5 + 1])
        torch.testing.assert_close(result.batch["output_async"], expected)


def test_decorator_dp_compute_td(decorator_wg):
    """verl test_decorator_on_cpu.py::test_decorator_dp_compute_td (a jagged nested tensor
    travels through mesh dispatch inside a TensorDict)."""
    position_ids = torch.nested.as_nested_tensor(
        [torch.arange(n).expand(4, n).contiguous() for n in (4, 5, 6, 7)], layout=torch.jagged
    )
    data = TensorDict(
        {"input": torch.arange(4, dtype=torch.float32), "position_ids": position_ids}, batch_size=[4]
    )
    output = decorator_wg.dp_compute_td(data).get()
    assert isinstance(output, TensorDict) and "output" in output.keys() and len(output) == 4
    expected = torch.cat([torch.tensor([0.0, 1.0]) + 10 + 0, torch.tensor([2.0, 3.0]) + 10 + 1])
    torch.testing.assert_close(output["output"], expected)


def get_aux_metrics(self, test_proto):
    sequence_ids = test_proto.batch["sequence_ids"]
    decode_count = [len(sequence_ids[i].tolist()) for i in range(sequence_ids.size(0))]
    return DataProto(
        batch=TensorDict(
            {"sequence_ids": sequence_ids, "decode_count": torch.tensor(decode_count)},
            batch_size=sequence_ids.size(0),
        )
    )


def test_driverfunc_to_worker(client4):
    """verl test_driverfunc_to_worker.py::test."""
    with WorkerGroup(client4, ModelActor, world_size=2) as shard_wg:
        test_proto = DataProto(
            TensorDict({"sequence_ids": torch.ones([8, 2048], dtype=torch.int64)}, batch_size=8),
            meta_info={"query_length": 1536},
        )
        ret_proto1 = shard_wg.execute_with_func_generator(get_aux_metrics, test_proto)
        ret_proto2 = get_aux_metrics(object(), test_proto)
        torch.testing.assert_close(ret_proto1.batch["decode_count"], ret_proto2.batch["decode_count"])


def _colocated_matches_standalone(client, spawn_roles):
    data = DataProto.from_dict({"a": torch.zeros(10)})
    actor_cls = ClassWithInitArgs(VerlActor)
    critic_cls = ClassWithInitArgs(VerlCritic, config={"b": 10})
    pool = ResourcePool(client, world_size=2)
    with (
        WorkerGroup(client, actor_cls, workers=pool) as actor_wg,
        WorkerGroup(client, critic_cls, workers=pool) as critic_wg,
    ):
        expected_actor_output = actor_wg.add(data)
        expected_critic_output = critic_wg.sub(data)
    cls_dict = {"actor": actor_cls, "critic": critic_cls}
    with WorkerGroup(client, create_colocated_worker_cls(cls_dict), workers=pool) as wg_dict:
        actor, critic = spawn_roles(wg_dict, cls_dict.keys())
        torch.testing.assert_close(expected_actor_output.batch, actor.add(data).batch, atol=0, rtol=0)
        torch.testing.assert_close(expected_critic_output.batch, critic.sub(data).batch, atol=0, rtol=0)


def test_colocated_workers(client4):
    """verl test_colocated_workers.py::test_colocated_workers (spawn)."""

    def spawn(wg, roles):
        spawned = wg.spawn(prefix_set=roles)
        return spawned["actor"], spawned["critic"]

    _colocated_matches_standalone(client4, spawn)


def test_colocated_workers_fused(client4):
    """verl test_colocated_workers_fused.py::test_colocated_workers_fused (fuse)."""

    def fuse(wg, roles):
        wg.fuse(roles)
        return wg.actor, wg.critic

    _colocated_matches_standalone(client4, fuse)


def test_fused_workers(client4):
    """verl test_fused_workers_on_cpu.py::test_fused_workers."""
    with WorkerGroup(client4, HybridWorker, world_size=2) as fused_wg:
        fused_wg.fuse(["actor", "critic"])
        x = fused_wg.actor.add(0.1)
        y = fused_wg.critic.sub(x)
        z = fused_wg.foo(0.1)
        assert x == pytest.approx([0.1, 1.1])
        assert y == z


def _split_outputs(client, pools, data_sizes):
    outputs = []
    for idx, (pool, size) in enumerate(zip(pools, data_sizes)):
        with WorkerGroup(client, ClassWithInitArgs(SplitActor, worker_id=idx * 100), workers=pool) as wg:
            outputs.append(
                (wg.world_size, wg.add(DataProto.from_dict({"a": torch.zeros(size)})).batch["a"].tolist())
            )
    return outputs


def test_split_resource_pool_with_split_size(client4):
    """verl test_split_resource_pool.py::test_split_resource_pool_with_split_size (4+4 → 2+2)."""
    pools = ResourcePool(client4, world_size=4).split(2)
    assert _split_outputs(client4, pools, [4, 4]) == [(2, [0, 0, 1, 1]), (2, [100, 100, 101, 101])]


def test_split_resource_pool_with_split_size_list(client4):
    """verl test_split_resource_pool.py::test_split_resource_pool_with_split_size_list ([2, 6] → [1, 3])."""
    pools = ResourcePool(client4, world_size=4).split([1, 3])
    assert _split_outputs(client4, pools, [2, 3]) == [(1, [0, 0]), (3, [100, 101, 102])]


def test_split_resource_pool_with_split_twice(client4):
    """verl test_split_resource_pool.py::test_split_resource_pool_with_split_twice ([2, 4, 2] then 1 → [1, 2, 1] then 1)."""
    rp_1, rp_2, rp_3 = ResourcePool(client4, world_size=4).split([1, 2, 1])
    rp_2_1, rp_2_2 = rp_2.split(1)
    outputs = _split_outputs(client4, [rp_1, rp_2_1, rp_2_2, rp_3], [4, 4, 4, 4])
    assert outputs == [(1, [0.0] * 4), (1, [100.0] * 4), (1, [200.0] * 4), (1, [300.0] * 4)]


def test_get_set_dispatch_collect_cpu(monkeypatch):
    """verl test_get_set_dispatch_collect_cpu.py::test_get_set_dispatch_collect_cpu (a mesh
    name clash is a ValueError, not an AssertionError)."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "12345",
    }.items():
        monkeypatch.setenv(key, value)
    ref = Worker()
    ref._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    actor = Worker()
    actor._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    actor_rollout_ref = Worker()
    actor_rollout_ref.set_dispatch_collect(mesh_name="ref", **ref.get_dispatch_collect())
    actor_rollout_ref.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    assert actor_rollout_ref._query_dispatch_info("ref") == 0
    assert actor_rollout_ref._query_collect_info("ref")
    assert actor_rollout_ref._query_dispatch_info("actor") == 1
    assert not actor_rollout_ref._query_collect_info("actor")
    actor2 = Worker()
    actor2._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    with pytest.raises(ValueError):
        actor_rollout_ref.set_dispatch_collect(mesh_name="actor", **actor2.get_dispatch_collect())


def test_ray_local_envs_basics(client4):
    """verl test_ray_local_envs_on_cpu.py::test_basics (``RAY_LOCAL_WORLD_SIZE`` is ``LOCAL_WORLD_SIZE``)."""
    with WorkerGroup(client4, GetenvActor, world_size=4) as wg:
        assert wg.execute_all_sync("getenv", key="LOCAL_WORLD_SIZE") == ["4", "4", "4", "4"]


def test_customized_worker_env(client4):
    """verl test_ray_local_envs_on_cpu.py::test_customized_worker_env."""
    with WorkerGroup(client4, GetenvActor, world_size=4, worker_env={"test_key": "test_value"}) as wg:
        assert wg.execute_all_sync("getenv", key="test_key") == ["test_value"] * 4
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        WorkerGroup(client4, GetenvActor, world_size=4, worker_env={"WORLD_SIZE": "100"})


def test_data_transfer(client4):
    """verl test_data_transfer.py::test_data_transfer, at CPU size (64 x 1024 instead of
    4096 x 32768, 4 ranks instead of 8): per-rank chunks in, DP_COMPUTE futures out."""
    with WorkerGroup(client4, TransferWorker, world_size=4) as wg:
        data = DataProto.from_dict(tensors={str(i): torch.randint(0, 10000, (64, 1024)) for i in range(2)})
        data_list = data.chunk(wg.world_size)
        output_lst = client4.gather(wg.do_nothing(data_list))
        for input_data, output_data in zip(data_list, output_lst, strict=True):
            for key in input_data.batch.keys():
                assert torch.equal(input_data.batch[key] + 1, output_data.batch[key])


def test_nested_worker(client4):
    """verl test_nested_worker.py::test_nested_worker."""
    with WorkerGroup(client4, ClassWithInitArgs(NestedActor, x=2), world_size=4) as worker_group:
        assert worker_group.get() == [2, 3, 4, 5]
    with WorkerGroup(client4, ClassWithInitArgs(HighLevelActor, x=2), world_size=4) as high_level:
        assert high_level.get() == [2, 3, 4, 5]
