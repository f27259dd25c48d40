"""Cancelling calls: a non-blocking call's future (a ``DataProtoFuture``, or its per-rank
Dask futures) cancelled with ``DataProtoFuture.cancel()`` or Dask's own ``client.cancel``.

A queued call never runs, a running ``async def`` method gets ``CancelledError`` at its next
``await``, a running plain method runs to its end and its result is dropped; every way of
reading the result says it was cancelled, and the group answers its next call.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import dask
import distributed
import pytest
from cancel_workers import CancelWorker, batch
from distributed import Client

import daskwg
from daskwg import CallCancelledError, DataProto, WorkerGroup, WorkerGroupError
from daskwg.plugin.sequencer import Sequencer

pytestmark = pytest.mark.timeout(120)

RANKS = 2


@pytest.fixture(scope="module")
def client(cluster4):
    with Client(cluster4) as client:
        yield client


@pytest.fixture(scope="module")
def wg(client):
    """One group for the module: that it answers after every cancellation is what the tests check."""
    group = WorkerGroup(client, CancelWorker, world_size=RANKS)
    yield group
    group.shutdown()


@pytest.fixture
def hold(wg, tmp_path):
    """``hold()`` starts a sync call on every rank that runs until ``release()``."""
    path = str(tmp_path / "release")

    class Hold:
        future = None

        def __call__(self):
            self.future = wg.generate_sync(batch(path=path, seconds=60))
            _wait_for(wg, lambda r: r["state"] == "running" and r["method"] == "generate_sync")
            return self.future

        def release(self):
            open(path, "w").close()

    holder = Hold()
    yield holder
    holder.release()


def _wait_for(wg: WorkerGroup, predicate, seconds: float = 30.0) -> list[dict]:
    end = time.monotonic() + seconds
    while True:
        status = wg.status()
        if all(predicate(r) for r in status):
            return status
        assert time.monotonic() < end, status
        time.sleep(0.05)


CANCELS = {
    "DataProtoFuture.cancel": lambda client, fut: fut.cancel(),
    "client.cancel(fut)": lambda client, fut: client.cancel(fut),
    "client.cancel(fut.futures)": lambda client, fut: client.cancel(fut.futures),
}


def _answers(wg: WorkerGroup) -> bool:
    return daskwg.get(wg.double(batch())).batch["out"].tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("cancel", CANCELS)
def test_a_cancelled_queued_call_never_runs_and_later_calls_go_on(client, wg, hold, cancel):
    wg.take_events()
    held = hold()
    queued = wg.double(batch())
    after = wg.note("after")
    CANCELS[cancel](client, queued)
    if cancel.startswith("client.cancel"):
        # Dask's client.cancel returns once the request is on its way (fut.cancel() once the
        # ranks answered): the call is taken off their queues a moment later.
        _wait_for(wg, lambda r: r["queued"] == 1)
    hold.release()
    assert daskwg.get(held).batch["out"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert daskwg.get(after) == ["after"] * RANKS
    assert wg.take_events() == [["generate_sync started", "generate_sync finished", "after"]] * RANKS
    with pytest.raises(CallCancelledError):
        queued.get()
    assert _answers(wg)


@pytest.mark.parametrize("cancel", CANCELS)
def test_a_cancelled_running_async_call_gets_cancelled_error_at_its_next_await(client, wg, cancel):
    wg.take_events()
    running = wg.generate(batch(steps=1200, step_s=0.05))  # a minute, unless cancelled
    # Running, and its coroutine begun on every rank (its stack is the task's, in
    # generate): a call its host thread took whose task does not exist yet does not begin
    # when cancelled, and would note nothing.
    _wait_for(
        wg,
        lambda r: (
            r["state"] == "running" and r["method"] == "generate" and "in generate" in (r["stack"] or "")
        ),
    )
    CANCELS[cancel](client, running)
    # Taken once the rank is free again: after the cancellation, long before the minute.
    assert wg.take_events() == [["generate started", "generate cancelled"]] * RANKS
    with pytest.raises(CallCancelledError):
        running.get()
    assert _answers(wg)


@pytest.mark.parametrize("cancel", CANCELS)
def test_a_cancelled_running_sync_call_runs_to_its_end_and_its_result_is_dropped(client, wg, hold, cancel):
    wg.take_events()
    running = hold()
    CANCELS[cancel](client, running)
    status = _wait_for(wg, lambda r: r["cancelled"])  # a sync method cannot be interrupted
    assert [r["method"] for r in status] == ["generate_sync"] * RANKS
    with pytest.raises(CallCancelledError):
        running.get()  # at once: the call still runs
    hold.release()
    assert wg.take_events() == [["generate_sync started", "generate_sync finished"]] * RANKS
    with pytest.raises(CallCancelledError):
        running.get()
    assert _answers(wg)


READS = {
    "fut.get()": lambda client, fut: fut.get(),
    "daskwg.get(fut)": lambda client, fut: daskwg.get(fut),
    "daskwg.get(fut.futures)": lambda client, fut: daskwg.get(fut.futures),
    "Future.result()": lambda client, fut: [f.result() for f in fut.futures],
    "client.gather(fut.futures)": lambda client, fut: client.gather(fut.futures),
    "dask.compute(fut)": lambda client, fut: dask.compute(fut),
    "client.compute(fut)": lambda client, fut: client.compute(fut).result(),
}


@pytest.mark.parametrize("read", READS)
def test_reading_a_cancelled_call_raises_call_cancelled_error(client, wg, read):
    # It was GroupBrokenError, after waiting 3 s for news of a lost worker.
    running = wg.generate(batch(steps=1200, step_s=0.05))
    running.cancel()
    # Every rank's call was cancelled; a read of all of them raises the first error it meets
    # (Dask's client.gather: in the order the parts settle).
    with pytest.raises(CallCancelledError, match=r"'generate' on rank [01] was cancelled"):
        READS[read](client, running)
    assert not wg.is_broken
    assert _answers(wg)


@pytest.mark.parametrize("cancel", CANCELS)
def test_a_cancel_right_after_the_call_is_never_lost_whatever_the_call_was_doing(client, wg, cancel):
    # Sent at once, the cancel reaches a rank before its call is taken, as it is taken, before
    # its coroutine's task exists, or while it awaits: every time the call ends (an endless
    # generation, unless cancelled), and the group answers within the deadline.
    for _ in range(6):
        wg.take_events()
        running = wg.generate(batch(steps=10**6, step_s=0.05))
        CANCELS[cancel](client, running)
        with pytest.raises(CallCancelledError):
            running.get()
        with daskwg.deadline(30):
            assert _answers(wg)
        for events in wg.take_events():
            assert events in (["double ran"], ["generate started", "generate cancelled", "double ran"]), (
                events
            )


def test_distributed_wait_on_a_cancelled_call_raises_dasks_futures_cancelled_error(client, wg):
    running = wg.generate(batch(steps=1200, step_s=0.05))
    running.cancel()
    with pytest.raises(distributed.client.FuturesCancelledError) as caught:
        distributed.wait(running)
    errors = [e for group in caught.value.error_groups for e in group.errors]
    assert sorted(e.key for e in errors) == sorted(f.key for f in running.futures)
    assert all(isinstance(e, CallCancelledError) for e in errors)
    assert _answers(wg)


def test_distributed_wait_waits_for_the_parts_of_a_data_proto_future(client, wg):
    fut = wg.double(batch())
    done, not_done = distributed.wait(fut)
    assert done == set(fut.futures) and not not_done


@pytest.mark.parametrize("compute", ["dask.compute", "client.compute"])
def test_dask_compute_of_a_data_proto_future_gives_its_value(client, wg, compute):
    fut = wg.double(batch()).select(batch_keys=["out"]).repeat(2)
    value = dask.compute(fut)[0] if compute == "dask.compute" else client.compute(fut).result()
    assert isinstance(value, DataProto)
    assert value.batch["out"].tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]


def test_call_cancelled_error_is_a_worker_group_error_and_a_cancelled_error():
    error = CallCancelledError("generate", 1, "key-r1")
    assert isinstance(error, WorkerGroupError)
    assert isinstance(error, concurrent.futures.CancelledError)
    assert "CallCancelledError" in daskwg.__all__
    assert "'generate' on rank 1 was cancelled" in str(error)


def test_a_call_whose_cancel_overtook_it_is_refused_and_its_place_given_up():
    # The cancel and the call reach the worker on different connections, in either order.
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        sequencer = Sequencer(lambda session: executor)  # one executor for every session
        sequencer.cancel("session", 0)
        cancelled = sequencer.submit("session", 0, lambda: "ran")
        later = sequencer.submit("session", 1, lambda: os.getpid())
        assert cancelled.cancelled()
        assert later.result(timeout=10) == os.getpid()
    finally:
        executor.shutdown()
