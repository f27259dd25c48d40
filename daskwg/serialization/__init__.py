"""Serialization: how values are pickled, measured and snapshotted when they cross processes.

* ``pickling``: the pickler (``dumps``/``loads``), result snapshots, message parts and
  the registration of daskwg's types with Dask's serializers and ``sizeof``.
* ``dtensor``: a DTensor crosses processes as a ``LocalShard`` (its local tensor and
  placement), never with its device mesh nor as the full tensor.

The names of ``pickling`` are re-exported here, where ``daskwg.serialization`` named them
before it became a package.
"""

from .pickling import *  # noqa: F403
from .pickling import __all__  # noqa: F401
