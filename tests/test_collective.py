"""Collectives across worker groups (``daskwg.create_collective_group``): a process group
over ranks of a 2-rank and a 3-rank group, next to each group's own default group."""

from __future__ import annotations

import time

import dask
import distributed
import pytest
from collective_workers import Member
from conftest import process_cluster
from distributed import Client
from plane_workers import no_shared_memory

import daskwg
from daskwg import DataProtoFuture, GroupBrokenError, RankError, ResourcePool, WorkerGroup, WorkerLostError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def groups():
    """A 2-rank and a 3-rank group on five workers, each with its own default process group."""
    with process_cluster(5) as cluster, Client(cluster) as client:
        two, three = ResourcePool(client, world_size=5).split([2, 3])
        a = WorkerGroup(client, Member, workers=two, name="trainer")
        b = WorkerGroup(client, Member, workers=three, name="rollout")
        assert a.init_own_group() == [2.0, 2.0] and b.init_own_group() == [3.0] * 3
        yield client, a, b
        a.shutdown()
        b.shutdown()


def test_a_collective_over_two_groups_all_reduces_and_broadcasts_next_to_their_own_groups(groups):
    _, a, b = groups
    with daskwg.create_collective_group([a, b], name="both") as both:
        assert both.world_size == 5
        assert both.members == [
            ("trainer", 0),
            ("trainer", 1),
            ("rollout", 0),
            ("rollout", 1),
            ("rollout", 2),
        ]
        results = [r for part in daskwg.get([a.exchange("both"), b.exchange("both")]) for r in part]
    assert [r["rank"] for r in results] == [0, 1, 2, 3, 4]
    for r in results:
        assert r["size"] == 5
        assert r["sum"] == 1 + 2 + 3 + 4 + 5
        assert r["broadcast"] == [0.0, 10.0, 20.0, 30.0]
        assert r["gathered"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert r["torch_api"] == 5.0
    # Each group's own default group still spans only that group.
    assert [r["own"] for r in results] == [2.0, 2.0, 3.0, 3.0, 3.0]


def test_a_large_broadcast_goes_along_the_chain_of_members_from_any_source(groups):
    _, a, b = groups
    # 9 MiB and 3 elements: chunks of daskwg.collective.CHAIN_CHUNK and a short last one.
    elements = (9 << 20) // 4 + 3
    with daskwg.create_collective_group([a, b], name="chain"):
        for src in (0, 3):
            done = daskwg.get(
                [a.big_broadcast("chain", src, elements), b.big_broadcast("chain", src, elements)]
            )
            assert done == [[True, True], [True, True, True]]


def test_non_contiguous_tensors_are_reduced_and_broadcast_as_the_views_they_are(groups):
    _, a, b = groups
    with daskwg.create_collective_group([a, b], name="strided"):
        results = [r for part in daskwg.get([a.strided("strided"), b.strided("strided")]) for r in part]
    assert results == [([5.0] * 4, [0.0, 2.0, 4.0, 6.0])] * 5


@pytest.mark.parametrize("sizes", [(3, 5), (300_000, 200_000)], ids=["small", "chained"])
def test_members_calling_an_operation_with_other_shapes_all_get_an_error_and_the_collective_goes_on(
    groups, sizes
):
    _, a, b = groups
    with daskwg.create_collective_group([a, b], name="shapes"):
        calls = [a.sized_broadcast("shapes", sizes[0]), b.sized_broadcast("shapes", sizes[1])]
        for future in [f for part in calls for f in part]:
            with pytest.raises(RankError, match="members called it differently"):
                daskwg.get(future)
        # Nobody started the broadcast: the collective and the workers are still fine.
        results = [r for part in daskwg.get([a.strided("shapes"), b.strided("shapes")]) for r in part]
        assert results == [([5.0] * 4, [0.0, 2.0, 4.0, 6.0])] * 5


def test_a_collective_of_trainer_rank_0_and_every_rollout_rank(groups):
    _, a, b = groups
    with daskwg.create_collective_group([(a, 0), b], name="weights") as weights:
        assert weights.world_size == 4
        first = a.execute_rank_zero_async("exchange", "weights", own_group=False)
        results = daskwg.get([first, b.exchange("weights")])
        ranks = [results[0]["rank"]] + [r["rank"] for r in results[1]]
        assert ranks == [0, 1, 2, 3]
        assert all(r["broadcast"] == [0.0, 10.0, 20.0, 30.0] for r in results[1])
        assert a.is_member("weights") == [True, False]
    # Destroyed on every member: the name is free again.
    assert a.is_member("weights") == [False, False] and b.is_member("weights") == [False] * 3
    with daskwg.create_collective_group([(a, 1), (b, [2])], name="weights") as again:
        assert again.members == [("trainer", 1), ("rollout", 2)]


def test_bad_members_are_refused_before_any_rank_joins(groups):
    client, a, b = groups
    with pytest.raises(ValueError, match="non-empty list"):
        daskwg.create_collective_group([])
    with pytest.raises(TypeError, match="must be a WorkerGroup"):
        daskwg.create_collective_group([a, "rollout"])
    with pytest.raises(ValueError, match="out of range 0..1"):
        daskwg.create_collective_group([(a, [2]), b])
    with pytest.raises(ValueError, match="named twice"):
        daskwg.create_collective_group([(a, [0]), (a, [0])])
    with pytest.raises(ValueError, match="backend must be"):
        daskwg.create_collective_group([a], backend="mpi")
    # Two members in one worker process: a colocated group on the trainer's workers.
    with WorkerGroup(client, Member, workers=a.workers, name="colocated") as c:
        with pytest.raises(ValueError, match="both on worker"):
            daskwg.create_collective_group([a, c])
    assert a.is_member("none") == [False, False]


def test_rank_code_using_a_collective_it_is_not_in_gets_a_clear_error(groups):
    _, a, _ = groups
    with pytest.raises(RankError, match="not a member of a collective named 'nowhere'"):
        daskwg.get(a.exchange("nowhere"))


def test_a_name_in_use_is_refused_and_nothing_is_left_joined(groups):
    _, a, b = groups
    with daskwg.create_collective_group([a], name="taken"):
        with pytest.raises(RankError, match="already exists in this worker process"):
            daskwg.create_collective_group([b, (a, 0)], name="taken")
        # The members that joined the refused one left it again.
        assert b.is_member("taken") == [False] * 3
        assert a.is_member("taken") == [True, True]


def test_shutting_down_a_member_group_destroys_its_members_collectives(groups):
    client, _, b = groups
    with WorkerGroup(client, Member, world_size=2, name="short-lived") as c:
        collective = daskwg.create_collective_group([c, (b, 0)], name="short")
        assert c.is_member("short") == [True, True]
    # c's ranks destroyed theirs at shutdown; b's member leaves at destroy().
    collective.destroy()
    assert b.is_member("short") == [False, False, False]
    with pytest.raises(GroupBrokenError, match="shut down or broken"):
        daskwg.create_collective_group([c, b])


# ---- weight sync without a collective: the data plane --------------------------------

W = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_a_replicated_state_dict_future_reaches_every_rollout_rank_as_the_value(groups):
    _, trainer, rollout = groups
    expected = [{"w": W, "b": [1.0, 1.0]}] * 3
    # As Ray resolves a top-level ObjectRef in an actor call's arguments.
    assert rollout.load_weights(trainer.get_weights()[0]) == expected
    assert rollout.load_weights(weights=trainer.get_weights()[1]) == expected
    # A one-part DataProtoFuture is its part, whatever it is.
    assert rollout.load_weights(DataProtoFuture.concat(trainer.get_weights()[:1])) == expected


def test_a_sharded_state_dict_reaches_every_rollout_rank_as_its_shards_worker_to_worker(groups):
    _, trainer, rollout = groups
    assert rollout.load_weights(trainer.get_shard()) == [{"shards": 2, "w": W}] * 3


def test_a_large_state_dict_is_relayed_sent_once_and_arrives_into_the_last_syncs_buffers(groups):
    # Above daskwg.relay-above (1 MiB) the rollout ranks relay the weights along a chain: the
    # trainer's worker sends them once, not once per rollout rank. Each rank receives into
    # memory of its own (its in-place change reaches no other rank), and once a rank dropped
    # a sync's weights their buffers wait in daskwg.buffer-pool for a later sync. (Workers of
    # one host share the trainer's copy instead, unless daskwg.shared-memory is off: the
    # route between hosts, which tests/test_multihost.py takes too.)
    _, trainer, rollout = groups
    nbytes = 8 << 20
    memory = []
    for version in (1.0, 2.0, 3.0):
        weights = trainer.big_weights(version, nbytes)[0]
        distributed.wait([weights])
        before = trainer.tcp_sent()[0]
        with dask.config.set({"daskwg.shared-memory": False}):
            got = rollout.keep_weights(weights, version)
        sent = trainer.tcp_sent()[0] - before
        assert [g["ok"] for g in got] == [True] * 3, version
        # TCP_INFO counts acknowledged bytes: the last few kB may still be in flight.
        assert 0.99 * nbytes <= sent < 1.5 * nbytes, f"sync {version}: trainer rank 0 sent {sent} bytes"
        memory.append([g["memory"] for g in got])
    # Sync 2 arrived while each rank still held sync 1 (fresh buffers); keeping sync 2 dropped
    # sync 1, whose buffers sync 3 then arrived into.
    assert memory[2] == memory[0]
    assert all(m1 != m0 for m1, m0 in zip(memory[1], memory[0])), memory


def _open_files(dask_worker) -> int:
    return dask_worker.plugins["daskwg"].inputs.shared.nbytes


def test_a_large_state_dict_on_one_host_is_mapped_copy_on_write_from_one_shared_copy(groups):
    # Workers of the trainer's host map the trainer worker's one shared-memory copy: nothing
    # but the pickle header crosses a socket, each rank's in-place change stays its own (the
    # next sync of the same future still reads the trainer's values), and the copy is closed
    # once the driver drops the future.
    client, trainer, rollout = groups
    nbytes = 8 << 20
    weights = trainer.big_weights(4.0, nbytes)[0]
    distributed.wait([weights])
    for sync in range(2):
        before = trainer.tcp_sent()[0]
        got = rollout.keep_weights(weights, 4.0)
        sent = trainer.tcp_sent()[0] - before
        assert [g["ok"] for g in got] == [True] * 3, f"sync {sync}: {got}"
        assert sent < nbytes // 8, f"sync {sync}: trainer rank 0 sent {sent} bytes"
    source = trainer.workers[0]
    assert client.run(_open_files, workers=[source])[source] >= nbytes
    del weights
    deadline = time.monotonic() + 10
    while client.run(_open_files, workers=[source])[source] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.run(_open_files, workers=[source])[source] == 0
    # The ranks keep what they mapped after the copy was closed.
    assert rollout.keep_weights(trainer.big_weights(5.0, nbytes)[0], 5.0)[0]["ok"]


def _files_of(size: int, dask_worker=None) -> int:
    """Shared-memory files (in use or pooled) of about ``size`` bytes on this worker."""
    shared = dask_worker.plugins["daskwg"].inputs.shared
    files = [s.file for s in shared._segments.values()] + shared._pool
    return sum(size <= f.capacity <= size + size // 4 for f in files)


def test_a_shared_memory_file_is_rewritten_for_the_next_sync_only_once_no_rank_maps_it(groups):
    # Sync 1's file, which no rank maps once they hold sync 2, takes sync 3; sync 2's, which
    # the ranks still map (unchanged: no page of it copied), is never written meanwhile.
    client, trainer, rollout = groups
    nbytes = 6 << 20
    source = trainer.workers[0]
    for version in (7.0, 8.0):
        weights = trainer.big_weights(version, nbytes)[0]
        assert rollout.hold_weights(weights, version) == [True] * 3
        del weights
    weights = trainer.big_weights(9.0, nbytes)[0]
    assert [g["ok"] for g in rollout.keep_weights(weights, 9.0)] == [True] * 3
    assert rollout.held_ok(8.0) == [True] * 3
    assert client.run(_files_of, nbytes, workers=[source])[source] == 2


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_shared_memory_that_cannot_be_made_or_mapped_falls_back_to_the_comm(groups, side):
    client, trainer, rollout = groups
    nbytes = 4 << 20
    where = trainer.workers[:1] if side == "producer" else rollout.workers
    client.run(no_shared_memory, side, workers=where)
    try:
        weights = trainer.big_weights(6.0, nbytes)[0]
        distributed.wait([weights])
        before = trainer.tcp_sent()[0]
        got = rollout.keep_weights(weights, 6.0)
        sent = trainer.tcp_sent()[0] - before
        assert [g["ok"] for g in got] == [True] * 3, got
        # Each consumer fetched its own copy over the comm (not relayed: it was meant to map it).
        assert sent >= 2.9 * nbytes, f"trainer rank 0 sent {sent} bytes"  # acknowledged ones
        assert [g["ok"] for g in rollout.keep_weights(weights, 6.0)] == [True] * 3
    finally:
        client.run(no_shared_memory, "undo", workers=where)


def test_weights_in_the_wrong_wrapper_are_refused_with_what_to_pass_instead(groups):
    _, trainer, rollout = groups
    # A list of per-rank futures inside concat's list: refused in the driver.
    with pytest.raises(
        TypeError, match="got a list at position 0 \\(a list of futures: pass that list itself\\)"
    ):
        DataProtoFuture.concat([trainer.get_weights()])
    # Shards are not batches: concatenating them as DataProto parts says what to do.
    with pytest.raises(RankError, match="must be DataProto or TensorDict, got dict: pass per-rank futures"):
        rollout.load_weights(DataProtoFuture.concat(trainer.get_shard()))
    assert rollout.load_weights(trainer.get_shard()) == [{"shards": 2, "w": W}] * 3


@pytest.mark.timeout(240)
def test_a_member_killed_mid_broadcast_gives_worker_lost_and_the_others_fail_within_the_timeout():
    nbytes = 4 << 20
    with process_cluster(5) as cluster, Client(cluster) as client:
        two, three = ResourcePool(client, world_size=5).split([2, 3])
        a = WorkerGroup(client, Member, workers=two, name="trainer")
        b = WorkerGroup(client, Member, workers=three, name="rollout")
        daskwg.create_collective_group([(a, 0), b], name="sync", timeout=10)
        t0 = time.monotonic()
        # Collective rank 2 is rollout rank 1: its process exits instead of receiving.
        sender = a.execute_rank_zero_async("broadcast_weights", "sync", 2, nbytes)
        receivers = b.broadcast_weights("sync", 2, nbytes)
        with pytest.raises(WorkerLostError) as lost:
            daskwg.get(receivers[1])
        assert lost.value.rank == 1
        # The others either got the weights before the member died (where gloo's
        # broadcast did not pass through it) or fail naming the collective: none hangs.
        # A survivor of the dead member's own group fails with the root cause, the dead
        # rank's WorkerLostError, its own error riding along (issue 43).
        for survivor in (sender, receivers[0], receivers[2]):
            try:
                assert daskwg.get(survivor) == nbytes // 4
            except WorkerLostError as exc:
                assert survivor is not sender and exc.rank == 1
                own = exc.__context__
                assert "broadcast on collective 'sync'" in str(own) and "a member died" in str(own)
            except RankError as exc:
                assert "broadcast on collective 'sync'" in str(exc) and "a member died" in str(exc)
        # The next collective operation, which needs the dead member, fails within the
        # collective's timeout on every member left.
        with pytest.raises(RankError, match="allreduce on collective 'sync'"):
            daskwg.get(a.execute_rank_zero_async("exchange", "sync", own_group=False))
        elapsed = time.monotonic() - t0
        print(f"\n[collective] member killed mid-broadcast: every call ended after {elapsed:.1f} s")
        assert elapsed < 2 * 10 + 15  # two operations' timeouts, plus the lost-worker verdict
