"""A driver's call stream to this worker: the ``daskwg_stream`` handler (:func:`serve`).

Drivers send their calls to a worker on call streams (``daskwg.transport.streams``): one
connection per driver loop and worker, which a Dask comm opened and on which both ends then
write :class:`daskwg.wire.frames.FrameStream` frames. Each message is one call
(:func:`daskwg.wire.messages.call_message`, the arguments' buffers beside it); each reply
(:func:`daskwg.wire.messages.reply_message`) goes out when its call finishes, in whatever order
calls finish, so no connection is held per waiting call.

Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

from distributed.core import Status

from ..config import Settings
from ..errors import safe_str
from ..serialization import pickling as serialization
from ..wire import memfiles
from ..wire.frames import FrameStream
from ..wire.messages import Call, reply_message

__all__ = ["serve"]

logger = logging.getLogger(__name__)


async def serve(
    comm: Any,
    start: Callable[..., None],
    free: Callable[[list], None],
    start_plan: Callable[..., None],
    fetch: Callable[..., Awaitable[serialization.Packed]],
    files: dict | None = None,
) -> Any:
    """Serve one call stream until the driver closes it.

    Args:
        comm: the stream's comm (the handler's first argument).
        start: the host's ``start(call, payload, refs, key, inline, relay_wait, reply)``.
        start_plan: ``PlanRunner.start(entries, payload, inline, reply)`` (a step plan's replay,
            :func:`daskwg.wire.messages.plan_message`).
        free: drops kept results by key (a ``("free", 0, keys)`` message: the driver let go
            of them before the scheduler heard of them).
        fetch: ``ResultStore.packed(key, session, seq, source)``, the pickled value of a
            kept result (a :func:`daskwg.wire.messages.fetch_message`), answered as a call's reply.
        files: the driver's :func:`daskwg.wire.memfiles.probe`, sent by a driver of this host
            (``daskwg.transport.streams``): this side answers whether it maps the driver's
            files (with ``daskwg.shared-memory`` on here too) and with its own probe; the
            driver's ``("files", 0, ok)`` says whether it maps this side's.

    Returns:
        ``Status.dont_reply`` (replies go out as calls finish).
    """
    frames = FrameStream(comm)
    lock = asyncio.Lock()
    if files is not None:
        ours = Settings.current().shared_memory and memfiles.can_open(files)
        try:
            await frames.write(("files", ours, memfiles.probe() if ours else None))
        except OSError:
            return Status.dont_reply
    while True:
        try:
            message, buffers = await frames.read()
        except OSError:  # CommClosedError: the driver closed it, or went away
            break
        if message[0] == "call":
            _one(frames, lock, message, buffers, start)
        elif message[0] == "plan":
            _plan(frames, lock, message, buffers, start_plan)
        elif message[0] == "fetch":
            asyncio.ensure_future(_fetch(frames, lock, message, fetch))
        elif message[0] == "free":
            free(list(message[2]))
        elif message[0] == "files":
            frames.files = memfiles.send_files() if message[2] else None
        else:
            logger.warning("daskwg call stream: unknown message %r ignored", message[0])
        # A call's arguments are not kept here until the driver's next message.
        message = buffers = None
    return Status.dont_reply


def _one(frames: FrameStream, lock: asyncio.Lock, message: tuple, buffers: list, start: Any) -> None:
    _, cid, call, header, key, inline, relay_wait, refs = message
    loop = asyncio.get_running_loop()

    def reply(outcome: tuple) -> None:
        status, nbytes, error, result, *info = outcome
        message = reply_message(
            cid,
            status,
            nbytes,
            None if error is None else _pickled(error),
            None if result is None else result.header,
            info[0] if info else None,
        )
        _send(frames, lock, loop, cid, message, [] if result is None else result.buffers)

    try:
        start(Call(*call), serialization.Packed(header, buffers), refs, key, inline, relay_wait, reply)
    except Exception as exc:  # noqa: BLE001 - start answers its own errors; this is a defect
        logger.exception("daskwg call stream: call %s failed outside the host", call)
        reply(("error", None, RuntimeError(f"daskwg's host failed: {exc!r}"), None))


def _send(
    frames: FrameStream,
    lock: asyncio.Lock,
    loop: asyncio.AbstractEventLoop,
    cid: int,
    message: tuple,
    buffers: list,
) -> None:
    """Write a reply from whichever thread has it: at once if the stream takes it
    (``FrameStream.write_now``), else on the stream's loop."""
    try:
        if frames.write_now(message, buffers):
            return
    except Exception as exc:  # noqa: BLE001 - the reply does not pickle: say so instead
        logger.exception("daskwg call stream: a reply could not be written")
        message, buffers = (
            reply_message(
                cid, "error", None, _pickled(RuntimeError(f"daskwg's reply failed: {exc!r}")), None
            ),
            [],
        )
    try:
        loop.call_soon_threadsafe(_write_later, frames, lock, message, buffers)
    except RuntimeError:
        pass  # the loop is closed: the worker is closing, and the driver sees the stream close


def _write_later(frames: FrameStream, lock: asyncio.Lock, message: tuple, buffers: list) -> None:
    asyncio.ensure_future(_write(frames, lock, message, buffers))


async def _write(frames: FrameStream, lock: asyncio.Lock, message: tuple, buffers: list) -> None:
    async with lock:
        try:
            await frames.write(message, buffers)
        except OSError:
            pass  # the driver is gone; kept results stay until it is released


def _plan(frames: FrameStream, lock: asyncio.Lock, message: tuple, buffers: list, start_plan: Any) -> None:
    _, cid, entries, header, inline = message
    loop = asyncio.get_running_loop()

    def reply(outcomes: list[tuple]) -> None:
        records, out_buffers = [], []
        for status, nbytes, error, result in outcomes:
            records.append(
                (
                    status,
                    nbytes,
                    None if error is None else _pickled(error),
                    None if result is None else result.header,
                    0 if result is None else len(result.buffers),
                )
            )
            if result is not None:
                out_buffers.extend(result.buffers)
        message = reply_message(cid, "plan", None, None, pickle.dumps(records))
        _send(frames, lock, loop, cid, message, out_buffers)

    try:
        start_plan(entries, serialization.Packed(header, buffers), inline, reply)
    except Exception as exc:  # noqa: BLE001 - start_plan answers its own errors; this is a defect
        logger.exception("daskwg call stream: a step plan failed outside the host")
        reply([("error", None, RuntimeError(f"daskwg's host failed: {exc!r}"), None)] * len(entries))


async def _fetch(frames: FrameStream, lock: asyncio.Lock, message: tuple, fetch: Any) -> None:
    _, cid, key, session, seq, source = message
    try:
        packed = await fetch(key, session, seq, source)
    except asyncio.CancelledError:
        return  # the worker is closing: the driver sees the stream close
    except Exception as exc:  # noqa: BLE001 - the driver raises it
        reply, buffers = reply_message(cid, "error", None, _pickled(exc), None), []
    else:
        reply, buffers = reply_message(cid, "OK", packed.nbytes, None, packed.header), packed.buffers
    async with lock:
        try:
            await frames.write(reply, buffers)
        except OSError:
            pass  # the driver is gone


def _pickled(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - shaped by the host to pickle; this is the last resort
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {safe_str(error)}"))
