"""The parts of a ``DataProtoFuture`` on the workers: how many rows each holds, and
fetching row ranges of them.

A consuming rank needs only its own rows of a batch that other ranks produced
(verl's NeoProto and RFC #5400: each rank materialises only the rows it owns). It
learns where every part is and how many rows it has from one small :class:`PartInfo`
per part (a Dask task pinned next to the part, :func:`part_info`), works out which
rows of which parts its piece needs (:func:`daskwg.futures.interpreter.evaluate`, the
interpreter the driver runs too), and asks the
workers holding them for exactly those rows and columns through the
``daskwg_rows`` comm handler (:func:`install`), which slices the stored value
without copying and sends the slice's own bytes. Parts on the rank's own worker are
read in place and copied once, so the rank may change its rows freely. Parts on another
worker of the rank's host (with ``daskwg.shared-memory`` on) of which the rank reads at
least a quarter are mapped copy-on-write from the shared-memory file their worker writes
them into once (``daskwg.plugin.shared``), and sliced there: no socket carries them, and
what the rank changes stays its own.
"""

from __future__ import annotations

import asyncio
import io
import pickle
from typing import Any

from distributed import get_worker
from distributed.protocol import to_serialize
from distributed.utils import sync

from .. import foreign
from ..errors import GroupBrokenError
from ..futures.interpreter import concat_parts, evaluate, rows_of, select_columns
from ..futures.plan import Plan
from ..protocol import DataProto
from ..serialization import pickling as serialization
from ..wire import codec
from ..wire.messages import Handler, PartInfo
from . import gathered

__all__ = ["part_info", "part_info_of", "part_released", "evaluate_on_worker", "install", "MAP_FRACTION"]

#: A part of another worker of this host is mapped from shared memory when this rank reads
#: at least 1/MAP_FRACTION of its rows (its worker writes the whole part into the file once,
#: whoever reads it); a smaller slice comes over the comm, as its own bytes only.
MAP_FRACTION = 4


def _stored(stored: Any) -> Any:
    return serialization.loads(stored) if isinstance(stored, serialization.Packed) else stored


def _value(stored: Any) -> Any:
    """A stored part's value; a verl DataProto as daskwg's (sharing its tensors)."""
    value = _stored(stored)
    return foreign.to_native(value) if foreign.is_verl_dataproto(value) else value


def part_info(value: Any, key: str) -> PartInfo:
    """Where part ``key`` is, its rows and ``meta_info``: the body of the task
    (:data:`daskwg.wire.messages.PART_INFO`) that runs on the worker holding it.

    Args:
        value: the part (a ``DataProto`` or ``TensorDict``, or its snapshot).
        key: the part's Dask key.
    """
    return part_info_of(value, key, get_worker().address)


def part_info_of(value: Any, key: str, address: str) -> PartInfo:
    """The :class:`PartInfo` of part ``key`` (``value``, or its snapshot) held at ``address``."""
    if isinstance(value, serialization.Packed):
        info = _packed_part_info(value, key, address)
        if info is not None:
            return info
    value = _stored(value)
    foreign_class = foreign.class_name(type(value)) if foreign.is_verl_dataproto(value) else None
    value = foreign.to_native(value) if foreign_class is not None else value
    meta = dict(value.meta_info) if isinstance(value, DataProto) else None
    return PartInfo(address, key, rows_of(value), meta, foreign_class, gathered.columns_of(value))


class _PackedColumns:
    """What a part's info reads of a TensorDict whose small columns travel in one buffer
    (:func:`daskwg.wire.codec.reduce_columns`), read from its snapshot without rebuilding a
    tensor per column: the batch size, device, names and ``(key, dtype name, shape)`` of
    every column, and the columns that travel on their own as they are."""

    __slots__ = ("batch_size", "device", "names", "keys", "rest", "packed")

    def __init__(self, batch_size, device, names, keys, rest, packed, buf):  # noqa: ARG002 - buf: unread
        self.batch_size, self.device, self.names = tuple(batch_size), device, names
        self.keys, self.rest = keys, rest
        self.packed = {key: (dtype, tuple(shape)) for key, dtype, shape, _ in packed}

    def columns(self) -> tuple | None:
        """:func:`daskwg.plugin.gathered.columns_of` of the batch this stands for (its
        DataProto has no ``non_tensor_batch``)."""
        device = self.device if codec.device_available(self.device) else None
        if len(self.batch_size) != 1 or (self.names is not None and self.names[0] is not None):
            return None
        if device not in (None, "cpu"):
            return None
        columns = []
        packed, rest = self.packed, self.rest
        for key in self.keys:
            spec = packed.get(key)
            if spec is not None:  # reduce_columns packs only dense contiguous CPU tensors
                columns.append((key, spec[0], spec[1][1:], device))
                continue
            tensor = rest[key]
            if not gathered.plain_column(tensor):
                return None
            columns.append((key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape[1:]), device))
        return tuple(columns)


class _InfoUnpickler(pickle.Unpickler):
    """Loads a snapshot with every TensorDict whose columns share one buffer as a
    :class:`_PackedColumns` (the part's info needs their shapes, not their tensors: a
    512-key batch costs a tensor rebuild per key otherwise)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == codec.__name__ and name == "rebuild_columns":
            return _PackedColumns
        return super().find_class(module, name)


def _packed_part_info(packed: serialization.Packed, key: str, address: str) -> PartInfo | None:
    """:func:`part_info_of` of a snapshot whose batch is a TensorDict of packed columns (a
    ``DataProto``'s, or the part itself), read without rebuilding its columns; ``None``
    for any other value (the caller loads it)."""
    if codec.__name__.encode() not in packed.header or b"rebuild_columns" not in packed.header:
        return None
    value = _InfoUnpickler(io.BytesIO(packed.header), buffers=packed.buffers).load()
    if type(value) is _PackedColumns:  # a TensorDict part
        return PartInfo(address, key, int(value.batch_size[0]) if value.batch_size else 0, None, None, None)
    verl = foreign.is_verl_dataproto(value)
    if not (isinstance(value, DataProto) or verl) or type(value.batch) is not _PackedColumns:
        return None
    batch = value.batch
    if not batch.batch_size:
        return None  # no rows to count: the loaded value says what is wrong with it
    rows = int(batch.batch_size[0])
    columns = None if value.non_tensor_batch else batch.columns()
    foreign_class = foreign.class_name(type(value)) if verl else None
    return PartInfo(address, key, rows, dict(value.meta_info), foreign_class, columns)


def part_released(key: str, address: str) -> GroupBrokenError:
    """The error of a part that ``address`` no longer holds."""
    return GroupBrokenError(
        f"the part {key!r} of a DataProtoFuture is no longer held by {address}: it was released "
        "(keep the DataProtoFuture until the call that consumes it has run) or the worker restarted"
    )


def _slice(worker: Any, lookup: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    try:
        stored = lookup(key)
    except KeyError:
        raise part_released(key, worker.address) from None
    return _piece(_value(stored), start, stop, columns)


def _piece(value: Any, start: int, stop: int, columns: Any) -> Any:
    piece = select_columns(value[start:stop], columns)
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

    worker.handlers[Handler.ROWS] = handle_rows
    gathered.install(worker, lookup, _value, part_released)


def evaluate_on_worker(
    plan: Plan, infos: list[PartInfo], worker: Any, lookup: Any, mapped: Any = None, write: Any = None
) -> Any:
    """The value of a ``DataProtoFuture``'s plan for this rank, fetching only its rows.

    Args:
        plan: the future's row plan (``DataProtoFuture.plan()[0]``).
        infos: the :class:`~daskwg.wire.messages.PartInfo` of every part, by part number.
        worker: the consuming Dask worker.
        lookup: ``key -> stored value`` of parts on this worker.
        mapped: ``[part number, ...] -> [the whole part mapped copy-on-write from its
            worker's shared-memory file, or None, ...]`` (``daskwg.plugin.shared``), asked
            (concurrently) for the parts of another worker of this host of which this rank
            reads at least a quarter (:data:`MAP_FRACTION`): their rows are then sliced from
            the mapping, not sent over a socket. ``None``: every such part comes over the
            comm.
        write: ``[(part, start, stop, target), ...] -> answers`` of ``daskwg_write_rows``
            (asked concurrently) for parts of other workers of this host: where a run of
            rows spans several such parts of dense tensors, their producers write the rows
            straight into one file of this process (:func:`daskwg.plugin.gathered.gather`).
            ``None``: never.

    Returns:
        a daskwg ``DataProto`` or ``TensorDict``; verl's ``DataProto`` when every part is one.

    Runs on the host thread of the consuming worker; fetches go through that
    worker's event loop and connection pool (its TLS settings included), those of the
    parts that one run of rows spans all at once.

    Raises:
        GroupBrokenError: a part is no longer held where its info says.
        OSError, CommClosedError: the worker holding a part cannot be reached.
        KeyError, ValueError: as the eager ``DataProto`` operations of the plan.
    """

    fetch = _Fetch(infos, worker, lookup, mapped, write)
    value = evaluate(plan, [i.rows for i in infos], [i.meta_info for i in infos], fetch)
    # All parts verl's: verl's class again (loaded here when the consuming class is verl's).
    names = {i.dataproto_class for i in infos}
    cls = foreign.loaded_class(names.pop()) if len(names) == 1 and None not in names else None
    return foreign.from_native(value, cls)


class _Fetch:
    """``evaluate``'s fetch on a worker; :meth:`many` gets several parts at once."""

    def __init__(self, infos: list[PartInfo], worker: Any, lookup: Any, mapped: Any, write: Any) -> None:
        self.infos, self.worker, self.lookup, self.mapped, self.write = infos, worker, lookup, mapped, write
        self.wholes: dict[int, Any] = {}  # part -> its mapping's value, or None: not mappable
        self.read: set[int] = set()  # parts already sliced from their mapping
        self.fetched: dict[tuple, Any] = {}  # (part, start, stop, columns) -> rows fetched early

    def _maps(self, part: int, start: int, stop: int) -> bool:
        info = self.infos[part]
        return (
            self.mapped is not None
            and info.address != self.worker.address
            and (stop - start) * MAP_FRACTION >= info.rows
        )

    def many(self, requests: list[tuple]) -> Any:
        """The rows of ``requests`` (``(part, start, stop, columns)``) concatenated: written
        into one file of this process by their producers where they can be, else fetched
        at once and concatenated here."""
        value = self._gather(requests)
        if value is None:
            self._prefetch(requests)
            value = concat_parts([self(*request) for request in requests])
        return value

    def _gather(self, requests: list[tuple]) -> Any:
        """``requests`` concatenated, written into one file of this process by the parts'
        producers (:func:`daskwg.plugin.gathered.gather`), or ``None``: fetch them apart."""
        columns = self.infos[requests[0][0]].columns
        wanted = requests[0][3]
        if (
            self.write is None
            or columns is None
            or any(self.infos[p].address == self.worker.address for p, _, _, _ in requests)
            or any(self.infos[p].columns != columns for p, _, _, _ in requests)
            or (wanted is not None and wanted[1])  # non-tensor columns: none here, let it fail as usual
            or (wanted is not None and wanted[0] is not None and not wanted[0] <= {c[0] for c in columns})
        ):
            return None
        return gathered.gather(requests, columns, self.write)

    def _prefetch(self, requests: list[tuple]) -> None:
        """Fetch ``requests`` concurrently: the parts to map in one batch of asks, the rows
        of other workers' parts in one round trip."""
        parts = [p for p, a, b, _ in requests if self._maps(p, a, b) and p not in self.wholes]
        if parts:
            self.wholes.update(zip(parts, self.mapped(parts)))
        remote = [
            r
            for r in requests
            if self.infos[r[0]].address != self.worker.address and self.wholes.get(r[0]) is None
        ]
        if len(remote) > 1:
            responses = sync(
                self.worker.loop, _gather_rows, self.worker, [(self.infos[r[0]], *r[1:]) for r in remote]
            )
            for request, response in zip(remote, responses):
                self.fetched[_request_key(request)] = response

    def __call__(self, part: int, start: int, stop: int, columns: Any) -> Any:
        info = self.infos[part]
        if self._maps(part, start, stop):
            if part not in self.wholes:
                self.wholes[part] = self.mapped([part])[0]
            whole = self.wholes[part]
            if whole is not None:
                piece = _piece(_value(whole), start, stop, columns)
                if part in self.read:  # two pieces of one mapping must not share memory
                    piece = serialization.loads(serialization.dumps(piece), copy=True)
                self.read.add(part)
                return piece
        if info.address == self.worker.address:
            piece = sync(
                self.worker.loop, _local_slice, self.worker, self.lookup, info.key, start, stop, columns
            )
            # A view of the stored value: the rank must get rows of its own.
            return serialization.loads(serialization.dumps(piece), copy=True)
        response = self.fetched.pop(_request_key((part, start, stop, columns)), None)
        if response is None:
            response = sync(self.worker.loop, _gather_rows, self.worker, [(info, start, stop, columns)])[0]
        return _value(response["data"])


def _request_key(request: tuple) -> tuple:
    part, start, stop, columns = request
    return part, start, stop, repr(_columns_msg(columns))


async def _gather_rows(worker: Any, requests: list[tuple]) -> list[dict]:
    """``daskwg_rows`` answers for ``(info, start, stop, columns)`` each, asked concurrently."""
    return await asyncio.gather(
        *(
            getattr(worker.rpc(info.address), Handler.ROWS)(
                key=info.key, start=start, stop=stop, columns=_columns_msg(columns)
            )
            for info, start, stop, columns in requests
        )
    )


async def _local_slice(worker: Any, lookup: Any, key: str, start: int, stop: int, columns: Any) -> Any:
    return _slice(worker, lookup, key, start, stop, columns)
