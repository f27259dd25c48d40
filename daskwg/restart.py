"""Restarting a group's worker processes: :func:`restart_workers`, what
``WorkerGroup.restart()`` does before it builds the ranks again."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from distributed import Client

from .errors import WorkerGroupError, WorldSizeError
from .pool import ResourcePool, WorkerSlot

__all__ = ["check_restartable", "restart_workers"]


def check_restartable(client: Client, slots: Sequence[WorkerSlot], group_name: str) -> None:
    """Refuse, before anything is restarted, workers that have no Nanny to restart them.

    Raises:
        WorkerGroupError: a worker has no Nanny (``processes=False``, ``dask worker --no-nanny``).
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    no_nanny = [s.address for s in slots if s.address in info and not info[s.address].get("nanny")]
    if no_nanny:
        raise WorkerGroupError(
            f"cannot restart group {group_name!r}: worker(s) {no_nanny} have no Nanny to restart them "
            "(processes=False, or dask worker --no-nanny); restart those workers yourself and build a new group"
        )


def restart_workers(
    client: Client,
    slots: Sequence[WorkerSlot],
    lost: Mapping[str, str],
    group_name: str,
    timeout: float = 120.0,
) -> list[WorkerSlot]:
    """Restart the worker processes of ``slots`` through their Nannies
    (``client.restart_workers``) and wait for the new processes.

    Args:
        client: the group's client.
        slots: the group's workers, in rank order.
        lost: server id -> why, the driver's lost marks (the scheduler's remove-worker
            events must be in before the new processes are watched, or a late one would
            mark the new process lost).
        group_name: for messages.
        timeout: seconds the workers get to come back.
    Returns:
        the slots of the restarted workers (same names, new processes), in rank order.
    Raises:
        WorkerGroupError: the workers did not come back within ``timeout`` (call
            :func:`check_restartable` first).
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    missing = [s.address for s in slots if s.address not in info]
    addresses = sorted({s.address for s in slots} - set(missing))
    if addresses:
        # Whether they are back is checked below, by process id, with its own bound.
        client.restart_workers(workers=addresses, raise_for_error=False)
    end = time.monotonic() + timeout
    names = [s.name for s in slots]
    while True:
        events_in = all(s.server_id in lost for s in slots)
        try:
            by_name = {s.name: s for s in ResourcePool(client, workers=names).slots}
        except (ValueError, WorldSizeError):
            by_name = {}
        fresh = [by_name.get(s.name) for s in slots]
        if events_in and all(f is not None and f.server_id != o.server_id for f, o in zip(fresh, slots)):
            return fresh
        if time.monotonic() > end:
            raise WorkerGroupError(
                f"the workers of group {group_name!r} did not come back within {timeout:g} s of their "
                f"restart ({names}); the group is unusable: shut it down"
            )
        time.sleep(0.1)
