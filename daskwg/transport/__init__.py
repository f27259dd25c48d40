"""The driver side: how calls and data travel between the driver and the ranks.

A group call goes dispatch (``daskwg.dispatch``) → send (this package) → host
(``daskwg.plugin``, on the workers) → collect (``daskwg.dispatch``). This package never
imports the worker side: both stand on ``daskwg.wire``. Every call, whatever its path, gets
per worker the next sequence number of this driver's session, and the worker runs calls
strictly in that order.

* ``group_transport``: :class:`GroupTransport`, the facade a group calls; picks each call's
  path and gives it its per-worker sequence numbers.
* ``driver``: :class:`Driver`, the per-client object shared by all groups of one ``Client``,
  holding its two parts, and ``GroupRanks``.
* ``sequencing``: the driver's per-worker sequence numbers, sessions and skips (owned by the
  calling threads); what the scheduler said of the workers is ``failure.health``.
* ``channel``: a driver thread's own event loop and connection pool; Ctrl-C held off while a
  call is written.
* ``streams``: call streams, one connection per worker process and driver loop.
* ``direct``: the direct path, blocking calls on the call streams (one round trip).
* ``leader``: the direct path through host leaders, one message per host (``daskwg.fan-out``).
* ``submit``: the submit path, non-blocking calls on the call streams, one future per rank.
* ``planned``: the plan path, one replay of a step plan as one message per worker.
* ``tasks``: the task path, calls taking futures no group call made, as Dask tasks.
* ``arguments``: futures among a call's arguments, and relayed broadcasts.
* ``owned``: results the driver owns on the workers (what it knows of each future).
* ``call_future``: :class:`CallFuture`, the Dask future of such a result.
* ``gather``: ``client.gather`` of group-call futures read as ``daskwg.get`` reads them, without
  a scheduler round trip.
* ``frees``: dropping results on their workers, batched with the next call.
* ``failure``: the failure model (one group's failure state, lost workers, heartbeats,
  waits, deadline reports and forensics).
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
