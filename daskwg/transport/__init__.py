"""The driver side: how calls and data travel between the driver and the ranks.

A group call goes dispatch (``daskwg.dispatch.modes``) → send (this package) → host
(``daskwg.plugin``, on the workers) → collect (``daskwg.dispatch.modes``). This package never
imports the worker side: both stand on ``daskwg.wire.messages``.

* :class:`GroupTransport` (``group_transport``): the facade a group calls; picks each
  call's path and gives it its per-worker sequence numbers.
* :class:`Driver` (``driver``): the per-client object shared by all groups of one
  ``Client``, holding its two parts, and ``GroupRanks``.
* ``sequencing``: the driver's per-worker sequence numbers, sessions and skips (owned by
  the calling threads); what the scheduler said of the workers is ``failure.health``.
* ``channel``: a driver thread's own event loop and connection pool (blocking calls).
* ``failures``: one group's failure state; ``CallWatch``.
* ``direct``: blocking calls straight to the workers' ``daskwg_call`` handler, one round
  trip, no scheduler hop.
* ``tasks``: non-blocking calls and calls taking a ``DataProtoFuture``, as Dask tasks
  whose results stay on the workers.
* ``waiting``: waiting for task-path futures, deadline reports.

Two ways to send, one order: every call gets, per worker, the next sequence number of
this driver, and the worker runs calls strictly in that order whichever way they came.
"""

from .call_future import CallFuture
from .channel import Channel
from .driver import Driver, GroupRanks
from .failure.state import CallWatch, FailureState
from .group_transport import GroupTransport

__all__ = [
    "CallFuture",
    "Driver",
    "GroupRanks",
    "Channel",
    "CallWatch",
    "FailureState",
    "GroupTransport",
]
