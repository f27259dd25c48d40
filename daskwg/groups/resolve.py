"""``daskwg.get``: wait for what non-blocking calls returned (``ray.get``'s counterpart).

verl code waits with ``ray.get(refs)`` on the object refs of ``execute_all_async`` and of
``blocking=False`` methods; on daskwg those are Dask futures and ``DataProtoFuture``
objects, and ``daskwg.get`` waits for them the way a blocking group call does: a rank
that raised gives a :class:`~daskwg.RankError`, a lost worker a
:class:`~daskwg.WorkerLostError` within seconds, never a bare Dask
``FutureCancelledError``, and the wait is bounded by the active ``daskwg.deadline``.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import CancelledError
from typing import Any

from distributed import Future, wait

from ..config import Settings
from ..deadlines import current_limit, deadline
from ..errors import CallCancelledError, CallTimeoutError, WorkerGroupError
from ..futures.future import DataProtoFuture
from ..transport import Driver
from ..transport.owned import FINISHED, PENDING

__all__ = ["get"]


def get(refs: Any) -> Any:
    """The value of a future, or the values of a (nested) list or tuple of them.

    Mirrors ``ray.get``: a single future gives its value, a list gives a list of values
    in the same order (nested lists and tuples keep their shape).

    Args:
        refs: a ``distributed.Future`` (from ``execute_all_async``,
            ``execute_rank_zero_async`` or a ``blocking=False`` method), a
            [`DataProtoFuture`][daskwg.DataProtoFuture], or lists/tuples of those, nested.

    Returns:
        the value(s); a ``DataProtoFuture`` gives its materialised ``DataProto`` (or
        TensorDict), as ``DataProtoFuture.get()``.

    Raises:
        TypeError: ``refs`` holds something that is not a future (the message names it).
        RankError: a rank raised in the method that produced a future.
        WorkerLostError: the worker of that rank died or left.
        CallTimeoutError: the active ``daskwg.deadline`` (or ``daskwg.call-timeout``)
            passed first.
        CallCancelledError: the call that makes a future was cancelled
            (``DataProtoFuture.cancel()``, ``client.cancel``), at once.
        WorkerGroupError: a future not made by a group was cancelled.
    """
    futures: list[Future] = []
    shape = _collect(refs, futures)
    call_timeout = Settings.current().call_timeout
    # One deadline for everything this get waits for: an enclosing block's, else
    # daskwg.call-timeout counted from now.
    scope = (
        deadline(call_timeout)
        if call_timeout is not None and current_limit() is None
        else contextlib.nullcontext()
    )
    with scope:
        values = _gather(futures)
        return _rebuild(shape, iter(values))


def _collect(refs: Any, futures: list[Future]) -> Any:
    """The nesting of ``refs`` with each leaf replaced by its index in ``futures``."""
    if isinstance(refs, Future):
        futures.append(refs)
        return ("future", len(futures) - 1)
    if isinstance(refs, DataProtoFuture):
        return ("data", refs)
    if isinstance(refs, (list, tuple)):
        return (type(refs), [_collect(r, futures) for r in refs])
    raise TypeError(
        f"daskwg.get takes futures (distributed.Future, DataProtoFuture) or lists of them, got "
        f"{type(refs).__name__}; a blocking call already returns its value"
    )


def _rebuild(shape: tuple, values: Any) -> Any:
    kind, content = shape
    if kind == "future":
        return next(values)
    if kind == "data":
        return content.get()
    return kind(_rebuild(s, values) for s in content)


def _gather(futures: list[Future]) -> list:
    """Values of ``futures`` in order; each group's futures through that group's wait."""
    if not futures:
        return []
    values = _came_back(futures, wait=True)
    if values is not None:
        return values
    by_transport: dict[Any, list[int]] = {}
    found: dict[tuple[int, str | None], Any] = {}  # (driver, group id) -> transport, this call
    for i, future in enumerate(futures):
        by_transport.setdefault(_transport_of(future, found), []).append(i)
    values: list[Any] = [None] * len(futures)
    for transport, indices in by_transport.items():
        chosen = [futures[i] for i in indices]
        gathered = transport.gather_any(chosen) if transport is not None else _gather_plain(chosen)
        for i, value in zip(indices, gathered):
            values[i] = value
    return values


def _came_back(futures: list[Future], wait: bool) -> list | None:
    """The values of results of non-blocking calls that all finish and come back with
    their replies, read here (a tight loop of small calls gathers these), after waiting
    for them up to ``daskwg.poll-interval`` (``wait``) as the groups' waits do between
    their checks; ``None`` for anything else, and for a call that failed or is not done
    by then: the groups' waits handle those (errors, lost workers, deadlines)."""
    client = futures[0].client
    owned = Driver.of(client).owned
    records = [owned.record(f) for f in futures]
    if any(r is None or f.client is not client for r, f in zip(records, futures)):
        return None
    if wait and any(r.status == PENDING for r in records):
        limit = current_limit()
        timeout = Settings.current().poll_interval
        if limit is not None:
            timeout = min(timeout, limit.remaining())
        if timeout > 0:
            owned.wait(records, timeout, every=True)  # until all came, or one failed
    if any(r.status != FINISHED for r in records):
        return None
    return owned.fetch_inline([f.key for f in futures])


def _transport_of(future: Future, found: dict | None = None) -> Any:
    """The transport of the live group whose call made ``future`` (``None`` for other
    futures); ``found`` remembers the groups already looked up (a call's futures share one)."""
    driver = Driver.of(future.client)
    call = driver.call_of(future)
    if call is None:
        return None
    key = (id(driver), call.group_id)
    if found is not None and key in found:
        return found[key]
    transport = next((t for t in list(driver.transports) if t.ranks.group_id == call.group_id), None)
    if found is not None:
        found[key] = transport
    return transport


def _gather_plain(futures: list[Future]) -> list:
    """``client.gather`` bounded by the active deadline, with daskwg's error types; a future
    that failed raises its error at once (the task's own exception, as ``client.gather``)."""
    limit = current_limit()
    client = futures[0].client
    try:
        pending = set(futures)
        while limit is not None and pending:  # each round takes at least one future off
            try:
                done, pending = wait(
                    pending, timeout=max(limit.remaining(), 0.0), return_when="FIRST_COMPLETED"
                )
            except TimeoutError:
                raise _plain_timeout(futures, limit.seconds) from None
            if any(f.status == "error" for f in done):
                break
        # direct: from the workers holding the values, never forwarded by the scheduler.
        return client.gather(futures, direct=True)
    except CallCancelledError:  # a group call the program cancelled (its group is gone now)
        raise
    except CancelledError as exc:  # Dask's FutureCancelledError and FuturesCancelledError
        raise WorkerGroupError(
            f"a future daskwg.get waited for was cancelled ({type(exc).__name__}: {exc}); its result "
            "is gone from the cluster: submit the work again"
        ) from None


def _plain_timeout(futures: list[Future], seconds: float) -> CallTimeoutError:
    states = {i: "done" if f.done() else "running" for i, f in enumerate(futures)}
    running = sum(state == "running" for state in states.values())
    return CallTimeoutError(
        "daskwg.get",
        seconds,
        states,
        {},
        f"daskwg.get passed its deadline of {seconds:g} s with {running} of {len(futures)} futures still "
        "running (futures no group call made: their states are by position in the list)",
    )
