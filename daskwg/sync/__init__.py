"""Weight sync from trainer ranks to rollout ranks, worker to worker.

* ``shards``: the sharded sync: each trainer rank sends only its own FSDP shards (DTensor
  local tensors with their place in the full tensor), bucketed, along a chain of the
  rollout ranks on a daskwg collective; optionally only the shards that changed.

Rank code uses the names of ``shards`` from here: ``daskwg.sync.send_shards``,
``daskwg.sync.receive_shards``, ``daskwg.sync.shard_digest``,
``daskwg.sync.assembled_digests``.
"""

from .shards import *  # noqa: F403
from .shards import __all__  # noqa: F401
