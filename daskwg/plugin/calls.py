"""What the host threads are doing: :class:`CallTable`, the calls queued for them, the one
each runs (one host thread per concurrency group: the default group's, and one per named
group such as ``"control"``), and the ones whose futures were cancelled (for
``daskwg_status``, ``daskwg_cancel`` and the driver's deadline reports).

The worker's event loop (handlers) and the host threads use it; its lock guards the queue
and the running calls, which are only ever iterated over as a copy taken under the lock.
Calls are keyed by ``(session, seq)``: a named group's calls count in a session of their
own (:func:`daskwg.wire.messages.group_session`), so the key is unique across groups.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import Any

from ..wire.messages import Call, of_client, status_record
from .rank_loop import task_stack

__all__ = ["CallTable", "QueuedCall", "RunningCall", "status_records"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueuedCall:
    """A call waiting for its turn on the host thread, since ``since`` (``time.monotonic()``:
    durations must not jump when the wall clock is stepped)."""

    call: Call
    since: float


@dataclass(frozen=True)
class RunningCall:
    """A call a host thread runs now: since ``since`` (``time.monotonic()``), on thread ``ident``."""

    call: Call
    since: float
    ident: int


class CallTable:
    """The calls of one worker's host threads, by ``(driver session, seq)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: dict[tuple[str, int], QueuedCall] = {}
        # Concurrency group (None: the default one) -> the call its host thread runs now,
        # set and cleared by that thread.
        self._running: dict[str | None, RunningCall] = {}
        # Unfinished calls, so that cancelling a call's future (Future.cancel,
        # client.cancel) reaches it; and the running ones that were cancelled.
        self._unfinished: dict[tuple[str, int], tuple[Call, ConcurrentFuture]] = {}
        self._cancelled: set[tuple[str, int]] = set()
        # Running calls whose driver left meanwhile (its client disconnected): they run to
        # their end all the same (a sync method cannot be interrupted), and the calls of
        # other drivers behind them say whose call they wait for.
        self._departed: set[tuple[str, int]] = set()

    def queue(self, call: Call) -> None:
        """``call`` waits for its turn from now."""
        with self._lock:
            self._queued[(call.session, call.seq)] = QueuedCall(call, time.monotonic())

    def dequeue(self, call: Call) -> None:
        """``call`` no longer waits (it starts, was refused or was skipped)."""
        with self._lock:
            self._queued.pop((call.session, call.seq), None)

    def track(self, call: Call, result: ConcurrentFuture) -> None:
        """Keep ``call``'s result future until it is done, so that it can be cancelled."""
        key = (call.session, call.seq)
        self._unfinished[key] = (call, result)
        result.add_done_callback(lambda _: self._unfinished.pop(key, None))

    def start(self, call: Call) -> None:
        """A host thread starts ``call`` (it leaves the queue)."""
        with self._lock:
            self._queued.pop((call.session, call.seq), None)
            self._running[call.concurrency_group] = RunningCall(call, time.monotonic(), threading.get_ident())

    def finish(self, call: Call) -> None:
        """The host thread of ``call``'s concurrency group finished it."""
        with self._lock:
            self._running.pop(call.concurrency_group, None)
            self._departed.discard((call.session, call.seq))

    @property
    def running(self) -> RunningCall | None:
        """The call the default group's host thread runs now, else ``None``."""
        return self._running.get(None)

    def running_calls(self) -> list[RunningCall]:
        """Every call a host thread runs now, the default group's first (a copy)."""
        with self._lock:
            return sorted(self._running.values(), key=lambda r: r.call.concurrency_group is not None)

    def queued(self) -> list[QueuedCall]:
        """The calls waiting now (a copy)."""
        with self._lock:
            return list(self._queued.values())

    def forget_session(self, client: str) -> None:
        """Drop the queued calls of a driver's client that left (all its sessions), and
        mark its running ones as calls of a departed driver (:meth:`departed`)."""
        with self._lock:
            for key in [k for k, q in self._queued.items() if of_client(q.call.session, client)]:
                del self._queued[key]
            for r in self._running.values():
                if of_client(r.call.session, client):
                    self._departed.add((r.call.session, r.call.seq))

    def departed(self, call: Call) -> bool:
        """Whether ``call`` runs on after its driver left (:meth:`forget_session`)."""
        return (call.session, call.seq) in self._departed

    def unfinished(self, session: str, seq: int) -> tuple[Call, ConcurrentFuture] | None:
        """``(call, result future)`` of call ``seq`` of ``session`` while it is not done."""
        return self._unfinished.get((session, seq))

    def cancel(self, call: Call, result: ConcurrentFuture, rank_loop: Any) -> str:
        """Cancel ``call`` as Ray cancels an actor task: a call still waiting for its turn
        never runs (its place in the order is given up, later calls go on); a running
        ``async def`` method gets ``asyncio.CancelledError`` at its current ``await``
        (``rank_loop``: the rank's :class:`~daskwg.plugin.rank_loop.RankLoop`, or ``None``);
        a running sync method cannot be interrupted (Python cannot stop a thread), so it
        runs to the end, the rank's next calls wait for it, and ``status()`` shows it as
        cancelled.

        Returns:
            ``"skipped"``, ``"interrupted"``, ``"running"`` or ``"done"``.
        """
        if result.cancel():
            self.dequeue(call)
            logger.info(
                "cancelled call %d (%r) of group %r rank %d before it ran; later calls go on",
                call.seq,
                call.method,
                call.group_name,
                call.rank,
            )
            return "skipped"
        if result.done():
            return "done"
        key = (call.session, call.seq)
        # Marked before looking at what runs: a call its host thread took but has not begun
        # (before CallTable.start, or before its coroutine's task exists) reads the mark
        # there and does not begin (was_cancelled), so a cancel is never lost in between.
        self._cancelled.add(key)
        if result.done():  # it ended meanwhile: its outcome went out without the mark
            self._cancelled.discard(key)
            return "done"
        running = self._running.get(call.concurrency_group)
        if running is None or (running.call.session, running.call.seq) != key:
            logger.info(
                "cancelled call %d (%r) of group %r rank %d as it was starting: it does not begin",
                call.seq,
                call.method,
                call.group_name,
                call.rank,
            )
            return "skipped"
        task = rank_loop.task_of(call.concurrency_group) if rank_loop is not None else None
        if task is not None:
            rank_loop.loop.call_soon_threadsafe(task.cancel)
            logger.info(
                "cancelled the running async call %r of group %r rank %d: CancelledError at its current await",
                call.method,
                call.group_name,
                call.rank,
            )
            return "interrupted"
        logger.warning(
            "call %r of group %r rank %d was cancelled while running; a running sync method cannot be "
            "interrupted, so it runs to the end and the rank's next calls wait for it (see wg.status())",
            call.method,
            call.group_name,
            call.rank,
        )
        return "running"

    def was_cancelled(self, call: Call) -> bool:
        """Whether ``call``'s future was cancelled after its host thread took it (while it
        ran, or as it was starting)."""
        return (call.session, call.seq) in self._cancelled

    def forget_cancelled(self, call: Call) -> None:
        """Drop ``call`` from the cancelled calls (its task has ended)."""
        self._cancelled.discard((call.session, call.seq))


def status_records(
    calls: CallTable, hosted: Mapping[tuple[str, int], Any], last_errors: Mapping
) -> list[dict]:
    """What ``daskwg_status`` answers: one :func:`~daskwg.wire.messages.status_record` per rank in
    ``hosted`` (``(group id, rank) -> HostedRank``; ``"idle"`` or ``"running"``, the running
    call with its stack), one more per call of a named concurrency group running beside it
    (after the rank's first record), one ``"running"`` for a rank whose ``__init__`` runs (it
    is not hosted yet, or whose driver left and released it while the call runs on), and one
    per call queued for a rank; ``last_errors`` by the same keys."""
    running = calls.running_calls()
    queued = calls.queued()
    frames = sys._current_frames()
    # The same clock as the table's: a stepped wall clock (NTP, a VM resumed) must not turn
    # a call's age negative or inflate it.
    now = time.monotonic()
    records = []
    for r in running:
        if (r.call.group_id, r.call.rank) not in hosted:
            # A rank being built: its __init__ runs before the rank is hosted.
            frame = frames.get(r.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else None
            records.append(
                status_record(
                    r.call.group_name,
                    r.call.group_id,
                    r.call.rank,
                    "running",
                    r.call,
                    now - r.since,
                    stack,
                    departed=calls.departed(r.call),
                )
            )
    for (group_id, rank), h in hosted.items():
        last_error = last_errors.get((group_id, rank))
        mine = [r for r in running if (r.call.group_id, r.call.rank) == (group_id, rank)]
        if not mine:
            records.append(status_record(h.group_name, group_id, rank, "idle", last_error=last_error))
            continue
        for r in mine:
            call = r.call
            frame = frames.get(r.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else None
            task = h.rank_loop.task_of(call.concurrency_group) if h.rank_loop is not None else None
            if task is not None:
                # An async call: the host thread only waits; where the coroutine is matters.
                stack = task_stack(task) or stack
            records.append(
                status_record(
                    h.group_name,
                    group_id,
                    rank,
                    "running",
                    call,
                    now - r.since,
                    stack,
                    last_error,
                    calls.was_cancelled(call),
                    calls.departed(call),
                )
            )
    for q in queued:
        records.append(
            status_record(q.call.group_name, q.call.group_id, q.call.rank, "queued", q.call, now - q.since)
        )
    return records
