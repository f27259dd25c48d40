"""Deadlines of group calls: ``with daskwg.deadline(s):``, ``@register(timeout=s)`` and
the Dask setting ``daskwg.call-timeout``.

verl's calls have no deadline, so one stalled rank freezes the whole job; here every
blocking call and every wait on a call's futures can be bounded. Which deadline a wait
gets, the first that applies:

1. the ``with daskwg.deadline(seconds):`` blocks the waiting thread is inside: the one
   that ends first (each counted from when it was entered: a budget for everything inside),
   so an inner block can shorten an outer one's budget but never extend it, as nested
   ``asyncio.timeout`` blocks and trio's cancel scopes behave;
2. the method's ``@register(..., timeout=seconds)`` (counted from the call);
3. ``daskwg.call-timeout`` (counted from the call; ``None``, the default: no deadline).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["deadline", "shielded", "Limit", "current_limit", "check_seconds"]

_local = threading.local()


@dataclass(frozen=True)
class Limit:
    """One wait's deadline: ``expires`` (``time.monotonic()`` seconds) and ``seconds``
    (the configured length, for messages)."""

    expires: float
    seconds: float

    def remaining(self) -> float:
        return self.expires - time.monotonic()


def check_seconds(seconds: object, what: str) -> float | None:
    """``seconds`` as a positive float (``None`` passes), else ``ValueError``/``TypeError``."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(seconds).__name__}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {seconds!r}")
    return float(seconds)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[Limit]:
    """Bound every group call and future wait of this thread inside the block.

    Args:
        seconds: the budget, counted from entering the block (a positive number).

    Yields:
        the ``Limit`` in force inside the block: this block's, or an enclosing block's
        when that one ends first.

    Raises:
        TypeError, ValueError: ``seconds`` is not a positive number.

    A call still waiting when the block's time is up raises
    [`daskwg.CallTimeoutError`][daskwg.CallTimeoutError] naming the ranks that are done, running (with their
    stacks), queued, unresponsive or lost. Blocks nest and the tighter deadline wins: an
    inner block shortens an enclosing block's budget but cannot extend it, as nested
    ``asyncio.timeout`` blocks and trio's cancel scopes behave. A block takes precedence
    over a method's ``@register(timeout=...)`` (longer or shorter) and over
    ``daskwg.call-timeout``. Other threads are not affected. Like ``trio.fail_after`` /
    ``asyncio.timeout``, but for daskwg's waits only.
    """
    limit = Limit(time.monotonic() + check_seconds(seconds, "deadline"), float(seconds))
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(limit)
    try:
        yield _tightest(stack)
    finally:
        stack.remove(limit)


@contextlib.contextmanager
def shielded(seconds: float) -> Iterator[Limit]:
    """A budget of its own for daskwg's clean-up waits (``shutdown()``), which enclosing
    ``deadline`` blocks of the thread do not shorten, as trio's shielded cancel scopes
    let clean-up run after the enclosing scope was cancelled: a group left by an exception
    (a ``CallTimeoutError`` of an expired block included) still gets
    ``daskwg.shutdown-timeout`` to destroy its ranks' objects.

    Args:
        seconds: the budget, counted from entering the block (a positive number).

    Yields:
        the ``Limit`` in force inside the block (this one, or a tighter block inside it).
    """
    outer = getattr(_local, "stack", None)
    _local.stack = []
    try:
        with deadline(seconds) as limit:
            yield limit
    finally:
        _local.stack = outer if outer is not None else []


def _tightest(limits: list[Limit]) -> Limit:
    return min(limits, key=lambda limit: limit.expires)


def current_limit(method_timeout: float | None = None, call_timeout: float | None = None) -> Limit | None:
    """The deadline of a wait starting now in this thread (see the module docstring).

    Args:
        method_timeout: the method's ``@register(timeout=...)`` in seconds, or ``None``.
        call_timeout: ``daskwg.call-timeout`` as the call's :class:`~daskwg.config.Settings`
            read it, or ``None``.
    """
    stack = getattr(_local, "stack", None)
    if stack:
        return _tightest(stack)
    seconds = method_timeout if method_timeout is not None else call_timeout
    if seconds is None:
        return None
    return Limit(time.monotonic() + seconds, seconds)
