"""Calls that come straight to this worker (the direct path): :class:`DirectCalls`.

A driver sends each call on its call stream to the rank's worker (``daskwg.plugin.stream``),
or as a ``daskwg_call`` request (how Dask actors are reached); either way the call is
unpacked here, its ``DataProtoFuture`` inputs start to arrive (``daskwg.plugin.inputs``),
it takes its place in the driver's order on the host thread
(:meth:`daskwg.plugin.host.HostPlugin.enqueue`), and its outcome goes back: the result
(a blocking call's, or a small kept one), or the error shaped for the driver. A
non-blocking call's result stays here under its key (``daskwg.plugin.results``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

from distributed.protocol import to_serialize

from ..errors import CallCancelledError
from ..serialization import pickling as serialization
from ..serialization.parts import message_part, unpack, unpacked_part
from ..wire.messages import Call
from . import rows
from .exceptions import picklable, unpickling_error

__all__ = ["DirectCalls"]

logger = logging.getLogger(__name__)


class DirectCalls:
    """The direct path's calls on one worker.

    Args:
        host: the worker's ``HostPlugin`` (its sequencer, call table, inputs and result store).
    """

    def __init__(self, host: Any):
        self.host = host

    async def handle_call(
        self,
        call: tuple,
        payload: dict,
        key: str | None = None,
        refs: dict | None = None,
        inline: int = 0,
        relay_wait: float = 10.0,
    ) -> dict:
        """A call as a Dask request (``daskwg_call``): :meth:`run` it and reply with
        ``{"status": "OK", "result": packed result}`` (``"nbytes"`` too for a kept one) or
        ``{"status": "error", "exception": ...}`` or ``{"status": "cancelled"}``. Drivers
        send calls on call streams (``daskwg_stream``); this serves what else sends one."""
        status, nbytes, error, result, *_ = await self.run(
            Call(*call), unpacked_part(payload), refs, key, inline, relay_wait
        )
        if status != "OK":
            return {"status": status, "exception": to_serialize(error)}
        reply: dict = {"status": "OK", "nbytes": nbytes}
        if result is not None:
            reply["result"] = message_part(result)
        return reply

    async def run(
        self,
        call: Call,
        payload: serialization.Packed,
        refs: Any,
        key: str | None = None,
        inline: int = 0,
        relay_wait: float = 10.0,
    ) -> tuple:
        """:meth:`start` one call and wait for its outcome, on the worker's event loop:
        ``(status, nbytes, error, result)`` as :meth:`start` gives it."""
        loop = asyncio.get_running_loop()
        outcome = loop.create_future()

        def reply(result: tuple) -> None:
            loop.call_soon_threadsafe(_resolve, outcome, result)

        self.start(call, payload, refs, key, inline, relay_wait, reply)
        return await outcome

    def start(
        self,
        call: Call,
        payload: serialization.Packed,
        refs: Any,
        key: str | None,
        inline: int,
        relay_wait: float,
        reply: Callable[[tuple], None],
    ) -> None:
        """Start one call that came straight to this worker, on the worker's event loop;
        ``reply(outcome)`` gets its outcome on the host thread as the call returns (so the
        reply can go out from there, without a wake-up of the loop), or on the loop when the
        call never reaches the host thread (it did not unpickle, it was refused or cancelled).

        Args:
            call: the call.
            payload: its arguments, pickled (:func:`daskwg.serialization.pickling.dumps`).
            refs: per ``LazyArg`` of the arguments ``(kind, values)``, pickled or as a
                message part (``None``: none): fetched from now on (``daskwg.plugin.inputs``).
            key: a non-blocking call's: its result stays here under ``key``.
            inline: bytes up to which a kept result is returned as well.
            relay_wait: ``daskwg.relay-wait`` (seconds), for relayed inputs.
            reply: called once with ``(status, nbytes, error, result)``: ``status`` ``"OK"``,
                ``"error"`` or ``"cancelled"``; ``nbytes`` a kept result's size; ``error`` the
                exception (shaped for the driver); ``result`` the snapshot to send back (a
                blocking call's, or a kept one of at most ``inline`` bytes holding no tensors
                or arrays), else ``None``; a kept batch's outcome has a fifth item, its
                pickled ``PartInfo`` (or ``None``).
        """
        host = self.host
        try:
            args = serialization.loads(payload)
            del payload
            if refs is not None:
                refs = pickle.loads(refs) if isinstance(refs, bytes) else unpack(refs)
            lazy = None if refs is None else host._inputs.prefetch(refs, relay_wait)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the worker cannot import
            # The call never reaches the host: give up its place in the order.
            host._sequencer.skip(call.session, call.seq)
            error = unpickling_error(call, host.address, exc)
            if key is not None:
                host.results.fail(key, error)
            reply(("error", None, error, None))
            return
        if key is not None:
            host.results.expect(key, call.session)
        box = [args]
        del args
        cfut = host.enqueue(call, box, lazy, boxed=True)
        del box, lazy
        cfut.add_done_callback(functools.partial(self._ended, call, key, inline, reply))

    def _ended(
        self, call: Call, key: str | None, inline: int, reply: Callable, cfut: ConcurrentFuture
    ) -> None:
        # The call's future is done: on the host thread as the call returns (the sequencer
        # sets it there), on the loop if it was refused or cancelled before it ran. A done
        # callback's exception is only logged by concurrent.futures: the reply must go anyway.
        try:
            outcome = self._outcome(call, key, inline, cfut)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle
            logger.exception("daskwg: finishing call %s failed", call)
            outcome = (
                "error",
                None,
                RuntimeError(f"daskwg's host failed finishing {call.method!r}: {exc!r}"),
                None,
            )
        reply(outcome)

    def _outcome(self, call: Call, key: str | None, inline: int, cfut: ConcurrentFuture) -> tuple:
        host = self.host
        if cfut.cancelled():
            if key is not None:  # its future was cancelled before it ran
                host.results.fail(key, CallCancelledError(call.method, call.rank, key))
            return ("cancelled", None, None, None)
        exc = cfut.exception()
        if exc is not None:
            cancelled = host.calls.was_cancelled(call)
            # A consumer of the result of an interrupted call reads why it is missing.
            error = CallCancelledError(call.method, call.rank, key) if cancelled else picklable(exc)
            del exc
            if key is not None:
                host.results.fail(key, error)
            if cancelled:
                host.calls.forget_cancelled(call)
                return ("cancelled", None, None, None)
            return ("error", None, error, None)
        host.calls.forget_cancelled(call)
        result = cfut.result()
        if not isinstance(result, serialization.Packed):
            result = serialization.dumps(result)  # a life-cycle call's (None, True)
        if key is None:
            return ("OK", result.nbytes, None, result)
        host.results.put(key, result)
        small = result.nbytes <= inline and not result.buffers  # batches stay here (data plane)
        if small:
            return ("OK", result.nbytes, None, result)
        return ("OK", result.nbytes, None, None, _part_info(result, key, host.address))


def _part_info(result: serialization.Packed, key: str, address: str) -> bytes | None:
    """The pickled :class:`~daskwg.wire.messages.PartInfo` of a kept result that is a batch, for its
    reply (consumers the driver sends it to need not ask for it); ``None`` for anything
    else, or for one too large to send along (a ``meta_info`` of more than 16 KiB)."""
    if not result.buffers:
        return None  # no tensors, no batch
    try:
        info = pickle.dumps(rows.part_info_of(result, key, address))
    except Exception:  # noqa: BLE001 - not a batch, or a meta_info that does not pickle
        return None
    return info if len(info) <= INFO_LIMIT else None


#: Bytes of a pickled PartInfo up to which it goes with its call's reply.
INFO_LIMIT = 16 << 10


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
