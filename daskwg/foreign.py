"""verl's own objects, recognised without importing verl.

A verl user's code reaches daskwg with verl's types: classes subclassing
``verl.single_controller.base.Worker``, methods marked with verl's ``@register`` (a dict
under verl's attribute ``attrs_3141562937``, holding verl's ``Dispatch``/``Execute``
members), batches of ``verl.protocol.DataProto``, classes wrapped by ``@ray.remote``.
This module recognises each and turns verl's batches into daskwg's and back, so that the
rest of daskwg deals with its own types. It never imports verl or ray: verl's classes are
looked up in ``sys.modules``, where they are whenever a user's object comes from verl.
It imports nothing of daskwg's but ``protocol`` (every other module may use it).

Conversions share the tensors, arrays and dicts of the object they convert (both
``DataProto`` classes are a TensorDict, a dict of numpy arrays and a dict): no tensor
byte is copied.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from .protocol import DataProto

__all__ = [
    "VERL_ENV_KEYS",
    "VERL_REGISTER_ATTR",
    "dataproto_class",
    "dataproto_future_class",
    "from_native",
    "is_verl_class",
    "is_verl_dataproto",
    "is_verl_nd_dispatch",
    "loaded_class",
    "class_name",
    "native_arguments",
    "native_member",
    "nativize",
    "to_native",
    "unwrap_ray_remote",
    "verl_register_attrs",
    "verl_rank_env",
]

#: The attribute verl's ``register`` sets on a method (``verl.single_controller.base.decorator.MAGIC_ATTR``).
VERL_REGISTER_ATTR = "attrs_3141562937"

#: Environment variables verl's ``RayWorkerGroup`` sets on every rank, on top of daskwg's.
VERL_ENV_KEYS = ("WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK")

_VERL_PROTOCOL = "verl.protocol"


def dataproto_class() -> type | None:
    """verl's ``DataProto`` class, or ``None`` while verl is not imported in this process."""
    module = sys.modules.get(_VERL_PROTOCOL)
    return getattr(module, "DataProto", None) if module is not None else None


def dataproto_future_class() -> type | None:
    """verl's ``DataProtoFuture`` class, or ``None`` while verl is not imported in this process."""
    module = sys.modules.get(_VERL_PROTOCOL)
    return getattr(module, "DataProtoFuture", None) if module is not None else None


def is_verl_dataproto(obj: Any) -> bool:
    """Whether ``obj`` is a ``verl.protocol.DataProto`` (False while verl is not imported)."""
    cls = dataproto_class()
    return cls is not None and isinstance(obj, cls)


def is_verl_class(cls: Any) -> bool:
    """Whether the class ``cls`` (or one of its bases) is defined in verl."""
    mro = getattr(cls, "__mro__", ())
    return any(getattr(c, "__module__", "").split(".")[0] == "verl" for c in mro)


def class_name(cls: type) -> str:
    """``"module:qualname"`` of ``cls``, what :func:`loaded_class` reads back."""
    return f"{cls.__module__}:{cls.__qualname__}"


def loaded_class(name: str) -> type | None:
    """The class :func:`class_name` named, if its module is loaded here (never imports it)."""
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def to_native(data: Any) -> DataProto:
    """daskwg's ``DataProto`` sharing the batch, arrays and ``meta_info`` of a verl one."""
    return _rebuilt(DataProto, data)


def from_native(data: Any, cls: type | None) -> Any:
    """A ``cls`` (verl's DataProto class) sharing the fields of daskwg's ``data``; ``data``
    unchanged when ``cls`` is ``None`` or ``data`` is not a daskwg DataProto."""
    if cls is None or type(data) is cls or not isinstance(data, DataProto):
        return data
    return _rebuilt(cls, data)


def _rebuilt(cls: type, data: Any) -> Any:
    # As unpickling does: the fields were checked when ``data`` was built.
    out = cls.__new__(cls)
    out.batch, out.non_tensor_batch, out.meta_info = data.batch, data.non_tensor_batch, data.meta_info
    return out


def nativize(values: list) -> type | None:
    """Replace, in place, every verl DataProto in ``values`` by daskwg's sharing its fields.

    Returns:
        verl's class when every entry was a verl DataProto (what a concatenation of them
        is converted back to with :func:`from_native`), else ``None``.
    """
    cls = dataproto_class()
    if cls is None or not values:
        return None
    every = True
    for i, value in enumerate(values):
        if isinstance(value, cls):
            values[i] = to_native(value)
        else:
            every = False
    return cls if every else None


def native_arguments(
    args: tuple, kwargs: Mapping[str, Any]
) -> tuple[tuple, dict, Callable[[tuple, dict], tuple[tuple, dict]]]:
    """Replace verl DataProto arguments by daskwg ones for a dispatch function.

    Returns:
        ``(args, kwargs, back)``: ``back(split_args, split_kwargs)`` gives the dispatch
        function's per-rank pieces of the arguments that were verl's back as verl's class
        (``split_args[i][r]``, ``split_kwargs[key][r]``).
    """
    cls = dataproto_class()
    positions = [i for i, v in enumerate(args) if cls is not None and isinstance(v, cls)]
    keys = [key for key, v in kwargs.items() if cls is not None and isinstance(v, cls)]
    if not positions and not keys:
        return args, dict(kwargs), lambda a, k: (a, k)
    new_args = tuple(to_native(v) if i in positions else v for i, v in enumerate(args))
    new_kwargs = {key: to_native(v) if key in keys else v for key, v in kwargs.items()}

    def back(split_args: tuple, split_kwargs: dict) -> tuple[tuple, dict]:
        pieces = list(split_args)
        for i in positions:
            pieces[i] = [from_native(piece, cls) for piece in pieces[i]]
        for key in keys:
            split_kwargs[key] = [from_native(piece, cls) for piece in split_kwargs[key]]
        return tuple(pieces), split_kwargs

    return new_args, new_kwargs, back


def native_member(member: Any, enum_cls: Any) -> Any:
    """daskwg's member of ``enum_cls`` (``Dispatch`` or ``Execute``) named like verl's ``member``.

    daskwg's members and anything not from verl pass through unchanged (the caller's type
    check then names it).

    Raises:
        ValueError: a verl member that daskwg has no counterpart for (e.g.
            ``Dispatch.DIRECT_ROLLOUT_METHOD``, which only vLLM's Ray executor uses).
    """
    if isinstance(member, enum_cls) or not is_verl_class(type(member)):
        return member
    name = getattr(member, "name", None)
    native = enum_cls.from_name(name) if isinstance(name, str) else None
    if native is None:
        raise ValueError(
            f"verl's {type(member).__name__}.{name} has no daskwg counterpart; daskwg offers "
            f"{enum_cls.names()} (register your own with daskwg.register_dispatch_mode)"
        )
    return native


def verl_register_attrs(func: Any) -> Mapping[str, Any] | None:
    """What verl's ``@register`` recorded on ``func`` (``dispatch_mode``, ``execute_mode``,
    ``blocking``), or ``None`` for a function it did not mark."""
    attrs = getattr(func, VERL_REGISTER_ATTR, None)
    return attrs if isinstance(attrs, Mapping) and "dispatch_mode" in attrs else None


def is_verl_nd_dispatch(fn: Any) -> str | None:
    """The mesh name when ``fn`` is the dispatch function of verl's
    ``make_nd_compute_dataproto_dispatch_fn(mesh_name)``, else ``None``."""
    inner = getattr(fn, "func", None)
    args = getattr(fn, "args", ())
    if (
        getattr(inner, "__module__", "") == "verl.single_controller.base.decorator"
        and getattr(inner, "__name__", "") == "dispatch_lazy_compute_data_proto"
        and len(args) == 1
        and isinstance(args[0], str)
    ):
        return args[0]
    return None


def unwrap_ray_remote(cls: Any) -> Any:
    """The class a ``@ray.remote`` actor class wraps (ray's ``__ray_actor_class__``, as
    verl's ``_unwrap_ray_remote`` reads it); anything else unchanged."""
    if isinstance(cls, type):
        return cls
    inner = getattr(cls, "__ray_actor_class__", None)
    return inner if isinstance(inner, type) else cls


def verl_rank_env(prefix: str, local_world_size: int, local_rank: int) -> dict[str, str]:
    """What verl's ``RayWorkerGroup`` adds to a rank's environment.

    ``WG_BACKEND=ray`` is the value verl's ``Worker`` checks before it asks ray for the
    node's address (``get_available_master_addr_port``). ``RAY_LOCAL_WORLD_SIZE`` is the
    number of the group's ranks on this host (verl: processes per node);
    ``RAY_LOCAL_RANK`` its position among them.
    """
    return {
        "WG_PREFIX": prefix,
        "WG_BACKEND": "ray",
        "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
        "RAY_LOCAL_RANK": str(local_rank),
    }
