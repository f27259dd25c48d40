"""Futures: a ``DataProtoFuture`` (a batch still on the workers) and its row algebra.

* ``future``: :class:`DataProtoFuture`, its lazy algebra (``union``, ``select``,
  ``repeat``, ``rename``, ``chunk``, ``concat``) and the row plan it builds.
* ``collection``: a ``DataProtoFuture`` as a Dask collection of its parts (``client.cancel``,
  ``distributed.wait``, ``dask.compute``), and cancelling its parts.
* ``plan``: the future's row plan as typed nodes (parts, a local batch, select, rename,
  repeat, union, pieces), which travels to the consuming ranks.
* ``interpreter``: the one interpreter of a row plan, run by the driver (``get()``) and by
  every consuming rank (``daskwg.plugin.rows``) alike.
* ``pieces``: how a batch is cut into one piece per rank, padded as ``DP_COMPUTE_PROTO``
  pads it.
* ``padding``: the ``DP_COMPUTE_PROTO`` padding rule: how many rows are added, how the count
  travels from dispatch to collect, and where the rows come off (driver or rank).

The names of ``future`` are re-exported here, where ``daskwg.futures`` named them before it
became a package.
"""

from .future import *  # noqa: F403
from .future import __all__  # noqa: F401
