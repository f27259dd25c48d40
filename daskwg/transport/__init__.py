"""How calls and data travel between the driver and the ranks.

A group call goes dispatch (``decorator``) → send (this module) → host (``plugin``) →
collect (``decorator``). This module is the send step and everything it needs in the
driver: per-client state (:class:`Driver`: sequence numbers, lost and paused workers),
the two ways a call reaches its ranks, the per-thread connections of blocking calls
(:class:`Channel`) and the failure state of one group's ranks (:class:`GroupTransport`).

Two ways to send, one order: every call gets, per worker, the next sequence number of
this driver, and the worker runs calls strictly in that order whichever way they came.

* Blocking calls whose arguments are all in the driver go straight to the hosting
  workers over Dask's comm (the ``daskwg_call`` handler), like Dask actors: one
  round trip, no scheduler hop.
* Non-blocking calls, and calls that take a ``DataProtoFuture``, are Dask tasks
  (``client.submit`` pinned with ``workers=[address]``, ``allow_other_workers=False``,
  ``pure=False``, no retries), named ``"<group>.<method>-<call>-r<rank>-<id>"`` on the
  dashboard. Their results stay on the workers as Dask futures, and futures passed to
  the next call move worker to worker.

The scheduler never holds a batch and never unpickles anything of torch or daskwg:
a task's function and small arguments travel as opaque pickle bytes (the task is
``dask.utils.apply(pickle.loads(bytes), args)``), and arguments over
``daskwg.scatter-above`` bytes are sent by the driver straight to the rank's worker
(``client.scatter(..., workers=[address], direct=True)``) and referenced by key.
A ``DataProtoFuture`` argument reaches a rank as one small
:class:`daskwg.parts.PartInfo` per part; the rank then fetches only its rows from the
workers holding them (``daskwg.parts``).
"""

from .channel import Channel
from .driver import Driver
from .failures import CallWatch
from .group_transport import GroupTransport

__all__ = ["Driver", "Channel", "CallWatch", "GroupTransport"]
