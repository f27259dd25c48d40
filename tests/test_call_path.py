"""Where a call's own work runs (issue 21): a worker's host thread writes each reply itself
and reads a chained call's input kept on its own worker, so neither waits for the worker's
event loop; the driver reads results that came back with their replies, and drops the
last reference to them, on the calling thread, without the client's event loop.

Each test holds one of those event loops (``time.sleep`` on it) at the moment the work
would need it, and checks that the work is done long before the loop is free again.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import pytest
import torch
from workers import PathWorker, block_event_loop

import daskwg
from daskwg import DataProto, WorkerGroup
from daskwg.transport.channel import Channel

#: Seconds an event loop is held; everything checked must be done well before it is free.
HELD = 3.0
#: Seconds within which the work must be done (the loop is held HELD - 0.3 s longer).
WITHIN = 2.0


def batch(rows: int = 4, seconds: float = 0.0) -> DataProto:
    """``rows`` rows of ``x``; ``PathWorker.make`` takes ``seconds`` over it."""
    return DataProto.from_dict({"x": torch.arange(rows)}, meta_info={"seconds": seconds})


def hold_worker_loop(client, wg) -> threading.Thread:
    """Hold the event loop of ``wg``'s (only) worker for HELD seconds, from now (``client.run``
    runs a plain function on the worker's loop, and returns when it does)."""
    holder = threading.Thread(
        target=client.run, args=(block_event_loop, HELD), kwargs={"workers": wg.workers}
    )
    holder.start()
    time.sleep(0.3)  # the hold has begun
    return holder


@contextlib.contextmanager
def client_loop_held(client):
    """Inside the block the client's event loop is held (a callback blocks it from before the
    block starts until it ends), however the machine schedules the two threads: what the
    block does cannot be waiting for the loop."""
    held, release = threading.Event(), threading.Event()
    client.loop.add_callback(lambda: (held.set(), release.wait(600)))
    assert held.wait(600), "the client's event loop never ran the holding callback"
    try:
        yield
    finally:
        release.set()


def wait_until(condition, timeout: float) -> float:
    """Seconds until ``condition()`` held (polled), or raise after ``timeout`` seconds."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not done within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
def wg(client4):
    with WorkerGroup(client4, PathWorker, world_size=1) as group:
        group.nap(0)  # the call streams are open
        yield group


@pytest.mark.timeout(60)
def test_a_blocking_calls_reply_leaves_while_the_workers_event_loop_is_held(client4, wg):
    out: list = []
    caller = threading.Thread(target=lambda: out.append(wg.nap(1.0)))
    caller.start()
    time.sleep(0.2)  # the call was read and runs on the host thread
    hold_worker_loop(client4, wg)
    t0 = time.monotonic()
    caller.join(HELD + 10)
    took = time.monotonic() - t0
    print(
        f"\n[call path] a blocking call's reply with the worker's loop held: {took:.2f} s after the hold began"
    )
    assert out == [[1.0]]
    assert took < WITHIN


@pytest.mark.timeout(60)
def test_a_chained_call_reads_its_input_and_replies_while_the_workers_event_loop_is_held(client4, wg):
    first = wg.make(batch(seconds=1.0))
    second = wg.double(first)  # its input is the first call's output, kept on the same worker
    time.sleep(0.2)  # both calls were read; the first runs on the host thread
    hold_worker_loop(client4, wg)
    took = wait_until(lambda: all(f.done() for f in second.futures), WITHIN)
    print(f"\n[call path] a 2-call chain with the worker's loop held: done {took:.2f} s after the hold began")
    assert second.get().batch["x"].tolist() == [2, 4, 6, 8]


@pytest.mark.timeout(60)
def test_a_replays_reply_leaves_while_the_workers_event_loop_is_held(client4, wg):
    with daskwg.plan("held") as step:
        step.output(wg.double(wg.make(step.input("data"))))
    assert step.run(data=batch()).get().batch["x"].tolist() == [2, 4, 6, 8]  # learns the rows
    out = step.run(data=batch(seconds=1.0))
    assert step.route == "one message per worker"
    time.sleep(0.2)
    hold_worker_loop(client4, wg)
    took = wait_until(lambda: all(f.done() for f in out.futures), WITHIN)
    print(f"\n[call path] a replay with the worker's loop held: done {took:.2f} s after the hold began")
    assert out.get().batch["x"].tolist() == [2, 4, 6, 8]


@pytest.mark.timeout(60)
def test_a_result_being_made_is_fetched_by_a_rank_on_another_worker_as_soon_as_it_exists(client4):
    # The producer's host thread stores the result; the consumer's fetch, waiting on the
    # producer's loop, is woken there.
    pool = daskwg.ResourcePool(client4, world_size=2)
    first, second = pool.split([1, 1])
    with (
        WorkerGroup(client4, PathWorker, workers=first) as a,
        WorkerGroup(client4, PathWorker, workers=second) as b,
    ):
        made = a.make(batch(seconds=0.5))
        t0 = time.monotonic()
        assert b.double_now(made).batch["x"].tolist() == [2, 4, 6, 8]
        assert 0.4 < time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_the_last_reference_to_a_result_that_came_back_is_dropped_on_the_calling_thread(client4, wg):
    owned = wg._transport.driver.owned
    futures = wg.nap_async(0)
    assert daskwg.get(futures) == [0]
    keys = [f.key for f in futures]
    assert all(k in owned.records for k in keys)
    with client_loop_held(client4):
        del futures
        gc.collect()
        # Dropped at once, with the loop held: nothing of them waits for it.
        assert not any(k in owned.records for k in keys)
        assert not any(k in client4.futures for k in keys)
    # ... and the worker lets go of the result: its free went with the next call (or its timer).
    wg.nap(0)

    def held_keys(dask_worker):
        return list(dask_worker.plugins["daskwg"].results._values)

    wait_until(lambda: not set(keys) & set(client4.run(held_keys, workers=wg.workers)[wg.workers[0]]), 5)


@pytest.mark.timeout(60)
def test_results_that_came_back_with_their_replies_are_read_without_an_event_loop(wg, monkeypatch):
    runs = []
    original = Channel.run

    def counting(self, coro, **kwargs):
        runs.append(getattr(coro, "__qualname__", str(coro)))
        return original(self, coro, **kwargs)

    monkeypatch.setattr(Channel, "run", counting)
    futures = wg.nap_async(0)
    assert daskwg.get(futures) == [0]
    assert runs == []
    # Dask's Future.result too: read here, with the client's loop held.
    with client_loop_held(wg._transport.driver.client):
        assert futures[0].result() == 0
        assert daskwg.get(futures) == [0]  # and daskwg.get, all of them having come back


@pytest.mark.timeout(60)
def test_a_result_that_fails_to_unpickle_in_the_driver_fails_only_its_call(client4):
    # Its reply is read on the stream that the group's other calls share: the error must
    # stay this call's (a RankError naming it), and the stream and group stay usable.
    from workers import UnloadableWorker

    with WorkerGroup(client4, UnloadableWorker, world_size=2) as group:
        group.nap(0)
        for _ in range(2):  # the second on a stream that is already open
            with pytest.raises(daskwg.RankError, match="could not cross") as info:
                group.unloadable()
            assert "refuses to be unpickled" in str(info.value)
        assert group.nap(0) == [0, 0]
        assert not group.is_broken


@pytest.mark.timeout(30)
def test_a_channel_collected_on_a_thread_running_another_loop_closes_its_loop_cleanly():
    # A driver thread's Channel may be collected by the GC on the client's loop thread,
    # where its own loop cannot run: its streams' tasks must still end, and its loop close,
    # without "coroutine ... never awaited" or "Task was destroyed but it is pending".
    import asyncio
    import warnings

    channel = Channel({})
    task = channel.loop.create_task(asyncio.sleep(60))
    loop = channel.loop

    async def collect():
        nonlocal channel
        del channel
        gc.collect()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(collect())
        deadline = time.monotonic() + 10
        while not loop.is_closed() and time.monotonic() < deadline:
            time.sleep(0.02)
        gc.collect()
    assert loop.is_closed() and task.cancelled()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
