"""Restarting a group's worker processes: :func:`restart_workers`, what
``WorkerGroup.restart()`` does before it builds the ranks again."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence

import dask.config
from dask.utils import parse_timedelta
from distributed import Client

from ..errors import WorkerGroupError, WorldSizeError
from .pool import ResourcePool, WorkerSlot

__all__ = ["check_restartable", "restart_workers", "same_worker"]

#: The setting after which a ``LocalCluster`` (any ``SpecCluster``) closes the Nanny of a
#: worker that has not registered again since its removal.
LOST_WORKER_TIMEOUT = "distributed.deploy.lost-worker-timeout"


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
        the slots of the restarted workers (new processes, found by their Nanny's address,
        which stays; their address and name may be new, as for ``dask worker`` without
        ``--name``), in rank order.

    Raises:
        WorkerGroupError: the workers did not come back within ``timeout`` (call
            :func:`check_restartable` first).

    A ``LocalCluster`` closes the Nanny of a worker that has not registered again within
    ``distributed.deploy.lost-worker-timeout`` (15 s by default) of its removal; a new
    process that takes longer to start (importing torch on a loaded machine) would be
    lost for good. That setting is raised to ``timeout`` while the workers restart.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    missing = [s.address for s in slots if s.address not in info]
    addresses = sorted({s.address for s in slots} - set(missing))
    with _lost_workers_kept(timeout):
        outcome: dict = {}  # address -> "OK" | "removed" | "timed out", as Dask answered
        if addresses:
            # Whether they are back is checked below, by process id, with its own bound.
            outcome = client.restart_workers(workers=addresses, raise_for_error=False) or {}
        end = time.monotonic() + timeout
        asked: Exception | None = None  # why the last look at the cluster failed, if it did
        while True:
            events_in = all(s.server_id in lost for s in slots)
            try:
                current, asked = ResourcePool(client).slots, None
            except (ValueError, WorldSizeError, OSError) as exc:
                current, asked = [], exc  # none yet, or one closing while asked: the next round
            fresh = [next((c for c in current if same_worker(c, s)), None) for s in slots]
            if events_in and all(f is not None and f.server_id != o.server_id for f, o in zip(fresh, slots)):
                return fresh
            if time.monotonic() > end:
                raise WorkerGroupError(
                    f"the workers of group {group_name!r} did not come back within {timeout:g} s of their "
                    f"restart ({_not_back(slots, fresh, lost, outcome, asked)}); the group is unusable: shut it down"
                )
            time.sleep(0.1)


def _not_back(
    slots: Sequence[WorkerSlot],
    fresh: Sequence[WorkerSlot | None],
    lost: Mapping[str, str],
    outcome: Mapping[str, str],
    asked: Exception | None,
) -> str:
    """What a restart that ran out of time was still waiting for, worker by worker: the
    scheduler's removal of the old process (this driver's lost marks), a new process of
    the same Nanny, and what ``client.restart_workers`` answered for it."""
    parts = []
    for old, new in zip(slots, fresh):
        removal = "removal seen" if old.server_id in lost else "removal of the old process not seen"
        if new is None:
            process = "no worker of its Nanny registered"
        elif new.server_id == old.server_id:
            process = "still the old process"
        else:
            process = f"new process at {new.address}"
        parts.append(
            f"{old.address}: {removal}, {process}, restart answered {outcome.get(old.address, 'nothing')!r}"
        )
    if asked is not None:
        parts.append(f"the last look at the cluster raised {type(asked).__name__}: {asked}")
    return "; ".join(parts)


def same_worker(candidate: WorkerSlot, old: WorkerSlot) -> bool:
    """Whether ``candidate`` is ``old``'s worker (maybe a later process of it): the same
    Nanny, or, for workers without one, the same name."""
    if old.nanny is not None:
        return candidate.nanny == old.nanny
    return candidate.name == old.name


@contextlib.contextmanager
def _lost_workers_kept(seconds: float) -> Iterator[None]:
    """``distributed.deploy.lost-worker-timeout`` at least ``seconds`` inside the block.

    A ``SpecCluster`` reads it on its event loop when a worker is removed, so a restart
    inside the block keeps the restarted workers' Nannies for that long. It is Dask's
    global configuration: other threads see the raised value meanwhile.
    """
    current = parse_timedelta(dask.config.get(LOST_WORKER_TIMEOUT, default="15s"), default="seconds")
    if current is not None and current >= seconds:
        yield
        return
    with dask.config.set({LOST_WORKER_TIMEOUT: f"{seconds:g}s"}):
        yield
