"""The wire: the records and names the driver side and the worker side share.

The driver side (``daskwg.transport``) sends what is defined here; the worker side
(``daskwg.plugin``) receives it. Neither imports the other: both stand on this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PLUGIN_NAME", "RANK_ENV_KEYS", "Call", "LazyArg", "PartInfo"]

PLUGIN_NAME = "daskwg"


#: Environment variables daskwg owns on every rank; ``worker_env`` may not set them.
RANK_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Call:
    """One call into one rank, as the driver sends it.

    Attributes:
        session: id of the issuing driver (its Dask client id); sequence numbers count
            per session and worker.
        seq: this call's position in the session's order on this worker.
        group_id: unique id of the group.
        group_name: readable group name (for messages).
        rank: the rank called.
        method: the method name, or ``"__init__"`` / ``"__del__"`` for the life-cycle
            calls that build and destroy the rank object.
        owner: client id that owns the group.
        worker_id: id of the worker process the call is meant for (``Worker.id``);
            a restarted worker (same name, maybe same address) has a new one.
    """

    session: str
    seq: int
    group_id: str
    group_name: str
    rank: int
    method: str
    owner: str
    worker_id: str | None = None


@dataclass(frozen=True)
class LazyArg:
    """Placeholder for an argument that is a ``DataProtoFuture``.

    The futures themselves travel in a separate list so that Dask resolves them (moving
    the data worker to worker); ``transform(values)`` rebuilds the argument on the rank.
    """

    index: int
    transform: Callable[[list], Any]
    #: the producing call, e.g. ``"gen.generate (ranks 0-3)"``: blamed if building fails.
    source: str = ""


@dataclass(frozen=True)
class PartInfo:
    """Where one part of a ``DataProtoFuture`` is and what a consumer must know of it.

    Attributes:
        address: the Dask worker holding it.
        key: its Dask key there.
        rows: its number of rows (padding included).
        meta_info: its ``meta_info`` (``None`` for a TensorDict part).
    """

    address: str
    key: str
    rows: int
    meta_info: dict | None
