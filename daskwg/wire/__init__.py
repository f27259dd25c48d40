"""The wire: what crosses between processes, and how its bytes travel.

Both the driver side (``daskwg.transport``) and the worker side (``daskwg.plugin``)
import this package; it imports nothing of daskwg's above ``errors`` and ``config``.

* ``messages``: the records that travel (the call, lazy arguments, parts, status records,
  the call streams' messages and replies), the handler names (``Handler``), the task-key
  format and the wire format version.
* ``frames``: one call stream's framing over a Dask comm (``FrameStream``).
* ``memfiles``: shared-memory files for large buffers between processes of one host.
* ``local_link``: Unix-domain sockets between a driver and workers of its host.
* ``buffers``: receive buffers kept for the next value of their size.
* ``codec``: a tensor as its own bytes (dtype, shape, strides, buffer) and back.
* ``records``: the groups' records in the scheduler's metadata.
* ``metrics``: the call counters' histogram buckets, which workers and the scheduler share.
"""
