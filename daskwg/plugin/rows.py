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

from typing import Any

from distributed import get_worker
from distributed.protocol import to_serialize
from distributed.utils import sync

from .. import foreign, serialization
from ..errors import GroupBrokenError
from ..futures import evaluate, rows_of, select_columns
from ..protocol import DataProto
from ..wire import PartInfo

__all__ = ["part_info", "part_info_of", "evaluate_on_worker", "install"]


def _stored(stored: Any) -> Any:
    return serialization.loads(stored) if isinstance(stored, serialization.Packed) else stored


def _value(stored: Any) -> Any:
    """A stored part's value; a verl DataProto as daskwg's (sharing its tensors)."""
    value = _stored(stored)
    return foreign.to_native(value) if foreign.is_verl_dataproto(value) else value


def part_info(value: Any, key: str) -> PartInfo:
    """Where part ``key`` is, its rows and ``meta_info``: the body of the task
    (:data:`daskwg.wire.PART_INFO`) that runs on the worker holding it.

    Args:
        value: the part (a ``DataProto`` or ``TensorDict``, or its snapshot).
        key: the part's Dask key.
    """
    return part_info_of(value, key, get_worker().address)


def part_info_of(value: Any, key: str, address: str) -> PartInfo:
    """The :class:`PartInfo` of part ``key`` (``value``, or its snapshot) held at ``address``."""
    value = _stored(value)
    foreign_class = foreign.class_name(type(value)) if foreign.is_verl_dataproto(value) else None
    value = foreign.to_native(value) if foreign_class is not None else value
    meta = dict(value.meta_info) if isinstance(value, DataProto) else None
    return PartInfo(address, key, rows_of(value), meta, foreign_class)


def _slice(worker: Any, lookup: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    try:
        stored = lookup(key)
    except KeyError:
        raise GroupBrokenError(
            f"the part {key!r} of a DataProtoFuture is no longer held by {worker.address}: it was released "
            "(keep the DataProtoFuture until the call that consumes it has run) or the worker restarted"
        ) from None
    piece = select_columns(_value(stored)[start:stop], columns)
    if isinstance(piece, DataProto):
        piece.meta_info = {}  # the consumer merges every part's meta_info from the PartInfos
    return piece


def _columns_msg(columns: Any) -> Any:
    return None if columns is None else [None if c is None else sorted(c) for c in columns]


def _columns_of(msg: Any) -> Any:
    return None if msg is None else tuple(None if c is None else set(c) for c in msg)


def install(worker: Any, lookup: Any) -> None:
    """Install the ``daskwg_rows`` comm handler on ``worker`` (from the host plugin's setup):
    ``(key, start, stop, columns)`` -> rows ``[start, stop)`` of the part stored under
    ``key`` (``lookup(key)``: the kept results', else the worker's data), sliced without
    copying, sent as the slice's own bytes."""

    def handle_rows(key: str, start: int, stop: int, columns: Any = None) -> dict:
        piece = _slice(worker, lookup, key, start, stop, _columns_of(columns))
        return {"data": to_serialize(serialization.dumps(piece))}

    worker.handlers["daskwg_rows"] = handle_rows


def evaluate_on_worker(plan: tuple, infos: list[PartInfo], worker: Any, lookup: Any) -> Any:
    """The value of a ``DataProtoFuture``'s plan for this rank, fetching only its rows.

    Args:
        plan: the future's plan (``DataProtoFuture.plan()[0]``).
        infos: the :class:`~daskwg.wire.PartInfo` of every part, by part number.
        worker: the consuming Dask worker.
        lookup: ``key -> stored value`` of parts on this worker.

    Returns:
        a daskwg ``DataProto`` or ``TensorDict``; verl's ``DataProto`` when every part is one.

    Runs on the host thread of the consuming worker; fetches go through that
    worker's event loop and connection pool (its TLS settings included).

    Raises:
        GroupBrokenError: a part is no longer held where its info says.
        OSError, CommClosedError: the worker holding a part cannot be reached.
        KeyError, ValueError: as the eager ``DataProto`` operations of the plan.
    """

    def fetch(part: int, start: int, stop: int, columns: Any) -> Any:
        info = infos[part]
        if info.address == worker.address:
            piece = sync(worker.loop, _local_slice, worker, lookup, info.key, start, stop, columns)
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

    value = evaluate(plan, [i.rows for i in infos], [i.meta_info for i in infos], fetch)
    # All parts verl's: verl's class again (loaded here when the consuming class is verl's).
    names = {i.dataproto_class for i in infos}
    cls = foreign.loaded_class(names.pop()) if len(names) == 1 and None not in names else None
    return foreign.from_native(value, cls)


async def _local_slice(worker: Any, lookup: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    return _slice(worker, lookup, key, start, stop, columns)
