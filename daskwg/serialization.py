"""Tensor serialisation for Dask's ``dask`` serializer family.

``distributed`` ships a torch serializer that goes through ``Tensor.numpy()``, which
fails for bfloat16 (and other dtypes numpy lacks) and for CUDA tensors. daskwg
replaces it, in every process that imports daskwg, with one that ships the raw bytes
of the tensor as a single frame (no copy for contiguous CPU tensors) and rebuilds the
tensor from that frame on the other side, for every dtype.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import numpy as np
import torch
from distributed.protocol import pickle as dask_pickle
from distributed.protocol import to_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

__all__ = ["serialize_tensor", "deserialize_tensor", "install", "pack", "unpack"]

#: Above this many pickled bytes a message part goes through Dask's framing instead.
_INLINE_MAX = 1 << 20

_packing = contextvars.ContextVar("daskwg_packing", default=False)


class _QuietWhilePacking(logging.Filter):
    """Drops Dask's "Failed to serialize" records while :func:`pack` runs.

    daskwg raises its own error for an object that cannot be pickled, naming the call
    and the argument; Dask's log of the same failure (with the object's repr and a
    traceback per rank) would only bury it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not _packing.get()


logging.getLogger(dask_pickle.__name__).addFilter(_QuietWhilePacking())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serialize_tensor(t: torch.Tensor) -> tuple[dict, list]:
    """Split a tensor into a header and one frame of raw bytes.

    Args:
        t: any dense (strided) tensor, any dtype, any device. CUDA tensors are copied
            to host memory; non-contiguous tensors are made contiguous (one copy).
    Returns:
        ``(header, [frame])``: the header holds dtype, shape, device and
        ``requires_grad``; the frame is a ``memoryview`` of ``t.numel() * itemsize`` bytes.
    """
    device = str(t.device)
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
    header = {
        "dtype": _dtype_name(t.dtype),
        "shape": list(t.shape),
        "device": device,
        "requires_grad": bool(t.requires_grad),
    }
    return header, [memoryview(flat.numpy())]


def deserialize_tensor(header: dict, frames: list) -> torch.Tensor:
    """Rebuild the tensor :func:`serialize_tensor` split, sharing the frame's memory.

    A CUDA tensor comes back on the same CUDA device index when this process can see
    it, else on the CPU.
    """
    dtype = getattr(torch, header["dtype"])
    frame = frames[0]
    buf = np.frombuffer(frame, dtype=np.uint8)
    if not buf.flags.writeable:
        # torch tensors are writable; a read-only frame (bytes) must be copied once.
        buf = buf.copy()
    t = torch.from_numpy(buf).view(dtype).reshape(header["shape"])
    device = header["device"]
    if device != "cpu":
        kind = device.split(":")[0]
        backend = getattr(torch, kind, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            t = t.to(device)
    if header["requires_grad"]:
        t.requires_grad_(True)
    return t


def pack(obj: Any) -> dict:
    """Encode one part of a comm message (call arguments or a result).

    Objects that pickle without out-of-band buffers and to at most 1 MiB travel as
    pickled bytes inline in the message: Dask's generic serialisation costs about
    half a millisecond per object on each side, most of a small call's time. Anything
    with buffers (tensors, arrays) or larger goes through ``to_serialize``, whose
    frames cross without copies.

    Returns:
        ``{"pickled": bytes}`` or ``{"serialized": Serialize}``; :func:`unpack` reverses it.
    Raises:
        whatever pickling raises for an object that cannot be pickled (Dask's error log
        of that failure is suppressed: the caller reports it).
    """
    buffers: list = []
    token = _packing.set(True)
    try:
        data = dask_pickle.dumps(obj, buffer_callback=buffers.append)
    finally:
        _packing.reset(token)
    if buffers or len(data) > _INLINE_MAX:
        return {"serialized": to_serialize(obj)}
    return {"pickled": data}


def unpack(part: dict) -> Any:
    """The object :func:`pack` encoded (the comm layer already deserialised frames)."""
    if "pickled" in part:
        return dask_pickle.loads(part["pickled"])
    return part["serialized"]


def install() -> None:
    """Register :func:`serialize_tensor` for ``torch.Tensor`` in this process.

    Idempotent. ``distributed`` registers its own torch serializer lazily on first use;
    that registration is triggered first so that daskwg's one replaces it for good.
    """
    dask_serialize.dispatch(torch.Tensor)
    dask_deserialize.dispatch(torch.Tensor)
    dask_serialize.register(torch.Tensor)(serialize_tensor)
    dask_deserialize.register(torch.Tensor)(deserialize_tensor)


install()
