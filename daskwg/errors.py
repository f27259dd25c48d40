"""The exceptions daskwg raises: one small hierarchy rooted at :class:`WorkerGroupError`.

Where a class also derives from a standard exception, ``except`` clauses written for that
one catch it too (a ``CallTimeoutError`` is a ``TimeoutError``, ...)::

    WorkerGroupError
    ├── DispatchError (ValueError)       bad arguments, raised before any rank runs
    ├── WorldSizeError (ValueError)      more ranks asked for than workers
    ├── RankError                        a rank raised in the method
    ├── WorkerLostError                  a rank's worker died or left
    ├── GroupBrokenError                 a call on a broken or shut down group
    ├── BatchDimsError (ValueError, AssertionError)
    ├── ConflictError (ValueError, AssertionError)
    ├── ConcatError (ValueError)         per-rank outputs that cannot be concatenated
    │   └── MetaInfoConflictError (ConflictError)
    ├── WorkerPausedError                a task-path call whose worker stayed paused
    ├── CallTimeoutError (TimeoutError)  a call or wait passed its deadline
    ├── CallCancelledError (concurrent.futures.CancelledError)
    │                                    the future of the call was cancelled
    └── VersionMismatchError             driver and worker versions differ
"""

from __future__ import annotations

import pickle
from concurrent.futures import CancelledError

__all__ = [
    "WorkerGroupError",
    "DispatchError",
    "RankError",
    "WorkerLostError",
    "GroupBrokenError",
    "WorldSizeError",
    "ConflictError",
    "ConcatError",
    "MetaInfoConflictError",
    "BatchDimsError",
    "WorkerPausedError",
    "CallTimeoutError",
    "CallCancelledError",
    "VersionMismatchError",
]


class WorkerGroupError(Exception):
    """Base class of every error daskwg raises about a worker group."""


class DispatchError(WorkerGroupError, ValueError):
    """The arguments of a group call cannot be split over the ranks.

    Raised in the driver by the dispatch function, before any rank runs, e.g. a
    ``DP_COMPUTE`` argument whose length is not ``world_size`` or a non-DataProto
    argument to a ``DP_COMPUTE_PROTO`` method.
    """


class WorldSizeError(WorkerGroupError, ValueError):
    """A group asked for more ranks than the cluster (or pool) has workers."""


class RankError(WorkerGroupError):
    """A rank raised while running a method.

    Attributes:
        rank: the rank that raised (``int``).
        address: the Dask worker address hosting that rank (``str``).
        method: the method name (``str``).
        remote_traceback: the traceback formatted on the worker (``str``).
        exception: the original exception object, when it could be rebuilt here
            (``None`` when its class exists only on the worker, or it does not pickle).
        exception_type: the original exception's class, ``"module.QualName"`` (``str``),
            kept even when the class cannot be rebuilt in the driver.
        message: ``str()`` of the original exception, taken on the worker (``str``).

    A ``RankError`` always crosses processes: its exception travels as pickled bytes
    beside its type name and message, and an exception that cannot be rebuilt where it
    arrives leaves ``exception=None`` with the name and message intact.
    """

    def __init__(
        self,
        rank: int,
        address: str,
        method: str,
        remote_traceback: str,
        exception=None,
        exception_type: str | None = None,
        message: str | None = None,
    ):
        self.rank = rank
        self.address = address
        self.method = method
        self.remote_traceback = remote_traceback
        self.exception = exception
        if exception is not None:
            cls = type(exception)
            exception_type = exception_type or (
                cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
            )
            message = safe_str(exception) if message is None else message
        self.exception_type = exception_type or ""
        self.message = message or ""
        super().__init__(rank, address, method, remote_traceback, exception)

    def __str__(self) -> str:
        what = f"{self.exception_type.rsplit('.', 1)[-1]}: {self.message}" if self.exception_type else ""
        return (
            f"rank {self.rank} ({self.address}) raised in {self.method!r}: {what}\n"
            f"--- remote traceback ---\n{self.remote_traceback}"
        )

    def __reduce__(self):
        try:
            blob = pickle.dumps(self.exception)
        except Exception:  # noqa: BLE001 - e.g. an argument that holds a lock
            blob = None
        state = (self.rank, self.address, self.method, self.remote_traceback, blob)
        return (_rebuild_rank_error, (type(self), state, self.exception_type, self.message))


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a note saying that it raised (a user ``__str__`` may)."""
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 - a user __str__ that raises
        return f"<str() of this {type(exc).__name__} raised {type(inner).__name__}: {inner}>"


def _rebuild_rank_error(cls, state: tuple, exception_type: str, message: str) -> RankError:
    rank, address, method, remote_traceback, blob = state
    exception = None
    if blob is not None:
        try:
            exception = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - the class exists only on the worker
            exception = None
    return cls(rank, address, method, remote_traceback, exception, exception_type, message)


class WorkerLostError(WorkerGroupError):
    """The Dask worker hosting a rank died or left the cluster; the group is broken.

    Attributes:
        rank: the rank whose worker was lost (``int``).
        address: that worker's address (``str``).
        survivor_errors: the errors other ranks of the same call raised because of the
            loss (``list[RankError]``, e.g. gloo's "Connection reset by peer" inside a
            collective; the first is also the ``__context__``); empty when none did.
        group: the name of the group that rank belongs to (``str``; ``None`` if unknown):
            for a call that read a lost result, the producing group, not the caller's.

    When a worker is lost while a call runs or just before it, this error wins over the
    survivors' errors that the loss caused: it names the rank to look at.
    """

    def __init__(self, rank: int, address: str, detail: str = "", group: str | None = None):
        self.rank = rank
        self.address = address
        self.detail = detail
        self.survivor_errors: list = []
        self.group = group
        super().__init__(rank, address, detail)

    def __str__(self) -> str:
        of = f" of group {self.group!r}" if self.group else ""
        msg = f"the worker hosting rank {self.rank}{of} ({self.address}) was lost"
        if self.detail:
            msg += f": {self.detail}"
        broken = f"group {self.group!r} is broken" if self.group else "the group is broken"
        return msg + (
            f"; {broken}: wg.heal() rebuilds the lost rank on a free worker (the other ranks keep "
            "their state), wg.restart() brings it back on fresh worker processes (rebuilding its "
            "ranks, whose state is lost), or shut it down and build a new one"
        )

    def __reduce__(self):
        return (
            type(self),
            (self.rank, self.address, self.detail, self.group),
            {"survivor_errors": self.survivor_errors},
        )


class GroupBrokenError(WorkerGroupError):
    """A call was made on a group that is broken (a worker was lost or a rank failed
    inside a collective) or already shut down.

    The message says why; build a new group (and call ``shutdown()`` on this one).
    """


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BatchDimsError(WorkerGroupError, ValueError, AssertionError):
    """A ``DataProto`` was asked for a number of batch dimensions other than one.

    Raised by ``DataProto.from_dict`` / ``from_tensordict`` for ``num_batch_dims != 1``.
    Also an ``AssertionError``, what verl raises there, so both kinds of caller catch it.
    """


class ConflictError(WorkerGroupError, ValueError, AssertionError):
    """Two sources hold different values under a key that must agree.

    Raised by ``DataProto.union`` and [`daskwg.protocol.union_tensor_dict`][daskwg.protocol.union_tensor_dict]
    / [`union_numpy_dict`][daskwg.protocol.union_numpy_dict] when a shared key holds different values.
    It is also an ``AssertionError`` because verl ``assert``s in these places, so ported
    code that catches verl's type keeps working; new code should catch ``ConflictError``
    (or ``ValueError``).
    """


class ConcatError(WorkerGroupError, ValueError):
    """Parts that cannot be concatenated into one batch.

    Raised by ``DataProto.concat`` and, naming the method and the ranks, by the collect step
    of a group call (blocking or ``DataProtoFuture.get()``), e.g. when ranks return a field
    padded to different lengths.

    Attributes:
        problem: what disagrees, e.g. ``"batch key 'responses' has different shapes"``.
        values: ``{part index: what that part holds}`` (a shape, a value), in part order.
        labels: how each part is named, parallel to ``values``: ``"part 0"`` outside a group
            call, ``"rank 3"`` in the collect step.
        method: the group method whose outputs were being collected, or ``None``.
        hint: what to do about it (may be empty).
    """

    def __init__(
        self,
        problem: str,
        values: dict | None = None,
        labels: dict | None = None,
        method: str | None = None,
        hint: str = "",
    ):
        self.problem = problem
        self.values = dict(values or {})
        self.labels = dict(labels or {})
        self.method = method
        self.hint = hint
        super().__init__(problem, self.values, self.labels, method, hint)

    def in_call(self, method: str, ranks: list[int]) -> ConcatError:
        """The same error for the collect step of ``method``, part ``i`` named ``rank ranks[i]``."""
        labels = {i: f"rank {ranks[i]}" if i < len(ranks) else f"part {i}" for i in self.values}
        return type(self)(self.problem, self.values, labels, method, self.hint)

    def __str__(self) -> str:
        shown = []
        for i, value in list(self.values.items())[:16]:
            shown.append(f"{self.labels.get(i, f'part {i}')}: {_short(value)}")
        if len(self.values) > 16:
            shown.append(f"... ({len(self.values) - 16} more)")
        where = f"collecting the outputs of {self.method!r}: " if self.method else ""
        text = f"{where}{self.problem}"
        if shown:
            text += " (" + ", ".join(shown) + ")"
        return text + (f"; {self.hint}" if self.hint else "")

    def __reduce__(self):
        return (type(self), (self.problem, self.values, self.labels, self.method, self.hint))


class MetaInfoConflictError(ConcatError, ConflictError):
    """Parts give different values for a non-metric ``meta_info`` key.

    verl raises ``AssertionError: Conflicting values for meta_info key ...`` here; this is
    an ``AssertionError`` and a ``ValueError`` too. In a group call the message names the
    method whose outputs were being collected and each rank's value; per-rank values belong
    in ``meta_info["metrics"]`` (merged into lists) or in ``non_tensor_batch``.
    """


class WorkerPausedError(WorkerGroupError):
    """A call on the Dask-task path could not start: its worker stayed paused.

    A Dask worker whose process memory is above ``distributed.worker.memory.pause``
    starts no tasks. Memory a rank holds (its model, optimizer, buffers) is not Dask's
    to free, so such a pause may never end; after ``daskwg.paused-timeout`` seconds the
    driver cancels the call on that rank (it did not run there) and raises this.
    Blocking calls without ``DataProtoFuture`` arguments are not affected: they reach
    the rank over the worker's comm handlers, which serve while paused.

    Attributes:
        rank: the rank whose call did not start (``int``).
        address: its worker's address (``str``).
        method: the method name (``str``).
        memory: the worker process's memory in bytes when the call was given up
            (``int``, ``None`` if the worker did not answer).
        memory_limit: the worker's ``memory_limit`` in bytes (``int`` or ``None``).
        pause_fraction: ``distributed.worker.memory.pause`` of that worker (``float`` or ``None``).
        paused_for: seconds the worker had been paused (``float``).
    """

    def __init__(
        self,
        rank: int,
        address: str,
        method: str,
        memory: int | None = None,
        memory_limit: int | None = None,
        pause_fraction: float | None = None,
        paused_for: float = 0.0,
    ):
        self.rank = rank
        self.address = address
        self.method = method
        self.memory = memory
        self.memory_limit = memory_limit
        self.pause_fraction = pause_fraction
        self.paused_for = paused_for
        super().__init__(rank, address, method, memory, memory_limit, pause_fraction, paused_for)

    def __str__(self) -> str:
        from dask.utils import format_bytes

        if self.memory is not None and self.memory_limit and self.pause_fraction:
            figures = (
                f"its process uses {format_bytes(self.memory)} of its memory_limit "
                f"{format_bytes(self.memory_limit)}, above distributed.worker.memory.pause = "
                f"{self.pause_fraction:g} ({format_bytes(int(self.memory_limit * self.pause_fraction))})"
            )
        else:
            figures = "its memory use is above distributed.worker.memory.pause"
        return (
            f"rank {self.rank} ({self.address}): {self.method!r} did not start there, the call was cancelled: "
            f"the worker has been paused for {self.paused_for:.0f} s ({figures}) and starts no tasks. "
            "Memory a rank holds is not Dask's to free: raise the workers' memory_limit, start them with "
            "distributed.worker.memory.pause: False (daskwg.local_cluster() does), or free memory in the rank"
        )

    def __reduce__(self):
        return (
            type(self),
            (
                self.rank,
                self.address,
                self.method,
                self.memory,
                self.memory_limit,
                self.pause_fraction,
                self.paused_for,
            ),
        )


class CallTimeoutError(WorkerGroupError, TimeoutError):
    """A group call (or a wait on its futures) passed its deadline.

    The deadline comes from ``@register(..., timeout=s)``, an enclosing
    ``with daskwg.deadline(s):`` or the Dask setting ``daskwg.call-timeout``. The
    ranks keep running the call (Python cannot stop a thread); ``wg.status()`` shows
    them and ``wg.restart()`` replaces their processes.

    Attributes:
        method: the method called (``str``).
        timeout: the deadline that expired, in seconds (``float``).
        ranks: ``{rank: "done" | "running" | "queued" | "unresponsive" | "lost"}``,
            taken on the workers when the deadline expired ("unresponsive": its worker
            did not answer within ``daskwg.status-timeout``, e.g. a stopped process).
        stacks: ``{rank: text}``: the Python stack of each running rank's thread.
    """

    def __init__(
        self, method: str, timeout: float, ranks: dict, stacks: dict | None = None, message: str = ""
    ):
        self.method = method
        self.timeout = timeout
        self.ranks = dict(ranks)
        self.stacks = dict(stacks or {})
        self.message = message
        # One argument: OSError (TimeoutError's base) would read two as errno, strerror.
        super().__init__(message or method)

    def __str__(self) -> str:
        return self.message or f"{self.method!r} passed its deadline of {self.timeout} s: {self.ranks}"

    def __reduce__(self):
        return (type(self), (self.method, self.timeout, self.ranks, self.stacks, self.message))


class CallCancelledError(WorkerGroupError, CancelledError):
    """The call was cancelled (``DataProtoFuture.cancel()``, ``client.cancel``,
    ``Future.cancel()``): reading its result raises this at once, as reading a cancelled
    Dask future or Ray object ref raises theirs; the group stays usable.

    A ``concurrent.futures.CancelledError`` too, as Dask's ``FutureCancelledError`` is, so
    ``except CancelledError`` written for Dask catches it. What became of the call on its
    rank: one still waiting for its turn never ran there; a running ``async def`` method
    got ``asyncio.CancelledError`` at its next ``await``; a running plain method ran to its
    end (Python cannot stop a thread) and its result was dropped.

    Attributes:
        method: the method called (``str``).
        rank: the rank whose result was read (``int``; ``-1`` when unknown).
        key: the Dask key of that result (``str`` or ``None``).
        reason: why it was cancelled, as Dask's ``Client.cancel(..., reason=)`` gives it
            (``str`` or ``None``).
    """

    def __init__(self, method: str, rank: int = -1, key: str | None = None, reason: str | None = None):
        self.method = method
        self.rank = rank
        self.key = key
        self.reason = reason
        super().__init__(method, rank, key, reason)

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank >= 0 else ""
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"the call of {self.method!r}{where} was cancelled{why}: its result is gone; "
            "the group stays usable, call the method again for a new result"
        )

    def __reduce__(self):
        return (type(self), (self.method, self.rank, self.key, self.reason))


class VersionMismatchError(WorkerGroupError):
    """The driver and a worker run versions of daskwg (or torch) that cannot work together.

    Raised when a group is built, before any rank object exists, naming both versions:
    a different daskwg release (``major.minor``), a different torch major version, or a
    different wire format (the layout of the calls daskwg sends). Install the same daskwg
    wheel (and torch) in the driver's and every worker's environment.
    """
