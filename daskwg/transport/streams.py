"""Call streams: one connection per worker process for a loop's calls to it and their
replies (:class:`CallStreams`; the worker side is ``daskwg.plugin.stream``).

A call is one message on its worker's stream (:class:`daskwg.wire.frames.FrameStream` frames),
written as soon as the call is made; its reply, tagged with the call's id, comes when the
call finishes, in whatever order calls finish. Any number of calls may wait in a worker's
queue at the cost of one connection, and a call costs one write and one read on each side.
Streams are keyed by the worker process (address and server id), so a worker restarted at
the same address gets a fresh one, and a stream whose connection closed is never reused.

The driver has one :class:`CallStreams` on the client's event loop (non-blocking calls) and
one per calling thread's own loop (blocking calls, ``daskwg.transport.channel``); each is
used only on its loop, except that a calling thread may write a small call on an open
stream of the client's loop itself (:meth:`CallStreams.send_now`, one wake-up of the
loop's thread fewer per call); its reply is read on the loop all the same.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.comm import connect

from ..config import Settings
from ..wire import local_link, memfiles
from ..wire.frames import FrameStream
from ..wire.memfiles import same_host
from ..wire.messages import FANOUT, Handler

__all__ = ["CallStreams", "StreamClosed"]

logger = logging.getLogger(__name__)


class StreamClosed(ConnectionError):
    """A call stream closed with calls on it (its worker died, left, or the link broke)."""


class _Stream:
    def __init__(
        self,
        address: str,
        connection_args: dict,
        on_close: Callable[[], None],
        lead: Callable[[], tuple | None] | None = None,
        server_id: str | None = None,
    ):
        self.address = address
        self.server_id = server_id
        self._lead = lead
        self.connection_args = connection_args
        self.frames: FrameStream | None = None
        self.pending: dict[int, Callable[[Any, list], None]] = {}
        self.ids = itertools.count()
        self._opening: asyncio.Future | None = None
        self._lock = asyncio.Lock()
        self._on_close = on_close
        self.closed = False

    async def _open(self) -> FrameStream:
        if self.frames is not None:
            return self.frames
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._opening)
        except BaseException:
            self._opening = None
            raise

    async def _connect(self) -> FrameStream:
        # A worker of this host is reached over its Unix-domain socket (daskwg.wire.local_link).
        comm = await local_link.connect(self.address, self.server_id)
        if comm is None:
            comm = await connect(self.address, **self.connection_args)
        comm.name = "daskwg call stream"
        probe = _probe(comm)
        await comm.write({"op": Handler.STREAM, "reply": False, "files": probe})
        frames = FrameStream(comm)
        if probe is not None:
            timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
            try:
                await asyncio.wait_for(_agree_on_files(frames), timeout)
            except BaseException as exc:
                comm.abort()
                if isinstance(exc, (OSError, asyncio.TimeoutError)):
                    raise OSError(
                        f"daskwg call stream to {self.address}: no answer to its opening ({exc!r})"
                    ) from exc
                raise
        self.frames = frames
        asyncio.ensure_future(self._read(self.frames))
        return self.frames

    async def send(self, message: tuple, buffers: list, on_reply: Callable[[Any, list], None]) -> None:
        """Write a call (``message[1]`` is left for its id); ``on_reply(reply, buffers)``
        gets the reply, or ``(StreamClosed, [])`` if the stream closes first.

        Raises:
            OSError: the stream could not be opened or written (a ``StreamClosed`` once closed).
        """
        if self.closed:
            raise StreamClosed(f"the call stream to {self.address} is closed")
        frames = await self._open()
        cid = next(self.ids)
        self.pending[cid] = on_reply
        try:
            async with self._lock:
                # the lead is taken when the message goes (a write cancelled before that,
                # while its large buffers are copied into a file, leaves it for the next)
                await frames.write((message[0], cid, *message[2:]), buffers, self._lead)
        except BaseException:
            self.pending.pop(cid, None)
            raise

    def send_now(self, message: tuple, buffers: list, on_reply: Callable[[Any, list], None]) -> bool:
        """:meth:`send` from any thread, written at once (``FrameStream.write_now``) if the
        stream is open and its loop is not writing; ``False``: nothing was sent, use
        :meth:`send` on the stream's loop."""
        frames = self.frames
        if self.closed or frames is None:
            return False
        cid = next(self.ids)
        self.pending[cid] = on_reply
        if frames.write_now((message[0], cid, *message[2:]), buffers, self._lead):
            return True
        self.pending.pop(cid, None)
        return False

    async def post(self, message: tuple) -> None:
        """Write a message that has no reply."""
        if self.closed:
            raise StreamClosed(f"the call stream to {self.address} is closed")
        frames = await self._open()
        async with self._lock:
            await frames.write(message)

    async def _read(self, frames: FrameStream) -> None:
        try:
            while True:
                reply, buffers = await frames.read()
                if reply[2] == FANOUT:
                    # A host leader answers in parts: its handler says when it has all.
                    callback = self.pending.get(reply[1])
                    if callback is not None and callback(reply, buffers):
                        self.pending.pop(reply[1], None)
                else:
                    callback = self.pending.pop(reply[1], None)
                    if callback is not None:
                        callback(reply, buffers)
                # Not kept until the next reply comes (which may be never): the callback
                # holds its call's outcome, a failed call's error (whose traceback holds the
                # caller's frames and arguments), and the buffers a result.
                reply = buffers = callback = None
        except Exception as exc:  # noqa: BLE001 - closed, reset, or a reply that did not load
            reason = exc
        self.closed = True
        frames.abort()
        self._on_close()
        pending = list(self.pending.values())
        self.pending.clear()
        for callback in pending:
            callback(StreamClosed(f"the call stream to {self.address} closed: {reason}"), [])

    def abort(self) -> None:
        if self.frames is not None:
            self.frames.abort()


def _probe(comm: Any) -> dict | None:
    """What the worker opens to learn whether it can map this process's files
    (:func:`daskwg.wire.memfiles.probe`): only to a worker of this host, with
    ``daskwg.shared-memory`` on; else ``None`` (every byte over the socket)."""
    if not Settings.current().shared_memory or getattr(comm, "stream", None) is None:
        return None
    if not (local_link.is_local(comm) or same_host(comm.local_address, comm.peer_address)):
        return None
    return memfiles.probe()


async def _agree_on_files(frames: FrameStream) -> None:
    """The opening's second half (``daskwg.plugin.stream.serve`` the other): the worker
    says whether it maps this process's files and gives its own probe; this side says
    whether it maps the worker's. Each side then sends large buffers through files only to
    a peer that maps them."""
    answer, _ = await frames.read()
    if answer[0] != "files":
        raise OSError(f"daskwg call stream: {answer[0]!r} where the opening's answer belongs")
    frames.files = memfiles.send_files() if answer[1] else None
    await frames.write(("files", 0, memfiles.can_open(answer[2])))


class CallStreams:
    """One loop's call streams, by worker process.

    Args:
        connection_args: the client's (``Client.connection_args``).
        epochs: server id -> how many times the driver took that worker process as lost
            while it may still be there (its heartbeat found it unreachable): a stream
            opened before the last such verdict is closed and never reused, since its
            connection may have died silently (a partition), however long TCP takes to say so.
    """

    def __init__(self, connection_args: dict, epochs: Mapping[str, int] | None = None):
        self.connection_args = connection_args
        self.epochs = {} if epochs is None else epochs
        #: ``lead((address, server_id))``: a message without reply to write just before
        #: the next call to that worker process, in the same write, or ``None``.
        self.lead: Callable[[tuple[str, str | None]], tuple | None] | None = None
        self._streams: dict[tuple[str, str | None], _Stream] = {}
        self._epoch: dict[tuple[str, str | None], int] = {}

    def _stream(self, address: str, server_id: str | None) -> _Stream:
        key = (address, server_id)
        stream = self._streams.get(key)
        epoch = self.epochs.get(server_id, 0) if server_id is not None else 0
        if stream is not None and self._epoch.get(key) != epoch:
            stream.closed = True  # its calls fail as lost when its connection goes
            stream.abort()
            self._streams.pop(key, None)
            stream = None
        if stream is None:
            lead = None if self.lead is None else functools.partial(self.lead, key)
            stream = _Stream(address, self.connection_args, lambda: self._drop(key, stream), lead, server_id)
            self._streams[key] = stream
            self._epoch[key] = epoch
        return stream

    def is_open(self, address: str, server_id: str | None) -> bool:
        """Whether a call stream to that worker process is open (readable from any thread)."""
        stream = self._streams.get((address, server_id))
        return stream is not None and stream.frames is not None and not stream.closed

    def _drop(self, key: tuple[str, str | None], stream: _Stream) -> None:
        if self._streams.get(key) is stream:
            del self._streams[key]

    async def send(
        self,
        address: str,
        server_id: str | None,
        message: tuple,
        buffers: list,
        on_reply: Callable[[Any, list], None],
    ) -> None:
        """:meth:`_Stream.send` on the stream to the worker process ``server_id`` at ``address``."""
        await self._stream(address, server_id).send(message, buffers, on_reply)

    def send_now(
        self,
        address: str,
        server_id: str | None,
        message: tuple,
        buffers: list,
        on_reply: Callable[[Any, list], None],
    ) -> bool:
        """:meth:`_Stream.send_now` on the open stream to that worker process, from any thread
        (``False``: there is none, or it could not take the message at once: use :meth:`send`
        on this loop)."""
        key = (address, server_id)
        stream = self._streams.get(key)
        epoch = self.epochs.get(server_id, 0) if server_id is not None else 0
        if stream is None or self._epoch.get(key) != epoch:
            return False
        return stream.send_now(message, buffers, on_reply)

    def backlogged(self, address: str, server_id: str | None) -> bool:
        """Whether part of what :meth:`send_now` wrote to that worker process waits for this
        loop (the socket did not take it all at once)."""
        stream = self._streams.get((address, server_id))
        return stream is not None and stream.frames is not None and stream.frames.backlogged

    async def drain(self, address: str, server_id: str | None) -> None:
        """Until the calls :meth:`send_now` wrote to that worker process have all gone out
        (``FrameStream.drain``; on this loop)."""
        stream = self._streams.get((address, server_id))
        if stream is not None and stream.frames is not None:
            await stream.frames.drain()

    async def post(self, address: str, server_id: str | None, message: tuple) -> None:
        """:meth:`_Stream.post` on the stream to that worker process."""
        await self._stream(address, server_id).post(message)

    async def request(
        self,
        address: str,
        server_id: str | None,
        message: tuple,
        buffers: list,
        sent: asyncio.Future | None = None,
    ) -> tuple:
        """Send a call and wait for its reply: ``(reply, buffers)``; ``sent`` (if given)
        is done once the call is written or its writing failed.

        Raises:
            OSError: the stream closed (a :class:`StreamClosed`) or could not be written.
        """
        future = asyncio.get_running_loop().create_future()

        def on_reply(reply: Any, reply_buffers: list) -> None:
            if future.done():
                return
            if isinstance(reply, BaseException):
                future.set_exception(reply)
            else:
                future.set_result((reply, reply_buffers))

        try:
            await self.send(address, server_id, message, buffers, on_reply)
        finally:
            if sent is not None and not sent.done():
                sent.set_result(None)
        return await future

    def forget(self, address: str) -> None:
        """Close the streams to a worker that is gone (their calls fail as lost)."""
        for key in [k for k in self._streams if k[0] == address]:
            self._streams[key].abort()

    def abort_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()
