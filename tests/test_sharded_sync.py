"""Sharded weight sync (``daskwg.sync``) and DTensors crossing processes.

Two trainer ranks hold a small MLP sharded with FSDP2 (``fully_shard``, gloo); four rollout
ranks hold a full copy, zeroed until a sync fills it. One 6-worker cluster and one set of
groups serve the module; each test declares its own collective.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

import pytest
import torch
from conftest import process_cluster
from distributed import Client
from sync_workers import Rollout, Trainer

import daskwg
from daskwg.serialization.dtensor import LocalShard
from daskwg.sync import peer_memory

pytestmark = pytest.mark.timeout(300)

WIDTH, LAYERS = 64, 4
_names = itertools.count()


@pytest.fixture(scope="module")
def groups():
    with process_cluster(6) as cluster, Client(cluster) as client:
        pool = daskwg.ResourcePool(client, world_size=6)
        trainer_pool, rollout_pool = pool.split([2, 4])
        trainer = daskwg.WorkerGroup(client, Trainer, workers=trainer_pool)
        rollout = daskwg.WorkerGroup(client, Rollout, workers=rollout_pool)
        trainer.init(WIDTH, LAYERS, frozen=2)
        rollout.init(WIDTH, LAYERS)
        yield trainer, rollout
        trainer.shutdown()
        rollout.shutdown()


def sync(trainer, rollout, name: str, bucket_bytes: int, delta: bool = False, same_host: bool = True):
    sent = trainer.send(name, bucket_bytes, delta, same_host)
    got = rollout.receive(name, trainer.world_size, same_host)
    return daskwg.get([sent, got])


# ---- DTensors through every path ---------------------------------------------------------


def check_shards(pieces: list) -> None:
    """Each rank's piece is a LocalShard of its own rows only; together they are the tensor."""
    assert [type(p) for p in pieces] == [LocalShard, LocalShard]
    for rank, piece in enumerate(pieces):
        assert tuple(piece.local.shape) == (WIDTH // 2, WIDTH)
        assert piece.offset == (rank * WIDTH // 2, 0)
        assert piece.shape == (WIDTH, WIDTH)
        assert repr(piece.placements) == "(Shard(dim=0),)"
        assert piece.mesh_shape == (2,) and piece.mesh_coordinate == (rank,)
        # only the shard's own bytes came, not a storage holding the full tensor
        assert piece.local.untyped_storage().nbytes() == piece.local.nbytes
    torch.manual_seed(0)
    assert torch.equal(LocalShard.assemble(pieces), torch.nn.Linear(WIDTH, WIDTH).weight.detach())


def test_a_dtensor_returned_by_a_blocking_call_arrives_as_its_local_shard(groups):
    trainer, _ = groups
    check_shards(trainer.weight())


def test_a_dtensor_arrives_as_its_local_shard_through_futures(groups):
    trainer, _ = groups
    check_shards(daskwg.get(trainer.weight_later()))


def test_a_dtensor_in_meta_info_arrives_as_its_local_shard(groups):
    trainer, _ = groups
    out = trainer.weight_in_meta(daskwg.DataProto.from_dict({"x": torch.arange(4)}))
    check_shards(out.meta_info["metrics"]["weight"])


def test_a_dtensor_arrives_as_its_local_shard_through_a_plan(groups):
    trainer, _ = groups
    with daskwg.plan("dtensor") as plan:
        plan.output(trainer.weight(plan.input("scale")))
    check_shards(plan.run(scale=1.0))


def test_a_sharded_state_dict_arrives_as_local_shards(groups):
    trainer, _ = groups
    states = trainer.state()
    assert sorted(states[0]) == sorted(f"{i}.{p}" for i in range(LAYERS) for p in ("weight", "bias"))
    assert all(isinstance(v, LocalShard) for state in states for v in state.values())
    assert tuple(states[1]["3.bias"].local.shape) == (WIDTH // 2,)


def test_a_dtensor_future_given_to_another_group_arrives_there_as_a_local_shard(groups):
    trainer, rollout = groups
    kind, pieces = rollout.describe(trainer.weight_later()[1])[0]
    assert kind == "LocalShard" and pieces == [((WIDTH // 2, WIDTH), "(Shard(dim=0),)")]


def test_assembling_pieces_that_miss_a_rank_says_which_are_needed(groups):
    trainer, _ = groups
    with pytest.raises(ValueError, match="pass the piece of every rank"):
        LocalShard.assemble(trainer.weight()[:1])


# ---- the sharded sync ------------------------------------------------------------------------


@pytest.fixture
def collective(groups):
    trainer, rollout = groups
    with daskwg.create_collective_group([trainer, rollout], name=f"weights-{next(_names)}") as group:
        yield group.name


#: Every guarantee holds on both routes: the same-host one (each rollout rank reads the
#: trainer ranks' memory) and the chain on the collective's sockets (ranks on other hosts).
routes = pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "chain"])


@routes
def test_every_rollout_rank_holds_the_trainers_full_weights_after_a_sync(groups, collective, same_host):
    trainer, rollout = groups
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    full = trainer.full_digest()[0]
    assert [r["full_digest"] for r in got] == [full] * 4
    assert [r["digests"] for r in got] == [[s["digest"] for s in sent]] * 4


@routes
def test_a_sync_after_a_training_step_brings_the_new_weights(groups, collective, same_host):
    trainer, rollout = groups
    sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    trainer.train()
    _, got = sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    assert [r["full_digest"] for r in got] == [trainer.full_digest()[0]] * 4


@routes
def test_a_sync_after_the_weights_moved_in_memory_reads_and_writes_where_they_are_now(
    groups, collective, same_host
):
    # Both sides keep a sync's layout for the next (the trainer's pieces, the rollout's
    # ranges): a parameter given new memory must be found there, not at its old address.
    trainer, rollout = groups
    sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    trainer.move_weights()
    rollout.move_weights()
    trainer.train()
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    assert [r["full_digest"] for r in got] == [trainer.full_digest()[0]] * 4
    assert [r["digests"] for r in got] == [[s["digest"] for s in sent]] * 4


@routes
def test_a_delta_sync_into_moved_rollout_weights_says_to_forget_and_the_collective_goes_on(
    groups, collective, same_host
):
    trainer, rollout = groups
    sync(trainer, rollout, collective, bucket_bytes=4096, delta=True, same_host=same_host)
    trainer.train()  # the frozen layers do not change: a delta sync does not send them
    rollout.move_weights()  # ... and the rollout's copy of them is gone
    sent = trainer.send(collective, 4096, True, same_host)
    got = rollout.receive(collective, trainer.world_size, same_host)
    with pytest.raises(daskwg.RankError, match="forget"):
        daskwg.get(got)
    if same_host:  # the rollout ranks' failure reaches the trainer ranks at once
        with pytest.raises(daskwg.RankError, match="could not take it"):
            daskwg.get(sent)
    else:  # every stream was taken before the rollout rank raised
        daskwg.get(sent)
    trainer.forget(collective)
    rollout.forget(collective)
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096, delta=True, same_host=same_host)
    assert [r["full_digest"] for r in got] == [trainer.full_digest()[0]] * 4


def test_a_rollout_rank_that_cannot_take_a_sync_fails_the_trainers_at_once_and_the_next_works(
    groups, collective
):
    trainer, rollout = groups
    sync(trainer, rollout, collective, bucket_bytes=4096)
    started = time.monotonic()
    sent = trainer.send(collective, 4096)
    got = rollout.receive(collective, trainer.world_size, True, "0.weight")
    with pytest.raises(daskwg.RankError, match="lack"):
        daskwg.get(got)
    with pytest.raises(daskwg.RankError, match="could not take it"):
        daskwg.get(sent)
    assert time.monotonic() - started < 20  # not the collective's timeout
    _, got = sync(trainer, rollout, collective, bucket_bytes=4096)
    assert [r["full_digest"] for r in got] == [trainer.full_digest()[0]] * 4


@routes
def test_a_trainer_rank_sends_its_shard_once_to_four_rollout_ranks(groups, collective, same_host):
    trainer, rollout = groups
    sent, _ = sync(trainer, rollout, collective, bucket_bytes=4096, same_host=same_host)
    for report in sent:
        assert report["egress"] <= 1.25 * report["shard_bytes"], report


@routes
def test_the_sync_grows_a_ranks_peak_memory_by_about_one_bucket(groups, collective, same_host):
    trainer, rollout = groups
    bucket = 1 << 20
    # a model of 4 x (1024 x 1024) floats: 8 MiB of shard per trainer rank, 16 MiB per rollout rank
    trainer.init(1024, 4)
    rollout.init(1024, 4)
    try:
        sent, got = sync(trainer, rollout, collective, bucket_bytes=bucket, same_host=same_host)
        assert all(r["shard_bytes"] >= 8 * bucket for r in sent)
        for report in sent + got:
            assert report["rss_growth"] <= 2 * bucket + (2 << 20), report
    finally:
        trainer.init(WIDTH, LAYERS, frozen=2)
        rollout.init(WIDTH, LAYERS)


@routes
def test_a_delta_sync_sends_only_changed_shards_and_equals_a_full_sync(groups, collective, same_host):
    trainer, rollout = groups
    sync(trainer, rollout, collective, bucket_bytes=4096, delta=True, same_host=same_host)
    trainer.train()  # layers 0 and 1 are frozen: half the bytes do not change
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096, delta=True, same_host=same_host)
    assert all(0 < r["changed_bytes"] <= r["shard_bytes"] // 2 for r in sent)
    full = trainer.full_digest()[0]
    assert [r["full_digest"] for r in got] == [full] * 4
    assert [r["digests"] for r in got] == [[s["digest"] for s in sent]] * 4


def test_ranks_of_one_host_take_the_same_host_route_and_may_be_kept_on_the_chain(groups, collective):
    trainer, rollout = groups
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096)
    assert {r["route"] for r in sent + got} == {"same-host"}
    assert all(r["buckets"] == 0 for r in sent + got)
    sent, got = sync(trainer, rollout, collective, bucket_bytes=4096, same_host=False)
    assert {r["route"] for r in sent + got} == {"chain"}


def test_a_sync_with_no_rollout_rank_left_says_how_the_members_are_counted(groups, collective):
    _, rollout = groups
    with pytest.raises(daskwg.RankError, match="at least one rollout rank follows them"):
        daskwg.get(rollout.receive(collective, 6))


def test_a_process_is_readable_only_where_its_probe_reads_back_with_its_token(groups):
    trainer, _ = groups
    probe = trainer.probe()[0]
    assert peer_memory.can_read(probe)
    assert not peer_memory.can_read(dataclasses.replace(probe, token=probe.token ^ 1))
    assert not peer_memory.can_read(dataclasses.replace(probe, address=8))


def test_many_ranges_are_read_in_few_calls_and_a_bad_one_raises(groups):
    # read_many takes a trainer rank's pieces in one system call per IOV_MAX ranges; here
    # this process reads itself (same system call), more ranges than one call takes.
    source = torch.arange(3000, dtype=torch.int64)
    target = torch.zeros(3000, dtype=torch.int64)
    size = source.element_size()
    ranges = [(source.data_ptr() + i * size, target.data_ptr() + i * size, size) for i in range(0, 3000, 2)]
    ranges.append((source.data_ptr(), target.data_ptr() + size, 0))  # empty: skipped
    peer_memory.read_many(os.getpid(), ranges)
    assert torch.equal(target[0::2], source[0::2])
    assert not target[1::2].any()
    # The kernel stops at the unmapped range (a partial read): the rest raises what stopped it.
    bad = [(source.data_ptr(), target.data_ptr(), size), (8, target.data_ptr() + size, size)]
    with pytest.raises(OSError):
        peer_memory.read_many(os.getpid(), bad)
