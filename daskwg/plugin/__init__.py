"""The worker side: the Dask ``WorkerPlugin`` that hosts the ranks of worker groups.

It never imports the driver side (``daskwg.transport``): both stand on ``daskwg.wire``.

* ``host``: :class:`HostPlugin`, routes the comm handlers and runs the life cycle of hosted
  ranks (one instance per worker process).
* ``stream``: a driver's call stream to this worker (the ``daskwg_stream`` handler).
* ``direct``: calls that come straight to this worker, unpacked and put in order.
* ``leader``: the host leader, handing a driver's calls on to the other ranks of its host.
* ``task``: the entry point of calls that come as Dask tasks (``run_call``).
* ``planned``: a replayed step plan's part on this worker.
* ``sequencer``: releasing calls to the host thread strictly in the driver's order.
* ``calls``: what the host thread is doing (queued, running, cancelled calls), for status.
* ``rank``: one hosted rank (the user's instance, its environment, running a call on it).
* ``rank_loop``: the event loop a rank's ``async def`` methods run on; the signal shim.
* ``inputs``: building a call's arguments on its rank (futures among them).
* ``results``: results of non-blocking calls kept on this worker.
* ``rows``: the parts of a ``DataProtoFuture``, their row counts, fetching row ranges.
* ``gathered``: rows of several same-host parts written into one file of the consumer.
* ``shared``: whole results read through shared memory by ranks of the same host.
* ``relay``: streaming a stored result to a consumer, and relayed broadcasts.
* ``metrics``: what the calls hosted here count, for the scheduler's ``/metrics``.
* ``exceptions``: shaping what rank code raises so that it reaches the driver.
* ``process_group``: the one torch.distributed default group a worker process holds.
* ``ports``: reserving a group's ``MASTER_PORT`` on rank 0's host.
* ``interfaces``: which network interface gloo and nccl use between hosts.
"""

from .host import HostPlugin
from .task import run_call

__all__ = ["HostPlugin", "run_call"]
