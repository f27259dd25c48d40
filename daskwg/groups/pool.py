"""Choosing and ordering the Dask workers that host a group's ranks.

:class:`ResourcePool` is daskwg's counterpart of verl's ``RayResourcePool``: an ordered
set of Dask workers. Groups built on the same pool (or on overlapping splits of it)
share the worker processes, which is how roles are colocated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
from distributed import Client
from distributed.comm.addressing import get_address_host

from ..errors import WorldSizeError

__all__ = [
    "ResourcePool",
    "WorkerSlot",
    "rank_order",
    "pick_free",
    "check_one_rank_per_process",
    "in_this_process",
]


@dataclass(frozen=True)
class WorkerSlot:
    """One Dask worker as a group sees it.

    Attributes:
        address: the worker's comm address (``tcp://host:port``).
        host: the host part of the address (a bare IPv6 literal for IPv6).
        name: the worker's Dask name.
        device: the first entry of the worker's ``CUDA_VISIBLE_DEVICES`` (``None`` if unset).
        server_id: the worker process's Dask server id; changes when a worker restarts.
        started: when the worker process started (seconds since the epoch, its host's
            clock; 0.0 if unknown): a removal the scheduler reported before it refers
            to an earlier process at the same address.
        nanny: the address of the worker's Nanny (``None`` without one). It stays the
            same across restarts of the worker process, when the worker's address and
            name (by default its address) change.
        pid: the worker process's id (``None`` if unknown).
    """

    address: str
    host: str
    name: str
    device: str | None
    server_id: str
    started: float = 0.0
    nanny: str | None = None
    pid: int | None = None


def _device_key(device: str | None) -> tuple:
    if device is None or device == "":
        return (2, 0, "")
    if device.isdigit():
        return (0, int(device), "")
    return (1, 0, device)


def _name_key(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def rank_order(slots: Sequence[WorkerSlot]) -> list[WorkerSlot]:
    """Order workers as the design's rank contract says.

    By host, then by the GPU the worker owns (numeric ids as numbers, opaque ids such as
    UUIDs after them, workers without a device last), then by worker name.
    """
    return sorted(slots, key=lambda s: (s.host, _device_key(s.device), _name_key(str(s.name)), s.address))


def _first_visible_device() -> str | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return value.split(",")[0].strip()


def _worker_identity(dask_worker) -> tuple[str | None, str, float, int]:
    # The scheduler's "id" for a worker is its name, which a restarted worker keeps;
    # the worker's own id is new in every process.
    return _first_visible_device(), dask_worker.id, process_started(), os.getpid()


def process_started() -> float:
    """When this process started, in seconds since the epoch (``time.time()``'s clock).

    On Linux from the process's start in clock ticks after boot (``/proc/self/stat``) and
    the boot clock now, to a tick (10 ms): ``psutil.Process().create_time()`` adds the
    start to the boot time the kernel reports in whole seconds, which runs up to a second
    or more early (0.8 s on this project's machines), and a worker restarted within that
    second would seem to have started before a removal event of its predecessor.
    """
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return psutil.Process().create_time()


def _cluster_slots(client: Client) -> list[WorkerSlot]:
    info = client.scheduler_info(n_workers=-1)["workers"]
    if not info:
        return []
    identities = client.run(_worker_identity, workers=list(info))
    return [
        WorkerSlot(
            address=addr,
            host=get_address_host(addr),
            name=str(w.get("name", addr)),
            device=identities[addr][0],
            server_id=identities[addr][1],
            started=identities[addr][2],
            nanny=w.get("nanny") or None,
            pid=identities[addr][3],
        )
        for addr, w in info.items()
        if addr in identities
    ]


def _fits(worker_resources: dict, wanted: dict) -> bool:
    return all(worker_resources.get(k, 0) >= v for k, v in wanted.items())


class ResourcePool:
    """An ordered set of Dask workers that groups are built on.

    Args:
        client: a connected ``distributed.Client``.
        world_size: how many workers to take (the first ones in rank order). ``None``
            takes every matching worker.
        workers: explicit worker addresses (or names); their rank order is still the
            design's order. Mutually exclusive with ``resources``.
        resources: Dask worker resources a worker must offer, e.g. ``{"GPU": 1}``.

    Raises:
        WorldSizeError: fewer matching workers than ``world_size``; the message lists
            the workers found.
        ValueError: an unknown worker address/name, duplicates, or a bad ``world_size``.
        TypeError: arguments of the wrong type.

    Mirrors verl's ``RayResourcePool``; [`split`][daskwg.ResourcePool.split] mirrors ``split_resource_pool``.
    """

    def __init__(
        self,
        client: Client,
        world_size: int | None = None,
        workers: Sequence[str] | None = None,
        resources: dict[str, float] | None = None,
        *,
        _slots: Sequence[WorkerSlot] | None = None,
    ):
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if workers is not None and resources is not None:
            raise ValueError("pass either workers= or resources=, not both")
        self.client = client
        if _slots is not None:
            self._slots = list(_slots)
            return
        slots = _cluster_slots(client)
        if workers is not None:
            if isinstance(workers, str) or not isinstance(workers, Sequence):
                raise TypeError("workers must be a list of worker addresses or names")
            by_key = {s.address: s for s in slots} | {s.name: s for s in slots}
            unknown = [w for w in workers if w not in by_key]
            if unknown:
                raise ValueError(
                    f"unknown worker(s) {unknown}; the cluster has {sorted(s.address for s in slots)}"
                )
            chosen = [by_key[w] for w in workers]
            if len({s.address for s in chosen}) != len(chosen):
                raise ValueError(f"workers lists a worker twice: {list(workers)}")
            slots = chosen
            if world_size is not None and world_size != len(slots):
                raise WorldSizeError(
                    f"world_size={world_size} but {len(slots)} workers were given; pass one address per rank"
                )
        elif resources is not None:
            info = client.scheduler_info(n_workers=-1)["workers"]
            slots = [s for s in slots if _fits(info[s.address].get("resources", {}), resources)]
        slots = rank_order(slots)
        if world_size is not None:
            if world_size > len(slots):
                found = ", ".join(s.address for s in slots) or "none"
                what = f" with resources {resources}" if resources else ""
                advice = (
                    f"start more workers or pass world_size={len(slots)}" if slots else "start such workers"
                )
                raise WorldSizeError(
                    f"asked for {world_size} ranks, the cluster has {len(slots)} workers{what} ({found}); {advice}"
                )
            slots = slots[:world_size]
        if not slots:
            what = f"with resources {resources}" if resources else "at all"
            raise WorldSizeError(f"the cluster has no workers {what}; start such workers first")
        self._slots = slots

    @property
    def world_size(self) -> int:
        """Number of workers (ranks) in the pool."""
        return len(self._slots)

    @property
    def slots(self) -> list[WorkerSlot]:
        """The workers in rank order."""
        return list(self._slots)

    @property
    def workers(self) -> list[str]:
        """Worker addresses in rank order (``workers[rank]``)."""
        return [s.address for s in self._slots]

    def split(self, sizes: int | Sequence[int]) -> list[ResourcePool]:
        """Cut the pool into consecutive sub-pools.

        Args:
            sizes: a list of sizes summing to ``world_size``, or one int that divides it.

        Returns:
            one ``ResourcePool`` per size, in order; each sub-pool's ranks restart at 0.

        Raises:
            ValueError: sizes that do not add up to ``world_size`` or are not positive.
        """
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            if sizes < 1 or self.world_size % sizes:
                raise ValueError(f"split size {sizes} does not divide world_size {self.world_size}")
            sizes = [sizes] * (self.world_size // sizes)
        sizes = list(sizes)
        if any(not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != self.world_size:
            raise ValueError(
                f"split sizes {sizes} must be positive ints summing to world_size {self.world_size}"
            )
        out, start = [], 0
        for size in sizes:
            out.append(ResourcePool(self.client, _slots=self._slots[start : start + size]))
            start += size
        return out

    def __repr__(self) -> str:
        return f"ResourcePool(world_size={self.world_size}, workers={self.workers})"


def pick_free(
    client: Client,
    world_size: int | None,
    workers: Sequence[str] | None,
    resources: dict[str, float] | None,
    busy: Callable[[WorkerSlot], object],
) -> ResourcePool:
    """``ResourcePool(client, world_size, workers, resources)``, except that, when the
    workers are not named, the first ``world_size`` in rank order for which ``busy(slot)``
    is falsy are taken, while enough of them match.

    Raises:
        as :class:`ResourcePool`.
    """
    pool = ResourcePool(client, world_size, workers, resources)
    if workers is not None or world_size is None or not any(busy(s) for s in pool.slots):
        return pool
    free = [s for s in ResourcePool(client, None, None, resources).slots if not busy(s)]
    return ResourcePool(client, _slots=free[:world_size]) if len(free) >= world_size else pool


def _process_of(slot: WorkerSlot) -> tuple | None:
    # A process is its id and start time (to a clock tick): two hosts' processes that
    # share an id started at different times.
    return None if slot.pid is None else (slot.pid, round(slot.started, 1))


def in_this_process(slot: WorkerSlot) -> bool:
    """Whether ``slot``'s Dask worker runs in this (the driver's) process, as the workers
    of ``LocalCluster(processes=False)`` do."""
    return slot.pid == os.getpid() and _process_of(slot) == (os.getpid(), round(process_started(), 1))


def check_one_rank_per_process(slots: Sequence[WorkerSlot], name: str) -> None:
    """Refuse a group two of whose ranks would run in one process.

    A rank's environment (``RANK``, ``MASTER_PORT``, ``worker_env``, ...) is the process's
    ``os.environ``, which ``torch.distributed`` and verl's ``Worker`` read: the ranks of
    in-process workers (``LocalCluster(processes=False)``) would read each other's values,
    as the ranks of a Ray job never do (one actor, one process).

    Raises:
        ValueError: two slots are workers of one process (named, with what to do).
    """
    by_process: dict[tuple, list[int]] = {}
    for rank, slot in enumerate(slots):
        key = _process_of(slot)
        if key is not None:
            by_process.setdefault(key, []).append(rank)
    shared = {key: ranks for key, ranks in by_process.items() if len(ranks) > 1}
    if shared:
        (pid, _), ranks = next(iter(shared.items()))
        raise ValueError(
            f"group {name!r}: ranks {ranks} would run in one process (pid {pid}: workers "
            f"{[slots[r].address for r in ranks]}), where they would share one os.environ and read each "
            "other's RANK, MASTER_PORT and worker_env. Start the workers as processes "
            "(daskwg.local_cluster() without processes=False, or dask worker with a nanny), or give the "
            "group one rank per process (world_size=1 on an in-process cluster)"
        )
