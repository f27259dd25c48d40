"""Serialization: how values are pickled, snapshotted and framed when they cross processes.

* ``pickling``: the pickler (:func:`dumps`/:func:`loads`, :class:`Packed`), every tensor
  as its own bytes in an out-of-band buffer.
* ``snapshots``: ownership snapshots (:func:`snapshot`, :func:`private`): a rank's result
  as it was when its method returned, copying only what something else may still change.
* ``parts``: comm message parts (:func:`pack`, :func:`message_part`, :func:`unpack`,
  :func:`unpacked_part`, :class:`Deferred`).
* ``registration``: daskwg's types in Dask's serializers and ``dask.sizeof``
  (:func:`install`, run when it is imported).
* ``dtensor``: a DTensor crosses processes as a ``LocalShard`` (its local tensor and
  placement), never with its device mesh nor as the full tensor.

Their public names are re-exported here, where ``daskwg.serialization`` named them before
it became a package.
"""

from .parts import Deferred, message_part, pack, unpack, unpacked_part
from .pickling import NestedFutureError, Packed, dumps, loads
from .registration import deserialize_tensor, install, serialize_tensor
from .snapshots import private, snapshot

__all__ = [
    "Packed",
    "dumps",
    "loads",
    "snapshot",
    "private",
    "pack",
    "message_part",
    "unpack",
    "unpacked_part",
    "Deferred",
    "NestedFutureError",
    "serialize_tensor",
    "deserialize_tensor",
    "install",
]
