"""Host-leader fan-out (``daskwg.fan-out: host``, issue 46): a blocking call to the ranks of
one host goes as one message to the worker of its lowest rank, which hands the calls on over
the host's Unix-domain call streams and answers for all of them. It gives the results and the
errors the direct path gives, keeps each rank's order, and a lost member or leader fails the
call with the right rank's ``WorkerLostError`` instead of hanging it.

All four workers of these clusters are on one host, so every call of a group spanning two or
more of them goes through a leader.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import dask
import pytest
import torch
from fault_workers import FaultWorker
from workers import AddWorker

import daskwg
from daskwg import CallTimeoutError, DataProto, RankError, WorkerGroup, WorkerLostError
from daskwg.transport.streams import CallStreams


@pytest.fixture
def host_fan_out():
    with dask.config.set({"daskwg.fan-out": "host"}):
        yield


def _kill_later(pid: int, delay: float) -> threading.Thread:
    def kill():
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_one_to_all_results_through_the_leader_equal_the_direct_ones(client4):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    try:
        direct = (wg.foo(1, 2), wg.pid(), wg.foo_all([1, 2, 3, 4], [0, 0, 0, 10]))
        with dask.config.set({"daskwg.fan-out": "host"}):
            assert (wg.foo(1, 2), wg.pid(), wg.foo_all([1, 2, 3, 4], [0, 0, 0, 10])) == direct
        assert direct[0] == [5, 5, 5, 5] and len(set(direct[1])) == 4
    finally:
        wg.shutdown()


def test_dp_compute_proto_results_through_the_leader_equal_the_direct_ones(client4):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    batch = DataProto.from_dict({"a": torch.arange(10)}, non_tensors={"id": list("abcdefghij")})
    try:
        direct = wg.add_rank(batch)
        with dask.config.set({"daskwg.fan-out": "host"}):
            led = wg.add_rank(batch)
        assert torch.equal(led.batch["a"], direct.batch["a"])
        assert list(led.non_tensor_batch["id"]) == list("abcdefghij")
        assert led.batch["a"].tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 12]  # 3 rows per rank, padded to 12
    finally:
        wg.shutdown()


def test_the_driver_writes_one_message_per_host_and_the_direct_path_one_per_rank(
    client4, monkeypatch, host_fan_out
):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    written: list[tuple[str, str]] = []
    send_now, send = CallStreams.send_now, CallStreams.send

    def spy_now(self, address, server_id, message, *args, **kwargs):
        ok = send_now(self, address, server_id, message, *args, **kwargs)
        if ok:
            written.append((message[0], address))
        return ok

    async def spy(self, address, server_id, message, *args, **kwargs):
        written.append((message[0], address))
        return await send(self, address, server_id, message, *args, **kwargs)

    monkeypatch.setattr(CallStreams, "send_now", spy_now)
    monkeypatch.setattr(CallStreams, "send", spy)
    try:
        assert wg.foo(1, 2) == [5, 5, 5, 5]
        assert written == [("fanout", wg.workers[0])]
        written.clear()
        with dask.config.set({"daskwg.fan-out": "direct"}):
            assert wg.foo(1, 2) == [5, 5, 5, 5]
        assert sorted(written) == sorted(("call", a) for a in wg.workers)
    finally:
        monkeypatch.undo()
        wg.shutdown()


def test_auto_sends_through_the_leader_only_from_eight_ranks_of_a_host(client4, monkeypatch):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    kinds: list[str] = []
    send_now = CallStreams.send_now

    def spy_now(self, address, server_id, message, *args, **kwargs):
        ok = send_now(self, address, server_id, message, *args, **kwargs)
        if ok:
            kinds.append(message[0])
        return ok

    monkeypatch.setattr(CallStreams, "send_now", spy_now)
    try:
        wg.foo(1, 2)  # opens the streams
        kinds.clear()
        with dask.config.set({"daskwg.fan-out": "auto"}):
            assert wg.foo(1, 2) == [5, 5, 5, 5]
        assert kinds == ["call"] * 4
    finally:
        monkeypatch.undo()
        wg.shutdown()


def test_a_members_error_through_the_leader_is_its_rank_error(client4, host_fan_out):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    try:
        with pytest.raises(RankError) as info:
            wg.fail_on(2, "bang")
        assert info.value.rank == 2 and info.value.address == wg.workers[2]
        assert "ValueError: bang" in str(info.value)
        with pytest.raises(RankError) as info:
            wg.fail_on(0, "leader's own")
        assert info.value.rank == 0 and "leader's own" in str(info.value)
        assert wg.foo(1, 2) == [5, 5, 5, 5]  # the group goes on
    finally:
        wg.shutdown()


def test_calls_through_the_leader_keep_each_ranks_order_among_direct_non_blocking_ones(client4, host_fan_out):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    try:
        for i in range(3):
            wg.record(i, delay=0.05)  # non-blocking: direct, queued behind one another
            wg.foo(i, 0)  # blocking: through the leader, after record(i) on every rank
            wg.record(10 + i)
        assert wg.get_log() == [[0, 10, 1, 11, 2, 12]] * 4
    finally:
        wg.shutdown()


@pytest.mark.timeout(120)
def test_a_deadline_through_the_leader_raises_call_timeout_naming_every_ranks_state(client4, host_fan_out):
    wg = WorkerGroup(client4, FaultWorker, world_size=4)
    try:
        with pytest.raises(CallTimeoutError) as info, daskwg.deadline(1.0):
            wg.sleep(4.0)
        assert info.value.ranks == {0: "running", 1: "running", 2: "running", 3: "running"}
        assert all("sleep" in info.value.stacks[r] for r in range(4))
    finally:
        wg.shutdown()


def test_a_fan_out_that_is_not_a_mode_is_refused_before_any_rank_runs(client4):
    wg = WorkerGroup(client4, AddWorker, world_size=2)
    try:
        with dask.config.set({"daskwg.fan-out": "tree"}), pytest.raises(ValueError, match="'direct', 'host'"):
            wg.record(1)
        assert wg.get_log() == [[], []]
    finally:
        wg.shutdown()


@pytest.mark.timeout(120)
def test_a_member_killed_during_a_call_through_the_leader_raises_its_worker_lost_error(
    fresh_cluster4, host_fan_out
):
    _, client = fresh_cluster4
    wg = WorkerGroup(client, FaultWorker, world_size=4)
    _kill_later(wg.pid()[2], 1.0)
    with pytest.raises(WorkerLostError) as info:
        wg.sleep(60)
    assert info.value.rank == 2 and info.value.address == wg.workers[2]
    assert wg.is_broken


@pytest.mark.timeout(120)
def test_a_leader_killed_during_a_call_fails_it_with_the_leaders_worker_lost_error(
    fresh_cluster4, host_fan_out
):
    _, client = fresh_cluster4
    wg = WorkerGroup(client, FaultWorker, world_size=4)
    survivors = wg.workers[1:]
    _kill_later(wg.pid()[0], 1.0)
    with pytest.raises(WorkerLostError) as info:
        wg.sleep(3.0)
    assert info.value.rank == 0 and info.value.address == wg.workers[0]
    # The calls the leader handed on finish on their own; nothing waits behind them for ever.
    other = WorkerGroup(client, AddWorker, workers=survivors)
    assert other.foo(1, 2) == [5, 5, 5]
    other.shutdown()


def test_non_blocking_results_through_the_leader_equal_the_direct_ones(client4, monkeypatch):
    wg = WorkerGroup(client4, AddWorker, world_size=4)
    batch = DataProto.from_dict({"a": torch.arange(8)})
    kinds: list[str] = []
    send_now = CallStreams.send_now

    def spy_now(self, address, server_id, message, *args, **kwargs):
        ok = send_now(self, address, server_id, message, *args, **kwargs)
        if ok:
            kinds.append(message[0])
        return ok

    try:
        direct = (daskwg.get(wg.record(7)), wg.add_rank_async(batch).get())
        monkeypatch.setattr(CallStreams, "send_now", spy_now)
        with dask.config.set({"daskwg.fan-out": "host"}):
            ints = wg.record(7)
            future = wg.add_rank_async(batch)
            assert kinds == ["fanout", "fanout"]
            led = (daskwg.get(ints), future.get())
            # The result stays on the ranks' workers: the next call reads it there.
            chained = wg.add_rank(future)
        monkeypatch.undo()
        assert led[0] == direct[0] == [7, 7, 7, 7]
        assert torch.equal(led[1].batch["a"], direct[1].batch["a"])
        assert chained.batch["a"].tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
        assert wg.get_log() == [[7, 7]] * 4
    finally:
        monkeypatch.undo()
        wg.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 2], ids=["leader", "member"])
def test_a_worker_killed_during_a_non_blocking_call_through_the_leader_fails_its_future(
    fresh_cluster4, host_fan_out, victim
):
    _, client = fresh_cluster4
    wg = WorkerGroup(client, FaultWorker, world_size=4)
    _kill_later(wg.pid()[victim], 1.0)
    futures = wg.sleep_async(3.0)
    with pytest.raises(WorkerLostError) as info:
        daskwg.get(futures)
    assert info.value.rank == victim and info.value.address == wg.workers[victim]
