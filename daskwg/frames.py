"""The frames of a call stream (``daskwg_stream``): :class:`FrameStream`.

A driver opens a call stream to a worker with an ordinary Dask comm (its address, its
connection arguments, TLS included) and one Dask message, ``{"op": "daskwg_stream"}``;
from then on both ends write frames of their own on the comm's byte stream: per message, a
fixed header (the lengths), one pickle of plain data (the message: tuples, strings, ints,
bytes) and the raw buffers of the tensors it carries, which the receiver reads straight into
buffers of its own (numpy allocations, huge pages for large ones). Dask's own message framing
(msgpack, sizing, serialisation families) costs more than a small call does; this costs one
``pickle.dumps`` and one socket write.

Comms without a byte stream (in-process ones) carry the same frames as Dask messages.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np
from distributed.comm.core import CommClosedError

from .buffers import receive_buffer

__all__ = ["FrameStream"]

_HEAD = struct.Struct("<QI")  # bytes of the message's pickle, number of buffers
_SIZE = struct.Struct("<Q")

#: Buffers up to this size are read into one allocation with the message (not worth one each).
_SMALL = 1 << 16


class FrameStream:
    """Messages as frames on one Dask comm (see the module docstring).

    Args:
        comm: an open Dask comm; a TCP or TLS one is written and read as bytes.
    """

    def __init__(self, comm: Any):
        self.comm = comm
        stream = getattr(comm, "stream", None)
        self._stream = stream if stream is not None and hasattr(stream, "read_into") else None

    def closed(self) -> bool:
        return self.comm.closed()

    async def write(self, message: Any, buffers: list = (), lead: Any = None) -> None:
        """Write one message and its buffers (bytes-like objects; not copied); ``lead``, if
        given, a message without buffers written just before it, in the same write.

        Raises:
            CommClosedError, OSError: the connection is gone.
        """
        if lead is not None and self._stream is None:
            await self.write(lead)
            lead = None
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        views = [memoryview(b).cast("B") for b in buffers]
        if self._stream is None:
            await self.comm.write({"m": body, "b": [bytes(v) for v in views]})
            return
        head = _HEAD.pack(len(body), len(views)) + b"".join(_SIZE.pack(v.nbytes) for v in views)
        if lead is not None:
            first = pickle.dumps(lead, protocol=pickle.HIGHEST_PROTOCOL)
            head = _HEAD.pack(len(first), 0) + first + head
        stream = self._stream
        try:
            if not views or sum(v.nbytes for v in views) <= _SMALL:
                await stream.write(b"".join([head, body, *views]))
                return
            stream.write(head + body)
            for view in views[:-1]:
                stream.write(view)
            await stream.write(views[-1])
        except Exception as exc:  # noqa: BLE001 - tornado's StreamClosedError and socket errors
            raise _closed(self.comm, exc) from None

    async def read(self) -> tuple[Any, list]:
        """The next message and its buffers (writable numpy arrays of this process's own).

        Raises:
            CommClosedError: the connection closed.
        """
        if self._stream is None:
            frame = await self.comm.read()
            return pickle.loads(frame["m"]), [np.frombuffer(bytearray(b), dtype=np.uint8) for b in frame["b"]]
        stream = self._stream
        try:
            n, count = _HEAD.unpack(await stream.read_bytes(_HEAD.size))
            rest = await stream.read_bytes(_SIZE.size * count + n)
            sizes = struct.unpack_from(f"<{count}Q", rest) if count else ()
            message = pickle.loads(memoryview(rest)[_SIZE.size * count :])
            buffers = []
            if sizes and sum(sizes) <= _SMALL:
                block = np.empty(sum(sizes), dtype=np.uint8)
                if block.nbytes:
                    await stream.read_into(memoryview(block))
                offset = 0
                for size in sizes:
                    buffers.append(block[offset : offset + size])
                    offset += size
            else:
                for size in sizes:
                    buffer = receive_buffer(size)
                    if size:
                        await stream.read_into(memoryview(buffer))
                    buffers.append(buffer)
        except Exception as exc:  # noqa: BLE001 - tornado's StreamClosedError and socket errors
            raise _closed(self.comm, exc) from None
        return message, buffers

    def abort(self) -> None:
        self.comm.abort()


def _closed(comm: Any, exc: BaseException) -> Exception:
    if isinstance(exc, (CommClosedError, OSError)):
        return exc
    comm.abort()
    return CommClosedError(f"in {comm}: {type(exc).__name__}: {exc}")
