"""The host leader: a worker that hands a driver's calls on to the other ranks of its host
(:class:`HostLeader`).

With ``daskwg.fan-out`` set to ``host`` (or ``auto`` for hosts with many ranks), a driver
sends a call (blocking or not) to the ranks of one host as ONE message
(:class:`daskwg.wire.messages.FanoutMessage`) to a worker of that host, the leader, instead
of one message per rank: its own writes and reads per call grow with hosts, not ranks, as
Monarch's meshes send to a host once. The leader starts its own rank's call as any call
(``DirectCalls.start``) and writes each other rank's call, an ordinary
:class:`~daskwg.wire.messages.CallMessage`, on a call stream of its own to that rank's worker
(over the host's Unix-domain socket, ``daskwg.wire.local_link``; the worker serves it as
any driver's stream). Calls carry their driver's sequence numbers, so a rank runs them in
the driver's order whichever way they came.

The answers come back through the leader, gathered (:class:`_Answers`): one reply to the
driver when every member answered, and a member's error at once, so a rank that raises
still fails the call at once. A member whose worker is gone (the leader's stream to it
closed) is answered :data:`~daskwg.wire.messages.LOST`; a leader that dies takes its
driver stream with it, and the driver fails the host's calls itself
(``daskwg.transport.leader``).

The streams are opened on the worker's event loop and kept (one per member worker process);
answers arrive on the loop (forwarded calls) or on the host thread (the leader's own rank)
and are gathered under a lock.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from distributed.comm import connect

from ..wire import local_link
from ..wire.frames import FrameStream
from ..wire.messages import LOST, Call, CallMessage, FanoutMessage, Handler

__all__ = ["HostLeader"]

logger = logging.getLogger(__name__)

#: ``answer(index, (status, nbytes, error, header, info), buffers)``.
Answer = Callable[[int, tuple, list], None]


class _Forward:
    """This worker's call stream to one other worker process of its host."""

    def __init__(self, address: str, server_id: str | None, connection_args: dict):
        self.address = address
        self.server_id = server_id
        self.connection_args = connection_args
        self.frames: FrameStream | None = None
        self.pending: dict[int, Callable[[Any, list], None]] = {}
        self.ids = itertools.count()
        self.closed = False
        self._opening: asyncio.Future | None = None
        self._lock = asyncio.Lock()

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
        comm = await local_link.connect(self.address, self.server_id)
        if comm is None:  # no Unix-domain socket to it (not Linux, TLS): its TCP address
            comm = await connect(self.address, **self.connection_args)
        comm.name = "daskwg host leader stream"
        # No shared-memory probe: the calls a leader hands on are small (the driver sends
        # large ones straight to each rank), so every byte goes over the socket.
        await comm.write({"op": Handler.STREAM, "reply": False, "files": None})
        self.frames = FrameStream(comm)
        asyncio.ensure_future(self._read(self.frames))
        return self.frames

    def send_now(self, message: tuple, buffers: list, on_reply: Callable[[Any, list], None]) -> bool:
        """Write one call at once if the stream is open and free (``FrameStream.write_now``);
        ``False``: nothing was written, use :meth:`send`."""
        frames = self.frames
        if self.closed or frames is None or self._lock.locked():
            return False
        cid = next(self.ids)
        self.pending[cid] = on_reply
        if frames.write_now((message[0], cid, *message[2:]), buffers):
            return True
        self.pending.pop(cid, None)
        return False

    async def send(self, message: tuple, buffers: list, on_reply: Callable[[Any, list], None]) -> None:
        """Write one call; ``on_reply(reply, buffers)`` gets its reply, or ``(OSError, [])``.

        Raises:
            OSError: the stream is closed, or could not be opened or written.
        """
        if self.closed:
            raise OSError(f"the host leader's stream to {self.address} is closed")
        frames = await self._open()
        cid = next(self.ids)
        self.pending[cid] = on_reply
        try:
            async with self._lock:
                await frames.write((message[0], cid, *message[2:]), buffers)
        except BaseException:
            self.pending.pop(cid, None)
            raise

    async def _read(self, frames: FrameStream) -> None:
        try:
            while True:
                reply, buffers = await frames.read()
                callback = self.pending.pop(reply[1], None)
                if callback is not None:
                    callback(reply, buffers)
                reply = buffers = callback = None
        except Exception as exc:  # noqa: BLE001 - closed or reset: the worker went away
            reason = exc
        self.closed = True
        frames.abort()
        pending = list(self.pending.values())
        self.pending.clear()
        for callback in pending:
            callback(OSError(f"the host leader's stream to {self.address} closed: {reason}"), [])

    def abort(self) -> None:
        self.closed = True
        if self.frames is not None:
            self.frames.abort()


class _Answers:
    """One fan-out message's answers, gathered: ``send(records, buffers)`` writes a reply
    (``records``: ``(index, fields, number of buffers)``). Errors go at once, the rest
    together once every member answered. Any thread."""

    def __init__(self, n: int, send: Callable[[list, list], None]):
        self._send = send
        self._left = n
        self._held: list[tuple[int, tuple, list]] = []
        self._answered: set[int] = set()
        self._lock = threading.Lock()

    def answer(self, index: int, fields: tuple, buffers: list) -> None:
        with self._lock:
            if index in self._answered:
                return  # a stream that closed while its call was being written answers twice
            self._answered.add(index)
            self._left -= 1
            if fields[0] == "OK" and self._left:
                self._held.append((index, fields, buffers))
                return
            ready = [(index, fields, buffers)]
            if not self._left:
                ready = self._held + ready
                self._held = []
        records, out = [], []
        for i, f, b in ready:
            records.append((i, f, len(b)))
            out.extend(b)
        self._send(records, out)


def _forwarded(answers: _Answers, index: int, reply: Any, buffers: list) -> None:
    if isinstance(reply, BaseException):  # the stream to the member's worker closed
        answers.answer(index, (LOST, None, str(reply), None, None), [])
    else:
        answers.answer(index, tuple(reply[2:]), buffers)


async def _send(
    forward: _Forward, message: CallMessage, payload: list, on_reply: Callable, answers: _Answers, index: int
) -> None:
    try:
        await forward.send(message.to_wire(), payload, on_reply)
    except Exception as exc:  # noqa: BLE001 - its worker is gone, or refused the stream
        forward.abort()
        answers.answer(index, (LOST, None, f"could not reach {forward.address}: {exc!r}", None, None), [])


class HostLeader:
    """A worker's part as its host's leader: its streams to the other workers of the host.

    Args:
        server_id: this worker's Dask server id (``Worker.id``): members meant for it are
            started here.
        connection_args: the worker's (``Worker.connection_args``), for a member reached over TCP.
    """

    def __init__(self, server_id: str, connection_args: dict):
        self.server_id = server_id
        self.connection_args = connection_args
        self._forwards: dict[tuple[str, str | None], _Forward] = {}

    def start(
        self,
        message: FanoutMessage,
        buffers: list,
        start_own: Callable[[CallMessage, list, Answer, int], None],
        send: Callable[[list, list], None],
    ) -> None:
        """Hand one fan-out message's calls on, on the worker's event loop.

        Args:
            message: the driver's message.
            buffers: its buffers, the payloads' one after another.
            start_own: ``(call message, payload buffers, answer, index)``: start a member meant
                for this worker (``daskwg.plugin.stream``, with ``DirectCalls.start``).
            send: ``(records, buffers)``: write one reply to the driver (:class:`_Answers`).
        """
        answers = _Answers(len(message.members), send)
        payloads, at = [], 0
        for count in message.counts:
            payloads.append(buffers[at : at + count])
            at += count
        for index, (address, server_id, call, payload, key, inline, relay_wait) in enumerate(message.members):
            call_message = CallMessage(
                Call.from_wire(call), message.headers[payload], key, inline, relay_wait
            )
            if server_id == self.server_id:
                start_own(call_message, payloads[payload], answers.answer, index)
                continue
            forward = self._forward(address, server_id)
            on_reply = functools.partial(_forwarded, answers, index)
            if not forward.send_now(call_message.to_wire(), payloads[payload], on_reply):
                # Opening (a first call), or the loop still writing an earlier one.
                asyncio.ensure_future(
                    _send(forward, call_message, payloads[payload], on_reply, answers, index)
                )

    def _forward(self, address: str, server_id: str | None) -> _Forward:
        key = (address, server_id)
        forward = self._forwards.get(key)
        if forward is None or forward.closed:
            forward = self._forwards[key] = _Forward(address, server_id, self.connection_args)
        return forward

    def close(self) -> None:
        """Close the streams (the worker is closing)."""
        for forward in list(self._forwards.values()):
            forward.abort()
        self._forwards.clear()
