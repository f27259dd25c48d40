"""The exceptions daskwg raises: one small hierarchy rooted at :class:`WorkerGroupError`."""

from __future__ import annotations

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
    "WorkerPausedError",
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
        exception: the original exception object, when it could be deserialised.
    """

    def __init__(self, rank: int, address: str, method: str, remote_traceback: str, exception=None):
        self.rank = rank
        self.address = address
        self.method = method
        self.remote_traceback = remote_traceback
        self.exception = exception
        super().__init__(rank, address, method, remote_traceback, exception)

    def __str__(self) -> str:
        what = f"{type(self.exception).__name__}: {self.exception}" if self.exception is not None else ""
        return (
            f"rank {self.rank} ({self.address}) raised in {self.method!r}: {what}\n"
            f"--- remote traceback ---\n{self.remote_traceback}"
        )

    def __reduce__(self):
        return (type(self), (self.rank, self.address, self.method, self.remote_traceback, self.exception))


class WorkerLostError(WorkerGroupError):
    """The Dask worker hosting a rank died or left the cluster; the group is broken.

    Attributes:
        rank: the rank whose worker was lost (``int``).
        address: that worker's address (``str``).
    """

    def __init__(self, rank: int, address: str, detail: str = ""):
        self.rank = rank
        self.address = address
        self.detail = detail
        super().__init__(rank, address, detail)

    def __str__(self) -> str:
        msg = f"the worker hosting rank {self.rank} ({self.address}) was lost"
        if self.detail:
            msg += f": {self.detail}"
        return msg + "; the group is broken: shut it down and build a new one"

    def __reduce__(self):
        return (type(self), (self.rank, self.address, self.detail))


class GroupBrokenError(WorkerGroupError):
    """A call was made on a group that is broken (a worker was lost or a rank failed
    inside a collective) or already shut down.

    The message says why; build a new group (and call ``shutdown()`` on this one).
    """


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConflictError(WorkerGroupError, ValueError, AssertionError):
    """Two sources hold different values under a key that must agree.

    Raised by ``DataProto.union`` and :func:`daskwg.protocol.union_tensor_dict` /
    :func:`~daskwg.protocol.union_numpy_dict` when a shared key holds different values.
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
