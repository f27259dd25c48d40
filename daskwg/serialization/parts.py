"""Comm message parts: a :class:`~daskwg.serialization.pickling.Packed` as one part of a
Dask comm message (:func:`message_part`, :func:`pack`) and back (:func:`unpack`,
:func:`unpacked_part`).

Small values without buffers travel inline as bytes; anything else as a :class:`Deferred`,
whose frames Dask sends without copies (``daskwg.serialization.registration`` registers
it with Dask's serializers) and which is unpickled only where the message is handled.
"""

from __future__ import annotations

import pickle
from typing import Any

from distributed.protocol import to_serialize

from .pickling import Packed, dumps, loads

__all__ = ["pack", "message_part", "unpack", "unpacked_part", "Deferred"]

#: Above this many pickled bytes a message part goes through Dask's framing instead.
_INLINE_MAX = 1 << 20


class Deferred:
    """A :class:`Packed` in a comm message that arrives as a :class:`Packed` (its frames, as
    received): it is unpickled by daskwg where the message is handled, so a class the
    receiver cannot import fails there, naming the call, instead of inside Dask's comm
    layer (where it would break the connection the message came on)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Packed):
        self.packed = packed


def message_part(packed: Packed) -> dict:
    """``packed`` as one part of a comm message, without pickling it again.

    Values without buffers (no tensors or arrays) that pickled to at most 1 MiB travel
    inline as bytes: Dask's generic serialisation costs about half a millisecond per
    object on each side, most of a small call's time. Anything else goes as its frames
    (:class:`Deferred`), which cross without copies.

    Returns:
        ``{"pickled": bytes}`` or ``{"packed": Serialize}``; :func:`unpack` reverses it.
    """
    if packed.buffers or len(packed.header) > _INLINE_MAX:
        return {"packed": to_serialize(Deferred(packed))}
    return {"pickled": packed.header}


def pack(obj: Any) -> dict:
    """:func:`message_part` of :func:`dumps` of ``obj``: one part of a comm message (call
    arguments or a result; a :class:`Packed` as it is).

    Raises:
        Exception: whatever pickling raises for an object that cannot be pickled (Dask's
            error log of that failure is suppressed: the caller reports it).
    """
    return message_part(dumps(obj))


def unpack(part: dict) -> Any:
    """The object :func:`pack` encoded (the comm layer already received its frames)."""
    if "pickled" in part:
        return pickle.loads(part["pickled"])
    if "packed" in part:
        return loads(part["packed"])
    value = part["serialized"]
    return loads(value) if isinstance(value, Packed) else value


def unpacked_part(part: dict) -> Packed:
    """The :class:`Packed` of a message part, without unpickling it."""
    if "pickled" in part:
        return Packed(part["pickled"], [])
    if "packed" in part:
        return part["packed"]
    return dumps(part["serialized"])
