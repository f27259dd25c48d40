"""Dask registrations: daskwg's types in Dask's serializers and ``dask.sizeof``.

It replaces ``distributed``'s own torch serializer (which goes through
``Tensor.numpy()`` and fails for bfloat16 and CUDA tensors), registers the frames of a
:class:`~daskwg.serialization.pickling.Packed` and a
:class:`~daskwg.serialization.parts.Deferred`, and registers ``dask.sizeof`` for tensors,
TensorDicts and DataProtos, so worker memory reports, the dashboard and spilling see
their bytes.

Importing it registers them (:func:`install`): every process that hands such values to
Dask imports it (the driver's transport, the worker's host plugin and task entry point).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch
from dask.sizeof import sizeof
from distributed.protocol.serialize import dask_deserialize, dask_serialize
from tensordict import TensorDictBase

from .. import foreign
from ..protocol import DataProto
from ..wire import codec
from .parts import Deferred
from .pickling import Packed, dumps

__all__ = ["serialize_tensor", "deserialize_tensor", "install"]


def serialize_tensor(t: torch.Tensor) -> tuple[dict, list]:
    """Split a tensor into a header and frames holding only its own bytes (any dtype,
    device or layout; sparse tensors as their index and value tensors)."""
    packed = dumps(t)
    return {"nbuffers": len(packed.buffers)}, [packed.header, *packed.buffers]


def deserialize_tensor(header: dict, frames: list) -> torch.Tensor:
    """Rebuild the tensor :func:`serialize_tensor` split, sharing the frames' memory."""
    return pickle.loads(frames[0], buffers=list(frames[1:]))


def _serialize_packed(packed: Packed) -> tuple[dict, list]:
    return {"nbuffers": len(packed.buffers)}, [packed.header, *packed.buffers]


def _deserialize_packed(header: dict, frames: list) -> Any:
    return pickle.loads(frames[0], buffers=list(frames[1:]))


def _serialize_deferred(deferred: Deferred) -> tuple[dict, list]:
    return _serialize_packed(deferred.packed)


def _deserialize_deferred(header: dict, frames: list) -> Packed:
    return Packed(frames[0], list(frames[1:]))


def _sizeof_tensor(t: torch.Tensor) -> int:
    if t.layout == torch.sparse_coo:
        return _sizeof_tensor(t._indices()) + _sizeof_tensor(t._values())
    if t.layout in codec.SPARSE_COMPRESSED:
        first, second = codec.SPARSE_COMPRESSED[t.layout]
        return sum(_sizeof_tensor(getattr(t, m)()) for m in (first, second, "values"))
    try:
        return t.numel() * t.element_size()
    except RuntimeError:  # nested and other layouts without a plain element count
        return sys.getsizeof(t)


def _sizeof_tensordict(td: TensorDictBase) -> int:
    total = 0
    for value in td.values(include_nested=True, leaves_only=True):
        total += sizeof(value)
    return total + 64


def _sizeof_dataproto(data: DataProto) -> int:
    total = 0 if data.batch is None else sizeof(data.batch)
    return total + sizeof(data.non_tensor_batch) + sizeof(data.meta_info) + 64


def install() -> None:
    """Register the tensor and :class:`Packed` serializers and ``sizeof`` for tensors,
    TensorDicts and DataProtos in this process. Idempotent.

    ``distributed`` registers its own torch serializer lazily on first use; that
    registration is triggered first so that daskwg's one replaces it for good.
    """
    dask_serialize.dispatch(torch.Tensor)
    dask_deserialize.dispatch(torch.Tensor)
    dask_serialize.register(torch.Tensor)(serialize_tensor)
    dask_deserialize.register(torch.Tensor)(deserialize_tensor)
    dask_serialize.register(Packed)(_serialize_packed)
    dask_deserialize.register(Packed)(_deserialize_packed)
    dask_serialize.register(Deferred)(_serialize_deferred)
    dask_deserialize.register(Deferred)(_deserialize_deferred)
    sizeof.register(torch.Tensor)(_sizeof_tensor)
    sizeof.register(TensorDictBase)(_sizeof_tensordict)
    sizeof.register(DataProto)(_sizeof_dataproto)
    sizeof.register(Packed)(lambda p: p.nbytes)

    @sizeof.register_lazy("verl")
    def _register_verl() -> None:  # run by Dask the first time it sizes an object of verl's
        verl_dataproto = foreign.dataproto_class()
        if verl_dataproto is not None:
            sizeof.register(verl_dataproto)(_sizeof_dataproto)


install()
