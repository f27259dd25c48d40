"""Colocated roles (create_colocated_worker_cls, spawn, fuse), resource pools shared by
several groups, and detached groups, on real Dask worker processes."""

from __future__ import annotations

import uuid

import pytest
import torch
from distributed import Client
from roles import EnvWorker, MeshByBlock, MeshByStride, Policy, Value

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    GroupBrokenError,
    ResourcePool,
    Worker,
    WorkerGroup,
    create_colocated_worker_cls,
    register,
)
from daskwg.groups.colocate import ColocatedWorker

ROLES = {"policy": ClassWithInitArgs(Policy, seed=7), "value": ClassWithInitArgs(Value, seed=70, scale=3.0)}


def _batch(rows: int = 10) -> DataProto:
    gen = torch.Generator().manual_seed(1)
    return DataProto.from_dict({"x": torch.randn(rows, 4, generator=gen)})


@pytest.fixture(scope="module")
def colocated(cluster4):
    with (
        Client(cluster4) as client,
        WorkerGroup(client, create_colocated_worker_cls(ROLES), world_size=4) as wg,
    ):
        yield client, wg


# ---------------------------------------------------------------- colocation


def test_colocated_roles_give_bit_identical_outputs_to_standalone_groups(colocated):
    client, wg = colocated
    roles = wg.spawn(["policy", "value"])
    data = _batch()
    with (
        WorkerGroup(client, ROLES["policy"], world_size=4) as policy,
        WorkerGroup(client, ROLES["value"], world_size=4) as value,
    ):
        expected_policy = policy.forward(data).batch["y"]
        expected_value = value.forward(data).batch["y"]
    torch.testing.assert_close(roles["policy"].forward(data).batch["y"], expected_policy, rtol=0, atol=0)
    torch.testing.assert_close(roles["value"].forward(data).batch["y"], expected_value, rtol=0, atol=0)
    assert not torch.equal(expected_policy, expected_value)


def test_same_named_methods_of_two_roles_stay_apart(colocated):
    _, wg = colocated
    roles = wg.spawn(["policy", "value"])
    assert roles["policy"].whoami() == ["policy0", "policy1", "policy2", "policy3"]
    assert roles["value"].whoami() == ["value0", "value1", "value2", "value3"]
    roles["policy"].set_value("p")
    roles["value"].set_value("v")
    assert roles["policy"].get_value() == ["p"] * 4
    assert roles["value"].get_value() == ["v"] * 4


def test_role_groups_bind_the_roles_methods_under_their_own_names(colocated):
    _, wg = colocated
    roles = wg.spawn(["policy", "value"])
    assert {"forward", "whoami", "init_env", "peer_whoami"} <= set(roles["policy"].method_names)
    assert "init_env" not in roles["value"].method_names
    assert roles["policy"].world_size == 4
    assert roles["policy"].workers == wg.workers


def test_role_instances_are_built_with_the_rank_environment(colocated):
    _, wg = colocated
    envs = wg.spawn(["policy"])["policy"].init_env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["MASTER_PORT"] for e in envs} == {str(wg.master_addr_port[1])}


def test_fuse_sets_role_groups_as_attributes(colocated):
    _, wg = colocated
    wg.fuse(["policy", "value"])
    assert wg.policy.whoami()[1] == "policy1"
    assert wg.value.whoami()[1] == "value1"


def test_a_role_reaches_another_through_fused_worker_dict(colocated):
    _, wg = colocated
    assert wg.spawn(["policy"])["policy"].peer_whoami("value") == ["value0", "value1", "value2", "value3"]


def test_spawn_rejects_an_unknown_role(colocated):
    _, wg = colocated
    with pytest.raises(ValueError, match="critic"):
        wg.spawn(["critic"])


def test_spawn_needs_a_colocated_group(client4):
    with WorkerGroup(client4, EnvWorker, world_size=2) as wg:
        with pytest.raises(TypeError, match="create_colocated_worker_cls"):
            wg.spawn(["actor"])


def test_each_role_dispatches_over_its_own_mesh(client4):
    cls = create_colocated_worker_cls({"block": MeshByBlock, "stride": MeshByStride})
    with WorkerGroup(client4, cls, world_size=4) as wg:
        roles = wg.spawn(["block", "stride"])
        data = DataProto.from_dict({"a": torch.zeros(2)})
        assert roles["block"].tag(data).batch["a"].tolist() == [10, 30]
        assert roles["stride"].tag(data).batch["a"].tolist() == [10, 20]
        assert roles["block"]._dispatch_info["train"] == [0, 0, 1, 1]
        assert roles["stride"]._dispatch_info["train"] == [0, 1, 0, 1]


def test_role_groups_fail_after_the_colocated_group_is_shut_down(client4):
    wg = WorkerGroup(client4, create_colocated_worker_cls(ROLES), world_size=2)
    policy = wg.spawn(["policy"])["policy"]
    wg.shutdown()
    with pytest.raises(GroupBrokenError):
        policy.whoami()


def test_role_names_are_checked_in_the_driver():
    with pytest.raises(ValueError, match="rank"):
        create_colocated_worker_cls({"rank": Policy})
    with pytest.raises(ValueError, match="identifier"):
        create_colocated_worker_cls({"bad name": Policy})
    with pytest.raises(TypeError):
        create_colocated_worker_cls({"policy": Policy(seed=0) if False else 3})


def test_colocated_worker_resolves_prefixed_names_in_process(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    worker = ColocatedWorker({"policy": Policy, "value": Value})
    assert worker.policy_whoami() == "policy1"
    assert worker.value_whoami() == "value1"
    assert worker.policy is worker.fused_worker_dict["policy"]
    with pytest.raises(AttributeError, match="roles"):
        worker.critic_whoami  # noqa: B018


# ---------------------------------------------------------------- resource pools


def test_split_gives_sub_pools_of_consecutive_workers(client4):
    pool = ResourcePool(client4, world_size=4)
    first, second = pool.split([2, 2])
    assert first.workers == pool.workers[:2]
    assert second.workers == pool.workers[2:]
    a, b = second.split(1)
    assert (a.workers, b.workers) == ([pool.workers[2]], [pool.workers[3]])
    with pytest.raises(ValueError):
        pool.split([3, 2])


def test_groups_on_split_pools_restart_ranks_at_zero(client4):
    pool = ResourcePool(client4, world_size=4)
    left, right = pool.split([2, 2])
    with (
        WorkerGroup(client4, ClassWithInitArgs(EnvWorker, tag=0), workers=left) as g1,
        WorkerGroup(client4, ClassWithInitArgs(EnvWorker, tag=100), workers=right) as g2,
    ):
        assert g2.workers == pool.workers[2:]
        assert [e["RANK"] for e in g2.env()] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in g2.env()} == {"2"}
        data = DataProto.from_dict({"a": torch.zeros(4)})
        assert g1.add(data).batch["a"].tolist() == [0, 0, 1, 1]
        assert g2.add(data).batch["a"].tolist() == [100, 100, 101, 101]


def test_groups_on_one_pool_share_worker_processes(client4):
    pool = ResourcePool(client4, world_size=4)
    with (
        WorkerGroup(client4, EnvWorker, workers=pool) as g1,
        WorkerGroup(client4, EnvWorker, workers=pool) as g2,
    ):
        assert [e["pid"] for e in g1.env()] == [e["pid"] for e in g2.env()]
        assert len({e["pid"] for e in g1.env()}) == 4


def test_groups_sharing_a_process_see_their_own_environment_at_every_call(client4):
    pool = ResourcePool(client4, world_size=4)
    _, right = pool.split([2, 2])
    whole = WorkerGroup(client4, EnvWorker, workers=pool, worker_env={"ROLE_ENV": "whole"})
    half = WorkerGroup(client4, EnvWorker, workers=right)
    try:
        for _ in range(3):  # interleaved: the environment is swapped per call
            w, h = whole.env(), half.env()
            assert [e["RANK"] for e in w] == ["0", "1", "2", "3"]
            assert [e["RANK"] for e in h] == ["0", "1"]
            assert [e["pid"] for e in h] == [e["pid"] for e in w[2:]]
            assert {e["WORLD_SIZE"] for e in w} == {"4"} and {e["WORLD_SIZE"] for e in h} == {"2"}
            assert {e["MASTER_PORT"] for e in w} == {str(whole.master_addr_port[1])}
            assert {e["MASTER_PORT"] for e in h} == {str(half.master_addr_port[1])}
            assert {e["ROLE_ENV"] for e in w} == {"whole"}
            assert {e["ROLE_ENV"] for e in h} == {None}
    finally:
        whole.shutdown()
        half.shutdown()


# ---------------------------------------------------------------- detached groups


def test_detached_group_outlives_its_driver_and_keeps_its_state(cluster4):
    name = f"trainer-{uuid.uuid4().hex[:6]}"
    with Client(cluster4) as first:
        wg = WorkerGroup(first, EnvWorker, world_size=4, detached=True, name=name)
        wg.set_value(42)
        workers = wg.workers
    with Client(cluster4) as second:
        again = WorkerGroup.attach(second, name)
        try:
            assert again.workers == workers
            assert again.get_value() == [42, 42, 42, 42]
            assert [e["RANK"] for e in again.env()] == ["0", "1", "2", "3"]
        finally:
            again.shutdown()
        with pytest.raises(ValueError, match=name):
            WorkerGroup.attach(second, name)


def test_detached_colocated_group_spawns_roles_after_attach(cluster4):
    name = f"colocated-{uuid.uuid4().hex[:6]}"
    with Client(cluster4) as first:
        wg = WorkerGroup(first, create_colocated_worker_cls(ROLES), world_size=2, detached=True, name=name)
        wg.spawn(["value"])["value"].set_value(5)
    with Client(cluster4) as second:
        again = WorkerGroup.attach(second, name)
        try:
            roles = again.spawn(["policy", "value"])
            assert roles["value"].get_value() == [5, 5]
            assert roles["policy"].get_value() == [None, None]
        finally:
            again.shutdown()


@pytest.mark.timeout(180)
def test_attach_refuses_a_group_whose_workers_restarted(fresh_cluster4):
    cluster, client = fresh_cluster4
    wg = WorkerGroup(client, EnvWorker, world_size=2, detached=True, name="restarted")
    client.restart_workers([wg.workers[1]])
    with pytest.raises(GroupBrokenError, match="restarted"):
        WorkerGroup.attach(client, "restarted")


def test_spawn_works_for_role_classes_the_workers_cannot_send_back(client4):
    # Classes made at run time (like those of a driver's __main__) pickle by value one
    # way only; spawn must not need them back from a worker.
    def make(letter):
        class Role(Worker):
            @register(dispatch_mode=Dispatch.ONE_TO_ALL)
            def hi(self):
                return letter

        return Role

    cls = create_colocated_worker_cls({"a": make("a"), "b": make("b")})
    with WorkerGroup(client4, cls, world_size=2) as wg:
        roles = wg.spawn(["a", "b"])
        assert roles["a"].hi() == ["a", "a"]
        assert roles["b"].hi() == ["b", "b"]
