"""The exceptions daskwg raises: one small hierarchy rooted at :class:`WorkerGroupError`."""

from __future__ import annotations

__all__ = [
    "WorkerGroupError",
    "DispatchError",
    "RankError",
    "WorkerLostError",
    "GroupBrokenError",
    "WorldSizeError",
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
