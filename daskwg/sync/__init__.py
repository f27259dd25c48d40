"""Weight sync from trainer ranks to rollout ranks, worker to worker.

* ``shards``: the sharded sync: each trainer rank sends only its own FSDP shards (DTensor
  local tensors with their place in the full tensor), bucketed, along a chain of the
  rollout ranks on a daskwg collective, or on one host straight from the trainer ranks'
  memory; optionally only the shards that changed.
* ``pieces``: what the sync's pieces are (a state dict's local shards and their place in
  the full tensors, kept from one sync to the next while they lie where they lay) and
  where they land in the rollout's parameters.
* ``peer_memory``: reading another process's memory on the same host
  (``process_vm_readv``), and finding out whether this process may.

Rank code uses the names of ``shards`` from here: ``daskwg.sync.send_shards``,
``daskwg.sync.receive_shards``, ``daskwg.sync.shard_digest``,
``daskwg.sync.assembled_digests``.
"""

from .shards import *  # noqa: F403
from .shards import __all__  # noqa: F401
