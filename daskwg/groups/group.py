"""The public group: :class:`WorkerGroup`, verl's ``RayWorkerGroup`` on Dask.

A call on a group goes dispatch → send → host → collect (see ``daskwg.groups.binding``, which
binds the registered methods). This module holds the group's life cycle: placement,
rank environment, build, attach, restart, shutdown; how calls and data travel is
``daskwg.transport``'s, and the ranks live in ``daskwg.plugin`` on the workers.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import cloudpickle
from distributed import Client, fire_and_forget

from .. import foreign
from ..config import Settings
from ..deadlines import current_limit, shielded
from ..errors import CallTimeoutError, GroupBrokenError, WorkerGroupError
from ..transport import CallFuture, GroupTransport
from ..transport.failure.state import fresh_error
from ..wire import records
from ..wire.messages import RANK_ENV_KEYS, WIRE_FORMAT
from ..worker import ClassWithInitArgs
from .binding import RESERVED, BoundGroup, method_signature
from .colocate import role_classes_of
from .heal import MembershipReport, follow_pool, follow_step, heal_group, keep_spares, resize_group
from .install import check_versions, install_plugins, version_of
from .pool import ResourcePool, WorkerSlot, check_one_rank_per_process, in_this_process, pick_free
from .restart import check_restartable, restart_workers
from .roles import RoleGroup, spawn_role_groups

__all__ = ["WorkerGroup", "ClassWithInitArgs"]

logger = logging.getLogger(__name__)


class WorkerGroup(BoundGroup):
    """A set of ranks, each an instance of the user's class in one Dask worker.

    Args:
        client: a connected ``distributed.Client`` (synchronous).
        cls_or_cls_with_init: the Worker class, or a [`ClassWithInitArgs`][daskwg.ClassWithInitArgs].
        world_size: number of ranks (``None``: every worker of the cluster or pool).
        workers: a [`ResourcePool`][daskwg.ResourcePool] or worker addresses/names to use.
        resources: Dask worker resources each chosen worker must offer.
        name: the group's name (dashboard keys, attach); default ``<Class>-<id>``. A
            non-detached group's name is scoped to its client, as Dask scopes a client's
            futures: two drivers (two clients) on one cluster can each build a group
            named ``"actor"``. A detached group's name holds on the whole cluster: any
            client attaches to it by that name.
        worker_env: extra environment variables (``str -> str``) for every rank.
        master_port: the ``MASTER_PORT`` to use (else one is reserved on rank 0's host).
        detached: keep the group alive after this client closes; reattach with
            [`attach`][daskwg.WorkerGroup.attach]. Needs ``name``.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``worker_env`` sets a rank variable; the name is taken (a live group of this
            client, a detached group, or, for a detached group, a group of any connected
            client); two ranks would run in one process (in-process workers: they would
            share one ``os.environ``).
        WorldSizeError: more ranks than matching workers.
        OSError: ``master_port`` is in use on rank 0's host.
        RankError: the class's ``__init__`` raised on a rank (nothing is left on the
            other ranks).

    Every method of the class marked with [`daskwg.register`][daskwg.register] becomes an attribute
    of the group that dispatches, executes and collects as its mode says. Mirrors
    verl's ``RayWorkerGroup``. A non-detached group that is garbage-collected without
    [`shutdown`][daskwg.WorkerGroup.shutdown] releases its ranks, as a Ray actor dies with its last handle.
    """

    #: ``WG_PREFIX`` of verl's rank variables on every rank (``daskwg.verl``'s groups set
    #: it); ``None``: they are set, with the group's name, only for classes from verl.
    _verl_prefix: str | None = None

    def __init__(
        self,
        client: Client,
        cls_or_cls_with_init: type | ClassWithInitArgs,
        *,
        world_size: int | None = None,
        workers: ResourcePool | Sequence[str] | None = None,
        resources: Mapping[str, float] | None = None,
        name: str | None = None,
        worker_env: Mapping[str, str] | None = None,
        master_port: int | None = None,
        detached: bool = False,
    ):
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        if client.asynchronous:
            raise TypeError(
                "WorkerGroup needs a synchronous Client (asynchronous=False): its calls block until the ranks "
                "return. From async code, connect a synchronous Client and run the blocking calls in a thread, "
                "e.g. wg = await asyncio.to_thread(WorkerGroup, client, cls, world_size=n) and "
                "out = await asyncio.to_thread(wg.step, batch); the event loop keeps running meanwhile"
            )
        cls_with_init = (
            cls_or_cls_with_init
            if isinstance(cls_or_cls_with_init, ClassWithInitArgs)
            else ClassWithInitArgs(cls_or_cls_with_init)
        )
        env = _check_options(worker_env, master_port, name, detached)
        _check_init_arguments(cls_with_init)
        placement = (workers.slots if isinstance(workers, ResourcePool) else None, resources)
        if isinstance(workers, ResourcePool):
            pool = workers
            if world_size is not None and world_size != pool.world_size:
                pool = ResourcePool(client, world_size=world_size, workers=pool.workers)
        else:
            # Workers busy with a call this driver abandoned are passed over while others match.
            busy = GroupTransport.driver_of(client).sequencer.busy_call
            pool = pick_free(client, world_size, workers, dict(resources) if resources else None, busy)
        group_id = uuid.uuid4().hex
        name = name or f"{cls_with_init.cls.__name__}-{group_id[:8]}"
        check_one_rank_per_process(pool.slots, name)
        self._setup(
            client,
            cls_with_init.cls,
            name,
            group_id,
            pool.slots,
            client.id,
            detached,
        )
        self._cls_with_init = cls_with_init
        # Where heal() and resize() look for workers first, and what they must offer.
        self._placement = placement
        self._worker_env = env
        self._requested_port = master_port
        self._role_classes = role_classes_of(cls_with_init)
        records.check_name_free(client, self._name, self._owner, detached)
        self._build_ranks()
        self._publish()
        if not detached:
            # Like a Ray actor that dies with its last handle: a group the program drops
            # without shutdown() gives its ranks (and their memory) back.
            self._finalizer = weakref.finalize(
                self, _release_dropped_group, self._transports, self._record_key
            )
            self._finalizer.atexit = False

    def _setup(
        self,
        client: Client,
        cls: type,
        name: str,
        group_id: str,
        slots: Sequence[WorkerSlot],
        owner: str,
        detached: bool,
    ) -> None:
        """The state a group has whether it was built here or attached."""
        self._client = client
        self._cls = cls
        self._name = name
        self._group_id = group_id
        self._slots = list(slots)
        self._owner = owner
        self._detached = detached
        # Where its record lives on the scheduler: a non-detached name is scoped to its owner.
        self._record_key = records.key_of(name, None if detached else owner)
        self._closed = False
        # keep_spares() and the warm-ups after a heal or resize (a thread of their own) take turns.
        self._spare_lock = threading.RLock()
        self._finalizer: weakref.finalize | None = None
        self._cls_with_init: ClassWithInitArgs | None = None
        self._placement: tuple = (None, None)
        self._role_classes: dict[str, type] | None = None
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._methods = self._bind_registered_methods()
        check_versions(client, self._slots)
        install_plugins(client)
        self._transport = GroupTransport(client, self._slots, name, group_id, owner, detached=detached)
        # The finaliser holds this list, not the group: restart() swaps the transport in it.
        self._transports = [self._transport]

    def _build_ranks(self) -> None:
        """Reserve ``MASTER_PORT`` and instantiate the class on every rank (all or none)."""
        settings = Settings.current()
        self._master_addr = self._slots[0].host
        self._master_port = self._client.sync(self._transport.reserve_port, self._requested_port)
        payloads = self._rank_payloads()
        try:
            # Refused before anything is sent: there is nothing to destroy.
            limit = current_limit(None, settings.call_timeout)
            self._transport.check("__init__", list(range(self.world_size)), limit)
        except BaseException:
            self._transport.close()
            self._closed = True
            raise
        try:
            self._send(
                "__init__",
                list(range(self.world_size)),
                payloads,
                blocking=True,
                raw_payload=True,
                settle=settings.rank_failure_grace,
            )
        except BaseException:
            self._destroy_ranks()
            self._transport.close()
            self._closed = True
            raise

    def _rank_payloads(self) -> list[dict]:
        """Every rank's ``__init__`` payload: the class, its environment, the options."""
        settings = Settings.current()
        hosts = [s.host for s in self._slots]
        return [
            {
                "cls": self._cls_with_init,
                "env": {
                    **_verl_env(self, hosts.count(host), hosts[:rank].count(host)),
                    **self._worker_env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.world_size),
                    "LOCAL_RANK": str(hosts[:rank].count(host)),
                    "LOCAL_WORLD_SIZE": str(hosts.count(host)),
                    "MASTER_ADDR": self._master_addr,
                    "MASTER_PORT": str(self._master_port),
                },
                "detached": self._detached,
                "world_size": self.world_size,
                # A worker in this very process (LocalCluster(processes=False)) puts the
                # rank's variables in place for each call only: this process's own
                # environment is the driver's.
                "scoped_env": in_this_process(slot),
                # Read in the driver, so a setting applies to the groups it builds there.
                "skip_signal_handlers": settings.skip_signal_handlers,
                "check_process_group": settings.check_process_group,
                # The worker refuses a call format it does not speak, naming both.
                "wire": WIRE_FORMAT,
                "daskwg": version_of("daskwg"),
            }
            for rank, (host, slot) in enumerate(zip(hosts, self._slots))
        ]

    # ---- public API ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._slots)

    @property
    def workers(self) -> list[str]:
        """Dask worker address of every rank (``workers[rank]``)."""
        return [s.address for s in self._slots]

    @property
    def name(self) -> str:
        """The group's name (used in task keys and by [`attach`][daskwg.WorkerGroup.attach]):
        unique among this client's groups and the cluster's detached groups."""
        return self._name

    @property
    def master_addr_port(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` every rank sees."""
        return self._master_addr, self._master_port

    @property
    def _broken(self) -> WorkerGroupError | None:
        return self._transport.broken

    @property
    def is_broken(self) -> bool:
        """Whether a worker was lost or ranks fell out of step (later calls raise)."""
        self._transport.settle()
        return self._broken is not None

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RoleGroup]:
        """One group per role of a colocated group (verl's ``RayWorkerGroup.spawn``).

        Args:
            prefix_set: role names of the ``create_colocated_worker_cls`` dict.

        Returns:
            role name → a group over the same ranks that binds that role's registered
            methods under their own names (``groups["actor"].add(data)``). Role groups
            own nothing: shut down this group to free the ranks.

        Raises:
            TypeError: this group's class is not a colocated worker.
            ValueError: an unknown role name.
        """
        return spawn_role_groups(self, prefix_set)

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """Set every role group of [`spawn`][daskwg.WorkerGroup.spawn] as an attribute: ``wg.actor.add(data)``
        (verl's ``RayWorkerGroup.fuse``).

        Raises:
            ValueError: a role name clashes with an attribute of the group.
            TypeError, ValueError: as [`spawn`][daskwg.WorkerGroup.spawn].
        """
        role_groups = self.spawn(prefix_set)
        for role in role_groups:
            if role in self._methods or hasattr(type(self), role) or role in RESERVED:
                raise ValueError(
                    f"role {role!r} clashes with the attribute {role!r} of the group; rename the role"
                )
        for role, role_group in role_groups.items():
            setattr(self, role, role_group)

    def status(self) -> list[dict]:
        """What every rank is doing now, read from its worker (forensics on demand).

        Returns:
            one dict per rank, in rank order: ``rank``, ``address``, ``state``
            (``"running"``, ``"queued"``, ``"idle"``, ``"unresponsive"``: no answer within
            ``daskwg.status-timeout`` seconds, e.g. a stopped process; ``"lost"``: the
            worker or the rank is gone), ``method`` (the running or first queued call),
            ``seconds`` (since it started or was queued), ``stack`` (the rank thread's
            Python stack while running, e.g. in ``all_reduce``), ``last_error``,
            ``queued`` (how many of its calls wait) and ``cancelled`` (the running call's
            future was cancelled: a sync method runs to its end). Calls the driver
            abandoned (a deadline, Ctrl-C) show while they run. Takes at most about
            ``daskwg.status-timeout`` seconds.
        """
        return self._transport.status()

    def restart(self) -> None:
        """Replace every rank's process and rebuild the ranks; the group stays valid.

        The hosting Dask workers restart through their Nannies
        (``client.restart_workers``; a worker is found again by its Nanny, so ``dask worker``
        processes without ``--name`` work; a local cluster's
        ``distributed.deploy.lost-worker-timeout`` is raised meanwhile, so slow starts are
        kept), then the class is instantiated again on every rank from the same
        ``ClassWithInitArgs`` and ``worker_env``, with a fresh ``MASTER_PORT`` (the one
        passed as ``master_port=``, if any). Returns when the ranks are ready. The way out of a rank stuck for good (a frozen process, a
        collective that never returns, a call abandoned by a deadline or Ctrl-C).
        Everything else on those workers is lost: other groups with ranks there raise
        ``WorkerLostError``, as with any restart.

        Raises:
            WorkerGroupError: a worker has no Nanny (``processes=False``,
                ``dask worker --no-nanny``), the group was attached rather than built
                here, or a worker did not come back.
            GroupBrokenError: the group was shut down.
            RankError: ``__init__`` raised on a rank (the group is then shut down).
        """
        if self._closed:
            raise GroupBrokenError(f"group {self._name!r} was shut down; build a new one")
        if self._cls_with_init is None:
            raise WorkerGroupError(
                f"group {self._name!r} was attached, not built by this driver: its init arguments are not "
                "known here; restart it from the driver that built it"
            )
        old_slots = self._slots
        check_restartable(self._client, old_slots, self._name)
        self._transport.close()
        self._slots = restart_workers(
            self._client,
            old_slots,
            self._transport.driver.health.lost,
            self._name,
            Settings.current().restart_timeout,
        )
        self._transport = GroupTransport(
            self._client, self._slots, self._name, self._group_id, self._owner, detached=self._detached
        )
        self._transports[:] = [self._transport]
        self._dispatch_info.clear()
        self._collect_info.clear()
        self._build_ranks()
        self._publish()

    def heal(self, timeout: float | None = None, rendezvous: bool = False) -> MembershipReport:
        """Replace the lost ranks of a broken group on free workers; the surviving ranks
        keep their processes and Python state.

        Replaced: ranks whose worker was lost, and ranks still stuck in the call that broke
        the group ``daskwg.rank-failure-grace`` seconds on (their workers restart through
        their Nannies; without one, the rank moves). Free workers host no rank of any group
        (one a Nanny just restarted is free); a group built on a ``ResourcePool`` takes its
        pool's first. Every rank gets a new rendezvous (``MASTER_ADDR`` = rank 0's host, a
        fresh ``MASTER_PORT``; ``RANK``, ``WORLD_SIZE`` unchanged), survivors' torch default
        process group is destroyed, replacements run ``__init__`` with the group's
        arguments, then [`Worker.on_membership_change`][daskwg.Worker.on_membership_change]
        runs on every rank at once. Logged. A healthy group is left as it is, unless
        ``rendezvous`` is true.

        Args:
            timeout: seconds to wait for free workers (and restarts), ``None``: 120.
            rendezvous: also when no rank is replaced, give every rank the new rendezvous
                and run ``on_membership_change`` (with empty ``new_ranks``). A collective
                that failed on some ranks (a peer's input was lost, a gloo or NCCL timeout)
                leaves the torch process group of every rank unusable although no worker
                was lost: its next collective raises ("Connection closed by peer"). Pass it
                for a group whose ranks may have been inside a collective when the failure
                came.

        Returns:
            a ``daskwg.groups.heal.MembershipReport``: ``moved`` (rank -> (old, new)
            worker address), ``seconds``, the new ``master_addr``/``master_port``.

        Raises:
            WorldSizeError: too few free workers within ``timeout`` (the message says what
                it waited for).
            GroupBrokenError: the group was shut down.
            WorkerGroupError: the group was attached, not built here.
            RankError: ``__init__`` or ``on_membership_change`` raised on a rank.
        """
        return heal_group(self, timeout, rendezvous=rendezvous)

    def resize(self, world_size: int, timeout: float | None = None) -> MembershipReport:
        """Grow or shrink the group between calls to ``world_size`` ranks.

        Kept ranks (``0 .. min(old, new) - 1``, in the design's order) keep their processes
        and state; new ranks (the highest) are built on free workers, as
        [`heal`][daskwg.WorkerGroup.heal] finds them, with the group's arguments; removed
        ranks (the highest) are destroyed. Every rank then sees the new ``WORLD_SIZE`` and
        rendezvous, and ``on_membership_change`` runs on every rank.

        Args:
            world_size: the new number of ranks (>= 1).
            timeout: seconds to wait for free workers, ``None``: 120.

        Returns:
            a ``daskwg.groups.heal.MembershipReport``.

        Raises:
            ValueError: ``world_size`` is not an int >= 1.
            GroupBrokenError: the group is broken (``heal()`` it first) or shut down.
            WorldSizeError: too few free workers within ``timeout``.
            RankError: ``__init__`` or ``on_membership_change`` raised on a rank.
        """
        return resize_group(self, world_size, timeout)

    def keep_spares(self, k: int) -> list[str]:
        """Keep ``k`` free workers warm for this group (hot spares), for
        [`heal`][daskwg.WorkerGroup.heal] and [`resize`][daskwg.WorkerGroup.resize] to use first.

        A spare is a free worker (hosting no rank of any group) on which the group's class
        has been unpickled (its module and what it imports, torch included, are imported in
        that process) and the version check of a rank's build has run: a heal onto it pays
        neither a process start nor those imports. After a heal or resize the group warms
        free workers again up to ``k`` where there are any (it logs when there are too
        few), in a thread of its own: the heal or resize returns as soon as the group
        answers, and ``wg.spares`` fills up meanwhile. Other groups of this driver do not
        heal or grow onto them. verl calls these warm *standbys* (``replace_worker``, PR
        #7910, off by default there).

        Args:
            k: spare workers to keep (``int`` >= 0; 0 lets them go).

        Returns:
            the spare workers' addresses now (``list[str]``, up to ``k``).

        Raises:
            ValueError: ``k`` is not an int >= 0.
            GroupBrokenError: the group was shut down.
            WorkerGroupError: the group was attached, not built here.
        """
        return keep_spares(self, k)

    def follow_pool(
        self,
        follow: bool = True,
        *,
        min_world_size: int = 1,
        max_world_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        """Let the group follow its pool (elastic groups, e.g. rollout): at call boundaries
        it grows onto workers that joined the cluster and shrinks when workers hosting its
        ranks leave it (``cluster.scale()``, an adaptive deployment, a lost node).

        At the start of a registered method's call (or an ``execute_*`` call), at most once
        a second (at once when the group is broken), the group looks at the cluster:

        * ranks whose workers were lost are replaced on free workers, as
          [`heal`][daskwg.WorkerGroup.heal] does; where there are too few, the group shrinks
          by as many ranks (a lost rank's number is taken by the highest surviving rank,
          rebuilt on its worker with the group's arguments; a rank is its number, so the
          ranks above cannot be renumbered), down to ``min_world_size`` (below it, it
          waits for workers up to ``timeout``, as ``heal()`` does);
        * free workers (hosting no rank of any group; its pool's and resources' rules as
          for ``heal()``) are taken, as [`resize`][daskwg.WorkerGroup.resize] grows, up to
          ``max_world_size``.

        Every change runs ``on_membership_change`` on every rank, as ``heal()`` and
        ``resize()`` do, and the call then runs at the new size: a call's batch is split
        over the ranks the group has when the call starts. Plans recorded at another size
        run call by call. The reports are in ``wg.membership_reports``.

        Args:
            follow: ``False`` stops following (the group keeps its size).
            min_world_size: fewest ranks to shrink to (``int`` >= 1).
            max_world_size: most ranks to grow to (``int`` >= 1; ``None``: no bound).
            timeout: seconds a heal or grow waits for workers, ``None``: 120.

        Raises:
            ValueError: a bound is not an int >= 1, or ``max_world_size < min_world_size``.
            GroupBrokenError: the group was shut down.
            WorkerGroupError: the group was attached, not built here.
        """
        follow_pool(self, follow, min_world_size, max_world_size, timeout)

    @property
    def membership_reports(self) -> list[MembershipReport]:
        """What following the pool changed, oldest first (see
        [`follow_pool`][daskwg.WorkerGroup.follow_pool])."""
        following = getattr(self, "_following", None)
        return list(following.reports) if following is not None else []

    def _at_call_boundary(self) -> None:
        if getattr(self, "_following", None) is not None:
            follow_step(self)

    @property
    def spares(self) -> list[str]:
        """Addresses of the workers kept warm for this group (see
        [`keep_spares`][daskwg.WorkerGroup.keep_spares])."""
        return [s.address for s in getattr(self, "_spares", [])]

    def shutdown(self) -> None:
        """Destroy the rank objects on every worker and forget the group. Idempotent.

        Works on a broken group too (surviving ranks are destroyed). Returns within
        about ``daskwg.shutdown-timeout`` seconds (10 s) even when a rank is stuck: a
        rank still busy then (a call that never returns, a frozen process) destroys its
        object when that call ends. Later calls raise [`GroupBrokenError`][daskwg.GroupBrokenError].
        """
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._transport.close()
        if self._client.status != "running":
            # The workers released this driver's ranks when its client left (or, with
            # the scheduler gone, closed themselves).
            return
        self._destroy_ranks()
        records.forget(self._client, self._record_key)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "ready"
        return f"<WorkerGroup {self._name!r} {self._cls.__name__} world_size={self.world_size} {state}>"

    @classmethod
    def attach(cls, client: Client, name: str) -> WorkerGroup:
        """Reattach to a detached group by name, from any client of the cluster (a detached
        group's name holds on the whole cluster; a non-detached one's only in its client).

        Returns:
            a ``WorkerGroup`` on the same ranks (same workers, same objects, same state).

        Raises:
            ValueError: no detached group of that name exists.
            GroupBrokenError: one of its workers has left or restarted since.
        """
        record = records.lookup(client, name)
        if record is None or not record.detached:
            raise ValueError(f"there is no detached group named {name!r} on this cluster")
        self = cls.__new__(cls)
        self._attach_ranks(client, name, record)
        return self

    def _attach_ranks(self, client: Client, name: str, record: records.GroupRecord) -> None:
        """Make ``self``, a group object not built yet, the group on the live ranks ``record``
        describes: :meth:`attach`, and verl's reattaching (``daskwg.verl``), which
        takes groups not built detached too.

        Raises:
            GroupBrokenError: one of its workers has left or restarted since.
        """
        try:
            pool = ResourcePool(client, workers=list(record.workers))
        except ValueError:
            pool = None
        if pool is None or [s.server_id for s in pool.slots] != list(record.server_ids):
            raise GroupBrokenError(
                f"a worker of group {name!r} left or restarted since the group was built; its ranks are gone"
            )
        self._setup(
            client,
            cloudpickle.loads(record.cls),
            name,
            record.group_id,
            pool.slots,
            record.owner,
            detached=record.detached,
        )
        self._master_addr, self._master_port = record.master_addr, record.master_port

    # ---- building and destroying -------------------------------------------------------

    def _publish(self) -> None:
        records.publish(
            self._client,
            self._name,
            records.GroupRecord(
                group_id=self._group_id,
                owner=self._owner,
                detached=self._detached,
                workers=self.workers,
                server_ids=[s.server_id for s in self._slots],
                cls=cloudpickle.dumps(self._cls),
                master_addr=self._master_addr,
                master_port=self._master_port,
                name=self._name,
            ),
        )

    def _destroy_ranks(self) -> None:
        lost = self._transport.driver.health.lost
        alive = [r for r, s in enumerate(self._slots) if s.server_id not in lost]
        # A rank busy with a call (a broken group's straggler, a call abandoned by a deadline
        # or Ctrl-C) destroys its object when that call returns: not waited for, nor are the
        # ranks of a broken group (one may still run the call that broke it).
        busy = {r: self._transport.busy_call(self._slots[r]) for r in alive}
        busy = {r: entry for r, entry in busy.items() if entry is not None}
        later = [r for r in alive if r in busy or self._broken is not None]
        alive = [r for r in alive if r not in later]
        try:
            if busy:
                now = time.monotonic()
                logger.warning(
                    "group %s: %s; their objects are destroyed when those calls end (restart the workers "
                    "to end them now: client.restart_workers(%s))",
                    self._name,
                    "; ".join(f"rank {r} is {entry.describe(now)}" for r, entry in sorted(busy.items())),
                    [self._slots[r].address for r in sorted(busy)],
                )
            if later:
                # Queued behind the busy calls; their futures may go: the calls run all the
                # same (a direct call's result is dropped when it comes; a task is kept).
                futures = self._send("__del__", later, [((), {})] * len(later), blocking=False, check=False)
                tasks = [f for f in futures if not isinstance(f, CallFuture)]
                if tasks:
                    fire_and_forget(tasks)
            if alive:
                with shielded(Settings.current().shutdown_timeout):
                    self._send(
                        "__del__", alive, [((), {})] * len(alive), blocking=True, check=False, settle=0.0
                    )
        except CallTimeoutError as exc:
            logger.warning(
                "group %s: shutdown did not wait for every rank; busy ranks destroy their objects when their "
                "calls end: %s",
                self._name,
                exc,
            )
        except WorkerGroupError as exc:
            logger.warning("group %s: could not destroy every rank: %s", self._name, exc)
        except Exception as exc:  # noqa: BLE001 - shutting down must not raise on a dying cluster
            logger.warning("group %s: shutdown failed: %s", self._name, exc)

    # ---- calling (see daskwg.groups.binding) ----------------------------------------------------

    def _check_usable(self, method_name: str) -> None:
        if self._closed:
            raise GroupBrokenError(
                f"group {self._name!r} was shut down; build a new one to call {method_name!r}"
            )
        if self._client.status not in ("running", "connecting"):
            raise GroupBrokenError(
                f"the client of group {self._name!r} is {self._client.status}: the workers released its ranks "
                "when it disconnected; connect a new client and build a new group"
            )
        self._transport.settle()
        if self._broken is not None:
            raise fresh_error(self._broken)

    def _deliver(self, method_name: str, ranks: list[int], payloads: list, **options: Any) -> list:
        return self._transport.send(method_name, ranks, payloads, **options)

    def _gather(self, futures: list, method_name: str) -> list:
        return self._transport.gather(futures, method_name)

    def _gather_any(self, futures: list) -> list:
        return self._transport.gather_any(futures)


def _verl_env(group: WorkerGroup, local_world_size: int, local_rank: int) -> dict[str, str]:
    """The variables verl's ``RayWorkerGroup`` sets on a rank (``WG_PREFIX``, ...), for groups
    with a ``_verl_prefix`` or whose class (or a colocated role) comes from verl;
    ``worker_env`` may override them on a :class:`WorkerGroup`."""
    prefix = group._verl_prefix
    if prefix is None:
        classes = [group._cls, *(group._role_classes or {}).values()]
        if not any(foreign.is_verl_class(c) for c in classes):
            return {}
        prefix = group._name
    return foreign.verl_rank_env(prefix, local_world_size, local_rank)


def _release_dropped_group(transports: list, metadata_key: list) -> None:
    """The finaliser of a non-detached group garbage-collected without ``shutdown()``."""
    for transport in transports:
        transport.release_dropped(metadata_key)


def _check_options(
    worker_env: Mapping[str, str] | None, master_port: int | None, name: str | None, detached: bool
) -> dict[str, str]:
    """``worker_env`` as a dict, after checking the group's options (in the driver, before
    anything is sent).

    Raises:
        TypeError: ``worker_env`` is not a ``str -> str`` mapping.
        ValueError: ``worker_env`` sets a rank variable, ``master_port`` is not in 1..65535,
            ``name`` is empty or has a ``/``, or a detached group has no name.
    """
    if master_port is not None and (
        isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536
    ):
        raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
        raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
    if detached and name is None:
        raise ValueError("a detached group needs a name= to be attached to later")
    if worker_env is None:
        return {}
    if not isinstance(worker_env, Mapping):
        raise TypeError(f"worker_env must be a dict of str to str, got {type(worker_env).__name__}")
    for key, value in worker_env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"worker_env must map str to str; {key!r}: {value!r} is not")
        if key in RANK_ENV_KEYS:
            raise ValueError(
                f"worker_env may not set {key}: daskwg sets {', '.join(RANK_ENV_KEYS)} for every rank"
            )
    return dict(worker_env)


def _check_init_arguments(cls_with_init: ClassWithInitArgs) -> None:
    """Refuse, before any worker is asked, init arguments the class's ``__init__`` does not
    take (a misspelt keyword, one too many), as building it on the ranks would.

    Raises:
        TypeError: the class cannot be built with them.
    """
    cls = cls_with_init.cls
    signature = method_signature(cls, "__init__")
    if signature is None:
        return
    try:
        signature.bind(None, *cls_with_init.args, **cls_with_init.kwargs)
    except TypeError as exc:
        params = list(signature.parameters.values())[1:]
        raise TypeError(
            f"{cls.__name__}({', '.join(str(p) for p in params)}) cannot be built with the given init "
            f"arguments ({exc}); no rank was built. Check ClassWithInitArgs({cls.__name__}, ...)"
        ) from None
