"""The driver's call streams: one Dask comm per worker for its non-blocking calls and their
replies (:class:`CallStreams`; the worker side is ``daskwg.plugin.stream``).

A call is one message on its worker's stream, written as soon as the call is made; the
reply, tagged with the call's key, comes when the call finishes, so any number of calls
may wait in a worker's queue at the cost of one connection. Comms are Dask's own, with the
client's connection arguments (TLS included).

Everything here runs on the client's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from distributed.comm import connect

__all__ = ["CallStreams", "StreamClosed"]

logger = logging.getLogger(__name__)


class StreamClosed(Exception):
    """A call stream closed with calls on it (its worker died, left, or the link broke)."""


class _Stream:
    def __init__(self, address: str, connection_args: dict):
        self.address = address
        self.connection_args = connection_args
        self.comm: Any = None
        self.pending: dict[str, Callable[[Any], None]] = {}
        self._opening: asyncio.Future | None = None
        self._lock = asyncio.Lock()

    async def _open(self) -> Any:
        if self.comm is not None and not self.comm.closed():
            return self.comm
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._opening)
        finally:
            if self._opening is not None and self._opening.done():
                self._opening = None

    async def _connect(self) -> Any:
        comm = await connect(self.address, **self.connection_args)
        comm.name = "daskwg call stream"
        # Its messages are known: no need for Dask to size each one to decide whether to
        # (de)serialise it on a thread.
        comm.allow_offload = False
        await comm.write({"op": "daskwg_stream", "reply": False})
        self.comm = comm
        asyncio.ensure_future(self._read(comm))
        return comm

    async def send(self, message: dict, on_reply: Callable[[Any], None]) -> None:
        """Write ``message`` (it carries ``"key"``); ``on_reply(reply)`` gets the reply, or a
        :class:`StreamClosed` if the stream closes first.

        Raises:
            OSError, CommClosedError: the stream could not be opened or written.
            whatever serialising the message raises.
        """
        comm = await self._open()
        self.pending[message["key"]] = on_reply
        try:
            async with self._lock:
                await comm.write(message, on_error="raise")
        except BaseException:
            self.pending.pop(message["key"], None)
            raise

    async def _read(self, comm: Any) -> None:
        try:
            while True:
                reply = await comm.read()
                callback = self.pending.pop(reply.pop("key", None), None)
                if callback is not None:
                    callback(reply)
        except Exception as exc:  # noqa: BLE001 - closed, reset, or a reply that did not load
            reason = exc
        if self.comm is comm:
            self.comm = None
        comm.abort()
        pending = list(self.pending.values())
        self.pending.clear()
        for callback in pending:
            callback(StreamClosed(f"the call stream to {self.address} closed: {reason}"))

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()


class CallStreams:
    """One driver's call streams, by worker address.

    Args:
        connection_args: the client's (``Client.connection_args``).
    """

    def __init__(self, connection_args: dict):
        self.connection_args = connection_args
        self._streams: dict[str, _Stream] = {}

    async def send(self, address: str, message: dict, on_reply: Callable[[Any], None]) -> None:
        """:meth:`_Stream.send` on the stream to ``address`` (opened on first use)."""
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = _Stream(address, self.connection_args)
        await stream.send(message, on_reply)

    def forget(self, address: str) -> None:
        """Close the stream to a worker that is gone."""
        stream = self._streams.pop(address, None)
        if stream is not None:
            stream.close()
