"""The pickler: how every value daskwg moves is pickled (:func:`dumps`) and loaded (:func:`loads`).

Every argument and result daskwg moves is pickled by one pickler
(:func:`dumps`) whose ``reducer_override`` encodes each tensor, wherever it sits
(arguments, keyword arguments, results, ``meta_info``, ``non_tensor_batch`` object
arrays, nested containers, TensorDicts), as its own bytes in one out-of-band pickle-5
buffer: a view of a 1 GiB tensor costs what its 16 elements cost, never its base
storage (torch's own pickling writes the whole storage with ``torch.save``). A
TensorDict's small columns share one buffer (``daskwg.wire.codec.reduce_columns``: a
512-key batch is one buffer, not 512). Sparse
(COO and compressed) tensors travel as their index and value tensors. The result is
a :class:`Packed`: the pickle stream plus the buffers, which Dask's comm sends as
frames without copying (``daskwg.serialization.registration`` registers it with Dask's
``dask`` serializer family) and whose :func:`dask.sizeof.sizeof` is the bytes it holds.

At import it adds a filter to Dask's pickle logger (Dask's "Failed to serialize" records
are dropped while this module pickles: daskwg reports the failure itself).
"""

from __future__ import annotations

import contextvars
import io
import logging
import pickle
from typing import Any

import cloudpickle
import numpy as np
import torch
from distributed import Future
from distributed.protocol import pickle as dask_pickle
from tensordict import TensorDict

from .. import foreign
from ..protocol import DataProto
from ..wire import codec
from .dtensor import reduce_dtensor

__all__ = ["Packed", "dumps", "loads", "NestedFutureError"]

_packing = contextvars.ContextVar("daskwg_packing", default=False)
# Set while a call's arguments are packed: a Dask future met there was not replaced by
# a placeholder, and a rank could not use it (an uninitialised Future in rank code).
_arguments = contextvars.ContextVar("daskwg_arguments", default=False)


class NestedFutureError(TypeError):
    """A Dask future sits where a call's arguments are not searched for futures."""


class _QuietWhilePacking(logging.Filter):
    """Drops Dask's "Failed to serialize" records while this module pickles.

    daskwg raises its own error for an object that cannot be pickled, naming the call
    and the argument; Dask's log of the same failure (with the object's repr and a
    traceback per rank) would only bury it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not _packing.get()


logging.getLogger(dask_pickle.__name__).addFilter(_QuietWhilePacking())


class Packed:
    """A value pickled at one moment: ``header`` (the pickle stream, bytes) and
    ``buffers`` (the tensors' and arrays' bytes, out of band, not copied).

    Dask sends it as frames ``[header, *buffers]``; on the receiving side Dask's
    deserialisation returns the value itself, not a ``Packed``. ``nbytes`` is what
    ``dask.sizeof`` reports for it.
    """

    __slots__ = ("header", "buffers")

    def __init__(self, header: bytes, buffers: list):
        self.header = header
        self.buffers = buffers

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(memoryview(b).nbytes for b in self.buffers)

    def __repr__(self) -> str:
        return f"<Packed {self.nbytes} bytes in {len(self.buffers)} buffers>"


def _rebuild_dataproto(cls: type, batch: Any, non_tensor_batch: dict, meta_info: dict) -> DataProto:
    data = cls.__new__(cls)
    data.batch, data.non_tensor_batch, data.meta_info = batch, non_tensor_batch, meta_info
    return data


def _is_verl_dataproto(kind: type, obj: Any) -> bool:
    """verl's DataProto pickles as daskwg's does (its own pickling copies the batch through
    ``torch.save``); the name is compared first, since every pickled object passes here."""
    return kind.__name__ == "DataProto" and foreign.is_verl_dataproto(obj)


def _reduce(obj: Any, private: set[int] | None) -> Any:
    """``reducer_override`` body. ``private``: ids of the tensors/arrays that need no
    copy (``None``: copy nothing)."""
    kind = type(obj)
    if kind is torch.Tensor:
        return codec.reduce_tensor(obj, private is not None and id(obj) not in private)
    if isinstance(obj, torch.Tensor) and (shard := reduce_dtensor(obj)) is not NotImplemented:
        return shard
    if kind is TensorDict:
        if obj.is_locked:
            return NotImplemented
        entries = dict(obj.items())
        device = None if obj.device is None else str(obj.device)
        names = obj.names if obj._has_names() else None
        columns = codec.reduce_columns(entries)
        if columns is not None:  # a wide batch: its small columns in one buffer
            rest, packed, buf = columns
            keys = tuple(entries)
            return codec.rebuild_columns, (tuple(obj.batch_size), device, names, keys, rest, packed, buf)
        return codec.rebuild_tensordict, (tuple(obj.batch_size), device, names, entries)
    if isinstance(obj, DataProto) or _is_verl_dataproto(kind, obj):
        return _rebuild_dataproto, (kind, obj.batch, obj.non_tensor_batch, obj.meta_info)
    if kind is np.ndarray and private is not None and obj.dtype != object and id(obj) not in private:
        return obj.copy().__reduce_ex__(5)
    if _arguments.get() and isinstance(obj, Future):
        raise NestedFutureError(f"a Dask future ({obj.key!r}) inside a {kind.__module__}.{kind.__qualname__}")
    return NotImplemented


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, buffers: list | None, private: set[int] | None):
        super().__init__(file, protocol=5, buffer_callback=None if buffers is None else buffers.append)
        self._private = private

    def reducer_override(self, obj: Any) -> Any:
        return _reduce(obj, self._private)


class _CloudPickler(cloudpickle.Pickler):
    def __init__(self, file: Any, buffers: list | None, private: set[int] | None):
        super().__init__(file, protocol=5, buffer_callback=None if buffers is None else buffers.append)
        self._private = private

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce(obj, self._private)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


def _names_by_value_module(header: bytes) -> bool:
    """Whether a by-reference pickle names ``__main__`` or a module registered with
    ``cloudpickle.register_pickle_by_value``, whose objects cloudpickle sends by value."""
    return b"__main__" in header or any(
        name.encode() in header for name in cloudpickle.list_registry_pickle_by_value()
    )


def _dump(obj: Any, private: set[int] | None, out_of_band: bool = True) -> Packed:
    token = _packing.set(True)
    try:
        for pickler in (_Pickler, _CloudPickler):
            buffers: list = []
            f = io.BytesIO()
            try:
                pickler(f, buffers if out_of_band else None, private).dump(obj)
            except Exception:  # noqa: BLE001 - lambdas, local classes: cloudpickle below
                if pickler is _CloudPickler:
                    raise
                continue
            header = f.getvalue()
            if pickler is _Pickler and _names_by_value_module(header):
                continue  # by-reference pickles of these objects do not load elsewhere
            return Packed(header, [b.raw() for b in buffers])
    finally:
        _packing.reset(token)
    raise AssertionError("unreachable")


def dumps(obj: Any, *, arguments: bool = False) -> Packed:
    """Pickle ``obj`` with every tensor as its own bytes in an out-of-band buffer.

    The buffers share memory with the tensors (no copy for contiguous CPU tensors):
    the value must not change until the ``Packed`` is sent. Use :func:`snapshot` for
    values that may.

    Args:
        arguments: ``obj`` is a call's arguments, from which the futures the ranks resolve
            were taken out: any Dask future left in it raises :class:`NestedFutureError`.

    Raises:
        NestedFutureError: see ``arguments``.
        Exception: whatever pickling raises for an object that cannot be pickled.
    """
    if isinstance(obj, Packed):
        return obj
    if not arguments:
        return _dump(obj, None)
    token = _arguments.set(True)
    try:
        return _dump(obj, None)
    finally:
        _arguments.reset(token)


def _copy_buffer(buffer: Any) -> np.ndarray:
    view = memoryview(buffer).cast("B")
    out = np.empty(view.nbytes, dtype=np.uint8)
    out[:] = view
    return out


def loads(packed: Packed, *, copy: bool = False) -> Any:
    """The value of a :class:`Packed`; ``copy=True`` gives it its own memory (a
    receiver that may change it in place must not change the stored value), allocated
    by numpy, which asks for huge pages for large buffers: a copy into them costs a
    fraction of one into fresh 4 KiB pages."""
    buffers = [_copy_buffer(b) for b in packed.buffers] if copy else packed.buffers
    return pickle.loads(packed.header, buffers=buffers)
