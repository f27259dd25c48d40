"""The driver's records of calls it sent that it still has to account for: a rank's call
left running when its group broke (:class:`StuckCall`), a call it stopped waiting for
(:class:`AbandonedCall`), a task-path future (:class:`TaskCall`), the unfinished
futures sent to each worker process (:class:`Inflight`), and the thread-shared weak set
these live in (:class:`SharedWeakSet`)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ...wire.messages import Call

__all__ = ["StuckCall", "AbandonedCall", "TaskCall", "Inflight", "SharedWeakSet"]


@dataclass(frozen=True)
class StuckCall:
    """A rank's call still running after its group broke: nothing is queued behind it.

    Attributes:
        group_name: the broken group.
        method: the call's method.
        watch: has ``done()``: whether the call has ended on the rank.
        since: ``time.monotonic()`` when the group broke with it running.
        seq: its sequence number on that worker (-1: unknown).
    """

    group_name: str
    method: str
    watch: Any
    since: float = 0.0
    seq: int = -1

    def describe(self, now: float) -> str:
        return (
            f"still stuck in {self.method!r} of the broken group {self.group_name!r} "
            f"({now - self.since:.1f} s since it broke; a rank failed while this one waited, e.g. in a collective)"
        )


@dataclass(frozen=True)
class AbandonedCall:
    """A call the driver stopped waiting for (a deadline, Ctrl-C) that may still run.

    Attributes:
        group_name, method: the call.
        watch: has ``done()``: whether the call has ended on the rank.
        since: ``time.monotonic()`` when it was abandoned.
        why: ``"deadline"`` or ``"interrupted"``.
        seq: its sequence number on that worker (-1: unknown).
    """

    group_name: str
    method: str
    watch: Any
    since: float
    why: str
    seq: int = -1

    def describe(self, now: float) -> str:
        by = "a deadline" if self.why == "deadline" else "Ctrl-C" if self.why == "interrupted" else self.why
        return (
            f"still busy with {self.method!r} of group {self.group_name!r}, abandoned by {by} "
            f"{now - self.since:.1f} s ago and not finished there yet"
        )


@dataclass(frozen=True)
class TaskCall:
    """What the driver knows of one task-path future, for deadline reports and paused workers.

    Attributes:
        call: the call it stands for.
        submitted: ``time.monotonic()`` when it was submitted.
        paused_timeout: the call's ``daskwg.paused-timeout`` (seconds).
    """

    call: Call
    submitted: float
    paused_timeout: float


class SharedWeakSet:
    """A ``weakref.WeakSet`` that several threads share: calling threads add while the
    client's loop iterates (a plain ``WeakSet`` then raises ``RuntimeError: Set changed
    size during iteration``). Iterating gives a snapshot, taken under the set's lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: weakref.WeakSet = weakref.WeakSet()

    def add(self, item: Any) -> None:
        with self._lock:
            self._items.add(item)

    def discard(self, item: Any) -> None:
        with self._lock:
            self._items.discard(item)

    def __iter__(self):
        with self._lock:
            snapshot = list(self._items)
        return iter(snapshot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class Inflight:
    """Per worker process (server id), the driver's futures of calls sent there (weakly
    held: a future the user dropped leaves by itself).

    Calling threads add while the client's loop and other calling threads read: every
    access takes one lock, as iterating a ``weakref.WeakSet`` another thread adds to
    raises ``RuntimeError: Set changed size during iteration``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_server: dict[str, SharedWeakSet] = {}

    def add(self, server_id: str, future: Any) -> None:
        with self._lock:
            futures = self._by_server.setdefault(server_id, SharedWeakSet())
        futures.add(future)

    def count(self, server_id: str) -> int:
        """How many futures sent to ``server_id`` are alive (finished ones included)."""
        with self._lock:
            futures = self._by_server.get(server_id)
        return len(futures) if futures is not None else 0

    def of(self, server_id: str) -> list:
        """The futures sent to ``server_id`` that are still alive (a snapshot)."""
        with self._lock:
            futures = self._by_server.get(server_id)
        return list(futures) if futures is not None else []

    def pop(self, server_id: str) -> list:
        """:meth:`of`, and forget them (their worker process is gone)."""
        with self._lock:
            futures = self._by_server.pop(server_id, None)
        return list(futures) if futures is not None else []
