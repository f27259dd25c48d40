"""Changing a group's membership while its surviving ranks keep their processes and state:
:func:`heal_group` (``WorkerGroup.heal()``) and :func:`resize_group` (``WorkerGroup.resize(n)``).

A heal replaces the ranks whose workers were lost (and ranks still stuck in the call that
broke the group after ``daskwg.rank-failure-grace``: a thread cannot be interrupted, so
their workers are restarted through their Nannies, or, without one, the ranks move to
other workers) on free workers of the cluster; a resize adds ranks on free workers or
destroys the highest ones. Either way, in three steps:

1. the removed ranks are destroyed (``__del__``);
2. at once, so that ranks can rendezvous with each other whichever step they do it in:
   the surviving ranks *rejoin* (the ``__rejoin__`` life-cycle call: each takes the new
   rendezvous, ``MASTER_ADDR`` = rank 0's host, a fresh ``MASTER_PORT``, the new
   ``WORLD_SIZE``; its Worker attributes follow; the torch default process group its group
   initialised there is destroyed, and, for a class without ``on_membership_change``,
   initialised again with the same backend), and the new ranks are built (``__init__`` with
   the group's ``ClassWithInitArgs``, which may call ``init_process_group`` as at the
   group's build);
3. ``Worker.on_membership_change(event)`` runs on every rank, the new ones right after their
   ``__init__``, the kept ones right after rejoining, all at the same time, so that ranks
   can rendezvous again in it (``init_process_group``; on a new rank whose ``__init__``
   already did, skip it there: ``event.new_ranks``).

A *free* worker hosts no rank of any group the scheduler knows of (``wire.records``),
is not lost and is not busy with a call this driver abandoned; a worker its Nanny has
just restarted is a new process and is free. A group built on a ``ResourcePool`` takes
free workers of its pool first, then other matching ones. Where too few are free, the
heal or resize waits for workers to join, up to its ``timeout``, and says so.

*Hot spares* (:func:`keep_spares`, ``wg.keep_spares(k)``): ``k`` free workers held
for one group, each warmed by unpickling the group's ``ClassWithInitArgs`` there (the
class's module and what it imports, torch included, are imported in that process) and
by the version check a rank's build does, so a heal does not wait for a process to start
or for those imports. A heal or resize takes the group's spares first, then other free
workers, and afterwards warms free workers again up to ``k``; other groups of this
driver leave a group's spares alone. Verl's word for these is a *standby* (PR #7910's
warm standbys for ``replace_worker``); *spare* is the operator's word for the same
(a hot spare disk), and says what it is for.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from distributed import fire_and_forget

from ..config import Settings
from ..deadlines import deadline
from ..errors import GroupBrokenError, WorkerGroupError, WorldSizeError
from ..transport import CallFuture, GroupTransport
from ..wire import records
from ..worker import MembershipChange, Worker
from .install import check_versions
from .pool import ResourcePool, WorkerSlot
from .restart import restart_workers

__all__ = [
    "MembershipReport",
    "heal_group",
    "resize_group",
    "keep_spares",
    "follow_pool",
    "follow_step",
    "DEFAULT_TIMEOUT",
    "FOLLOW_INTERVAL",
]

logger = logging.getLogger(__name__)

#: Seconds ``heal()``/``resize()`` wait for free workers when no ``timeout`` is given.
DEFAULT_TIMEOUT = 120.0

#: Seconds between looks for free workers while waiting for them.
_POLL = 0.2

#: Seconds between two looks at the cluster by a group that follows its pool (at call
#: boundaries: a group called less often looks at its next call).
FOLLOW_INTERVAL = 1.0

#: The groups of this driver that keep spares (their spares are not free to the others).
_WITH_SPARES: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class MembershipReport:
    """What a ``heal()`` or ``resize()`` did.

    Attributes:
        kind: ``"heal"`` or ``"resize"``.
        moved: rank -> ``(old worker address or None for a new rank, new worker address)``
            for every rank built anew.
        removed: ranks destroyed (a resize down).
        old_world_size, new_world_size: the group's size before and after.
        master_addr, master_port: the new rendezvous every rank sees.
        seconds: wall-clock seconds it took.
        event: the [`MembershipChange`][daskwg.worker.MembershipChange] the ranks got.
    """

    kind: str
    moved: dict = field(default_factory=dict)
    removed: tuple = ()
    old_world_size: int = 0
    new_world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    seconds: float = 0.0
    event: MembershipChange | None = None

    def __str__(self) -> str:
        moves = ", ".join(f"rank {r}: {a or 'new'} -> {b}" for r, (a, b) in sorted(self.moved.items()))
        removed = f"; removed ranks {list(self.removed)}" if self.removed else ""
        return (
            f"{self.kind} in {self.seconds:.2f} s: world size {self.old_world_size} -> {self.new_world_size}; "
            f"{moves or 'no rank moved'}{removed}; rendezvous {self.master_addr}:{self.master_port}"
        )


def heal_group(wg: Any, timeout: float | None, rendezvous: bool = False) -> MembershipReport:
    """``wg.heal(timeout, rendezvous)``: see [`WorkerGroup.heal`][daskwg.WorkerGroup.heal]."""
    t0 = time.monotonic()
    _check_changeable(wg, "heal")
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    transport, slots = wg._transport, list(wg._slots)
    driver = transport.driver
    transport.settle()
    lost = [r for r, s in enumerate(slots) if s.server_id in driver.health.lost]
    stuck = _stuck_ranks(wg, [r for r in range(len(slots)) if r not in lost])
    if not lost and not stuck and transport.broken is None and not rendezvous:
        logger.info("group %s: heal() found nothing to heal", wg._name)
        return MembershipReport(
            "heal",
            old_world_size=wg.world_size,
            new_world_size=wg.world_size,
            master_addr=wg._master_addr,
            master_port=wg._master_port,
            seconds=time.monotonic() - t0,
        )
    replaced: dict[int, WorkerSlot] = {}
    restartable = [r for r in stuck if slots[r].nanny is not None]
    if restartable:
        logger.warning(
            "group %s: rank(s) %s are still stuck in the call that broke the group; restarting their workers "
            "through their Nannies",
            wg._name,
            restartable,
        )
        fresh = restart_workers(
            wg._client, [slots[r] for r in restartable], driver.health.lost, wg._name, limit
        )
        replaced.update(zip(restartable, fresh))
    left_out = [r for r in stuck if r not in replaced]
    if left_out:
        _destroy_later(wg, left_out)
    todo = [r for r in lost + left_out if r not in replaced]
    keep = [s for r, s in enumerate(slots) if r not in todo]
    replaced.update(
        zip(todo, _free_workers(wg, len(todo), keep, limit - (time.monotonic() - t0), "heal", todo))
    )
    new_slots = [replaced.get(r, s) for r, s in enumerate(slots)]
    moved = {r: (slots[r].address, new_slots[r].address) for r in sorted(replaced)}
    report = _change(wg, "heal", new_slots, sorted(replaced), moved, (), t0, rendezvous_timeout=limit)
    logger.warning("group %s: %s", wg._name, report)
    _replenish_later(wg)
    return report


def resize_group(wg: Any, world_size: int, timeout: float | None) -> MembershipReport:
    """``wg.resize(world_size, timeout)``: see [`WorkerGroup.resize`][daskwg.WorkerGroup.resize]."""
    t0 = time.monotonic()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"resize() takes a world size >= 1, got {world_size!r}")
    _check_changeable(wg, "resize")
    wg._transport.settle()
    if wg._transport.broken is not None:
        raise GroupBrokenError(
            f"group {wg._name!r} is broken ({wg._transport.broken}); wg.heal() it first, then resize it"
        )
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    slots, old = list(wg._slots), wg.world_size
    if world_size == old:
        return MembershipReport("resize", old_world_size=old, new_world_size=old)
    if world_size > old:
        new = list(range(old, world_size))
        added = _free_workers(wg, len(new), slots, limit, "resize", new)
        new_slots = slots + list(added)
        moved = {r: (None, s.address) for r, s in zip(new, added)}
        report = _change(wg, "resize", new_slots, new, moved, (), t0, rendezvous_timeout=limit)
    else:
        removed = tuple(range(world_size, old))
        report = _change(
            wg, "resize", slots[:world_size], [], {}, removed, t0, old_slots=slots, rendezvous_timeout=limit
        )
    logger.info("group %s: %s", wg._name, report)
    _replenish_later(wg)
    return report


def keep_spares(wg: Any, k: int) -> list[str]:
    """``wg.keep_spares(k)``: see [`WorkerGroup.keep_spares`][daskwg.WorkerGroup.keep_spares]."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"keep_spares() takes a number of spare workers >= 0, got {k!r}")
    _check_changeable(wg, "keep_spares")
    with wg._spare_lock:
        wg._spare_count = k
        if k:
            _WITH_SPARES.add(wg)
        else:
            wg._spares = []
            _WITH_SPARES.discard(wg)
        _replenish(wg)
        return [s.address for s in wg._spares]


def _replenish_later(wg: Any) -> None:
    """:func:`_replenish` in a thread of its own, after a heal or resize: the group answers
    at once, while a spare is warmed (a restarted worker may still be importing torch: the
    warm-up waits for it). Best effort: a failure is logged, and ``keep_spares(k)`` warms
    synchronously when called."""
    if not getattr(wg, "_spare_count", 0):
        return
    with wg._spare_lock:  # at once: a spare that now hosts a rank (or was lost) is none
        lost = wg._transport.driver.health.lost
        ranks = {s.server_id for s in wg._slots}
        wg._spares = [s for s in wg._spares if s.server_id not in lost and s.server_id not in ranks]

    def replenish() -> None:
        try:
            with wg._spare_lock:
                _replenish(wg)
        except Exception as exc:  # noqa: BLE001 - the client closing, a worker going: next time
            logger.info("group %s: warming spare workers failed: %s", wg._name, exc)

    threading.Thread(target=replenish, name=f"daskwg-spares-{wg._name}", daemon=True).start()


def _replenish(wg: Any) -> None:
    """Drop spares that were lost or now host a rank; warm free workers up to the count."""
    want = getattr(wg, "_spare_count", 0)
    if not want:
        return
    lost = wg._transport.driver.health.lost
    ranks = {s.server_id for s in wg._slots}
    spares = [s for s in getattr(wg, "_spares", []) if s.server_id not in lost and s.server_id not in ranks]
    spares = spares[:want]
    if len(spares) < want:
        held = {s.server_id for s in spares}
        more = [s for s in _free_now(wg, wg._slots) if s.server_id not in held][: want - len(spares)]
        if more:
            _warm(wg, more)
        spares += more
    if len(spares) < want:
        logger.warning(
            "group %s: keeps %d of %d spare worker(s): no other worker is free (add workers)",
            wg._name,
            len(spares),
            want,
        )
    wg._spares = spares


def _warm(wg: Any, slots: list[WorkerSlot]) -> None:
    """Import the group's class (and its imports) on ``slots`` and run the version check a
    rank's build runs there, so a heal onto them pays neither."""
    blob = cloudpickle.dumps(wg._cls_with_init)
    check_versions(wg._client, slots)
    wg._client.run(_warm_spare, blob, workers=[s.address for s in slots])
    logger.info("group %s: spare worker(s) %s warmed", wg._name, [s.address for s in slots])


def _warm_spare(blob: bytes) -> str:
    """On a spare worker: unpickle the ``ClassWithInitArgs``, importing its module."""
    return cloudpickle.loads(blob).cls.__qualname__


def _spares_of_others(wg: Any) -> set:
    return {s.server_id for g in list(_WITH_SPARES) if g is not wg for s in getattr(g, "_spares", [])}


@dataclass
class _Following:
    """What ``wg.follow_pool()`` set: the bounds, and when the group looks next."""

    min_world_size: int
    max_world_size: int | None
    timeout: float | None
    next_look: float = 0.0
    reports: list = field(default_factory=list)


def follow_pool(
    wg: Any, follow: bool, min_world_size: int, max_world_size: int | None, timeout: float | None
) -> None:
    """``wg.follow_pool(...)``: see [`WorkerGroup.follow_pool`][daskwg.WorkerGroup.follow_pool]."""
    if not follow:
        wg._following = None
        return
    for name, value in (("min_world_size", min_world_size), ("max_world_size", max_world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"follow_pool() takes {name} as an int >= 1, got {value!r}")
    if max_world_size is not None and max_world_size < min_world_size:
        raise ValueError(
            f"follow_pool() got max_world_size={max_world_size} below min_world_size={min_world_size}"
        )
    _check_changeable(wg, "follow_pool")
    wg._following = _Following(min_world_size, max_world_size, timeout)


def follow_step(wg: Any) -> MembershipReport | None:
    """At a call boundary of a group that follows its pool: replace or drop the ranks whose
    workers were lost, and grow onto free workers, at most every :data:`FOLLOW_INTERVAL`
    seconds (at once when the group is broken). Returns the report of what changed, if
    anything did."""
    following = getattr(wg, "_following", None)
    if following is None or wg._closed:
        return None
    transport = wg._transport
    transport.settle()
    lost = transport.driver.health.lost
    # A worker that left between calls (retired by a scale-down, lost) breaks no call yet.
    losing = transport.broken is not None or any(s.server_id in lost for s in wg._slots)
    now = time.monotonic()
    if not losing and now < following.next_look:
        return None
    following.next_look = now + FOLLOW_INTERVAL
    report = None
    if losing:
        report = _follow_losses(wg, following)
    if following.max_world_size is None or wg.world_size < following.max_world_size:
        free = _free_now(wg, wg._slots)
        room = len(free) if following.max_world_size is None else following.max_world_size - wg.world_size
        if free and room > 0:
            report = resize_group(wg, wg.world_size + min(len(free), room), following.timeout)
    if report is not None:
        following.reports.append(report)
    return report


def _follow_losses(wg: Any, following: _Following) -> MembershipReport:
    """A broken group that follows its pool: heal where there are free workers enough for
    the lost ranks, else shrink by as many ranks as were lost (the lost places are taken by
    the highest surviving ranks' workers, those ranks rebuilt there: a rank is its number,
    so survivors above a lost rank cannot be renumbered), down to ``min_world_size``."""
    slots, driver = list(wg._slots), wg._transport.driver
    lost = [r for r, s in enumerate(slots) if s.server_id in driver.health.lost]
    if not lost or len(_free_now(wg, [s for r, s in enumerate(slots) if r not in lost])) >= len(lost):
        return heal_group(wg, following.timeout)
    new_world = max(len(slots) - len(lost), following.min_world_size)
    if new_world > len(slots) - len(lost):  # below the floor: wait for workers instead
        return heal_group(wg, following.timeout)
    t0 = time.monotonic()
    wg._transport.settle()
    # Workers of the highest surviving ranks take the lost places below new_world.
    donors = [r for r in range(len(slots) - 1, new_world - 1, -1) if r not in lost]
    holes = [r for r in lost if r < new_world]
    new_slots = slots[:new_world]
    moved = {}
    for hole, donor in zip(holes, donors):
        new_slots[hole] = slots[donor]
        moved[hole] = (slots[hole].address, slots[donor].address)
    removed = tuple(r for r in range(new_world, len(slots)))
    alive_removed = tuple(r for r in removed if r not in lost)
    report = _change(
        wg, "resize", new_slots, sorted(holes), moved, removed, t0, old_slots=slots, destroy=alive_removed
    )
    logger.warning(
        "group %s follows its pool: lost rank(s) %s and no free worker: %s", wg._name, lost, report
    )
    _replenish_later(wg)
    return report


# ---- the steps -----------------------------------------------------------------------------


def _change(
    wg: Any,
    kind: str,
    new_slots: list[WorkerSlot],
    new_ranks: list[int],
    moved: dict,
    removed: tuple,
    t0: float,
    old_slots: list[WorkerSlot] | None = None,
    destroy: tuple | None = None,
    rendezvous_timeout: float = DEFAULT_TIMEOUT,
) -> MembershipReport:
    """Make ``new_slots`` the group's ranks: rejoin the kept ones, build ``new_ranks``,
    destroy ``removed`` (ranks of ``old_slots``; ``destroy``: those of them still alive,
    when not all are), run the hook everywhere. ``rendezvous_timeout``: seconds a kept rank
    that initialises its process group again waits for the new ranks."""
    client, old_world = wg._client, wg.world_size
    old_transport = wg._transport
    check_versions(client, [new_slots[r] for r in new_ranks])
    doomed = removed if destroy is None else destroy
    if doomed:
        _destroy(wg, old_transport, list(doomed))
    old_transport.close()
    wg._slots = list(new_slots)
    wg._transport = GroupTransport(
        client, wg._slots, wg._name, wg._group_id, wg._owner, detached=wg._detached
    )
    wg._transports[:] = [wg._transport]
    wg._dispatch_info.clear()
    wg._collect_info.clear()
    # A fresh port: the survivors' old rendezvous (rank 0's TCPStore) may still hold the old one.
    wg._master_addr = wg._slots[0].host
    wg._master_port = client.sync(wg._transport.reserve_port, None)
    event = MembershipChange(
        kind=kind,
        old_world_size=old_world,
        new_world_size=wg.world_size,
        new_ranks=tuple(new_ranks),
        removed_ranks=tuple(removed),
        master_addr=wg._master_addr,
        master_port=wg._master_port,
    )
    payloads = wg._rank_payloads()
    kept = [r for r in range(wg.world_size) if r not in new_ranks]
    settings = Settings.current()
    # daskwg's Worker has a no-op hook: only an override does what the class needs.
    hook = getattr(wg._cls, "on_membership_change", None)
    has_hook = hook is not None and hook is not Worker.on_membership_change

    def build_new() -> None:
        # A new rank's __init__ may rendezvous (init_process_group, as ranks built with the
        # group do): it runs while the kept ranks rejoin and run the hook, never after them.
        wg._send(
            "__init__",
            new_ranks,
            [payloads[r] for r in new_ranks],
            blocking=True,
            raw_payload=True,
            settle=settings.rank_failure_grace,
        )
        if has_hook:
            wg._send("on_membership_change", new_ranks, [((event,), {})] * len(new_ranks), blocking=True)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="daskwg-heal") as pool:
        building = pool.submit(contextvars.copy_context().run, build_new) if new_ranks else None
        try:
            if kept:
                # Without a hook, a kept rank whose default process group was destroyed
                # initialises it again (same backend, new rendezvous), meeting the new ranks'
                # __init__; with one, the hook does what the class needs.
                rejoin = [
                    {
                        "env": payloads[r]["env"],
                        "world_size": wg.world_size,
                        "reinit_timeout": None if has_hook else rendezvous_timeout,
                    }
                    for r in kept
                ]
                wg._send("__rejoin__", kept, rejoin, blocking=True, raw_payload=True, check=False)
                if has_hook:
                    wg._send("on_membership_change", kept, [((event,), {})] * len(kept), blocking=True)
        finally:
            if building is not None:
                building.result()
    wg._publish()
    return MembershipReport(
        kind,
        moved,
        removed,
        old_world,
        wg.world_size,
        wg._master_addr,
        wg._master_port,
        time.monotonic() - t0,
        event,
    )


def _destroy(wg: Any, transport: GroupTransport, ranks: list[int]) -> None:
    """Destroy ``ranks`` of the group (a resize down), bounded by ``daskwg.shutdown-timeout``."""
    with deadline(Settings.current().shutdown_timeout):
        transport.send("__del__", ranks, [((), {})] * len(ranks), blocking=True, check=False, settle=0.0)


def _destroy_later(wg: Any, ranks: list[int]) -> None:
    """Queue the destruction of ranks left out of a heal (stuck, on workers without a
    Nanny): each ends its object when the call it is stuck in returns."""
    logger.warning(
        "group %s: rank(s) %s are stuck in the call that broke the group on worker(s) without a Nanny %s; "
        "they are left out (their objects are destroyed when that call ends) and moved to free workers",
        wg._name,
        ranks,
        [wg._slots[r].address for r in ranks],
    )
    try:
        futures = wg._transport.send("__del__", ranks, [((), {})] * len(ranks), blocking=False, check=False)
        fire_and_forget([f for f in futures if not isinstance(f, CallFuture)])
    except Exception as exc:  # noqa: BLE001 - best effort: the heal goes on without them
        logger.info("group %s: could not queue the destruction of ranks %s: %s", wg._name, ranks, exc)


def _stuck_ranks(wg: Any, alive: list[int]) -> list[int]:
    """Ranks of ``alive`` still running the call that broke the group after
    ``daskwg.rank-failure-grace`` seconds (given from now, for a call that just failed)."""
    transport = wg._transport
    end = time.monotonic() + Settings.current().rank_failure_grace
    while True:
        busy = [r for r in alive if transport.busy_call(wg._slots[r]) is not None]
        if not busy or time.monotonic() >= end:
            return busy
        time.sleep(0.02)


def _free_workers(
    wg: Any, n: int, keep: Sequence[WorkerSlot], timeout: float, what: str, ranks: list[int]
) -> list[WorkerSlot]:
    """``n`` free workers for ``ranks``, the group's pool's first; waits for them up to
    ``timeout`` seconds, saying so.

    Raises:
        WorldSizeError: fewer than ``n`` free workers within ``timeout``.
    """
    if n == 0:
        return []
    end = time.monotonic() + max(timeout, 0.0)
    said = False
    while True:
        free = _free_now(wg, keep)
        if len(free) >= n:
            return free[:n]
        if time.monotonic() >= end:
            raise WorldSizeError(
                f"{what}() of group {wg._name!r} needs {n} free worker(s) for rank(s) {ranks} and found "
                f"{len(free)} within {timeout:g} s{_wanted(wg)}; every other worker hosts a rank. Add workers "
                "(cluster.scale(...), dask worker <scheduler>), shut down another group, or call "
                f"{what}() again with a longer timeout"
            )
        if not said:
            logger.warning(
                "group %s: %s() waits up to %.0f s for %d free worker(s) for rank(s) %s (%d free now%s)",
                wg._name,
                what,
                max(end - time.monotonic(), 0.0),
                n,
                ranks,
                len(free),
                _wanted(wg),
            )
            said = True
        time.sleep(_POLL)


def _wanted(wg: Any) -> str:
    pool_slots, resources = wg._placement
    parts = []
    if resources:
        parts.append(f"offering {resources}")
    if pool_slots:
        parts.append(f"preferably from its pool {[s.address for s in pool_slots]}")
    return f" ({', '.join(parts)})" if parts else ""


def _free_now(wg: Any, keep: Sequence[WorkerSlot]) -> list[WorkerSlot]:
    """The free workers now, in the design's order, the group's pool's first."""
    client, driver = wg._client, wg._transport.driver
    pool_slots, resources = wg._placement
    try:
        matching = ResourcePool(client, None, None, dict(resources) if resources else None).slots
    except (ValueError, WorldSizeError, OSError):
        return []
    taken = {s.server_id for s in keep} | _spares_of_others(wg)
    for record in (client.get_metadata([records.ROOT], default=None) or {}).values():
        if record:
            taken.update(record.get("server_ids", ()))
    free = [
        s
        for s in matching
        if s.server_id not in taken
        and s.server_id not in driver.health.lost
        and driver.sequencer.busy_call(s) is None
    ]
    if pool_slots:
        nannies = {s.nanny for s in pool_slots if s.nanny} | {s.address for s in pool_slots}
        free.sort(key=lambda s: s.nanny not in nannies and s.address not in nannies)
    # The group's warm spares first (a stable sort keeps the order above among the rest).
    spares = {s.server_id for s in getattr(wg, "_spares", [])}
    free.sort(key=lambda s: s.server_id not in spares)
    return free


def _check_changeable(wg: Any, what: str) -> None:
    if wg._closed:
        raise GroupBrokenError(f"group {wg._name!r} was shut down; build a new one")
    if wg._cls_with_init is None:
        raise WorkerGroupError(
            f"group {wg._name!r} was attached, not built by this driver: its init arguments are not known "
            f"here; {what}() it from the driver that built it"
        )
