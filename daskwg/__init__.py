"""daskwg: verl-style single-controller worker groups on Dask.

One driver holds :class:`WorkerGroup` objects; each rank of a group is an instance of a
user :class:`Worker` subclass living in a Dask worker process. Methods marked with
:func:`register` are bound on the group: the arguments are split per rank (dispatch),
the method runs on every rank (execute) and the results are merged (collect).
"""

from . import config as _config  # noqa: F401  (daskwg's dask.config defaults)
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
from .plans.plan import PlanValue, StepPlan, plan
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
