"""The driver's records of calls it sent that it still has to account for: a rank's call
left running when its group broke (:class:`StuckCall`), a call it stopped waiting for
(:class:`AbandonedCall`), and a task-path future (:class:`TaskCall`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire import Call

__all__ = ["StuckCall", "AbandonedCall", "TaskCall"]


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
