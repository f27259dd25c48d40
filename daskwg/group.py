"""The driver side: :class:`WorkerGroup`, verl's ``RayWorkerGroup`` on Dask.

A call on a group goes dispatch (``decorator``: split the arguments per rank) → send
(``transport``: one call per rank, pinned to the rank's Dask worker) → host
(``plugin``: the ordered thread on the worker runs the user's method) → collect
(``decorator``: merge the per-rank results). This module holds the group's life cycle
(placement, rank environment, build, attach, shutdown), the binding of registered
methods, dispatch and collect; how calls and data travel is ``transport``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import pickle
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import cloudpickle
import dask.config
from distributed import Client, Future, fire_and_forget

from . import config as _config  # noqa: F401  (loads daskwg's dask.config defaults)
from .colocate import ColocatedWorker, role_classes_of
from .deadlines import deadline
from .decorator import Execute, get_predefined_dispatch_fn, get_registered_method
from .dispatch import PADDING_SIZE_KEY, RankOutputs
from .errors import CallTimeoutError, DispatchError, GroupBrokenError, WorkerGroupError, WorldSizeError
from .futures import DataProtoFuture
from .pool import ResourcePool
from .transport import GroupTransport
from .wire import RANK_ENV_KEYS
from .worker import ClassWithInitArgs

__all__ = ["WorkerGroup", "ClassWithInitArgs"]

logger = logging.getLogger(__name__)

_METADATA_ROOT = "daskwg-groups"


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
    verl's ``RayWorkerGroup``. A non-detached group that is garbage-collected without
    :meth:`shutdown` releases its ranks, as a Ray actor dies with its last handle.
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
        self._cls = cls_with_init.cls
        self._cls_with_init = cls_with_init
        self._worker_env = env
        self._requested_port = master_port
        self._role_classes = role_classes_of(cls_with_init)
        self._group_id = uuid.uuid4().hex
        self._name = name or f"{self._cls.__name__}-{self._group_id[:8]}"
        self._slots = pool.slots
        self._owner = client.id
        self._detached = detached
        self._closed = False
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._methods = self._bind_registered_methods()
        self._transport = GroupTransport(client, self._slots, self._name, self._group_id, self._owner)
        self._check_name_free()
        self._build_ranks()
        self._publish()
        self._finalizer = None
        if not detached:
            # Like a Ray actor that dies with its last handle: a group the program drops
            # without shutdown() gives its ranks (and their memory) back.
            self._transports = [self._transport]
            self._finalizer = weakref.finalize(
                self, _release_dropped_group, self._transports, [_METADATA_ROOT, self._name]
            )
            self._finalizer.atexit = False

    def _build_ranks(self) -> None:
        """Reserve ``MASTER_PORT`` and instantiate the class on every rank (all or none)."""
        self._master_addr = self._slots[0].host
        self._master_port = self._reserve_port(self._requested_port)
        hosts = [s.host for s in self._slots]
        envs = []
        for rank, host in enumerate(hosts):
            envs.append(
                {
                    **self._worker_env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.world_size),
                    "LOCAL_RANK": str(hosts[:rank].count(host)),
                    "LOCAL_WORLD_SIZE": str(hosts.count(host)),
                    "MASTER_ADDR": self._master_addr,
                    "MASTER_PORT": str(self._master_port),
                }
            )
        # Read in the driver, so a setting applies to the groups it builds there.
        options = {
            "skip_signal_handlers": bool(dask.config.get("daskwg.skip-signal-handlers")),
            "check_process_group": bool(dask.config.get("daskwg.check-process-group")),
        }
        payloads = [
            {
                "cls": self._cls_with_init,
                "env": e,
                "detached": self._detached,
                "world_size": self.world_size,
                **options,
            }
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
            self._transport.close()
            self._closed = True
            raise

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
    def _broken(self) -> WorkerGroupError | None:
        return self._transport.broken

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
        return _spawn_role_groups(self, prefix_set)

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

    def status(self) -> list[dict]:
        """What every rank is doing now, read from its worker (forensics on demand).

        Returns:
            one dict per rank, in rank order: ``rank``, ``address``, ``state``
            (``"running"``, ``"queued"``, ``"idle"``, ``"unresponsive"``: the worker did
            not answer within ``daskwg.status-timeout`` seconds, e.g. a stopped
            process; ``"lost"``: the worker or the rank is gone), ``method`` (the running
            or first queued call), ``seconds`` (since it started or was queued),
            ``stack`` (the Python stack of the rank's thread while running), plus
            ``last_error`` (the rank's last failure there), ``queued`` (how many of
            its calls wait) and ``cancelled`` (the running call's future was cancelled:
            a sync method runs to its end; see "Cancelling a call" in the failure
            model). A running rank's stack shows where it is stuck, e.g. in
            ``all_reduce``. Takes at most about ``daskwg.status-timeout`` seconds.
            Calls the driver abandoned (a deadline, Ctrl-C) show here while they run.
        """
        return self._transport.status()

    def restart(self) -> None:
        """Replace every rank's process and rebuild the ranks; the group stays valid.

        The hosting Dask workers restart through their Nannies
        (``client.restart_workers``), then the class is instantiated again on every
        rank from the same ``ClassWithInitArgs`` and ``worker_env``, with a fresh
        ``MASTER_PORT`` (the one passed as ``master_port=``, if any). Returns when the
        ranks are ready. The way out of a rank stuck for good (a frozen process, a
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
        if not hasattr(self, "_cls_with_init"):
            raise WorkerGroupError(
                f"group {self._name!r} was attached, not built by this driver: its init arguments are not "
                "known here; restart it from the driver that built it"
            )
        old_slots = self._slots
        info = self._client.scheduler_info(n_workers=-1)["workers"]
        missing = [s.address for s in old_slots if s.address not in info]
        no_nanny = [s.address for s in old_slots if s.address in info and not info[s.address].get("nanny")]
        if no_nanny:
            raise WorkerGroupError(
                f"cannot restart group {self._name!r}: worker(s) {no_nanny} have no Nanny to restart them "
                "(processes=False, or dask worker --no-nanny); restart those workers yourself and build a new group"
            )
        addresses = sorted({s.address for s in old_slots} - set(missing))
        self._transport.close()
        if addresses:
            # Whether they are back is checked below, by process id, with its own bound.
            self._client.restart_workers(workers=addresses, raise_for_error=False)
        self._slots = self._restarted_slots(old_slots)
        self._transport = GroupTransport(self._client, self._slots, self._name, self._group_id, self._owner)
        if getattr(self, "_transports", None) is not None:
            self._transports[:] = [self._transport]
        self._dispatch_info.clear()
        self._collect_info.clear()
        self._build_ranks()
        self._publish()

    def _restarted_slots(self, old_slots: list) -> list:
        """The slots of the restarted workers (same names, new processes), in rank order."""
        driver = self._transport.driver
        timeout = 120.0
        end = time.monotonic() + timeout
        names = [s.name for s in old_slots]
        while True:
            # The scheduler's remove-worker events must be in before the new processes
            # are watched, or a late one would mark the new process lost.
            events_in = all(s.server_id in driver.lost for s in old_slots)
            try:
                by_name = {s.name: s for s in ResourcePool(self._client, workers=names).slots}
            except (ValueError, WorldSizeError):
                by_name = {}
            fresh = [by_name.get(s.name) for s in old_slots]
            if events_in and all(
                f is not None and f.server_id != o.server_id for f, o in zip(fresh, old_slots)
            ):
                return fresh
            if time.monotonic() > end:
                raise WorkerGroupError(
                    f"the workers of group {self._name!r} did not come back within {timeout:g} s of their "
                    f"restart ({names}); the group is unusable: shut it down"
                )
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Destroy the rank objects on every worker and forget the group. Idempotent.

        Works on a broken group too (surviving ranks are destroyed). Returns within
        about ``daskwg.shutdown-timeout`` seconds (10 s) even when a rank is stuck: a
        rank still busy then (a call that never returns, a frozen process) destroys its
        object when that call ends. Later calls raise :class:`GroupBrokenError`.
        """
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        self._transport.close()
        if self._client.status != "running":
            # The workers released this driver's ranks when its client left (or, with
            # the scheduler gone, closed themselves).
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
        self._cls = pickle.loads(record["cls"])
        self._role_classes = None
        self._group_id = record["group_id"]
        self._name = name
        self._slots = pool.slots
        self._owner = record["owner"]
        self._detached = True
        self._closed = False
        self._finalizer = None
        self._dispatch_info = {}
        self._collect_info = {}
        self._master_addr, self._master_port = record["master_addr"], record["master_port"]
        self._methods = self._bind_registered_methods()
        self._transport = GroupTransport(client, self._slots, name, self._group_id, self._owner)
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
        return self._client.sync(self._transport.reserve_port, port)

    def _init_settle_seconds(self) -> float:
        return float(dask.config.get("daskwg.rank-failure-grace"))

    def _destroy_ranks(self) -> None:
        alive = [r for r, s in enumerate(self._slots) if s.server_id not in self._transport.driver.lost]
        # A rank stuck in a call of this (broken) group destroys its object only when
        # that call returns; waiting for it here could take until a collective's timeout.
        # So does every rank of a broken group: one may still be running the call
        # that broke it (the other ranks of a lost worker's call, say).
        stuck = [
            r
            for r in alive
            if self._broken is not None
            or self._transport.is_stuck(self._slots[r])
            or self._transport.is_abandoned(self._slots[r])
        ]
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
                with deadline(float(dask.config.get("daskwg.shutdown-timeout"))):
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
        outputs = self._send(
            method_name,
            ranks,
            payloads,
            blocking=registered.blocking,
            timeout=getattr(registered, "timeout", None),
        )
        # The group lets go of the parts, so concatenation can free each one as it goes;
        # the method name and ranks let a collect error say whose outputs it was merging.
        outputs = RankOutputs(outputs, method=method_name, ranks=ranks)
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
        self._transport.settle()

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
        timeout: float | None = None,
    ) -> list:
        """Send one call to each of ``ranks`` (:meth:`GroupTransport.send`), after
        checking that the group is usable and has the method."""
        if check:
            self._check_usable(method_name)
            if method_name not in self._methods and not hasattr(self._cls, method_name):
                raise AttributeError(
                    f"{self._cls.__name__} has no method {method_name!r}; registered methods: "
                    f"{sorted(self._methods)}"
                )
        return self._transport.send(
            method_name,
            ranks,
            payloads,
            blocking=blocking,
            raw_payload=raw_payload,
            check=check,
            settle=settle,
            timeout=timeout,
        )

    def _gather(self, futures: list[Future], method_name: str) -> list:
        return self._transport.gather(futures, method_name)

    def _gather_any(self, futures: list) -> list:
        return self._transport.gather_any(futures)


class _RoleGroup(WorkerGroup):
    """One role of a colocated group: the role's registered methods over the same ranks.

    Built by :meth:`WorkerGroup.spawn`. It owns nothing: ranks, connection and failure
    state are the colocated group's (``parent``). Only its bound methods and its mesh
    caches (``_dispatch_info``/``_collect_info``, filled from the role's own mesh
    registration) are its own.
    """

    def __init__(self, parent: WorkerGroup, role: str, role_cls: type):
        # WorkerGroup.__init__ is not called: the ranks exist already.
        self._parent = parent
        self._role = role
        self._cls = role_cls
        self._dispatch_info = {}
        self._collect_info = {}
        self._methods = self._bind_registered_methods()

    def __getattr__(self, item: str) -> Any:
        # Everything not set above (client, slots, name, failure state, ...) is the
        # parent's, read live, so the role group never holds a stale copy.
        if item.startswith("_") and not item.startswith("__") and item not in ("_parent", "_methods", "_cls"):
            parent = self.__dict__.get("_parent")
            if parent is not None:
                return getattr(parent, item)
        return super().__getattr__(item)

    def __repr__(self) -> str:
        return f"<role group {self._role!r} of {self._parent!r}>"

    def _check_usable(self, method_name: str) -> None:
        self._parent._check_usable(f"{self._role}_{method_name}")

    def _settle(self) -> None:
        self._parent._settle()

    def _gather_any(self, futures: list) -> list:
        return self._parent._gather_any(futures)

    def _send(
        self, method_name: str, ranks: list[int], payloads: list, *, check: bool = True, **kwargs: Any
    ) -> list:
        if check:
            self._check_usable(method_name)
            if method_name not in self._methods and not hasattr(self._cls, method_name):
                raise AttributeError(
                    f"role {self._role!r} ({self._cls.__name__}) has no method {method_name!r}; "
                    f"registered methods: {sorted(self._methods)}"
                )
        return self._parent._send(f"{self._role}_{method_name}", ranks, payloads, check=False, **kwargs)

    def shutdown(self) -> None:
        """Does nothing: the ranks belong to the colocated group; shut that one down."""


def _spawn_role_groups(group: WorkerGroup, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
    """``WorkerGroup.spawn``: one :class:`_RoleGroup` per requested role, in the order given."""
    if not (isinstance(group._cls, type) and issubclass(group._cls, ColocatedWorker)):
        raise TypeError(
            f"spawn needs a group built from create_colocated_worker_cls (a ColocatedWorker); "
            f"group {group.name!r} runs {group._cls.__name__}"
        )
    if isinstance(prefix_set, str):
        raise TypeError("prefix_set must be a collection of role names, not a string")
    wanted = list(prefix_set)
    role_classes = group._role_classes
    if role_classes is None:
        # Not built by this driver (attached): ask rank 0.
        role_classes = group._send("role_classes", [0], [((), {})], blocking=True)[0]
    unknown = [role for role in wanted if role not in role_classes]
    if unknown:
        raise ValueError(f"group {group.name!r} has no role(s) {unknown}; its roles are {list(role_classes)}")
    return {role: _RoleGroup(group, role, role_classes[role]) for role in wanted}


_RESERVED = {"_dispatch_info", "_collect_info", "_client", "_slots", "_methods", "_cls", "_name"}


def _release_dropped_group(transports: list, metadata_key: list) -> None:
    """The finaliser of a non-detached group garbage-collected without ``shutdown()``."""
    for transport in transports:
        transport.release_dropped(metadata_key)


def _connected_clients(dask_scheduler) -> list[str]:
    return list(dask_scheduler.clients)


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
