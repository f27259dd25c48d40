"""A driver's call stream to this worker: the ``Handler.STREAM`` handler (:func:`serve`).

Drivers send their calls to a worker on call streams (``daskwg.transport.streams``): one
connection per driver loop and worker, which a Dask comm opened and on which both ends then
write :class:`daskwg.wire.frames.FrameStream` frames. Each message is one call
(:class:`daskwg.wire.messages.CallMessage`, the arguments' buffers beside it), step plan
(:class:`~daskwg.wire.messages.PlanMessage`), fetch or free; each
:class:`~daskwg.wire.messages.Reply` goes out when its call finishes, in whatever order
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
from ..wire.messages import (
    FANOUT,
    CallMessage,
    FanoutMessage,
    FetchMessage,
    FreeMessage,
    PlanMessage,
    Reply,
)
from .direct import Outcome
from .leader import HostLeader

__all__ = ["serve"]

logger = logging.getLogger(__name__)


async def serve(
    comm: Any,
    start: Callable[[CallMessage, serialization.Packed, Callable[[Outcome], None]], None],
    free: Callable[[list], None],
    start_plan: Callable[..., None],
    fetch: Callable[..., Awaitable[serialization.Packed]],
    files: dict | None = None,
    leader: HostLeader | None = None,
) -> Any:
    """Serve one call stream until the driver closes it.

    Args:
        comm: the stream's comm (the handler's first argument).
        start: :meth:`daskwg.plugin.direct.DirectCalls.start` ``(message, payload, reply)``.
        start_plan: ``PlanRunner.start(entries, payload, inline, reply)`` (a step plan's replay,
            :class:`daskwg.wire.messages.PlanMessage`).
        free: drops kept results by key (a :class:`~daskwg.wire.messages.FreeMessage`: the
            driver let go of them before the scheduler heard of them).
        fetch: ``ResultStore.packed(key, session, seq, source)``, the pickled value of a
            kept result (a :class:`~daskwg.wire.messages.FetchMessage`), answered as a call's reply.
        files: the driver's :func:`daskwg.wire.memfiles.probe`, sent by a driver of this host
            (``daskwg.transport.streams``): this side answers whether it maps the driver's
            files (with ``daskwg.shared-memory`` on here too) and with its own probe; the
            driver's ``("files", 0, ok)`` says whether it maps this side's.
        leader: this worker's :class:`~daskwg.plugin.leader.HostLeader`, for a
            :class:`~daskwg.wire.messages.FanoutMessage` (``None``: its calls are answered
            with an error).

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
        kind = message[0]
        if kind == "call":
            _one(frames, lock, CallMessage.from_wire(message), buffers, start)
        elif kind == "plan":
            _plan(frames, lock, PlanMessage.from_wire(message), buffers, start_plan)
        elif kind == "fanout":
            _fanout(frames, lock, FanoutMessage.from_wire(message), buffers, start, leader)
        elif kind == "fetch":
            asyncio.ensure_future(_fetch(frames, lock, FetchMessage.from_wire(message), fetch))
        elif kind == "free":
            free(FreeMessage.from_wire(message).keys)
        elif message[0] == "files":
            frames.files = memfiles.send_files() if message[2] else None
        else:
            logger.warning("daskwg call stream: unknown message %r ignored", kind)
        # A call's arguments are not kept here until the driver's next message.
        message = buffers = None
    return Status.dont_reply


def _one(frames: FrameStream, lock: asyncio.Lock, message: CallMessage, buffers: list, start: Any) -> None:
    cid = message.cid
    loop = asyncio.get_running_loop()

    def reply(outcome: Outcome) -> None:
        error, result = outcome.error, outcome.result
        answer = Reply(
            cid,
            outcome.status,
            outcome.nbytes,
            None if error is None else _pickled(error),
            None if result is None else result.header,
            outcome.info,
        )
        _send(frames, lock, loop, answer, [] if result is None else result.buffers)

    try:
        start(message, serialization.Packed(message.header, buffers), reply)
    except Exception as exc:  # noqa: BLE001 - start answers its own errors; this is a defect
        logger.exception("daskwg call stream: call %s failed outside the host", message.call)
        reply(Outcome("error", error=RuntimeError(f"daskwg's host failed: {exc!r}")))


def _fanout(
    frames: FrameStream,
    lock: asyncio.Lock,
    message: FanoutMessage,
    buffers: list,
    start: Any,
    leader: HostLeader | None,
) -> None:
    """A host leader's message (``daskwg.plugin.leader``): its calls handed on, their
    answers gathered into :data:`~daskwg.wire.messages.FANOUT` replies."""
    cid = message.cid
    loop = asyncio.get_running_loop()

    def send(records: list, out_buffers: list) -> None:
        _send(frames, lock, loop, Reply(cid, FANOUT, header=pickle.dumps(records)), out_buffers)

    def start_own(call: CallMessage, payload: list, answer: Any, index: int) -> None:
        def reply(outcome: Outcome) -> None:
            fields, out = _fields(outcome)
            answer(index, fields, out)

        try:
            start(call, serialization.Packed(call.header, payload), reply)
        except Exception as exc:  # noqa: BLE001 - start answers its own errors; this is a defect
            logger.exception("daskwg call stream: call %s failed outside the host", call.call)
            reply(Outcome("error", error=RuntimeError(f"daskwg's host failed: {exc!r}")))

    if leader is None:
        error = _pickled(RuntimeError("this daskwg worker takes no host leader's messages"))
        send([(i, ("error", None, error, None, None), 0) for i in range(len(message.members))], [])
        return
    leader.start(message, buffers, start_own, send)


def _fields(outcome: Outcome) -> tuple[tuple, list]:
    """An outcome as a reply's ``(status, nbytes, error, header, info)`` and its buffers."""
    error, result = outcome.error, outcome.result
    fields = (
        outcome.status,
        outcome.nbytes,
        None if error is None else _pickled(error),
        None if result is None else result.header,
        outcome.info,
    )
    return fields, [] if result is None else result.buffers


def _send(
    frames: FrameStream,
    lock: asyncio.Lock,
    loop: asyncio.AbstractEventLoop,
    reply: Reply,
    buffers: list,
) -> None:
    """Write a reply from whichever thread has it: at once if the stream takes it
    (``FrameStream.write_now``), else on the stream's loop."""
    message = reply.to_wire()
    try:
        if frames.write_now(message, buffers):
            return
    except Exception as exc:  # noqa: BLE001 - the reply does not pickle: say so instead
        logger.exception("daskwg call stream: a reply could not be written")
        failed = RuntimeError(f"daskwg's reply failed: {exc!r}")
        message, buffers = Reply(reply.cid, "error", error=_pickled(failed)).to_wire(), []
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


def _plan(
    frames: FrameStream, lock: asyncio.Lock, message: PlanMessage, buffers: list, start_plan: Any
) -> None:
    cid, entries = message.cid, message.entries
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
        _send(frames, lock, loop, Reply(cid, "plan", header=pickle.dumps(records)), out_buffers)

    try:
        start_plan(entries, serialization.Packed(message.header, buffers), message.inline, reply)
    except Exception as exc:  # noqa: BLE001 - start_plan answers its own errors; this is a defect
        logger.exception("daskwg call stream: a step plan failed outside the host")
        reply([("error", None, RuntimeError(f"daskwg's host failed: {exc!r}"), None)] * len(entries))


async def _fetch(frames: FrameStream, lock: asyncio.Lock, message: FetchMessage, fetch: Any) -> None:
    cid = message.cid
    try:
        packed = await fetch(message.key, message.session, message.seq, message.source)
    except asyncio.CancelledError:
        return  # the worker is closing: the driver sees the stream close
    except Exception as exc:  # noqa: BLE001 - the driver raises it
        reply, buffers = Reply(cid, "error", error=_pickled(exc)), []
    else:
        reply, buffers = Reply(cid, "OK", packed.nbytes, header=packed.header), packed.buffers
    async with lock:
        try:
            await frames.write(reply.to_wire(), buffers)
        except OSError:
            pass  # the driver is gone


def _pickled(error: BaseException) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - shaped by the host to pickle; this is the last resort
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {safe_str(error)}"))
