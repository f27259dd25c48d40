"""``Worker``: the base class of what a worker group runs on every rank.

Mirrors verl's ``verl.single_controller.base.worker.Worker``. A group instantiates the
user's subclass once per rank, inside a Dask worker process, after setting ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
in ``os.environ``; ``Worker.__init__`` reads them. Setting them by hand makes a Worker
usable in-process (tests, a worker nested in another).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from . import foreign
from .dispatch.register import Dispatch, Execute, register
from .errors import ConflictError

__all__ = ["ClassWithInitArgs", "DistGlobalInfo", "DistRankInfo", "MembershipChange", "Worker"]


@dataclass(frozen=True)
class MembershipChange:
    """What [`Worker.on_membership_change`][daskwg.Worker.on_membership_change] is told
    after ``wg.heal()`` or ``wg.resize(n)``.

    Attributes:
        kind: ``"heal"`` (lost or stuck ranks replaced) or ``"resize"``.
        old_world_size: the group's size before (``int``).
        new_world_size: its size now (``WORLD_SIZE``, ``self.world_size``).
        new_ranks: the ranks built anew (``__init__`` ran there just before), e.g. ``(1,)``.
        removed_ranks: the ranks destroyed (a resize down), e.g. ``(3,)``.
        master_addr: the new ``MASTER_ADDR`` (rank 0's host).
        master_port: the new ``MASTER_PORT`` (``int``), free on rank 0's host.
    """

    kind: str
    old_world_size: int
    new_world_size: int
    new_ranks: tuple = ()
    removed_ranks: tuple = ()
    master_addr: str = ""
    master_port: int = 0


@dataclass
class DistRankInfo:
    """This rank's position along each parallel dimension (verl's ``DistRankInfo``)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int


@dataclass
class DistGlobalInfo:
    """The size of each parallel dimension (verl's ``DistGlobalInfo``)."""

    tp_size: int
    dp_size: int
    pp_size: int
    cp_size: int


def _normalize_visible_devices(environ: MutableMapping[str, str]) -> None:
    """Fold ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES`` into ``CUDA_VISIBLE_DEVICES``.

    verl's rules (``Worker._setup_env_cuda_visible_devices``), as typed errors:

    - ``HIP_VISIBLE_DEVICES`` is removed; its value becomes ``CUDA_VISIBLE_DEVICES``, which
      must be unset or equal to it.
    - ``ROCR_VISIBLE_DEVICES`` must not be combined with HIP/CUDA ones (ROCR filters the
      devices before HIP numbers them, so the two would mean different GPUs); alone, it is
      moved to ``CUDA_VISIBLE_DEVICES``.

    Values are compared as opaque strings (GPU UUIDs and MIG ids pass through). An empty
    value counts as unset, as in verl. ``environ`` is left unchanged when an error is raised.

    Raises:
        ValueError: HIP and CUDA values differ (both values are named), or ROCR is set
            together with HIP or CUDA.
    """
    hip = environ.get("HIP_VISIBLE_DEVICES") or None
    rocr = environ.get("ROCR_VISIBLE_DEVICES") or None
    cuda = environ.get("CUDA_VISIBLE_DEVICES") or None
    if hip is not None and cuda is not None and hip != cuda:
        raise ValueError(
            f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; set only one of "
            f"them, or both to the same value"
        )
    if rocr is not None and (cuda is not None or hip is not None):
        raise ValueError(
            f"ROCR_VISIBLE_DEVICES={rocr!r} is set together with "
            f"{'CUDA' if cuda is not None else 'HIP'}_VISIBLE_DEVICES={cuda or hip!r}; ROCR filters devices "
            f"before HIP/CUDA number them, so set only one of them"
        )
    if hip is not None:
        del environ["HIP_VISIBLE_DEVICES"]
        environ["CUDA_VISIBLE_DEVICES"] = hip
    elif rocr is not None:
        del environ["ROCR_VISIBLE_DEVICES"]
        environ["CUDA_VISIBLE_DEVICES"] = rocr


def _int_env(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = environ.get(key)
    if value is None:
        if default is not None:
            return default
        raise RuntimeError(
            f"environment variable {key} is not set. Workers are normally built by a WorkerGroup, which "
            f"sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; to build "
            f"one in-process, set {key} (and the others) in os.environ first"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key} must be an integer, got {value!r}") from None


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class Worker:
    """Base class of the object a worker group runs on every rank (verl's ``Worker``).

    Subclasses call ``super().__init__()`` first in their ``__init__``, then build their
    models; methods marked with [`register`][daskwg.register] become group methods.
    State lives in single-underscore attributes (``_rank``, ``_world_size``,
    ``_local_rank``, ``_local_world_size``, ``_master_addr``, ``_master_port``,
    ``_dispatch_dp_rank``, ``_collect_dp_rank``) that subclasses may read.
    """

    fused_worker_attr_name = "fused_worker_dict"

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        """Read this rank's place in the group from ``os.environ``.

        Args:
            cuda_visible_devices: if given, written to ``CUDA_VISIBLE_DEVICES`` (as verl).

        Reads ``RANK``, ``WORLD_SIZE`` (required), ``LOCAL_RANK`` (default 0),
        ``LOCAL_WORLD_SIZE`` (default 1), ``MASTER_ADDR``, ``MASTER_PORT`` (``None`` when
        unset: only ``torch.distributed`` needs them), after normalising
        HIP/ROCR/CUDA visible devices (see ``_setup_env_cuda_visible_devices``).

        Raises:
            RuntimeError: ``RANK`` or ``WORLD_SIZE`` is not set (the message names it); or
                ``cuda_visible_devices`` would change ``CUDA_VISIBLE_DEVICES`` after CUDA was
                initialised in this process, where it has no effect.
            ValueError: a variable is not an integer, ``RANK`` is outside
                ``[0, WORLD_SIZE)``, or the visible-device variables conflict.
        """
        self._setup_env_cuda_visible_devices()
        if cuda_visible_devices is not None:
            self._set_cuda_visible_devices(str(cuda_visible_devices))

        environ = os.environ
        rank = _int_env(environ, "RANK")
        world_size = _int_env(environ, "WORLD_SIZE")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world_size}: RANK must be in [0, WORLD_SIZE)")
        self._rank = rank
        self._world_size = world_size
        self._local_rank = _int_env(environ, "LOCAL_RANK", 0)
        self._local_world_size = _int_env(environ, "LOCAL_WORLD_SIZE", 1)
        self._master_addr: str | None = environ.get("MASTER_ADDR")
        self._master_port: str | None = environ.get("MASTER_PORT")

        self.fused_worker_dict: dict[str, Worker] = {}
        self._dispatch_dp_rank: dict[str, int] = {}
        self._collect_dp_rank: dict[str, bool] = {}

    def on_membership_change(self, event: MembershipChange) -> None:
        """Called on every rank of the group, all at once, after ``wg.heal()`` or
        ``wg.resize(n)`` changed its members (no-op here; override it).

        By then ``os.environ`` and ``self.world_size``/``get_master_addr_port()`` hold the
        new rendezvous, surviving ranks kept their objects and state, new ranks ran
        ``__init__``, and the torch default process group a surviving rank had was
        destroyed; so the usual override rebuilds it and its sub-groups, e.g.
        ``torch.distributed.init_process_group("gloo")``. It runs on a new rank right after
        its ``__init__`` and on the kept ranks at the same time: where ``__init__`` already
        joined the process group, skip that on the new ranks (``event.new_ranks``). Without
        an override, a kept rank whose default process group was destroyed initialises it
        again itself (same backend), meeting the new ranks' ``__init__``. Replicated state a new rank
        needs (weights, optimizer state) is the override's to send, from a surviving rank
        that holds it. No peer of verl or Ray has this hook; torch elastic restarts every
        rank instead.

        Args:
            event: what changed: kind, old/new world size, new and removed ranks, the new
                ``MASTER_ADDR``/``MASTER_PORT``.
        """

    @classmethod
    def env_keys(cls) -> list[str]:
        """The environment variables that configure a Worker (verl's ``Worker.env_keys``)."""
        return [
            "WORLD_SIZE",
            "RANK",
            "LOCAL_WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
        ]

    # ------------------------------------------------------------------ environment

    def _setup_env_cuda_visible_devices(self) -> None:
        """Apply verl's HIP/ROCR/CUDA visible-device rules to ``os.environ``.

        Raises:
            ValueError: the variables conflict (see ``_normalize_visible_devices``).
        """
        _normalize_visible_devices(os.environ)

    @staticmethod
    def _set_cuda_visible_devices(value: str) -> None:
        if os.environ.get("CUDA_VISIBLE_DEVICES") == value:
            return
        if _cuda_initialized():
            raise RuntimeError(
                f"cannot set CUDA_VISIBLE_DEVICES={value!r}: CUDA is already initialised in this process, "
                f"so the change would have no effect; set it before torch touches the GPU"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = value

    def _state(self, attr: str) -> Any:
        try:
            return self.__dict__[attr]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__} has no {attr!r}: {type(self).__name__}.__init__ must call "
                f"super().__init__() before using the Worker API"
            ) from None

    @property
    def rank(self) -> int:
        """This rank, in ``[0, world_size)``."""
        return self._state("_rank")

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self._state("_world_size")

    @property
    def local_rank(self) -> int:
        """Position among the group's ranks on this host."""
        return self._state("_local_rank")

    @property
    def local_world_size(self) -> int:
        """Number of the group's ranks on this host."""
        return self._state("_local_world_size")

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        """``(MASTER_ADDR, MASTER_PORT)`` as strings, ``None`` where unset (verl's method)."""
        return self._state("_master_addr"), self._state("_master_port")

    def get_cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` of this process, or ``"not set"`` (verl's method)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    # ------------------------------------------------------------------ colocation

    def get_fused_worker_by_name(self, worker_name: str) -> Worker | None:
        """The role worker fused into this one under ``worker_name``, or ``None`` (verl's method)."""
        return self._state("fused_worker_dict").get(worker_name)

    # ------------------------------------------------------------------ device meshes

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Record this rank's dp rank in ``mesh_name`` and whether its output is collected.

        Call it in ``__init__`` for every mesh a method dispatches over with
        [`make_nd_compute_dataproto_dispatch_fn`][daskwg.make_nd_compute_dataproto_dispatch_fn] (verl's
        method).

        Raises:
            ValueError: ``mesh_name`` is already registered, or ``dp_rank`` is negative.
            TypeError: ``dp_rank`` is not an integer.
        """
        dispatch, collect = self._state("_dispatch_dp_rank"), self._state("_collect_dp_rank")
        if mesh_name in dispatch or mesh_name in collect:
            raise ValueError(f"mesh {mesh_name!r} is already registered on rank {self.rank}")
        if isinstance(dp_rank, bool) or not hasattr(dp_rank, "__index__"):
            raise TypeError(f"dp_rank must be an int, got {type(dp_rank).__name__}")
        if int(dp_rank) < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
        dispatch[mesh_name] = int(dp_rank)
        collect[mesh_name] = bool(is_collect)

    def _lookup_mesh(self, table: dict[str, Any], mesh_name: str) -> Any:
        try:
            return table[mesh_name]
        except KeyError:
            raise ValueError(
                f"mesh {mesh_name!r} is not registered on {type(self).__name__} rank {self.rank} "
                f"(registered: {sorted(table)}); call self._register_dispatch_collect_info in __init__"
            ) from None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's dp rank in ``mesh_name``; on a group, the list over ranks (verl's method).

        Raises:
            ValueError: ``mesh_name`` is not registered.
        """
        return self._lookup_mesh(self._state("_dispatch_dp_rank"), mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected in ``mesh_name``; on a group, the list over ranks.

        Raises:
            ValueError: ``mesh_name`` is not registered.
        """
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is collected in ``mesh_name`` (verl's method).

        Raises:
            ValueError: ``mesh_name`` is not registered.
        """
        return self._lookup_mesh(self._state("_collect_dp_rank"), mesh_name)

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """Copies of the registered mesh info (verl's method).

        Returns:
            ``{"dispatch_dp_rank": {mesh: dp_rank}, "collect_dp_rank": {mesh: is_collect}}``,
            ready to pass as ``**kwargs`` to another worker's
            [`set_dispatch_collect`][daskwg.Worker.set_dispatch_collect].
        """
        return {
            "dispatch_dp_rank": dict(self._state("_dispatch_dp_rank")),
            "collect_dp_rank": dict(self._state("_collect_dp_rank")),
        }

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: Mapping[str, int], collect_dp_rank: Mapping[str, bool]
    ) -> None:
        """Register under ``mesh_name`` the mesh info of another worker (verl's method).

        Used when fusing role workers into one: ``fused.set_dispatch_collect("actor",
        **actor.get_dispatch_collect())``. Each mapping is the other worker's; when it holds
        one mesh, that one is taken whatever its name, otherwise the entry named ``mesh_name``.
        (verl takes the last entry of each dict.)

        Raises:
            ConflictError: ``mesh_name`` is already registered here (a ``ValueError`` and, as
                in verl, an ``AssertionError``).
            ValueError: the mappings are empty
                or hold several meshes none of which is ``mesh_name``.
        """
        dispatch, collect = self._state("_dispatch_dp_rank"), self._state("_collect_dp_rank")
        if mesh_name in dispatch or mesh_name in collect:
            # Also an AssertionError: verl asserts here.
            raise ConflictError(
                f"mesh {mesh_name!r} is already registered on rank {self.rank} (registered: {sorted(dispatch)})"
            )

        def pick(label: str, table: Mapping[str, Any]) -> Any:
            if len(table) == 1:
                return next(iter(table.values()))
            if mesh_name in table:
                return table[mesh_name]
            raise ValueError(
                f"{label} must hold one mesh or one named {mesh_name!r}, got meshes {sorted(table)}"
            )

        dp_rank = pick("dispatch_dp_rank", dispatch_dp_rank)
        is_collect = pick("collect_dp_rank", collect_dp_rank)
        dispatch[mesh_name] = int(dp_rank)
        collect[mesh_name] = bool(is_collect)

    # ------------------------------------------------------------------ driver functions

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a driver-supplied ``func(self, *args, **kwargs)`` on every rank (verl's method).

        On a group, ``func`` is sent to every rank and the DataProto arguments are split
        over the ranks (``Dispatch.DP_COMPUTE_PROTO_WITH_FUNC``); outputs are concatenated.
        """
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a driver-supplied ``func(*args, **kwargs)`` on rank 0 only (verl's method).

        verl registers it with ``Dispatch.ALL_TO_ALL``, which passes the arguments through
        unchanged; here ALL_TO_ALL checks that arguments are per-rank lists, so this uses
        ``ONE_TO_ALL``: rank 0 gets the arguments exactly as given, as in verl.
        """
        return func(*args, **kwargs)


class ClassWithInitArgs:
    """The class a group instantiates on every rank, with its constructor arguments.

    Args:
        cls: the user's Worker subclass (any class works; subclass [`daskwg.Worker`][daskwg.Worker]
            or verl's ``Worker`` to get the rank environment as attributes). A
            ``@ray.remote`` class is unwrapped to the class it decorates.
        *args: passed to ``cls(*args, **kwargs)`` on every rank, pickled (cloudpickle)
            once per rank.
        **kwargs: as ``args``.

    Mirrors verl's ``verl.single_controller.base.worker_group.ClassWithInitArgs``.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any):
        cls = foreign.unwrap_ray_remote(cls)
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
