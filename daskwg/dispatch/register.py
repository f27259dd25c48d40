"""``@register`` and the dispatch modes: which methods a group binds, and how each is called.

A method marked with :func:`register` is bound on every :class:`~daskwg.groups.group.WorkerGroup`
built from its class. Its :class:`Dispatch` mode names the dispatch and collect functions
(``daskwg.dispatch.modes``) that split the call's arguments over the ranks and merge the
results; its :class:`Execute` mode says which ranks run it. Mirrors verl's
``verl.single_controller.base.decorator`` (``register``, ``Dispatch``, ``Execute``,
``get_predefined_dispatch_fn``, ``register_dispatch_mode``, ``update_dispatch_mode``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .. import foreign
from ..deadlines import check_seconds
from ..futures.future import DataProtoFuture
from ..wire.messages import DEFAULT_CONCURRENCY_GROUP
from .modes import (
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_dp_compute_metric,
    dispatch_one_to_all,
    make_nd_compute_dataproto_dispatch_fn,
)

__all__ = [
    "Dispatch",
    "Execute",
    "RegisteredMethod",
    "get_predefined_dispatch_fn",
    "get_registered_method",
    "register",
    "register_dispatch_mode",
    "update_dispatch_mode",
]


# The one attribute ``register`` sets on a method; its value is a ``RegisteredMethod``.
_REGISTERED_ATTR = "_daskwg_registered"

_E = TypeVar("_E", bound="_ExtensibleEnum")
_F = TypeVar("_F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- enums


class _ExtensibleEnumMeta(type):
    """Lets an extensible enum class be iterated, indexed by name and tested with ``in``."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(list(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, str):
            return item in cls._members
        return any(item is member for member in cls._members.values())

    def __getitem__(cls, name: str) -> Any:
        return cls._members[name]


def _enum_member(enum_cls: type[_E], name: str) -> _E:
    """Unpickle a member by name, creating it when this process has not registered it yet.

    A mode registered at run time in the driver (``register_dispatch_mode``) reaches Dask
    workers inside pickled methods; the workers never dispatch, so they only need a member
    with the same name.
    """
    member = enum_cls.from_name(name)
    return member if member is not None else enum_cls.register(name)


class _ExtensibleEnum(metaclass=_ExtensibleEnumMeta):
    """An enum whose members can be added at run time (verl's ``DynamicEnum``).

    Members are singletons per process: they compare and hash by identity, and pickle by
    name, so an unpickled member *is* the local member of that name.
    """

    __slots__ = ("name", "value")
    _members: ClassVar[dict[str, Any]] = {}

    name: str
    value: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._members = {}

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_enum_member, (type(self), self.name))

    @classmethod
    def register(cls: type[_E], name: str) -> _E:
        """Add a member called ``name.upper()`` and return it.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: ``name`` is not a Python identifier, or the member already exists.
        """
        if not isinstance(name, str):
            raise TypeError(f"{cls.__name__} member names are strings, got {type(name).__name__}")
        key = name.upper()
        if not key.isidentifier() or key.startswith("_"):
            raise ValueError(
                f"{cls.__name__} member name must be an identifier not starting with '_', got {name!r}"
            )
        if key in cls._members:
            raise ValueError(f"{cls.__name__}.{key} already exists")
        member = cls(key, len(cls._members))
        cls._members[key] = member
        setattr(cls, key, member)
        return member

    @classmethod
    def from_name(cls: type[_E], name: str) -> _E | None:
        """The member called ``name`` (case-insensitive), or ``None``."""
        return cls._members.get(name.upper()) if isinstance(name, str) else None

    @classmethod
    def names(cls) -> list[str]:
        """The member names, in registration order."""
        return list(cls._members)


class Dispatch(_ExtensibleEnum):
    """How a group call's arguments are split over ranks and its outputs merged.

    Predefined members (verl's names and meaning):

    - ``RANK_ZERO``: every rank gets the arguments as given; the result is rank 0's output.
    - ``ONE_TO_ALL``: every rank gets the arguments as given; the result is the list of
      per-rank outputs.
    - ``ALL_TO_ALL``: every argument already holds one entry per rank (a list or tuple of
      length ``world_size``); rank ``r`` gets entry ``r``; the result is the list of outputs.
    - ``DP_COMPUTE``: like ``ALL_TO_ALL`` (data-parallel lists); the result is the list.
    - ``DP_COMPUTE_PROTO``: ``DataProto`` / ``TensorDict`` / ``DataProtoFuture`` arguments are
      padded to a multiple of ``world_size`` and split into ``world_size`` pieces; outputs are
      concatenated (the group strips the padding).
    - ``DP_COMPUTE_PROTO_WITH_FUNC``: the first argument is a callable sent to every rank;
      the rest are split like ``DP_COMPUTE_PROTO`` but without padding.
    - ``DP_COMPUTE_METRIC``: split like ``DP_COMPUTE_PROTO``; the result is the list of
      per-rank outputs (nothing is unpadded).

    Add members with [`register_dispatch_mode`][daskwg.register_dispatch_mode] (or ``Dispatch.register(name)``
    plus [`update_dispatch_mode`][daskwg.update_dispatch_mode]).
    """

    __slots__ = ()

    RANK_ZERO: ClassVar[Dispatch]
    ONE_TO_ALL: ClassVar[Dispatch]
    ALL_TO_ALL: ClassVar[Dispatch]
    DP_COMPUTE: ClassVar[Dispatch]
    DP_COMPUTE_PROTO: ClassVar[Dispatch]
    DP_COMPUTE_PROTO_WITH_FUNC: ClassVar[Dispatch]
    DP_COMPUTE_METRIC: ClassVar[Dispatch]


class Execute(_ExtensibleEnum):
    """Which ranks run a group call: ``ALL`` ranks, or ``RANK_ZERO`` only (verl's ``Execute``)."""

    __slots__ = ()

    ALL: ClassVar[Execute]
    RANK_ZERO: ClassVar[Execute]


for _name in (
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
):
    Dispatch.register(_name)
for _name in ("ALL", "RANK_ZERO"):
    Execute.register(_name)
del _name


_DISPATCH_FNS: dict[Dispatch, dict[str, Callable[..., Any]]] = {
    Dispatch.RANK_ZERO: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_rank_zero},
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {
        "dispatch_fn": dispatch_dp_compute_data_proto_with_func,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute_metric, "collect_fn": collect_dp_compute},
}


# --------------------------------------------------------------------------- registry


def _check_fns(dispatch_fn: Any, collect_fn: Any) -> None:
    for key, fn in (("dispatch_fn", dispatch_fn), ("collect_fn", collect_fn)):
        if not callable(fn):
            raise TypeError(f"{key} must be callable, got {type(fn).__name__}")


def _check_dispatch_mode(dispatch_mode: Any) -> None:
    if isinstance(dispatch_mode, Dispatch):
        return
    if isinstance(dispatch_mode, Mapping):
        missing = [key for key in ("dispatch_fn", "collect_fn") if key not in dispatch_mode]
        if missing:
            raise ValueError(
                f"a dict dispatch_mode needs the keys 'dispatch_fn' and 'collect_fn'; missing {missing}"
            )
        _check_fns(dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"])
        return
    raise TypeError(
        f"dispatch_mode must be a Dispatch member or a dict with 'dispatch_fn' and 'collect_fn', "
        f"got {type(dispatch_mode).__name__}"
    )


def get_predefined_dispatch_fn(
    dispatch_mode: Dispatch | Mapping[str, Callable[..., Any]],
) -> dict[str, Callable[..., Any]]:
    """The ``{"dispatch_fn", "collect_fn"}`` of a mode (verl's function of that name).

    For a ``Dispatch`` member, a copy of its registry entry; for a dict mode, the dict itself.

    Raises:
        TypeError: ``dispatch_mode`` is neither a Dispatch member nor a dict (or a function
            in the dict is not callable).
        ValueError: a Dispatch member with no functions registered, or a dict missing a key.
    """
    _check_dispatch_mode(dispatch_mode)
    if isinstance(dispatch_mode, Dispatch):
        try:
            return dict(_DISPATCH_FNS[dispatch_mode])
        except KeyError:
            raise ValueError(
                f"no dispatch/collect functions are registered for {dispatch_mode!r}; "
                f"call update_dispatch_mode({dispatch_mode!r}, dispatch_fn, collect_fn)"
            ) from None
    return dispatch_mode  # type: ignore[return-value]


def register_dispatch_mode(
    name: str, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> Dispatch:
    """Add a dispatch mode ``Dispatch.<NAME>`` and return it (verl's function of that name).

    ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)`` must return one entry
    per rank for every argument; ``collect_fn(worker_group, outputs) -> Any``.

    Raises:
        TypeError: a function is not callable.
        ValueError: a mode of that name already has functions, or the name is not an identifier.
    """
    _check_fns(dispatch_fn, collect_fn)
    mode = Dispatch.from_name(name) if isinstance(name, str) else None
    if mode is None:
        mode = Dispatch.register(name)
    elif mode in _DISPATCH_FNS:
        raise ValueError(f"dispatch mode {mode!r} already exists; use update_dispatch_mode to replace it")
    _DISPATCH_FNS[mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}
    return mode


def update_dispatch_mode(
    dispatch_mode: Dispatch, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> None:
    """Replace the functions of an existing dispatch mode (verl's function of that name).

    Raises:
        TypeError: ``dispatch_mode`` is not a Dispatch member, or a function is not callable.
        ValueError: the mode has no functions registered yet (use
            [`register_dispatch_mode`][daskwg.register_dispatch_mode]).
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch member, got {type(dispatch_mode).__name__}")
    _check_fns(dispatch_fn, collect_fn)
    if dispatch_mode not in _DISPATCH_FNS:
        raise ValueError(f"dispatch mode {dispatch_mode!r} is not registered; use register_dispatch_mode")
    _DISPATCH_FNS[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


# --------------------------------------------------------------------------- @register


@dataclass(frozen=True)
class RegisteredMethod:
    """What :func:`register` recorded about a method; read it with :func:`get_registered_method`."""

    dispatch_mode: Dispatch | Mapping[str, Callable[..., Any]]
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    timeout: float | None = None
    concurrency_group: str | None = None


def get_registered_method(func: Any) -> RegisteredMethod | None:
    """The :class:`RegisteredMethod` of a function or bound method marked by :func:`register`
    or by verl's own ``register`` (see :func:`_from_verl`), else ``None``."""
    info = getattr(func, _REGISTERED_ATTR, None)
    if isinstance(info, RegisteredMethod):
        return info
    attrs = foreign.verl_register_attrs(func)
    return None if attrs is None else _from_verl(attrs)


def _from_verl(attrs: Mapping[str, Any]) -> RegisteredMethod:
    """What verl's ``register`` recorded, as daskwg's registration of the same meaning.

    Members map to daskwg's of the same name. verl's ``ALL_TO_ALL`` with
    ``Execute.RANK_ZERO`` hands rank 0 the arguments exactly as given (verl's
    ``execute_rank_zero``), which daskwg calls ``ONE_TO_ALL`` (its ``ALL_TO_ALL`` would give
    rank 0 entry 0 of per-rank lists), as daskwg's own ``Worker.execute_func_rank_zero``.
    verl's ``make_nd_compute_dataproto_dispatch_fn(mesh)`` becomes daskwg's for the same
    mesh (verl's functions require verl's own group class); other dict modes are kept.
    verl records no ``materialize_futures`` (it always materialises).

    Raises:
        ValueError: a verl member daskwg has no counterpart for.
    """
    mode = attrs["dispatch_mode"]
    if isinstance(mode, Mapping):
        mesh = foreign.is_verl_nd_dispatch(mode.get("dispatch_fn"))
        dispatch = make_nd_compute_dataproto_dispatch_fn(mesh) if mesh is not None else dict(mode)
    else:
        dispatch = foreign.native_member(mode, Dispatch)
    execute = foreign.native_member(attrs.get("execute_mode", Execute.ALL), Execute)
    if execute is Execute.RANK_ZERO and dispatch is Dispatch.ALL_TO_ALL:
        dispatch = Dispatch.ONE_TO_ALL
    return RegisteredMethod(
        dispatch_mode=dispatch,
        execute_mode=execute,
        blocking=bool(attrs.get("blocking", True)),
        materialize_futures=True,
    )


def _check_concurrency_group(name: Any) -> str | None:
    """``register``'s ``concurrency_group`` as :class:`RegisteredMethod` keeps it: ``None`` for
    the default group (``None`` or ``"default"``), else the name.

    Raises:
        TypeError: not a string.
        ValueError: not a Python identifier.
    """
    if name is None or name == DEFAULT_CONCURRENCY_GROUP:
        return None
    if not isinstance(name, str):
        raise TypeError(
            f"concurrency_group must be a str (a name such as 'control') or None, got {type(name).__name__}"
        )
    if not name.isidentifier():
        raise ValueError(
            f"concurrency_group must be a Python identifier (letters, digits and '_', such as 'control'), "
            f"got {name!r}"
        )
    return name


def _materialize_futures(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """New args/kwargs with every top-level DataProtoFuture replaced by its ``.get()``."""
    for v in args:
        if isinstance(v, DataProtoFuture):
            break
    else:
        for v in kwargs.values():
            if isinstance(v, DataProtoFuture):
                break
        else:
            return args, kwargs
    new_args = tuple(arg.get() if isinstance(arg, DataProtoFuture) else arg for arg in args)
    new_kwargs = {key: v.get() if isinstance(v, DataProtoFuture) else v for key, v in kwargs.items()}
    return new_args, new_kwargs


def register(
    dispatch_mode: Dispatch | Mapping[str, Callable[..., Any]] = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    timeout: float | None = None,
    concurrency_group: str | None = None,
) -> Callable[[_F], _F]:
    """Mark a Worker method to be bound on worker groups (verl's ``register``).

    Args:
        dispatch_mode: a [`Dispatch`][daskwg.Dispatch] member, or ``{"dispatch_fn": f, "collect_fn": g}``
            (see [`make_nd_compute_dataproto_dispatch_fn`][daskwg.make_nd_compute_dataproto_dispatch_fn]);
            verl's ``Dispatch`` members are taken as daskwg's of the same name.
        execute_mode: [`Execute`][daskwg.Execute] ``ALL`` or ``RANK_ZERO`` (verl's members too).
        blocking: ``True``: the group call returns the collected result; ``False``: it returns
            futures (a ``DataProtoFuture`` for the ``DP_COMPUTE_PROTO`` family).
        materialize_futures: when the method runs, ``DataProtoFuture`` arguments are replaced
            by the data they stand for (``.get()``).
        timeout: seconds a blocking group call of this method may wait for its ranks
            before it raises [`daskwg.CallTimeoutError`][daskwg.CallTimeoutError]; an enclosing
            ``daskwg.deadline`` block takes precedence; ``None``: that block, else
            ``daskwg.call-timeout``. Not in verl (its calls have no deadline).
        concurrency_group: the name of the method's concurrency group (Ray's actor
            ``concurrency_groups``, e.g. ``"control"``), a Python identifier; ``None`` or
            ``"default"``: the default group, which every other method is in. A rank runs
            the calls of one group one at a time, in the order the driver issued them, but
            does not make them wait for a running call of another group: a sync method of a
            group runs on a thread of that group, an ``async def`` one on the rank's event
            loop beside the running coroutine. So ``abort()`` or ``get_progress()`` in
            ``"control"`` reaches a running ``generate``. Not in verl. Step plans
            (``daskwg.plan``) refuse such methods. See docs/ranks.md ("Concurrency groups").

    The decorated method stays an ordinary method: calling it on an instance runs it in
    this process (after materialising futures); ``async def`` methods stay coroutine
    functions. The mark is one attribute holding a ``RegisteredMethod``.

    Raises:
        TypeError: an argument has the wrong type (including ``@register`` written without
            parentheses), or a dict mode holds a non-callable.
        ValueError: a dict mode lacks ``dispatch_fn`` or ``collect_fn``; decorating a function
            that is already registered; ``timeout`` is not a positive number; a verl member
            without daskwg counterpart (``Dispatch.DIRECT_ROLLOUT_METHOD``); ``concurrency_group``
            is not an identifier.
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, (Dispatch, Mapping)):
        raise TypeError("register takes arguments: write @register() or @register(dispatch_mode=...)")
    dispatch_mode = foreign.native_member(dispatch_mode, Dispatch)
    execute_mode = foreign.native_member(execute_mode, Execute)
    _check_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {type(execute_mode).__name__}")
    for label, flag in (("blocking", blocking), ("materialize_futures", materialize_futures)):
        if not isinstance(flag, bool):
            raise TypeError(f"{label} must be a bool, got {type(flag).__name__}")
    info = RegisteredMethod(
        dispatch_mode=dispatch_mode if isinstance(dispatch_mode, Dispatch) else dict(dispatch_mode),
        execute_mode=execute_mode,
        blocking=blocking,
        materialize_futures=materialize_futures,
        timeout=check_seconds(timeout, "timeout"),
        concurrency_group=_check_concurrency_group(concurrency_group),
    )

    def decorator(func: _F) -> _F:
        if not callable(func):
            raise TypeError(f"register decorates functions, got {type(func).__name__}")
        if get_registered_method(func) is not None:
            raise ValueError(f"{getattr(func, '__qualname__', func)!r} is already registered")

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                if materialize_futures:
                    args, kwargs = _materialize_futures(args, kwargs)
                return await func(*args, **kwargs)

        else:

            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if materialize_futures:
                    args, kwargs = _materialize_futures(args, kwargs)
                return func(*args, **kwargs)

        setattr(wrapper, _REGISTERED_ATTR, info)
        return wrapper  # type: ignore[return-value]

    return decorator
