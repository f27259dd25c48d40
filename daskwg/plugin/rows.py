"""The parts of a ``DataProtoFuture`` on the workers: how many rows each holds, and
fetching row ranges of them.

A consuming rank needs only its own rows of a batch that other ranks produced
(verl's NeoProto and RFC #5400: each rank materialises only the rows it owns). It
learns where every part is and how many rows it has from one small :class:`PartInfo`
per part (a Dask task pinned next to the part, :func:`part_info`), works out which
rows of which parts its piece needs (:func:`daskwg.futures.evaluate`), and asks the
workers holding them for exactly those rows and columns through the
``daskwg_rows`` comm handler (:func:`install`), which slices the stored value
without copying and sends the slice's own bytes. Parts on the rank's own worker are
read in place and copied once, so the rank may change its rows freely.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from distributed import get_worker
from distributed.protocol import to_serialize
from distributed.utils import sync

from .. import serialization
from ..errors import GroupBrokenError
from ..futures import _rows_of, _select_columns, evaluate
from ..protocol import DataProto
from ..wire import PartInfo

__all__ = ["part_info", "evaluate_on_worker", "fetching_on", "install"]

_local = threading.local()


@contextlib.contextmanager
def fetching_on(worker: Any) -> Iterator[None]:
    """Within it, :func:`evaluate_on_worker` in this thread fetches through ``worker``
    (the host thread is not one of Dask's task threads, so ``get_worker()`` fails there)."""
    previous = getattr(_local, "worker", None)
    _local.worker = worker
    try:
        yield
    finally:
        _local.worker = previous


def _value(stored: Any) -> Any:
    return serialization.loads(stored) if isinstance(stored, serialization.Packed) else stored


def part_info(value: Any, key: str) -> PartInfo:
    """Task body, run on the worker holding part ``key`` (its value is ``value``)."""
    value = _value(value)
    meta = dict(value.meta_info) if isinstance(value, DataProto) else None
    return PartInfo(get_worker().address, key, _rows_of(value), meta)


def _slice(worker: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    try:
        stored = worker.data[key]
    except KeyError:
        raise GroupBrokenError(
            f"the part {key!r} of a DataProtoFuture is no longer held by {worker.address}: it was released "
            "(keep the DataProtoFuture until the call that consumes it has run) or the worker restarted"
        ) from None
    piece = _select_columns(_value(stored)[start:stop], columns)
    if isinstance(piece, DataProto):
        piece.meta_info = {}  # the consumer merges every part's meta_info from the PartInfos
    return piece


def _columns_msg(columns: Any) -> Any:
    return None if columns is None else [None if c is None else sorted(c) for c in columns]


def _columns_of(msg: Any) -> Any:
    return None if msg is None else tuple(None if c is None else set(c) for c in msg)


def install(worker: Any) -> None:
    """Install the ``daskwg_rows`` comm handler on ``worker`` (from the host plugin's setup)."""

    def handle_rows(key: str, start: int, stop: int, columns: Any = None) -> dict:
        piece = _slice(worker, key, start, stop, _columns_of(columns))
        return {"data": to_serialize(serialization.dumps(piece))}

    worker.handlers["daskwg_rows"] = handle_rows


def evaluate_on_worker(plan: tuple, infos: list[PartInfo]) -> Any:
    """The value of a ``DataProtoFuture``'s plan for this rank, fetching only its rows.

    Runs on the host thread of the consuming worker; fetches go through that
    worker's event loop and connection pool (its TLS settings included).

    Raises:
        GroupBrokenError: a part is no longer held where its info says.
        OSError, CommClosedError: the worker holding a part cannot be reached.
        KeyError, ValueError: as the eager ``DataProto`` operations of the plan.
    """
    worker = getattr(_local, "worker", None)
    if worker is None:
        raise RuntimeError("evaluate_on_worker runs inside fetching_on(worker)")

    def fetch(part: int, start: int, stop: int, columns: Any) -> Any:
        info = infos[part]
        if info.address == worker.address:
            piece = sync(worker.loop, _local_slice, worker, info.key, start, stop, columns)
            # A view of the stored value: the rank must get rows of its own.
            return serialization.loads(serialization.dumps(piece), copy=True)
        response = sync(
            worker.loop,
            worker.rpc(info.address).daskwg_rows,
            key=info.key,
            start=start,
            stop=stop,
            columns=_columns_msg(columns),
        )
        return _value(response["data"])

    return evaluate(plan, [i.rows for i in infos], [i.meta_info for i in infos], fetch)


async def _local_slice(worker: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    return _slice(worker, key, start, stop, columns)
