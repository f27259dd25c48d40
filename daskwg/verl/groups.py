"""verl's class and group names on daskwg: ``RayClassWithInitArgs``, the colocated classes
and ``RayWorkerGroup`` (verl's ``verl.single_controller.ray.base``), with verl's semantics."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from distributed import Client, get_client

from .. import foreign
from ..dispatch.modes import collect_all_to_all, split_or_broadcast
from ..dispatch.register import Dispatch, Execute, RegisteredMethod, get_predefined_dispatch_fn
from ..futures.future import DataProtoFuture
from ..groups.colocate import ColocatedWorker
from ..groups.colocate import create_colocated_worker_cls as _create_colocated
from ..groups.group import WorkerGroup
from ..wire import records
from ..worker import ClassWithInitArgs
from .pools import RayResourcePool, random_prefix

__all__ = [
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
]

#: verl's ``RayWorkerGroup`` keyword arguments that have no effect here.
_IGNORED_KWARGS = frozenset(
    {"device_name", "profile_steps", "worker_nsight_options", "master_port_range", "use_gpu"}
)


class RayClassWithInitArgs(ClassWithInitArgs):
    """The class a group runs on every rank, with its arguments (verl's ``RayClassWithInitArgs``).

    ``cls`` may be a ``@ray.remote`` class: the class it wraps is used. Ray actor options
    (``update_options``, ``set_additional_resource``) are kept and not used.
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, Any] = {}
        self.fused_worker_used = False

    def set_additional_resource(self, additional_resource: dict[str, Any]) -> None:
        """Recorded only: Dask workers carry their resources themselves."""
        self._additional_resource = additional_resource

    def update_options(self, options: dict[str, Any]) -> None:
        """Recorded only: there are no Ray actor options on Dask."""
        self._options.update(options)


def create_colocated_worker_cls(class_dict: Mapping[str, ClassWithInitArgs | type]) -> RayClassWithInitArgs:
    """Every role of ``class_dict`` in one worker per rank (verl's ``create_colocated_worker_cls``).

    Returns:
        the class to build a :class:`RayWorkerGroup` from; ``wg.spawn(class_dict.keys())``
        gives one group per role. Backed by :func:`daskwg.create_colocated_worker_cls`.
    """
    native = _create_colocated(dict(class_dict))
    return RayClassWithInitArgs(native.cls, *native.args, **native.kwargs)


def create_colocated_worker_cls_fused(
    class_dict: Mapping[str, ClassWithInitArgs | type],
) -> RayClassWithInitArgs:
    """verl's fused variant of [`create_colocated_worker_cls`][daskwg.create_colocated_worker_cls]; the
    same here."""
    cia = create_colocated_worker_cls(class_dict)
    cia.fused_worker_used = True
    return cia


def create_colocated_worker_raw_cls(class_dict: Mapping[str, ClassWithInitArgs | type]) -> type:
    """A class hosting every role of ``class_dict`` (verl's ``create_colocated_worker_raw_cls``).

    Subclass it to add registered methods that combine roles (``self.actor``,
    ``self.critic`` are the role instances); build groups from it with
    ``RayClassWithInitArgs(cls=Subclass)`` and reach the roles with ``wg.fuse(roles)``.
    """
    roles = _create_colocated(dict(class_dict)).args[0]
    name = "_".join(["FusedWorker", *roles])

    def __init__(self: Any) -> None:
        ColocatedWorker.__init__(self, roles)

    return type(
        name,
        (ColocatedWorker,),
        {"__init__": __init__, "__module__": __name__, "raw_cls_dict": {r: c.cls for r, c in roles.items()}},
    )


# --------------------------------------------------------------------------- groups


def _verl_future_type() -> type | None:
    """A class that is both daskwg's and verl's ``DataProtoFuture`` (``None`` without verl)."""
    verl_future = foreign.dataproto_future_class()
    if verl_future is None:
        return None
    cached = _VERL_FUTURES.get(verl_future)
    if cached is None:
        # Not a dataclass itself: daskwg's fields, __init__ and replace() apply, so every
        # future derived from it (chunk, union, ...) keeps both types.
        cached = _VERL_FUTURES[verl_future] = type("DataProtoFuture", (DataProtoFuture, verl_future), {})
    return cached


_VERL_FUTURES: dict[type, type] = {}


class RayWorkerGroup(WorkerGroup):
    """verl's ``RayWorkerGroup`` on the current Dask client; a [`daskwg.WorkerGroup`][daskwg.WorkerGroup].

    Args:
        resource_pool: the [`RayResourcePool`][daskwg.verl.RayResourcePool] (or split) to run on; ``None``
            with ``worker_names``: reattach to that live group (as
                [`from_detached`][daskwg.verl.RayWorkerGroup.from_detached]).
        ray_cls_with_init: the class and its init arguments.
        name_prefix: prefix of the group's name ``{prefix}{Class}`` and of
            ``worker_names`` (random when ``None``, as verl); ranks see it as ``WG_PREFIX``.
        detached: the group outlives this driver (reattach with
            [`from_detached`][daskwg.verl.RayWorkerGroup.from_detached]).
        worker_names: with ``resource_pool=None``, the names of the group to reattach to.
        worker_env: extra variables for every rank; daskwg's and verl's own may not be
            set (``ValueError`` naming the key, as verl).
        master_port: the ``MASTER_PORT`` to use.
        client: the Dask client (default ``distributed.get_client()``).
        bin_pack: verl's, accepted and not used, as ``worker_handles``,
            ``ray_wait_register_center_timeout`` and the keyword arguments
            ``device_name``, ``profile_steps``, ``worker_nsight_options``,
            ``master_port_range`` and ``use_gpu``.
        **kwargs: those of verl's keyword arguments.

    Raises:
        ValueError: a reserved key in ``worker_env``; neither a pool nor worker names; no
            live group of those names.
        TypeError: an unknown keyword argument.
        GroupBrokenError: reattaching, a worker of the group left or restarted since.
        WorldSizeError, RankError: as [`daskwg.WorkerGroup`][daskwg.WorkerGroup].
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: ClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: Any = None,
        ray_wait_register_center_timeout: int = 300,
        *,
        worker_env: Mapping[str, str] | None = None,
        master_port: int | None = None,
        client: Client | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _IGNORED_KWARGS)
        if unknown:
            raise TypeError(f"RayWorkerGroup got unexpected keyword argument(s) {unknown}")
        self.ray_cls_with_init = ray_cls_with_init
        self.fused_worker_used = bool(getattr(ray_cls_with_init, "fused_worker_used", False))
        self.resource_pool = resource_pool
        self.sub_cls_name = ""
        if resource_pool is None:
            self.name_prefix = self._verl_prefix = name_prefix
            self._reattach(worker_names, client or get_client())
            return
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init (a RayClassWithInitArgs)")
        reserved = sorted(set(worker_env or {}) & set(foreign.VERL_ENV_KEYS))
        if reserved:
            raise ValueError(f"worker_env may not set {', '.join(reserved)}: verl's worker group sets them")
        self.name_prefix = random_prefix() if name_prefix is None else name_prefix
        # verl's RayWorkerGroup sets its variables (WG_PREFIX, ...) for any class.
        self._verl_prefix = self.name_prefix
        pool = resource_pool.pool
        super().__init__(
            pool.client if client is None else client,
            ray_cls_with_init,
            workers=pool,
            name=f"{self.name_prefix}{ray_cls_with_init.cls.__name__}",
            worker_env=worker_env,
            master_port=master_port,
            detached=detached,
        )

    def _reattach(self, worker_names: list[str] | None, client: Client) -> None:
        if not worker_names:
            raise ValueError(
                "RayWorkerGroup needs a resource_pool, or the worker_names of a live group to reattach to "
                "(RayWorkerGroup.from_detached(worker_names=wg.worker_names, ray_cls_with_init=...))"
            )
        # verl's names are "{prefix}{Class}_{node}:{local_rank}"; the group is "{prefix}{Class}".
        name = str(worker_names[0]).rsplit("_", 1)[0]
        record = records.lookup(client, name, any_client=True)
        if record is None:
            raise ValueError(
                f"there is no live group named {name!r} on this cluster (from worker_names {list(worker_names)})"
            )
        self._attach_ranks(client, name, record)

    # ---- verl's attributes -------------------------------------------------------------

    @property
    def worker_names(self) -> list[str]:
        """One name per rank, verl's ``{prefix}{Class}_{node}:{local_rank}``; pass them to
        [`from_detached`][daskwg.verl.RayWorkerGroup.from_detached] to reattach."""
        hosts: list[str] = []
        names = []
        for slot in self._slots:
            if slot.host not in hosts:
                hosts.append(slot.host)
        seen: dict[str, int] = {}
        for slot in self._slots:
            local = seen.get(slot.host, 0)
            seen[slot.host] = local + 1
            names.append(f"{self.name}_{hosts.index(slot.host)}:{local}")
        return names

    @property
    def master_address(self) -> str:
        """``MASTER_ADDR`` of the ranks (verl's property)."""
        return self.master_addr_port[0]

    @property
    def master_port(self) -> int:
        """``MASTER_PORT`` of the ranks (verl's property)."""
        return self.master_addr_port[1]

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | None = None,
        worker_handles: Any = None,
        ray_cls_with_init: ClassWithInitArgs | None = None,
        *,
        client: Client | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """Reattach to a live group by its ``worker_names`` (verl's ``from_detached``).

        Works for any live group, built detached or not, from any process with a client
        of the cluster (``distributed.get_client()`` by default; inside a Dask task, the
        worker's client). ``ray_cls_with_init`` and ``name_prefix`` are kept as
        attributes; the ranks' class is the one the group was built with.

        Raises:
            ValueError: no worker names, or no live group of that name.
            GroupBrokenError: a worker of the group left or restarted since.
        """
        return cls(
            name_prefix=name_prefix,
            worker_names=worker_names,
            ray_cls_with_init=ray_cls_with_init,
            client=client,
            **kwargs,
        )

    # ---- verl's argument semantics ------------------------------------------------------

    def _dispatch_fns(self, registered: RegisteredMethod) -> dict[str, Callable[..., Any]]:
        """verl's ``ALL_TO_ALL``: arguments that are all lists of ``world_size`` entries are
        split, any others go to every rank as given (verl's ``execute_all``; with
        ``Execute.RANK_ZERO``, rank 0 gets them as given); non-blocking results that are
        ``DataProtoFuture`` objects are verl's ``DataProtoFuture`` too."""
        if registered.dispatch_mode is Dispatch.ALL_TO_ALL:
            if registered.execute_mode is Execute.RANK_ZERO:
                fns = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
            else:
                fns = {"dispatch_fn": split_or_broadcast, "collect_fn": collect_all_to_all}
        else:
            fns = super()._dispatch_fns(registered)
        collect = fns["collect_fn"]

        # functools.wraps sets __wrapped__: step plans (daskwg.plans.recorded) see the mode's
        # own collect function through it, so they read its output rank by rank as on a
        # native group.
        @functools.wraps(collect)
        def collect_fn(group: Any, outputs: list[Any]) -> Any:
            return _as_verl_future(collect(group, outputs))

        return {**fns, "collect_fn": collect_fn}


def _as_verl_future(result: Any) -> Any:
    verl_future = _verl_future_type()
    if verl_future is None or not isinstance(result, DataProtoFuture) or isinstance(result, verl_future):
        return result
    return verl_future(**{f.name: getattr(result, f.name) for f in fields(result)})
