"""The frames of a call stream (``daskwg_stream``): :class:`FrameStream`.

A driver opens a call stream to a worker with an ordinary Dask comm (its address, its
connection arguments, TLS included) and one Dask message, ``{"op": "daskwg_stream"}``;
from then on both ends write frames of their own on the comm's byte stream: per message, a
fixed header (the lengths), one pickle of plain data (the message: tuples, strings, ints,
bytes) and the raw buffers of the tensors it carries, which the receiver reads straight into
buffers of its own (numpy allocations, huge pages for large ones). Dask's own message framing
(msgpack, sizing, serialisation families) costs more than a small call does; this costs one
``pickle.dumps`` and one socket write.

Between a driver and a worker of one host, a message's large buffers (a megabyte or more)
go through a shared-memory file instead of the socket (:mod:`daskwg.wire.memfiles`): the frame
carries where the file is, the receiver maps it. :attr:`FrameStream.files` says whether the
peer can map this process's files; the stream's opening sets it.

Comms without a byte stream (in-process ones) carry the same frames as Dask messages.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import pickle
import socket
import struct
import threading
import weakref
from typing import Any

import numpy as np
from distributed.comm.core import CommClosedError
from tornado.iostream import SSLIOStream

from . import memfiles
from .buffers import receive_buffer

__all__ = ["FrameStream", "received_bytes"]

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<QI")  # bytes of the message's pickle, number of buffers
_SIZE = struct.Struct("<Q")

#: Buffers up to this size are read into one allocation with the message (not worth one each).
_SMALL = 1 << 16
#: Bytes of the read buffer (what one socket read may take), at least a message's worth of
#: small buffers; a larger message grows it for as long as it is being read.
_READ_BUFFER = 4 * _SMALL


# Bytes this process received on call streams, by the way they came (received_bytes()).
_received = {"tcp": 0, "unix": 0, "files": 0, "inproc": 0}
_received_lock = threading.Lock()


def received_bytes() -> dict[str, int]:
    """Bytes this process has received on daskwg's call streams, by transport: ``"tcp"``
    (TCP or TLS sockets, which the kernel's per-socket counters, ``TCP_INFO``, count too),
    ``"unix"`` (Unix-domain sockets to workers of this host), ``"files"`` (buffers of this
    host's peers mapped from shared-memory files, which no socket counter sees) and
    ``"inproc"`` (in-process comms). Dask's own messages are not counted."""
    with _received_lock:
        return dict(_received)


def _count(kind: str, nbytes: int) -> None:
    with _received_lock:
        _received[kind] += nbytes


class FrameStream:
    """Messages as frames on one Dask comm (see the module docstring).

    Args:
        comm: an open Dask comm; a TCP or TLS one is written and read as bytes.
    """

    def __init__(self, comm: Any):
        self.comm = comm
        stream = getattr(comm, "stream", None)
        self._stream = stream if stream is not None and hasattr(stream, "read_into") else None
        #: write_now may write the socket itself (plain TCP; TLS has state of its own)
        self._raw = self._stream is not None and not isinstance(self._stream, SSLIOStream)
        # What has been read from the socket and not yet taken: _rbuf[_rpos:_rend].
        self._rbuf = bytearray(_READ_BUFFER if self._stream is not None else 0)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
        sock = getattr(self._stream, "socket", None)
        self._kind = (
            "inproc"
            if self._stream is None
            else "unix"
            if sock is not None and sock.family == socket.AF_UNIX
            else "tcp"
        )
        # Writes from other threads (write_now) and the loop's own (write) take turns:
        # _writing counts the loop's writes under way; _backlog is what write_now could not
        # put on the socket at once, which goes out on the loop before anything else.
        self._wlock = threading.Lock()
        self._writing = 0
        self._backlog: bytes | None = None
        self._flushing: asyncio.Future | None = None  # the loop's write of the backlog
        #: where large buffers go when the peer maps this process's files (set by the
        #: stream's opening), else ``None``: all bytes go over the socket
        self.files: memfiles.SendFiles | None = None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # made outside a loop: only write() on the loop writes
            self._raw = False

    def closed(self) -> bool:
        return self.comm.closed()

    async def write(self, message: Any, buffers: list = (), lead: Any = None) -> None:
        """Write one message and its buffers (bytes-like objects; not copied); ``lead``, if
        given, a message without buffers written just before it, in the same write, or a
        callable giving one (or ``None``), called once the message is ready to go (so a
        write cancelled before that takes nothing from the caller).

        Raises:
            CommClosedError, OSError: the connection is gone.
        """
        views = [memoryview(b).cast("B") for b in buffers]
        infile = None
        if self.files is not None and _worth_a_file(views):
            message, views = await self._filed(message, views)
            infile = message if type(message) is memfiles.InFile else None
        try:
            if callable(lead):
                lead = lead()
            body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            if self._stream is None:
                if lead is not None:
                    await self.write(lead)
                await self.comm.write({"m": body, "b": [bytes(v) for v in views]})
                return
            head = _HEAD.pack(len(body), len(views)) + b"".join(_SIZE.pack(v.nbytes) for v in views)
            if lead is not None:
                first = pickle.dumps(lead, protocol=pickle.HIGHEST_PROTOCOL)
                head = _HEAD.pack(len(first), 0) + first + head
        except BaseException:
            self._give_back(infile)  # nothing of it reached the socket
            raise
        stream = self._stream
        with self._wlock:
            self._writing += 1
            backlog, self._backlog = self._backlog, None
        try:
            if backlog is not None:
                stream.write(backlog)
            if not views or sum(v.nbytes for v in views) <= _SMALL:
                await stream.write(b"".join([head, body, *views]))
                return
            stream.write(head + body)
            for view in views[:-1]:
                stream.write(view)
            await stream.write(views[-1])
        except Exception as exc:  # noqa: BLE001 - tornado's StreamClosedError and socket errors
            raise _closed(self.comm, exc) from None
        finally:
            with self._wlock:
                self._writing -= 1

    def write_now(self, message: Any, buffers: list, lead: Any = None) -> bool:
        """From any thread: write a small message (and its buffers, at most 64 KiB) on the
        socket at once, as :meth:`write` would on the loop, if no write of the loop is under
        way; saves the hop to the loop (a wake-up of its thread) per message.

        What the socket does not take at once goes out on the loop, before any later
        message; a connection that broke shows there (and in :meth:`read`) as for
        :meth:`write`.

        Args:
            lead: a callable giving a message without buffers to write just before this
                one, in the same write (or ``None``); called only if this writes.

        Returns:
            ``False`` (nothing written, ``lead`` not called) when the message must go through
            :meth:`write` on the loop: not a byte stream, too large, or the loop is writing.
        """
        if not self._raw:
            return False
        views = [memoryview(b).cast("B") for b in buffers]
        infile = None
        if sum(v.nbytes for v in views) > _SMALL:
            if self.files is None or not _worth_a_file(views) or self._busy():
                return False  # the loop's write copies it in its executor, beside other copies
            message, views = self._put(message, views)  # copied here, on the calling thread
            infile = message if isinstance(message, memfiles.InFile) else None
            if infile is None or sum(v.nbytes for v in views) > _SMALL:
                self._give_back(infile)
                return False
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > _READ_BUFFER:
            self._give_back(infile)
            return False  # a large pickle (a result without buffers of its own): the loop writes it
        head = _HEAD.pack(len(body), len(views)) + b"".join(_SIZE.pack(v.nbytes) for v in views)
        with self._wlock:
            sock = self._stream.socket  # None once tornado closed it
            if (
                self._writing
                or self._backlog is not None
                or sock is None
                or self._stream.closed()
                # bytes of a loop write whose coroutine was cancelled may still be queued
                or self._stream.writing()
            ):
                self._give_back(infile)
                return False
            first = None if lead is None else lead()
            if first is not None:
                first = pickle.dumps(first, protocol=pickle.HIGHEST_PROTOCOL)
                head = _HEAD.pack(len(first), 0) + first + head
            data = b"".join([head, body, *views])
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                sent = 0  # broken: the loop's write of the backlog says so
            if sent == len(data):
                return True
            self._backlog = data[sent:]
        try:
            self._loop.call_soon_threadsafe(self._start_flush)
        except RuntimeError:  # the loop is closed: so is the connection
            pass
        return True

    def _busy(self) -> bool:
        """Whether a write from another thread would have to wait for the loop now."""
        return bool(self._writing or self._backlog is not None or self._stream.writing())

    def _put(self, message: Any, views: list) -> tuple[Any, list]:
        """``message`` with its large buffers in a shared-memory file (``memfiles.InFile``),
        or as it was if no file can be made (logged: the socket takes them)."""
        ref = weakref.ref(self)

        def alive() -> bool:
            frames = ref()
            return frames is not None and not frames.closed()

        try:
            return self.files.put(message, views, alive)
        except OSError as exc:
            logger.warning(
                "daskwg: no shared-memory file for a message (%s): sending it over the socket", exc
            )
            return message, views

    def _give_back(self, infile: Any) -> None:
        if type(infile) is memfiles.InFile:
            self.files.give_back(infile)

    async def _filed(self, message: Any, views: list) -> tuple[Any, list]:
        """:meth:`_put` in a thread of the loop's executor (the copy takes milliseconds);
        a file written for a write that was cancelled meanwhile is given back."""
        done = self._loop.run_in_executor(None, self._put, message, views)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            done.add_done_callback(lambda f: f.cancelled() or f.exception() or self._give_back(f.result()[0]))
            raise

    def _start_flush(self) -> None:
        self._flushing = asyncio.ensure_future(self._flush_backlog())

    @property
    def backlogged(self) -> bool:
        """Whether part of what :meth:`write_now` wrote waits for the loop (:meth:`drain`)."""
        return self._backlog is not None

    async def drain(self) -> None:
        """On the stream's loop: until what :meth:`write_now` could not write at once has
        gone out (at once when nothing is left)."""
        if self._backlog is not None:
            await asyncio.sleep(0)  # the flush write_now asked this loop for starts
        flushing = self._flushing
        if flushing is not None and not flushing.done():
            await asyncio.shield(flushing)

    async def _flush_backlog(self) -> None:
        with self._wlock:
            backlog, self._backlog = self._backlog, None
            if backlog is None:
                return  # a write on the loop took it first
            self._writing += 1
        try:
            await self._stream.write(backlog)
        except Exception:  # noqa: BLE001 - closed: the reader fails the calls waiting
            self.comm.abort()
        finally:
            with self._wlock:
                self._writing -= 1

    async def read(self) -> tuple[Any, list]:
        """The next message and its buffers (writable numpy arrays of this process's own).

        Raises:
            CommClosedError: the connection closed.
        """
        if self._stream is None:
            frame = await self.comm.read()
            buffers = [np.frombuffer(bytearray(b), dtype=np.uint8) for b in frame["b"]]
            _count("inproc", len(frame["m"]) + sum(b.nbytes for b in buffers))
            return pickle.loads(frame["m"]), buffers
        try:
            await self._fill(_HEAD.size)
            n, count = _HEAD.unpack_from(self._rbuf, self._rpos)
            self._rpos += _HEAD.size
            await self._fill(_SIZE.size * count + n)
            sizes = struct.unpack_from(f"<{count}Q", self._rbuf, self._rpos) if count else ()
            self._rpos += _SIZE.size * count
            with self._rview[self._rpos : self._rpos + n] as body:
                message = pickle.loads(body)
            self._rpos += n
            infile = message if type(message) is memfiles.InFile else None
            buffers = []
            if sizes and sum(sizes) <= _SMALL:
                total = sum(sizes)
                await self._fill(total)
                block = np.frombuffer(self._rbuf, dtype=np.uint8, count=total, offset=self._rpos).copy()
                self._rpos += total
                offset = 0
                for size in sizes:
                    buffers.append(block[offset : offset + size])
                    offset += size
            else:
                for size in sizes:
                    buffers.append(await self._read_buffer(size))
            self._shrink()
            _count(self._kind, _HEAD.size + _SIZE.size * count + n + sum(sizes))
            if infile is not None:
                try:
                    message, buffers = infile.take(buffers)
                    _count("files", max(0, sum(memoryview(b).nbytes for b in buffers) - sum(sizes)))
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        hint = "this process has too many open files: raise its limit (ulimit -n)"
                    else:
                        hint = "set daskwg.shared-memory: false if processes of this host cannot map each other's files"
                    why = (
                        f"a shared-memory file of a message from process {infile.where[0][1].get('pid')} "
                        f"could not be mapped here ({exc}); the call stream closes: {hint}"
                    )
                    logger.error("daskwg: %s", why)
                    self.comm.abort()
                    raise CommClosedError(why) from exc
        except Exception as exc:  # noqa: BLE001 - tornado's StreamClosedError and socket errors
            raise _closed(self.comm, exc) from None
        return message, buffers

    async def _fill(self, need: int) -> None:
        """Read until ``need`` bytes past ``_rpos`` are in the read buffer.

        Every read asks for as much as the buffer holds and takes whatever has come
        (``read_into(partial=True)``): tornado then never holds bytes of its own between
        messages, so the socket stays registered for reading from one message to the next
        (a read that leaves bytes in tornado's buffer unregisters it, and the next one
        registers it again: two ``epoll_ctl`` calls and their bookkeeping per message).
        """
        if self._rend - self._rpos >= need:
            return
        if self._rpos == self._rend:
            self._rpos = self._rend = 0
        if self._rpos + need > len(self._rbuf):
            kept = self._rend - self._rpos
            if need > len(self._rbuf) or kept > len(self._rbuf) // 2:
                grown = bytearray(max(need, _READ_BUFFER))
                grown[:kept] = self._rview[self._rpos : self._rend]
                self._rbuf, self._rview = grown, memoryview(grown)
            else:
                self._rbuf[:kept] = bytes(self._rview[self._rpos : self._rend])
            self._rpos, self._rend = 0, kept
        while self._rend - self._rpos < need:
            self._rend += await self._stream.read_into(self._rview[self._rend :], partial=True)

    async def _read_buffer(self, size: int) -> np.ndarray:
        """One large buffer of ``size`` bytes: what the read buffer has of it, then the
        rest straight from the socket into the receive buffer (no copy)."""
        buffer = receive_buffer(size)
        have = min(size, self._rend - self._rpos)
        if have:
            buffer[:have] = np.frombuffer(self._rbuf, dtype=np.uint8, count=have, offset=self._rpos)
            self._rpos += have
        if size > have:
            await self._stream.read_into(memoryview(buffer)[have:])
        return buffer

    def _shrink(self) -> None:
        # A read buffer grown for one large message goes back to its size once it is empty.
        if self._rpos == self._rend and len(self._rbuf) > _READ_BUFFER:
            self._rbuf = bytearray(_READ_BUFFER)
            self._rview = memoryview(self._rbuf)
            self._rpos = self._rend = 0

    def abort(self) -> None:
        self.comm.abort()


_warned = False  # a shared-memory file could not be made: said once at warning level


def _worth_a_file(views: list) -> bool:
    """Whether a message has a buffer of :data:`daskwg.wire.memfiles.BUFFER_SMALLEST` bytes or more."""
    return any(v.nbytes >= memfiles.BUFFER_SMALLEST for v in views)


def _closed(comm: Any, exc: BaseException) -> Exception:
    if isinstance(exc, (CommClosedError, OSError)):
        return exc
    comm.abort()
    return CommClosedError(f"in {comm}: {type(exc).__name__}: {exc}")
