"""daskwg: verl-style single-controller worker groups on Dask.

One driver holds :class:`WorkerGroup` objects; each rank of a group is an instance of a
user :class:`Worker` subclass living in a Dask worker process. Methods marked with
:func:`register` are bound on the group: the arguments are split per rank (dispatch),
the method runs on every rank (execute) and the results are merged (collect).

The package namespace is lazy (PEP 562, as SciPy and scikit-image do): ``import daskwg``
loads daskwg's ``dask.config`` defaults and nothing else, so the Dask scheduler, which
imports ``daskwg.scheduler`` to run daskwg's scheduler plugins, never imports torch. Each
name of ``__all__`` is imported from its module on first use (``daskwg.WorkerGroup``,
``from daskwg import WorkerGroup``), and so is each subpackage (``daskwg.protocol``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import config as _config  # noqa: F401  (daskwg's dask.config defaults)

if TYPE_CHECKING:  # what the names below are, for type checkers and IDEs
    from .cluster import local_cluster
    from .collective import CollectiveGroup, create_collective_group
    from .deadlines import deadline
    from .dispatch.modes import make_nd_compute_dataproto_dispatch_fn
    from .dispatch.register import (
        Dispatch,
        Execute,
        register,
        register_dispatch_mode,
        update_dispatch_mode,
    )
    from .errors import (
        BatchDimsError,
        CallCancelledError,
        CallTimeoutError,
        ConcatError,
        ConflictError,
        DispatchError,
        GroupBrokenError,
        MetaInfoConflictError,
        RankError,
        VersionMismatchError,
        WorkerGroupError,
        WorkerLostError,
        WorkerPausedError,
        WorldSizeError,
    )
    from .futures.future import DataProtoFuture
    from .groups.colocate import create_colocated_worker_cls
    from .groups.group import WorkerGroup
    from .groups.pool import ResourcePool
    from .groups.resolve import get
    from .plans.step import PlanValue, StepPlan, plan
    from .protocol import DataProto, DataProtoConfig, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto
    from .worker import ClassWithInitArgs, DistGlobalInfo, DistRankInfo, Worker

__version__ = "0.1.0"

__all__ = [
    "BatchDimsError",
    "CallCancelledError",
    "CallTimeoutError",
    "ClassWithInitArgs",
    "CollectiveGroup",
    "ConcatError",
    "ConflictError",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "Dispatch",
    "DispatchError",
    "DistGlobalInfo",
    "DistRankInfo",
    "Execute",
    "GroupBrokenError",
    "MetaInfoConflictError",
    "PlanValue",
    "RankError",
    "ResourcePool",
    "StepPlan",
    "VersionMismatchError",
    "Worker",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerLostError",
    "WorkerPausedError",
    "WorldSizeError",
    "create_collective_group",
    "create_colocated_worker_cls",
    "deadline",
    "get",
    "local_cluster",
    "make_nd_compute_dataproto_dispatch_fn",
    "pad_dataproto_to_divisor",
    "plan",
    "register",
    "register_dispatch_mode",
    "unpad_dataproto",
    "update_dispatch_mode",
]

#: Where each name of ``__all__`` is defined: module (relative to this package) -> names.
_NAMES_BY_MODULE: dict[str, tuple[str, ...]] = {
    ".cluster": ("local_cluster",),
    ".collective": ("CollectiveGroup", "create_collective_group"),
    ".deadlines": ("deadline",),
    ".dispatch.modes": ("make_nd_compute_dataproto_dispatch_fn",),
    ".dispatch.register": (
        "Dispatch",
        "Execute",
        "register",
        "register_dispatch_mode",
        "update_dispatch_mode",
    ),
    ".errors": (
        "BatchDimsError",
        "CallCancelledError",
        "CallTimeoutError",
        "ConcatError",
        "ConflictError",
        "DispatchError",
        "GroupBrokenError",
        "MetaInfoConflictError",
        "RankError",
        "VersionMismatchError",
        "WorkerGroupError",
        "WorkerLostError",
        "WorkerPausedError",
        "WorldSizeError",
    ),
    ".futures.future": ("DataProtoFuture",),
    ".groups.colocate": ("create_colocated_worker_cls",),
    ".groups.group": ("WorkerGroup",),
    ".groups.pool": ("ResourcePool",),
    ".groups.resolve": ("get",),
    ".plans.step": ("PlanValue", "StepPlan", "plan"),
    ".protocol": (
        "DataProto",
        "DataProtoConfig",
        "DataProtoItem",
        "pad_dataproto_to_divisor",
        "unpad_dataproto",
    ),
    ".worker": ("ClassWithInitArgs", "DistGlobalInfo", "DistRankInfo", "Worker"),
}
_MODULE_OF = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}


def __getattr__(name: str) -> Any:
    """PEP 562: a name of ``__all__`` imported from its module on first use (then kept in
    this module's namespace), or a submodule of daskwg (``daskwg.protocol``).

    Raises:
        AttributeError: daskwg has no such name or submodule.
    """
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
