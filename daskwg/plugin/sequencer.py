"""Releasing a worker's calls to its host threads strictly in the driver's order.

Each concurrency group (``@register(concurrency_group=...)``, Ray's term) has an order of
its own: the driver numbers a group's calls in a session of their own
(:func:`daskwg.wire.messages.group_session`), and the sequencer hands each session's calls
to the one thread of its group, so a ``"control"`` call never waits for a running call of
the default group, and calls within a group never overtake each other.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass, field
from typing import Any

from ..errors import GroupBrokenError
from ..wire.messages import of_client

__all__ = ["Sequencer"]


@dataclass
class _Session:
    session: str
    executor: Executor
    next_seq: int = 0
    pending: dict = field(default_factory=dict)
    skipped: set = field(default_factory=set)
    #: numbers cancelled before their call arrived: it is refused (cancelled) when it comes.
    cancelled: set = field(default_factory=set)


class Sequencer:
    """Releases work items to one thread per session strictly in sequence-number order.

    Each driver (``session``) numbers its calls to this worker 0, 1, 2, ...; a call runs
    once every lower number of its driver has run or was skipped, whichever path it came
    by, so the direct path and the task path cannot overtake each other. A named
    concurrency group's calls count in a session of their own, run by that group's thread.

    Args:
        executor_for: ``session -> executor``: the one-thread executor a session's calls run
            on (the host thread of its concurrency group); asked once per session.
    """

    def __init__(self, executor_for: Callable[[str], Executor]):
        self._executor_for = executor_for
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._released: set[str] = set()
        #: per session, the sequence number of its last call that finished (or was
        #: skipped) on its thread; calls finish in order, so one number says it all.
        self.progress: dict[str, int] = {}

    def _done(self, session: str, seq: int) -> None:
        self.progress[session] = seq

    def submit(
        self, session: str, seq: int, fn: Callable[[], Any], outlives: bool = False, span: int = 1
    ) -> ConcurrentFuture:
        """Run ``fn`` on the thread once call ``seq`` of driver ``session`` has its turn;
        returns the future of its result (failed at once for a departed driver, unless
        the call ``outlives`` it: a call of a detached group, which runs as a detached Ray
        actor's queued tasks do; or for a number that came twice). ``fn`` takes the places
        ``seq`` to ``seq + span - 1`` (a step plan's calls on this worker, run in one turn)."""
        result: ConcurrentFuture = ConcurrentFuture()
        with self._lock:
            if session in self._released and not outlives:
                result.set_exception(
                    GroupBrokenError(
                        f"driver session {session} was released on this worker (the scheduler dropped its "
                        "client, and with it the client's ranks): build the group again"
                    )
                )
                return result
            state = self._state(session)
            if seq in state.cancelled:
                # Its cancel overtook it (another connection): it never runs, its place is given up.
                state.cancelled.discard(seq)
                result.cancel()
                return result
            if seq < state.next_seq or seq in state.pending:
                result.set_exception(
                    RuntimeError(f"call {seq} of driver {session} arrived twice or after it was skipped")
                )
                return result
            # A call the driver gave up on (skip) may still arrive; then it runs.
            state.skipped.discard(seq)
            state.pending[seq] = (fn, result, span)
            self._release(state)
        return result

    def _state(self, session: str) -> _Session:
        state = self._sessions.get(session)
        if state is None:
            state = self._sessions[session] = _Session(session, self._executor_for(session))
        return state

    def seen(self, session: str, seq: int) -> bool:
        """Whether call ``seq`` of driver ``session`` has reached this worker (it is queued,
        ran, or its place was given up)."""
        with self._lock:
            state = self._sessions.get(session)
            return state is not None and (seq < state.next_seq or seq in state.pending)

    def skip(self, session: str, seq: int) -> None:
        """Mark ``seq`` as never coming (its task failed before reaching this worker)."""
        with self._lock:
            state = self._state(session)
            if seq >= state.next_seq and seq not in state.pending:
                state.skipped.add(seq)
                self._release(state)

    def cancel(self, session: str, seq: int) -> None:
        """Call ``seq`` of driver ``session`` was cancelled before it reached this worker:
        its place is given up (later calls go on) and, unlike a :meth:`skip`, the call is
        refused if it still comes (the cancel and the call travel on different connections)."""
        with self._lock:
            state = self._state(session)
            if seq >= state.next_seq and seq not in state.pending:
                state.cancelled.add(seq)
                state.skipped.add(seq)
                self._release(state)

    def forget(self, client: str) -> None:
        """A driver's client left: calls of its sessions (:func:`daskwg.wire.messages.session_id`)
        from now on are refused, not queued, except those that outlive it (see
        :meth:`submit`), which keep their order: their numbers still count on. A session
        of that client not seen yet (the client reconnected and numbers afresh) is a new one."""
        with self._lock:
            for session in [s for s in self._sessions if of_client(s, client)]:
                self._released.add(session)
            self._released.add(client)

    def _release(self, state: _Session) -> None:
        while True:
            seq = state.next_seq
            if seq in state.skipped:
                state.skipped.discard(seq)
                # Through the thread too, so progress never runs ahead of a call still running.
                state.executor.submit(self._done, state.session, seq)
            elif seq in state.pending:
                fn, result, span = state.pending.pop(seq)
                state.executor.submit(
                    _run_into, fn, result, functools.partial(self._done, state.session, seq + span - 1)
                )
                state.next_seq += span
                continue
            else:
                return
            state.next_seq += 1


def _run_into(fn: Callable[[], Any], result: ConcurrentFuture, done: Callable[[], None]) -> None:
    try:
        if not result.set_running_or_notify_cancel():
            return
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            result.set_exception(exc)
        else:
            result.set_result(value)
    finally:
        done()
