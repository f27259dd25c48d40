"""The driver side: :class:`WorkerGroup` and :class:`ClassWithInitArgs`.

A call on a group goes dispatch (``decorator``: split the arguments per rank) → send
(this module: one call per rank, pinned to the rank's Dask worker) → host (``plugin``:
the ordered thread on the worker runs the user's method) → collect (``decorator``:
merge the per-rank results).

Two ways to send, one order: every call gets, per worker, the next sequence number of
this driver, and the worker runs calls strictly in that order whichever way they came.

* Blocking calls whose arguments are all in the driver go straight to the hosting
  workers over Dask's comm (the ``daskwg_call`` handler), like Dask actors: one
  round trip, no scheduler hop.
* Non-blocking calls, and calls that take a ``DataProtoFuture``, are Dask tasks
  (``client.submit`` pinned with ``workers=[address]``, ``allow_other_workers=False``,
  ``pure=False``, no retries), named ``"<group>.<method>-<call>-r<rank>-<id>"`` on the
  dashboard. Their results stay on the workers as Dask futures, and futures passed to
  the next call move worker to worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import logging
import pickle
import re
import threading
import time
import traceback
import uuid
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import cloudpickle
import dask.config
from distributed import Client, Future, fire_and_forget
from distributed import wait as dask_wait
from distributed.client import FuturesCancelledError
from distributed.comm.core import CommClosedError
from distributed.core import ConnectionPool
from distributed.diagnostics.plugin import SchedulerPlugin

from . import config as _config  # noqa: F401  (loads daskwg's dask.config defaults)
from . import serialization  # also installs the tensor serializer in the driver
from .decorator import (
    PADDING_SIZE_KEY,
    Execute,
    RankOutputs,
    get_predefined_dispatch_fn,
    get_registered_method,
)
from .errors import DispatchError, GroupBrokenError, RankError, WorkerGroupError, WorkerLostError
from .futures import DataProtoFuture
from .plugin import PLUGIN_NAME, RANK_ENV_KEYS, Call, HostPlugin, LazyArg, run_call
from .pool import ResourcePool

__all__ = ["WorkerGroup", "ClassWithInitArgs"]

logger = logging.getLogger(__name__)

_METADATA_ROOT = "daskwg-groups"
_KEY_RANK = re.compile(r"-r(\d+)-[0-9a-f]{8}$")


class ClassWithInitArgs:
    """The class a group instantiates on every rank, with its constructor arguments.

    Args:
        cls: the user's Worker subclass (any class works; subclass :class:`daskwg.Worker`
            to get the rank environment as attributes).
        *args, **kwargs: passed to ``cls(*args, **kwargs)`` on every rank. They are
            pickled (cloudpickle) once per rank.

    Mirrors verl's ``verl.single_controller.base.worker_group.ClassWithInitArgs``.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a class, got {type(cls).__name__}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        """Instantiate ``cls(*args, **kwargs)``."""
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__qualname__})"


class _Driver:
    """Per-client driver state shared by all groups of one ``Client``.

    Holds the sequence counter per worker (one lock, so that calls from several
    threads and groups get the same relative order on every worker) and the
    subscriptions to the scheduler's per-worker event topics, through which groups
    learn that a worker was removed.
    """

    _registry: dict[str, _Driver] = {}
    _registry_lock = threading.Lock()

    def __init__(self, client: Client):
        self.client = client
        self.session = client.id
        self.lock = threading.Lock()
        # Sequence numbers, lost marks and busy ranks are keyed by the worker process's
        # id (``WorkerSlot.server_id``), not its address: a Nanny restarts a worker under
        # the same name and, with a fixed port, the same address, and its fresh plugin
        # counts from 0 again.
        self.next_seq: dict[str, int] = defaultdict(int)
        self.groups: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()
        self.watched: set[str] = set()
        self.server_ids: dict[str, set[str]] = defaultdict(set)
        self.lost: dict[str, str] = {}
        self.paused: dict[str, float] = {}
        self.stuck: dict[str, tuple[str, str, Any]] = {}
        self.inflight: dict[str, weakref.WeakSet[Future]] = defaultdict(weakref.WeakSet)
        self.plugins_ready = False
        self.call_numbers = itertools.count()
        self.local = threading.local()

    @classmethod
    def of(cls, client: Client) -> _Driver:
        with cls._registry_lock:
            driver = cls._registry.get(client.id)
            if driver is None or driver.client is not client:
                driver = cls._registry[client.id] = cls(client)
            return driver

    def ensure_plugins(self) -> None:
        if self.plugins_ready:
            return
        self.client.register_plugin(HostPlugin(), name=PLUGIN_NAME)
        try:
            self.client.register_plugin(_ReleaseOnClientExit(), name="daskwg-release")
        except Exception as exc:  # noqa: BLE001 - the scheduler may not have daskwg installed
            logger.warning(
                "could not install daskwg's scheduler plugin (%s): groups of a driver that "
                "exits without shutdown() stay on the workers until they restart",
                exc,
            )
        self.plugins_ready = True

    def channel(self) -> _Channel | None:
        """The calling thread's :class:`_Channel`, or ``None`` where the thread already
        runs an event loop (e.g. Jupyter) and must go through ``client.sync``."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return None
        channel = getattr(self.local, "channel", None)
        if channel is None:
            channel = self.local.channel = _Channel(self.client.connection_args)
        return channel

    def take_seqs(self, server_ids: Sequence[str]) -> list[int]:
        with self.lock:
            seqs = []
            for sid in server_ids:
                seqs.append(self.next_seq[sid])
                self.next_seq[sid] += 1
            return seqs

    def watch(self, slots: Sequence[Any]) -> None:
        for slot in slots:
            self.server_ids[slot.address].add(slot.server_id)
            if slot.address not in self.watched:
                self.watched.add(slot.address)
                self.client.subscribe_topic(
                    slot.address, functools.partial(self._on_worker_event, slot.address)
                )

    def _on_worker_event(self, address: str, event: tuple) -> None:
        _, msg = event
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "remove-worker":
            reason = msg.get("stimulus_id", "")
            orphans = []
            for sid in self.server_ids.pop(address, ()):
                self.lost[sid] = reason
                orphans += [f for f in self.inflight.pop(sid, ()) if not f.done()]
            if orphans:
                # A task pinned to a worker that is gone would wait forever ("no-worker"
                # state) in a plain future.result(): cancel it, saying why.
                asyncio.ensure_future(
                    self.client._cancel(
                        orphans,
                        reason="worker-lost",
                        msg=f"WorkerLostError: the worker {address} was lost ({reason})",
                    )
                )
            self.paused.pop(address, None)
            for group in list(self.groups):
                group._worker_lost(address, reason)
        elif msg.get("action") == "worker-status-change":
            # Paused workers (memory above distributed.worker.memory.pause) start no
            # tasks, so calls on the task path wait; _gather says so instead of waiting
            # silently. Handlers (the direct path) still run while paused.
            if msg.get("status") == "paused":
                self.paused.setdefault(address, time.monotonic())
            else:
                self.paused.pop(address, None)

    def check_not_stuck(self, slots: Sequence[Any], what: str) -> None:
        """Refuse to queue work behind a rank stuck in a call of a broken group.

        The worker runs calls one at a time, so anything sent there would wait until
        the stuck call returns (for a collective: its timeout, 30 min by default for
        gloo), which is a hang as far as the user can tell.
        """
        for slot in slots:
            entry = self.stuck.get(slot.server_id)
            if entry is None:
                continue
            group_name, method, future = entry
            if future.done():
                self.stuck.pop(slot.server_id, None)
                continue
            raise GroupBrokenError(
                f"cannot run {what} on {slot.address}: its host thread is still stuck in {method!r} of the "
                f"broken group {group_name!r} (a rank failed while this one waited, e.g. in a collective), "
                "and calls run one at a time there. Restart the workers (client.restart()), or let the "
                "collective time out (pass a short timeout= to init_process_group) and retry"
            )


class _Channel:
    """A private event loop and Dask ``ConnectionPool`` owned by one driver thread.

    Blocking direct calls run this loop in the calling thread itself
    (``loop.run_until_complete``) instead of handing the work to the client's loop
    thread and waiting for it (``client.sync``): two thread switches less per call,
    which is most of a small call's cost on a busy machine. Comms are Dask's own,
    with the client's connection arguments (TLS included).
    """

    def __init__(self, connection_args: dict):
        self.loop = asyncio.new_event_loop()
        self.pool = ConnectionPool(limit=256, connection_args=connection_args)
        self.loop.run_until_complete(self.pool.start())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(self._fresh(coro))

    @staticmethod
    async def _fresh(coro: Any) -> Any:
        # The loop sat idle since the last call: let it first see the connections that
        # closed meanwhile (a worker that died or restarted), so the pool does not hand
        # one of them out again.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return await coro

    def __del__(self) -> None:
        # The thread that owned this channel ended (its threading.local went away):
        # close its connections now rather than leave "dangling stream" warnings.
        try:
            for comms in (*self.pool.available.values(), *self.pool.occupied.values()):
                for comm in list(comms):
                    comm.abort()
            self.loop.close()
        except Exception:  # noqa: BLE001 - best effort at garbage collection
            pass


class _CallWatch:
    """Tells when one call on one worker has finished, by polling the worker's
    ``daskwg_progress`` from the client's event loop. ``done()`` like a future."""

    def __init__(self, driver: _Driver, address: str, seq: int, interval: float = 0.1):
        self._event = threading.Event()
        driver.client.loop.add_callback(self._poll, driver, address, seq, interval)

    def done(self) -> bool:
        return self._event.is_set()

    async def _poll(self, driver: _Driver, address: str, seq: int, interval: float) -> None:
        try:
            while await driver.client.rpc(address).daskwg_progress(session=driver.session) < seq:
                await asyncio.sleep(interval)
                interval = min(interval * 1.5, 2.0)  # a stuck collective may take minutes
        except Exception:  # noqa: BLE001 - a worker that is gone runs nothing any more
            pass
        self._event.set()


class _ReleaseOnClientExit(SchedulerPlugin):
    """Scheduler plugin: when a driver's client leaves, tell every worker to destroy
    that driver's non-detached ranks, so a new driver can use the workers at once."""

    name = "daskwg-release"
    idempotent = True

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def remove_client(self, scheduler, client: str) -> None:
        if client.startswith("fire-and-forget") or not scheduler.workers:
            return
        asyncio.ensure_future(
            scheduler.broadcast(msg={"op": "daskwg_release", "client": client}, on_error="ignore")
        )


class WorkerGroup:
    """A set of ranks, each an instance of the user's class in one Dask worker.

    Args:
        client: a connected ``distributed.Client`` (synchronous).
        cls_or_cls_with_init: the Worker class, or a :class:`ClassWithInitArgs`.
        world_size: number of ranks (``None``: every worker of the cluster or pool).
        workers: a :class:`ResourcePool` or worker addresses/names to use.
        resources: Dask worker resources each chosen worker must offer.
        name: the group's name (dashboard keys, attach); default ``<Class>-<id>``.
        worker_env: extra environment variables (``str -> str``) for every rank.
        master_port: the ``MASTER_PORT`` to use (else one is reserved on rank 0's host).
        detached: keep the group alive after this client closes; reattach with
            :meth:`attach`. Needs ``name``.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``worker_env`` sets a rank variable; a duplicate group name.
        WorldSizeError: more ranks than matching workers.
        OSError: ``master_port`` is in use on rank 0's host.
        RankError: the class's ``__init__`` raised on a rank (nothing is left on the
            other ranks).

    Every method of the class marked with :func:`daskwg.register` becomes an attribute
    of the group that dispatches, executes and collects as its mode says. Mirrors
    verl's ``RayWorkerGroup``.
    """

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
            raise TypeError("WorkerGroup needs a synchronous Client (asynchronous=False)")
        cls_with_init = (
            cls_or_cls_with_init
            if isinstance(cls_or_cls_with_init, ClassWithInitArgs)
            else ClassWithInitArgs(cls_or_cls_with_init)
        )
        env = _check_worker_env(worker_env)
        if master_port is not None and (
            isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536
        ):
            raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        if detached and name is None:
            raise ValueError("a detached group needs a name= to be attached to later")

        if isinstance(workers, ResourcePool):
            pool = workers
            if world_size is not None and world_size != pool.world_size:
                pool = ResourcePool(client, world_size=world_size, workers=pool.workers)
        else:
            pool = ResourcePool(
                client,
                world_size=world_size,
                workers=workers,
                resources=dict(resources) if resources else None,
            )

        self._client = client
        self._driver = _Driver.of(client)
        self._cls = cls_with_init.cls
        from .colocate import role_classes_of

        self._role_classes = role_classes_of(cls_with_init)
        self._group_id = uuid.uuid4().hex
        self._name = name or f"{self._cls.__name__}-{self._group_id[:8]}"
        self._slots = pool.slots
        self._owner = client.id
        self._detached = detached
        self._closed = False
        self._broken: WorkerGroupError | None = None
        self._unsettled: tuple[float, str, int, list] | None = None
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._methods = self._bind_registered_methods()
        self._driver.ensure_plugins()
        self._check_name_free()
        self._driver.groups.add(self)
        self._driver.watch(self._slots)

        self._master_addr = self._slots[0].host
        self._master_port = self._reserve_port(master_port)
        hosts = [s.host for s in self._slots]
        envs = []
        for rank, host in enumerate(hosts):
            envs.append(
                {
                    **env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.world_size),
                    "LOCAL_RANK": str(hosts[:rank].count(host)),
                    "LOCAL_WORLD_SIZE": str(hosts.count(host)),
                    "MASTER_ADDR": self._master_addr,
                    "MASTER_PORT": str(self._master_port),
                }
            )
        payloads = [
            {"cls": cls_with_init, "env": e, "detached": detached, "world_size": self.world_size}
            for e in envs
        ]
        ranks = list(range(self.world_size))
        try:
            self._send(
                "__init__",
                ranks,
                payloads,
                blocking=True,
                raw_payload=True,
                settle=self._init_settle_seconds(),
            )
        except BaseException:
            self._destroy_ranks()
            self._driver.groups.discard(self)
            self._closed = True
            raise
        self._publish()

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
        """The group's name (used in task keys and by :meth:`attach`)."""
        return self._name

    @property
    def master_addr_port(self) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` every rank sees."""
        return self._master_addr, self._master_port

    @property
    def method_names(self) -> list[str]:
        """Names of the registered methods bound on this group."""
        return sorted(self._methods)

    @property
    def is_broken(self) -> bool:
        """Whether a worker was lost or ranks fell out of step (later calls raise)."""
        self._settle()
        return self._broken is not None

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method_name`` on every rank and wait; returns the per-rank results.

        An argument that is a list of exactly ``world_size`` items (all arguments
        being such lists) is split one item per rank; otherwise every rank gets every
        argument, as verl's ``execute_all_async`` does.
        """
        return self._execute_all(method_name, args, kwargs, blocking=True)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Future]:
        """As :meth:`execute_all_sync` but returns one ``distributed.Future`` per rank."""
        return self._execute_all(method_name, args, kwargs, blocking=False)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Future]:
        """Alias of :meth:`execute_all_async`, as in verl."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` on rank 0 only and return its result."""
        return self._send(method_name, [0], [(args, kwargs)], blocking=True)[0]

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``method_name`` on rank 0 only; returns its ``distributed.Future``."""
        return self._send(method_name, [0], [(args, kwargs)], blocking=False)[0]

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Future:
        """Alias of :meth:`execute_rank_zero_async`, as in verl."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
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
        from .colocate import spawn_role_groups

        return spawn_role_groups(self, prefix_set)

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """Set every role group of :meth:`spawn` as an attribute: ``wg.actor.add(data)``
        (verl's ``RayWorkerGroup.fuse``).

        Raises:
            ValueError: a role name clashes with an attribute of the group.
            TypeError, ValueError: as :meth:`spawn`.
        """
        role_groups = self.spawn(prefix_set)
        for role in role_groups:
            if role in self._methods or hasattr(type(self), role) or role in _RESERVED:
                raise ValueError(
                    f"role {role!r} clashes with the attribute {role!r} of the group; rename the role"
                )
        for role, role_group in role_groups.items():
            setattr(self, role, role_group)

    def shutdown(self) -> None:
        """Destroy the rank objects on every worker and forget the group. Idempotent.

        Works on a broken group too (surviving ranks are destroyed). Later calls
        raise :class:`GroupBrokenError`.
        """
        if self._closed:
            return
        self._closed = True
        self._driver.groups.discard(self)
        if self._client.status not in ("running", "connecting"):
            # The workers released this driver's ranks when its client left.
            return
        self._destroy_ranks()
        try:
            self._client.set_metadata([_METADATA_ROOT, self._name], None)
        except Exception:  # noqa: BLE001 - the scheduler may be gone already
            pass

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "ready"
        return f"<WorkerGroup {self._name!r} {self._cls.__name__} world_size={self.world_size} {state}>"

    def __getattr__(self, item: str) -> Any:
        # Only reached for names that are not attributes: unknown methods.
        if item.startswith("__") or item in ("_methods", "_cls"):
            raise AttributeError(item)
        methods = self.__dict__.get("_methods", {})
        cls = self.__dict__.get("_cls")
        cls_name = cls.__name__ if cls is not None else "the worker class"
        hint = (
            f"{cls_name}.{item} exists but is not decorated with @register"
            if cls is not None and hasattr(cls, item)
            else f"{cls_name} has no method {item!r}"
        )
        raise AttributeError(
            f"WorkerGroup has no attribute {item!r}: {hint}; registered methods: {sorted(methods)}"
        )

    @classmethod
    def attach(cls, client: Client, name: str) -> WorkerGroup:
        """Reattach to a detached group by name, from any client of the cluster.

        Returns:
            a ``WorkerGroup`` on the same ranks (same workers, same objects, same state).
        Raises:
            ValueError: no detached group of that name exists.
            GroupBrokenError: one of its workers has left or restarted since.
        """
        record = client.get_metadata([_METADATA_ROOT, name], default=None)
        if not record or not record.get("detached"):
            raise ValueError(f"there is no detached group named {name!r} on this cluster")
        self = cls.__new__(cls)
        try:
            pool = ResourcePool(client, workers=list(record["workers"]))
        except ValueError:
            pool = None
        if pool is None or [s.server_id for s in pool.slots] != list(record["server_ids"]):
            raise GroupBrokenError(
                f"a worker of group {name!r} left or restarted since the group was built; its ranks are gone"
            )
        self._client = client
        self._driver = _Driver.of(client)
        self._cls = pickle.loads(record["cls"])
        self._role_classes = None
        self._group_id = record["group_id"]
        self._name = name
        self._slots = pool.slots
        self._owner = record["owner"]
        self._detached = True
        self._closed = False
        self._broken = None
        self._unsettled = None
        self._dispatch_info = {}
        self._collect_info = {}
        self._master_addr, self._master_port = record["master_addr"], record["master_port"]
        self._methods = self._bind_registered_methods()
        self._driver.ensure_plugins()
        self._driver.groups.add(self)
        self._driver.watch(self._slots)
        return self

    # ---- building ----------------------------------------------------------------------

    def _bind_registered_methods(self) -> dict[str, Any]:
        methods = {}
        for attr_name, attr in inspect.getmembers(self._cls):
            registered = get_registered_method(attr)
            if registered is None:
                continue
            if attr_name in WorkerGroup.__dict__ or attr_name in _RESERVED:
                raise ValueError(
                    f"{self._cls.__name__}.{attr_name} is registered but clashes with the WorkerGroup "
                    "attribute of that name; rename the method"
                )
            bound = functools.partial(self._call_registered, attr_name, registered)
            functools.update_wrapper(bound, attr)
            setattr(self, attr_name, bound)
            methods[attr_name] = registered
        return methods

    def _check_name_free(self) -> None:
        record = self._client.get_metadata([_METADATA_ROOT, self._name], default=None)
        if not record:
            return
        # A non-detached group of another driver counts while that driver is connected;
        # the record of one that left without shutdown() is stale.
        taken = record.get("detached") or record.get("owner") == self._owner
        if not taken:
            taken = record.get("owner") in self._client.run_on_scheduler(_connected_clients)
        if taken:
            raise ValueError(
                f"a worker group named {self._name!r} already exists on this cluster; "
                "pick another name, shut it down, or WorkerGroup.attach() to it"
            )

    def _publish(self) -> None:
        self._client.set_metadata(
            [_METADATA_ROOT, self._name],
            {
                "group_id": self._group_id,
                "owner": self._owner,
                "detached": self._detached,
                "workers": self.workers,
                "server_ids": [s.server_id for s in self._slots],
                "cls": cloudpickle.dumps(self._cls),
                "master_addr": self._master_addr,
                "master_port": self._master_port,
            },
        )

    def _reserve_port(self, port: int | None) -> int:
        return self._client.sync(self._reserve_port_async, port)

    async def _reserve_port_async(self, port: int | None) -> int:
        addr = self._slots[0].address
        try:
            return await self._client.rpc(addr).daskwg_reserve_port(port=port)
        except OSError as exc:
            raise OSError(str(exc)) from None

    def _init_settle_seconds(self) -> float:
        return float(dask.config.get("daskwg.rank-failure-grace"))

    def _destroy_ranks(self) -> None:
        alive = [r for r, s in enumerate(self._slots) if s.server_id not in self._driver.lost]
        # A rank stuck in a call of this (broken) group destroys its object only when
        # that call returns; waiting for it here could take until a collective's timeout.
        # So does every rank of a broken group: one may still be running the call
        # that broke it (the other ranks of a lost worker's call, say).
        stuck = [r for r in alive if self._broken is not None or self._is_stuck(self._slots[r])]
        alive = [r for r in alive if r not in stuck]
        try:
            if stuck:
                logger.warning(
                    "group %s: rank(s) %s are still stuck in a call; their objects are destroyed when it "
                    "returns (restart the workers to free them now: client.restart())",
                    self._name,
                    stuck,
                )
                fire_and_forget(
                    self._send("__del__", stuck, [((), {})] * len(stuck), blocking=False, check=False)
                )
            if alive:
                self._send("__del__", alive, [((), {})] * len(alive), blocking=True, check=False, settle=0.0)
        except WorkerGroupError as exc:
            logger.warning("group %s: could not destroy every rank: %s", self._name, exc)
        except Exception as exc:  # noqa: BLE001 - shutting down must not raise on a dying cluster
            logger.warning("group %s: shutdown failed: %s", self._name, exc)

    # ---- calling -----------------------------------------------------------------------

    def _call_registered(self, method_name: str, registered: Any, *args: Any, **kwargs: Any) -> Any:
        fns = get_predefined_dispatch_fn(registered.dispatch_mode)
        self._check_usable(method_name)
        try:
            d_args, d_kwargs = fns["dispatch_fn"](self, *args, **kwargs)
        except DispatchError:
            raise
        except (TypeError, ValueError, IndexError) as exc:
            raise DispatchError(f"{self._name}.{method_name}: {exc}") from exc
        d_kwargs = dict(d_kwargs)
        pad_size = d_kwargs.pop(PADDING_SIZE_KEY, 0) or 0
        for i, value in enumerate(d_args):
            _check_per_rank(value, self.world_size, f"{self._name}.{method_name}: positional argument {i}")
        for key, value in d_kwargs.items():
            _check_per_rank(value, self.world_size, f"{self._name}.{method_name}: argument {key!r}")

        rank_zero_only = registered.execute_mode == Execute.RANK_ZERO
        ranks = [0] if rank_zero_only else list(range(self.world_size))
        payloads = [(tuple(a[r] for a in d_args), {k: v[r] for k, v in d_kwargs.items()}) for r in ranks]
        outputs = self._send(method_name, ranks, payloads, blocking=registered.blocking)
        from .protocol import DataProto

        if outputs and all(isinstance(out, DataProto) for out in outputs):
            # The group lets go of the parts, so concatenation can free each one as it goes.
            outputs = RankOutputs(outputs)
        if rank_zero_only:
            return outputs[0]
        result = fns["collect_fn"](self, outputs)
        if result is outputs:
            result = list(result)
        if isinstance(result, DataProtoFuture):
            result = dataclasses.replace(result, gather=self._gather_any)
        if pad_size:
            if isinstance(result, DataProtoFuture):
                result = result.unpad(pad_size)
            else:
                from .protocol import DataProto, unpad_dataproto

                if isinstance(result, DataProto):
                    result = unpad_dataproto(result, pad_size)
                else:  # a TensorDict
                    result = result[: len(result) - pad_size]
        return result

    def _execute_all(self, method_name: str, args: tuple, kwargs: dict, *, blocking: bool) -> list:
        n = self.world_size
        values = list(args) + list(kwargs.values())
        split = bool(values) and all(isinstance(v, list) and len(v) == n for v in values)
        if split:
            payloads = [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]
        else:
            payloads = [(args, kwargs)] * n
        return self._send(method_name, list(range(n)), payloads, blocking=blocking)

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
        self._settle()
        if self._broken is not None:
            raise self._broken

    def _settle(self) -> None:
        """Decide whether an earlier failed call left ranks out of step.

        After a rank raised, the other ranks of that call get a grace period
        (``daskwg.rank-failure-grace`` seconds) to finish; ranks still running after
        it are stuck (typically in a collective waiting for the failed rank), so the
        group is broken.
        """
        if self._unsettled is None or self._broken is not None:
            return
        deadline, method, failed_rank, pending = self._unsettled
        while time.monotonic() < deadline and not all(p.done() for _, p in pending):
            time.sleep(0.02)
        self._unsettled = None
        stuck = self._mark_stuck(method, pending)
        if stuck:
            self._broken = GroupBrokenError(
                f"group {self._name!r} is broken: rank {failed_rank} failed in {method!r} while other ranks "
                "were still running it (e.g. waiting in a collective); shut the group down and build a new "
                "one (restart the workers if their threads stay stuck: client.restart())"
            )

    def _mark_stuck(self, method: str, pending: list) -> list:
        """Record ``(rank, future)`` pairs still running a failed call on the driver, so
        that nothing is queued behind them (:meth:`_Driver.check_not_stuck`)."""
        stuck = [(rank, p) for rank, p in pending if not p.done()]
        for rank, p in stuck:
            self._driver.stuck[self._slots[rank].server_id] = (self._name, method, p)
        return stuck

    def _is_stuck(self, slot: Any) -> bool:
        entry = self._driver.stuck.get(slot.server_id)
        return entry is not None and not entry[2].done()

    def _worker_lost(self, address: str, reason: str) -> None:
        for rank, slot in enumerate(self._slots):
            if slot.address == address and slot.server_id in self._driver.lost and self._broken is None:
                self._broken = WorkerLostError(rank, address, reason)

    def _raise_if_lost(self, ranks: Sequence[int]) -> None:
        if isinstance(self._broken, WorkerLostError):
            raise self._broken
        for rank in ranks:
            slot = self._slots[rank]
            if slot.server_id in self._driver.lost:
                self._broken = WorkerLostError(rank, slot.address, self._driver.lost[slot.server_id])
                raise self._broken

    def _send(
        self,
        method_name: str,
        ranks: list[int],
        payloads: list,
        *,
        blocking: bool,
        raw_payload: bool = False,
        check: bool = True,
        settle: float | None = None,
    ) -> list:
        """Send one call to each of ``ranks``; values if blocking, else Dask futures."""
        if check:
            self._check_usable(method_name)
            if method_name not in self._methods and not hasattr(self._cls, method_name):
                raise AttributeError(
                    f"{self._cls.__name__} has no method {method_name!r}; registered methods: "
                    f"{sorted(self._methods)}"
                )
        lazies: list[list[list]] = [[] for _ in ranks]
        if not raw_payload:
            payloads = [_extract_lazies(p, lz) for p, lz in zip(payloads, lazies)]
        slots = [self._slots[r] for r in ranks]
        if check:
            # A lost worker fails at once (no connection attempt, no task that never
            # runs), and nothing is queued behind a rank stuck in a broken group's call.
            self._raise_if_lost(ranks)
            self._driver.check_not_stuck(slots, f"{self._name}.{method_name}")
        seqs = self._driver.take_seqs([s.server_id for s in slots])
        calls = [
            Call(
                session=self._driver.session,
                seq=seq,
                group_id=self._group_id,
                group_name=self._name,
                rank=rank,
                method=method_name,
                owner=self._owner,
                worker_id=slot.server_id,
            )
            for rank, seq, slot in zip(ranks, seqs, slots)
        ]
        grace = float(dask.config.get("daskwg.rank-failure-grace")) if settle is None else settle
        if blocking and not any(lazies):
            channel = self._driver.channel()
            if channel is None:
                return self._client.sync(self._send_direct, self._client.rpc, calls, payloads, grace, False)
            return channel.run(self._send_direct(channel.pool, calls, payloads, grace, True))
        futures = self._submit(calls, payloads, lazies)
        if blocking:
            return self._gather(futures, method_name, grace)
        return futures

    async def _send_direct(
        self, pool: Any, calls: list[Call], payloads: list, grace: float, private: bool
    ) -> list:
        """Send ``calls`` straight to the hosting workers' ``daskwg_call`` handler and wait.

        ``pool`` is a Dask ``ConnectionPool``: the client's (on the client's event loop)
        or the calling thread's own (:class:`_Channel`), which saves the two thread
        hops of ``client.sync`` on every call.
        """

        async def one(call: Call, payload: Any) -> Any:
            address = self._slots[call.rank].address
            try:
                response = await pool(address).daskwg_call(
                    call=dataclasses.astuple(call), payload=serialization.pack(payload)
                )
            except (CommClosedError, OSError) as exc:
                sid = self._slots[call.rank].server_id
                reason = self._driver.lost.setdefault(sid, f"connection lost: {exc}")
                self._worker_lost(address, reason)
                raise self._broken or WorkerLostError(call.rank, address, str(exc)) from None
            except _TRANSFER_ERRORS as exc:
                # The arguments could not be unpickled on the worker, or the result here:
                # name the call instead of a bare Dask protocol error. If the call never
                # reached the host, its place in the order must be given up, or every
                # later call to this worker would wait behind it (skip is a no-op if it ran).
                try:
                    await pool(address).daskwg_skip(session=call.session, seqs=[call.seq])
                except Exception:  # noqa: BLE001 - the worker may be gone; nothing waits then
                    pass
                raise _transfer_error(call.rank, address, call.method, exc) from None
            if response.get("status") != "OK":
                raise response["exception"]
            try:
                return serialization.unpack(response["result"])
            except _TRANSFER_ERRORS as exc:
                raise _transfer_error(call.rank, address, call.method, exc) from None

        tasks = [asyncio.ensure_future(one(c, p)) for c, p in zip(calls, payloads)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            first = failed[0]
            pending_calls = [(c, t) for c, t in zip(calls, tasks) if not t.done()]
            pending = [(c.rank, t) for c, t in pending_calls]
            for _, t in pending_calls:
                t.add_done_callback(_consume_exception)
            if private:
                # The private loop only runs while its thread is in a call, so its
                # tasks cannot tell when these ranks finish: ask their workers instead.
                # The tasks stay on that loop and finish whenever it runs again (their
                # error handling must still run: e.g. giving up an undelivered call's place).
                pending = [
                    (c.rank, _CallWatch(self._driver, self._slots[c.rank].address, c.seq))
                    for c, _ in pending_calls
                ]
            exc = first.exception()
            if pending and isinstance(exc, RankError):
                self._unsettled = (time.monotonic() + grace, calls[0].method, exc.rank, pending)
            elif pending and isinstance(exc, WorkerLostError):
                self._mark_stuck(calls[0].method, pending)
            raise exc
        return [t.result() for t in tasks]

    def _submit(self, calls: list[Call], payloads: list, lazies: list[list[list]]) -> list[Future]:
        call_no = next(self._driver.call_numbers)
        futures = []
        try:
            for call, payload, call_lazies in zip(calls, payloads, lazies):
                address = self._slots[call.rank].address
                key = f"{self._name}.{call.method}-{call_no}-r{call.rank}-{self._group_id[:8]}"
                future = self._client.submit(
                    run_call,
                    call,
                    payload,
                    call_lazies or None,
                    key=key,
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                    retries=0,
                )
                future.add_done_callback(functools.partial(self._skip_if_not_run, address, call.seq))
                self._driver.inflight[self._slots[call.rank].server_id].add(future)
                futures.append(future)
        except BaseException:
            # Calls that were never submitted must not hold up later ones on their workers.
            for call in calls[len(futures) :]:
                self._client.loop.add_callback(self._send_skip, self._slots[call.rank].address, [call.seq])
            raise
        return futures

    def _skip_if_not_run(self, address: str, seq: int, future: Future) -> None:
        status = future.status
        if status == "finished":
            return
        if status == "error":
            try:
                exc = future.exception(timeout=5)
            except Exception:  # noqa: BLE001
                exc = None
            if isinstance(exc, RankError):
                return  # it ran (and raised) on its rank: its place in the order is used
        self._client.loop.add_callback(self._send_skip, address, [seq])

    async def _send_skip(self, address: str, seqs: list[int]) -> None:
        try:
            await self._client.rpc(address).daskwg_skip(session=self._driver.session, seqs=seqs)
        except Exception:  # noqa: BLE001 - the worker may be gone; nothing waits on it then
            pass

    def _gather(self, futures: list[Future], method_name: str, grace: float | None = None) -> list:
        """Wait for per-rank futures; the first failure raises at once. Never waits on a
        lost worker: its rank raises ``WorkerLostError`` within the poll interval."""
        ranks = [_rank_of(f) for f in futures]
        poll = float(dask.config.get("daskwg.poll-interval"))
        warned: set[str] = set()
        while True:
            failed = [f for f in futures if f.status in ("error", "cancelled")]
            pending = [f for f in futures if not f.done()]
            if failed:
                exc = self._future_error(failed[0], method_name)
                if pending and isinstance(exc, RankError):
                    wait_s = float(dask.config.get("daskwg.rank-failure-grace")) if grace is None else grace
                    pending_ranks = [(r, f) for r, f in zip(ranks, futures) if not f.done()]
                    self._unsettled = (time.monotonic() + wait_s, method_name, exc.rank, pending_ranks)
                raise exc
            if not pending:
                try:
                    return self._client.gather(futures)
                except _TRANSFER_ERRORS as exc:
                    raise _transfer_error(-1, "?", method_name, exc) from None
            try:
                self._raise_if_lost([r for r, f in zip(ranks, futures) if not f.done()])
            except WorkerLostError:
                self._mark_stuck(method_name, [(r, f) for r, f in zip(ranks, futures) if not f.done()])
                raise
            self._warn_if_paused([r for r, f in zip(ranks, futures) if not f.done()], method_name, warned)
            try:
                dask_wait(pending, timeout=poll, return_when="FIRST_COMPLETED")
            except (TimeoutError, asyncio.TimeoutError, FuturesCancelledError):
                pass  # a cancelled future is reported by the next round

    def _warn_if_paused(self, ranks: Sequence[int | None], method_name: str, warned: set[str]) -> None:
        after = float(dask.config.get("daskwg.paused-warning"))
        for rank in ranks:
            if rank is None:
                continue
            address = self._slots[rank].address
            since = self._driver.paused.get(address)
            if since is None or address in warned or time.monotonic() - since < after:
                continue
            warned.add(address)
            logger.warning(
                "%s.%s: rank %d waits on worker %s, which is paused (its memory use is above "
                "distributed.worker.memory.pause) and starts no tasks until it frees memory; "
                "free memory there, raise the worker's memory_limit or the pause threshold",
                self._name,
                method_name,
                rank,
                address,
            )

    def _future_error(self, future: Future, method_name: str) -> BaseException:
        rank = _rank_of(future)
        address = self._slots[rank].address if rank is not None else "?"
        if future.status == "cancelled":
            if rank is not None and self._slots[rank].server_id in self._driver.lost:
                slot = self._slots[rank]
                self._broken = self._broken or WorkerLostError(
                    rank, slot.address, self._driver.lost[slot.server_id]
                )
                return self._broken
            return GroupBrokenError(f"the call of {method_name!r} on rank {rank} was cancelled")
        exc = future.exception()
        if isinstance(exc, WorkerGroupError):
            return exc
        tb = "".join(traceback.format_tb(future.traceback())) if future.traceback() else ""
        return RankError(rank if rank is not None else -1, address, method_name, tb, exc)

    def _gather_any(self, futures: list) -> list:
        return self._gather(list(futures), "DataProtoFuture.get")


_RESERVED = {"_dispatch_info", "_collect_info", "_client", "_slots", "_methods", "_cls", "_name"}


#: What Dask raises when a result cannot be serialised on the worker or deserialised here.
_TRANSFER_ERRORS = (TypeError, pickle.PicklingError, pickle.UnpicklingError, AttributeError, ImportError)


def _transfer_error(rank: int, address: str, method: str, exc: BaseException) -> RankError:
    return RankError(
        rank,
        address,
        method,
        "",
        TypeError(
            f"the arguments or the result of {method!r} could not cross between the driver and the worker: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; the workers must be able to "
            "import every class and function sent to them (install its module there), and results must be "
            "tensors, numpy arrays, DataProto or plain data"
        ),
    )


def _connected_clients(dask_scheduler) -> list[str]:
    return list(dask_scheduler.clients)


def _consume_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _rank_of(future: Future) -> int | None:
    match = _KEY_RANK.search(str(future.key))
    return int(match.group(1)) if match else None


def _check_worker_env(worker_env: Mapping[str, str] | None) -> dict[str, str]:
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


def _check_per_rank(value: Any, world_size: int, what: str) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = (
            f"a {type(value).__name__} of length {len(value)}"
            if hasattr(value, "__len__")
            else type(value).__name__
        )
        raise DispatchError(
            f"{what}: the dispatch function must give one value per rank ({world_size}), got {got}"
        )


def _extract_lazies(payload: tuple, lazies: list[list]) -> tuple:
    """Replace ``DataProtoFuture`` arguments by :class:`LazyArg` placeholders.

    Their Dask futures are appended to ``lazies`` (a list the Dask task takes as an
    argument, so Dask resolves them on the worker).
    """
    args, kwargs = payload

    def swap(value: Any) -> Any:
        if isinstance(value, DataProtoFuture):
            lazies.append(list(value.futures))
            return LazyArg(len(lazies) - 1, value.transform)
        return value

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
