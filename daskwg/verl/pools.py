"""verl's resource pools on Dask workers: ``RayResourcePool``, its splits and merges, and
``ResourcePoolManager`` (verl's ``verl.single_controller.ray.base`` and trainer names)."""

from __future__ import annotations

import random
import string
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from distributed import Client, get_client

from ..errors import WorldSizeError
from ..groups.pool import ResourcePool

__all__ = [
    "RayResourcePool",
    "ResourcePoolManager",
    "SubRayResourcePool",
    "merge_resource_pool",
    "random_prefix",
    "split_resource_pool",
]


def random_prefix() -> str:
    """Six random letters and digits: verl's default ``name_prefix``."""
    return "".join(random.choice(string.ascii_letters + string.digits) for _ in range(6))


# Worker addresses held by live pools, per client id: pools are disjoint, as verl's
# placement groups reserve their bundles.
_claims: dict[str, weakref.WeakValueDictionary] = {}
_claims_lock = threading.Lock()


class RayResourcePool:
    """``process_on_nodes`` Dask workers for groups (verl's ``RayResourcePool``).

    Args:
        process_on_nodes: processes per node, e.g. ``[4]`` or ``[2, 2]``; the pool holds
            ``sum(process_on_nodes)`` workers, taken in daskwg's rank order (by host).
        use_gpu: verl's placement-group setting, kept as an attribute and not used (a Dask
            worker owns its GPU under dask-cuda).
        name_prefix: the pool's name (random when ``None``, as verl).
        max_colocate_count: likewise kept and not used.
        detached: kept for [`merge_resource_pool`][daskwg.verl.merge_resource_pool]'s check.
        accelerator_type: likewise kept and not used.
        client: the Dask client (default: ``distributed.get_client()`` when first used).

    The workers are chosen when a group or a split first needs them; from then on no
    other live pool of the same client gets them.

    Raises (when first used):
        WorldSizeError: fewer free workers than the pool's size (the message names the
            workers other pools hold).
    """

    def __init__(
        self,
        process_on_nodes: list[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        *,
        client: Client | None = None,
    ) -> None:
        self._store = list(process_on_nodes) if process_on_nodes is not None else []
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self._store):
            raise ValueError(
                f"process_on_nodes must be a list of non-negative ints, got {process_on_nodes!r}"
            )
        self.use_gpu = use_gpu
        self.name_prefix = random_prefix() if name_prefix is None else name_prefix
        self.max_colocate_count = max_colocate_count
        self.n_gpus_per_node = 8
        self.detached = detached
        self.accelerator_type = accelerator_type
        self._client = client
        self._pool: ResourcePool | None = None

    @property
    def store(self) -> list[int]:
        """Processes per node (verl's ``store``)."""
        return self._store

    def __call__(self) -> list[int]:
        return self._store

    def add_node(self, process_count: int) -> None:
        """One more node of ``process_count`` processes (before the pool is first used)."""
        if self._pool is not None:
            raise ValueError("the pool's workers were chosen already; add nodes before building groups")
        self._store.append(process_count)

    @property
    def world_size(self) -> int:
        """Number of processes (ranks) in the pool."""
        return sum(self._store)

    def local_world_size_list(self) -> list[int]:
        """Per rank: the number of processes on its node (verl's method)."""
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        """Per rank: its position on its node (verl's method)."""
        return [i for n in self._store for i in range(n)]

    @property
    def pool(self) -> ResourcePool:
        """The [`daskwg.ResourcePool`][daskwg.ResourcePool] behind this one (chosen on first use)."""
        if self._pool is None:
            self._pool = self._choose()
        return self._pool

    def get_placement_groups(self, *args: Any, **kwargs: Any) -> list[ResourcePool]:
        """verl calls this to reserve the resources: here it chooses the workers.

        Returns:
            ``[self.pool]`` (there are no placement groups on Dask).
        """
        return [self.pool]

    def _choose(self) -> ResourcePool:
        client = self._client or get_client()
        if self.world_size < 1:
            raise ValueError(f"RayResourcePool(process_on_nodes={self._store}) has no processes")
        with _claims_lock:
            held = _claims.setdefault(client.id, weakref.WeakValueDictionary())
            everything = ResourcePool(client)
            free = [a for a in everything.workers if a not in held]
            if len(free) < self.world_size:
                taken = sorted(a for a in everything.workers if a in held)
                raise WorldSizeError(
                    f"RayResourcePool {self.name_prefix!r} needs {self.world_size} workers, the cluster has "
                    f"{everything.world_size}, {len(taken)} of them held by other live pools ({taken}); start more "
                    "workers, or drop (or shut down with ray.shutdown) the pools you no longer use"
                )
            pool = ResourcePool(client, workers=free[: self.world_size])
            for address in pool.workers:
                held[address] = self
        return pool

    def __repr__(self) -> str:
        return f"RayResourcePool(process_on_nodes={self._store}, name_prefix={self.name_prefix!r})"


class SubRayResourcePool(RayResourcePool):
    """A slice of a pool's workers (verl's ``SubRayResourcePool``); from
    [`split_resource_pool`][daskwg.verl.split_resource_pool]."""

    def __init__(
        self, pool: ResourcePool, start_bundle_index: int, parent: RayResourcePool, name_prefix: str
    ):
        super().__init__(
            process_on_nodes=parent.store,
            use_gpu=parent.use_gpu,
            name_prefix=name_prefix,
            max_colocate_count=parent.max_colocate_count,
            detached=parent.detached,
        )
        self._pool = pool
        self._parent = parent  # keeps the parent's claim alive
        self.start_bundle_index = start_bundle_index
        self.subgroup_world_size = pool.world_size

    @property
    def world_size(self) -> int:
        return self.subgroup_world_size


def split_resource_pool(
    resource_pool: RayResourcePool, split_size: int | list[int]
) -> list[SubRayResourcePool]:
    """Cut a pool into consecutive sub-pools (verl's ``split_resource_pool``).

    Args:
        resource_pool: a pool or a sub-pool (split again).
        split_size: one size that divides the pool's ``world_size``, or a list of sizes
            summing to it.

    Returns:
        one [`SubRayResourcePool`][daskwg.verl.SubRayResourcePool] per size, in order.

    Raises:
        ValueError: sizes that do not add up (verl: ``AssertionError``).
    """
    pieces = resource_pool.pool.split(split_size)
    start = getattr(resource_pool, "start_bundle_index", 0)
    out = []
    for i, piece in enumerate(pieces):
        out.append(SubRayResourcePool(piece, start, resource_pool, f"{resource_pool.name_prefix}_split_{i}"))
        start += piece.world_size
    return out


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool over the workers of both (verl's ``merge_resource_pool``).

    Raises:
        ValueError: the pools differ in ``use_gpu``, ``max_colocate_count`` or
            ``detached`` (verl: ``AssertionError``).
    """
    for attr in ("use_gpu", "max_colocate_count", "detached"):
        if getattr(rp1, attr) != getattr(rp2, attr):
            raise ValueError(
                f"cannot merge pools with different {attr}: {getattr(rp1, attr)!r} and {getattr(rp2, attr)!r}"
            )
    # verl concatenates the stores; a sub-pool counts as one node of its own size.
    stores = [rp.store if type(rp) is RayResourcePool else [rp.world_size] for rp in (rp1, rp2)]
    merged = RayResourcePool(
        stores[0] + stores[1],
        rp1.use_gpu,
        f"{rp1.name_prefix}_{rp2.name_prefix}",
        rp1.max_colocate_count,
        rp1.detached,
    )
    first, second = rp1.pool, rp2.pool
    merged._pool = ResourcePool(first.client, workers=first.workers + second.workers)
    merged._parents = (rp1, rp2)  # keeps their claims alive
    return merged


@dataclass
class ResourcePoolManager:
    """Pools by name and the pool of each role (verl's ``ResourcePoolManager``).

    Attributes:
        resource_pool_spec: pool name → processes per node.
        mapping: role → pool name.
        max_colocate_count: passed to every pool (not used on Dask).
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Any, str]
    max_colocate_count: int = 3
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict)

    def create_resource_pool(self) -> None:
        """Build one [`RayResourcePool`][daskwg.verl.RayResourcePool] per entry of ``resource_pool_spec``."""
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                max_colocate_count=self.max_colocate_count,
                name_prefix=name,
            )

    def get_resource_pool(self, role: Any) -> RayResourcePool:
        """The pool ``role`` runs on."""
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_gpus(self) -> int:
        """Processes over all pools (verl counts one GPU per process)."""
        return sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
