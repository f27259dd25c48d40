"""Self-healing and elastic groups on real worker processes: the lost rank's error wins over
its peers' echoes, ``wg.heal()`` replaces lost ranks and keeps the survivors, ``wg.resize(n)``
grows and shrinks a group. Measured times are printed, never asserted."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import pytest
from conftest import process_cluster, wait_for_workers
from distributed import Client
from heal_workers import HealWorker

import daskwg
from daskwg import WorkerGroup, WorkerLostError, WorldSizeError


@pytest.fixture(scope="module")
def cluster():
    """Four worker processes shared by this module's tests; a killed worker's Nanny
    restarts it, so each test starts from four workers again."""
    with process_cluster(4) as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    with Client(cluster) as client:
        wait_for_workers(client, 4)
        yield client


def _group(client: Client, world_size: int) -> WorkerGroup:
    wg = WorkerGroup(client, HealWorker, world_size=world_size)
    assert wg.init_pg() == [True] * world_size
    return wg


def _kill(wg: WorkerGroup, rank: int) -> None:
    os.kill(wg.pid()[rank], signal.SIGKILL)


# ---- the root cause wins ------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "victim"), [(3, 0), (3, 1), (3, 2), (4, 3)])
def test_a_call_right_after_a_sigkill_raises_the_dead_ranks_worker_lost_error(client, world_size, victim):
    wg = _group(client, world_size)
    try:
        assert wg.all_reduce()[0] == world_size * (world_size + 1) / 2
        _kill(wg, victim)
        with pytest.raises(WorkerLostError) as info:
            wg.all_reduce()
        assert info.value.rank == victim, info.value
        assert all(e.rank != victim for e in info.value.survivor_errors)
        if info.value.survivor_errors:
            assert info.value.__context__ is info.value.survivor_errors[0]
    finally:
        wg.shutdown()


@pytest.mark.timeout(120)
def test_a_non_blocking_call_right_after_a_sigkill_raises_the_dead_ranks_worker_lost_error(client):
    wg = _group(client, 3)
    try:
        wg.all_reduce()
        _kill(wg, 1)
        with pytest.raises(WorkerLostError) as info:
            daskwg.get(wg.all_reduce_later())
        assert info.value.rank == 1, info.value
    finally:
        wg.shutdown()


@pytest.mark.timeout(120)
def test_a_step_plan_replayed_right_after_a_sigkill_raises_the_dead_ranks_worker_lost_error(client):
    wg = _group(client, 3)
    try:
        with daskwg.plan("reduce") as step:
            step.output(wg.all_reduce())
        step.run()
        step.run()
        _kill(wg, 2)
        with pytest.raises(WorkerLostError) as info:
            step.run()
        assert info.value.rank == 2, info.value
    finally:
        wg.shutdown()


@pytest.mark.timeout(30)
def test_the_probe_takes_a_port_that_resets_its_connection_unanswered_as_gone_and_a_worker_as_alive(client):
    """A killed process's listening socket can outlive its gloo sockets for a moment: the
    kernel still completes a connection from its backlog, then resets it. The root-cause
    probe waits for the first byte of Dask's handshake, so that moment reads as gone (a
    bare connection used to read as alive, and the survivor's RankError won: seen in CI)."""
    from daskwg.transport.failure.root_cause import _probe

    with socket.socket() as dying:  # listens, never accepts: a process being torn down
        dying.bind(("127.0.0.1", 0))
        dying.listen(8)
        address = f"tcp://127.0.0.1:{dying.getsockname()[1]}"

        async def probe_then_close() -> str:
            probe = asyncio.ensure_future(_probe(address))
            await asyncio.sleep(0.2)
            assert not probe.done()  # connected, waiting for a byte
            dying.close()
            return await probe

        assert asyncio.run(probe_then_close()) == "refused"
    worker = next(iter(client.scheduler_info()["workers"]))
    assert asyncio.run(_probe(worker)) == "answers"


# ---- heal ---------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_heal_keeps_the_survivors_processes_and_state_and_an_all_reduce_spans_every_rank(client, figure):
    wg = _group(client, 3)
    try:
        wg.set_state("kept")
        pids = wg.pid()
        old_port = wg.master_addr_port[1]
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            wg.all_reduce()
        report = wg.heal(timeout=60)
        assert wg.all_reduce() == [6.0, 6.0, 6.0]  # rank 1, the replacement, takes part
        figure(f"[heal] SIGKILL -> healed group answering an all_reduce: {time.monotonic() - t0:.2f} s")
        new_pids = wg.pid()
        assert new_pids[0] == pids[0] and new_pids[2] == pids[2] and new_pids[1] != pids[1]
        assert wg.get_state() == ["kept", None, "kept"]
        assert sorted(report.moved) == [1] and report.moved[1][1] == wg.workers[1]
        addr, port = wg.master_addr_port
        assert port != old_port
        assert wg.place() == [("t", r, 3, addr, str(port)) for r in range(3)]
        assert wg.membership_events() == [[("heal", 3, 3, (1,))]] * 3
        assert not wg.is_broken
    finally:
        wg.shutdown()


@pytest.mark.timeout(120)
def test_heal_with_rendezvous_gives_ranks_whose_collective_timed_out_a_working_process_group(client):
    """No worker is lost, but an all-reduce that rank 2 never joined timed out on ranks 0
    and 1, and gloo closed their connections: every rank's process group is unusable. A
    plain heal() leaves the group as it is; heal(rendezvous=True) gives the same processes a
    new rendezvous and runs on_membership_change, which initialises the group again."""
    wg = WorkerGroup(client, HealWorker, world_size=3)
    try:
        assert wg.init_pg(2.0) == [True] * 3
        pids, port = wg.pid(), wg.place()[0][4]
        outcomes = wg.all_reduce_on([0, 1])
        assert outcomes[2] == "left out" and all("Timed out" in o for o in outcomes[:2]), outcomes
        with pytest.raises(daskwg.RankError):
            wg.all_reduce()
        plain = wg.heal()
        assert plain.moved == {} and plain.event is None and wg.place()[0][4] == port
        report = wg.heal(rendezvous=True)
        assert report.moved == {} and report.event.new_ranks == () and report.master_port != int(port)
        assert wg.pid() == pids
        assert wg.all_reduce() == [6.0] * 3
        assert wg.membership_events() == [[("heal", 3, 3, ())]] * 3
        assert {p[4] for p in wg.place()} == {str(report.master_port)}
    finally:
        wg.shutdown()


@pytest.mark.timeout(240)
def test_heal_with_no_free_worker_waits_and_says_so_until_its_timeout(caplog):
    with process_cluster(3) as cluster, Client(cluster) as client:
        wg = _group(client, 3)
        _kill(wg, 1)
        with pytest.raises(WorkerLostError):
            wg.all_reduce()
        wait_for_workers(client, 3)  # the Nanny restarted the dead worker: take it
        survivors = {wg.workers[0], wg.workers[2]}
        restarted = [a for a in client.scheduler_info(n_workers=-1)["workers"] if a not in survivors]
        blocker = WorkerGroup(client, HealWorker, workers=restarted)
        with caplog.at_level(logging.WARNING, logger="daskwg.groups.heal"):
            with pytest.raises(WorldSizeError, match=r"needs 1 free worker\(s\) for rank\(s\) \[1\]"):
                wg.heal(timeout=1.0)
        assert "waits up to" in caplog.text
        blocker.shutdown()
        wg.heal(timeout=60)
        assert wg.all_reduce() == [6.0, 6.0, 6.0]
        wg.shutdown()


# ---- resize -------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_resize_up_then_down_keeps_the_kept_ranks_processes_and_state(client):
    wg = _group(client, 2)
    try:
        wg.set_state("kept")
        pids = wg.pid()
        wg.resize(3, timeout=60)
        assert wg.world_size == 3
        assert wg.all_reduce() == [6.0, 6.0, 6.0]
        assert wg.pid()[:2] == pids
        assert wg.get_state() == ["kept", "kept", None]
        assert wg.membership_events()[0] == [("resize", 2, 3, (2,))]
        wg.resize(2, timeout=60)
        assert wg.world_size == 2
        assert wg.all_reduce() == [3.0, 3.0]
        assert wg.pid() == pids and wg.get_state() == ["kept", "kept"]
        assert [p[2] for p in wg.place()] == [2, 2]
    finally:
        wg.shutdown()


# ---- hot spares ---------------------------------------------------------------------------


def _imported(client: Client, address: str) -> bool:
    """Whether the worker process at ``address`` has imported the test's worker module."""
    return client.run(lambda: "heal_workers" in __import__("sys").modules, workers=[address])[address]


@pytest.mark.timeout(240)
def test_heal_moves_the_lost_rank_onto_a_warm_spare_and_warms_another(figure):
    with process_cluster(4) as cluster, Client(cluster) as client:
        wait_for_workers(client, 4)
        wg = _group(client, 2)
        spares = wg.keep_spares(1)
        assert len(spares) == 1 and spares[0] not in wg.workers
        cold = [a for a in client.scheduler_info(n_workers=-1)["workers"] if a not in wg.workers + spares]
        assert _imported(client, spares[0]) and not _imported(client, cold[0])  # warmed, the other not
        t0 = time.monotonic()
        _kill(wg, 1)
        with pytest.raises(WorkerLostError):
            wg.all_reduce()
        report = wg.heal(timeout=60)
        assert wg.all_reduce() == [3.0, 3.0]
        figure(
            f"[heal] SIGKILL -> healed onto a warm spare, answering an all_reduce: {time.monotonic() - t0:.2f} s"
        )
        assert wg.workers[1] == spares[0] and report.moved[1][1] == spares[0]
        end = time.monotonic() + 120  # another spare is warmed in the background, bounded
        while len(wg.spares) < 1 and time.monotonic() < end:
            time.sleep(0.1)
        assert len(wg.spares) == 1 and wg.spares[0] not in wg.workers  # a free worker warmed again
        assert _imported(client, wg.spares[0])
        wg.shutdown()


def test_keep_spares_refuses_a_negative_count(client):
    wg = WorkerGroup(client, HealWorker, world_size=1)
    try:
        with pytest.raises(ValueError, match="keep_spares\\(\\) takes a number of spare workers >= 0"):
            wg.keep_spares(-1)
    finally:
        wg.shutdown()


# ---- following the pool -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_group_that_follows_its_pool_grows_with_the_cluster_and_shrinks_when_a_worker_leaves():
    with process_cluster(2) as cluster, Client(cluster) as client:
        wait_for_workers(client, 2)
        wg = _group(client, 2)
        try:
            wg.set_state("kept")
            pids = wg.pid()
            wg.follow_pool(max_world_size=3, timeout=60)
            assert wg.all_reduce() == [3.0, 3.0]  # nothing free: the size it has
            cluster.scale(4)
            wait_for_workers(client, 4)
            # The next call starts on every free worker up to the bound, kept ranks untouched.
            assert wg.all_reduce() == [6.0, 6.0, 6.0]
            assert wg.pid()[:2] == pids and wg.get_state() == ["kept", "kept", None]
            assert [r.kind for r in wg.membership_reports] == ["resize"]
            grown = wg.pid()
            # A scale-down retires workers; with none free, the group shrinks by the lost ones.
            free = [a for a in client.scheduler_info(n_workers=-1)["workers"] if a not in wg.workers]
            blocker = WorkerGroup(client, HealWorker, workers=free)  # holds the one free worker
            victim = wg.workers[1]
            client.retire_workers([victim], close_workers=True)
            end = time.monotonic() + 60
            while victim in client.scheduler_info(n_workers=-1)["workers"] and time.monotonic() < end:
                time.sleep(0.1)
            assert wg.all_reduce() == [3.0, 3.0]
            assert wg.world_size == 2 and victim not in wg.workers
            # Rank 2's worker took rank 1's place (rank 1 rebuilt there); rank 0 kept all.
            assert wg.pid() == [grown[0], grown[2]]
            assert wg.get_state() == ["kept", None]
            assert [r.kind for r in wg.membership_reports] == ["resize", "resize"]
            blocker.shutdown()
            wg.follow_pool(False)
        finally:
            wg.shutdown()


def test_follow_pool_refuses_bounds_that_are_not_positive_or_out_of_order(client):
    wg = WorkerGroup(client, HealWorker, world_size=1)
    try:
        with pytest.raises(ValueError, match="max_world_size=1 below min_world_size=2"):
            wg.follow_pool(min_world_size=2, max_world_size=1)
        with pytest.raises(ValueError, match="min_world_size as an int >= 1"):
            wg.follow_pool(min_world_size=0)
    finally:
        wg.shutdown()


@pytest.mark.timeout(240)
def test_heal_rebuilds_a_rank_whose_init_joins_the_process_group_and_the_survivors_join_again():
    # A rank's __init__ that calls init_process_group waits for every rank: the survivors
    # (no hook) initialise theirs again at the same time, instead of after it (a deadlock).
    from heal_init_workers import InitPGWorker

    with process_cluster(3) as cluster, Client(cluster) as client:
        wait_for_workers(client, 3)
        wg = WorkerGroup(client, InitPGWorker, world_size=2)
        try:
            assert wg.all_reduce() == [3.0, 3.0]
            survivor = wg.pid()[0]
            os.kill(wg.pid()[1], signal.SIGKILL)
            with pytest.raises(WorkerLostError):
                wg.all_reduce()
            with daskwg.deadline(120):
                wg.heal(timeout=60)
            assert wg.all_reduce() == [3.0, 3.0]
            assert wg.pid()[0] == survivor
        finally:
            wg.shutdown()
