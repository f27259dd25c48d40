"""verl's ``verl.single_controller.ray`` names, on Dask: change one import.

::

    # from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from daskwg.verl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

The classes take verl's arguments and follow verl's semantics where they differ from
daskwg's native API (the native API keeps its own):

- ``RayResourcePool(process_on_nodes=[4])`` stands for 4 Dask workers of the current
  client (``distributed.get_client()``), taken in daskwg's rank order when the pool is
  first used. Pools are disjoint, as verl's placement groups are: a second pool takes
  workers no live pool holds. Groups built on one pool share its processes (colocation).
- ``RayWorkerGroup`` is a :class:`daskwg.WorkerGroup`: every rank sees verl's variables
  (``WG_PREFIX``, ``WG_BACKEND``, ``RAY_LOCAL_WORLD_SIZE``, ``RAY_LOCAL_RANK``) besides
  daskwg's; a method registered with ``Dispatch.ALL_TO_ALL`` (on the group or on a role
  group of its ``spawn``) splits its arguments only
  when every one is a list of ``world_size`` entries and otherwise gives every rank the
  same arguments (verl's ``execute_all``; daskwg's native ALL_TO_ALL raises
  ``DispatchError``); ``worker_names`` are verl's ``{prefix}{Class}_{node}:{local_rank}``
  and :meth:`RayWorkerGroup.from_detached` (or ``RayWorkerGroup(worker_names=...)``)
  reattaches to any live group by them, from
  any process with a client of the cluster (a Dask task included); non-blocking
  ``DP_COMPUTE_PROTO`` calls return futures that are also ``verl.protocol.DataProtoFuture``
  instances when verl is loaded.
- ``ray.get`` is :func:`daskwg.get`.

What has no counterpart: placement groups and bundles (``use_gpu``,
``max_colocate_count``, ``accelerator_type``, ``bin_pack`` are accepted and not used: a
Dask worker is the unit, one per GPU under dask-cuda), Ray actor options
(``update_options``, ``set_additional_resource`` are recorded only), Ray actor handles
(``workers`` are Dask worker addresses).

Modules: ``groups`` (``RayClassWithInitArgs``, the colocated classes, ``RayWorkerGroup``)
and ``pools`` (``RayResourcePool``, its splits and merges, ``ResourcePoolManager``).
"""

from __future__ import annotations

from .groups import (
    RayClassWithInitArgs,
    RayWorkerGroup,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)
from .pools import (
    RayResourcePool,
    ResourcePoolManager,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "split_resource_pool",
]
