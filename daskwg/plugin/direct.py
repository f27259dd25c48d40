"""Calls that come straight to this worker (the direct path): :class:`DirectCalls`.

A driver sends each call on its call stream to the rank's worker (``daskwg.plugin.stream``,
a :class:`daskwg.wire.messages.CallMessage`); the call is unpacked here, its
``DataProtoFuture`` inputs start to arrive (``daskwg.plugin.inputs``), it takes its place in
the driver's order on the host thread (:meth:`daskwg.plugin.host.HostPlugin.enqueue`), and
its :class:`Outcome` goes back: the result (a blocking call's, or a small kept one), or the
error shaped for the driver. A non-blocking call's result stays here under its key
(``daskwg.plugin.results``).
"""

from __future__ import annotations

import functools
import logging
import pickle
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CallCancelledError
from ..serialization import pickling as serialization
from ..wire.messages import Call, CallMessage
from . import rows
from .exceptions import picklable, unpickling_error

if TYPE_CHECKING:
    from .host import HostPlugin

__all__ = ["DirectCalls", "Outcome"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call that came straight to this worker ended, as :meth:`DirectCalls.start`
    hands it to its ``reply`` (``daskwg.plugin.stream`` turns it into a
    :class:`~daskwg.wire.messages.Reply`).

    Attributes:
        status: ``"OK"``, ``"error"`` or ``"cancelled"``.
        nbytes: the result's size in bytes (``None`` unless ``"OK"``).
        error: the exception, shaped for the driver (``"error"`` only).
        result: the snapshot to send back: a blocking call's result, or a kept one of at
            most ``inline`` bytes holding no tensors or arrays; else ``None``.
        info: a kept batch's pickled :class:`~daskwg.wire.messages.PartInfo`, when the
            result stays here (``None``: not a batch, or too large to send along).
    """

    status: str
    nbytes: int | None = None
    error: BaseException | None = None
    result: serialization.Packed | None = None
    info: bytes | None = None


#: The outcome of a call cancelled before it ran, or interrupted.
CANCELLED = Outcome("cancelled")


class DirectCalls:
    """The direct path's calls on one worker.

    Args:
        host: the worker's host plugin (its order, call table, inputs and result store).
    """

    def __init__(self, host: HostPlugin):
        self.host = host

    def start(
        self, message: CallMessage, payload: serialization.Packed, reply: Callable[[Outcome], None]
    ) -> None:
        """Start one call that came straight to this worker, on the worker's event loop;
        ``reply(outcome)`` gets its outcome on the host thread as the call returns (so the
        reply can go out from there, without a wake-up of the loop), or on the loop when the
        call never reaches the host thread (it did not unpickle, it was refused or cancelled).

        Args:
            message: the call, as it came (its ``refs``: per ``LazyArg`` of the arguments
                ``(kind, values)``, pickled, fetched from now on by ``daskwg.plugin.inputs``;
                its ``key``: a non-blocking call's, its result stays here under it).
            payload: its arguments, pickled (:func:`daskwg.serialization.pickling.dumps`).
            reply: called once with the call's :class:`Outcome`.
        """
        host, call, key = self.host, message.call, message.key
        try:
            args = serialization.loads(payload)
            del payload
            refs = message.refs
            lazy = None if refs is None else host.inputs.prefetch(pickle.loads(refs), message.relay_wait)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the worker cannot import
            # The call never reaches the host: give up its place in the order.
            host.skip(call)
            error = unpickling_error(call, host.address, exc)
            if key is not None:
                host.results.fail(key, error)
            reply(Outcome("error", error=error))
            return
        if key is not None:
            host.results.expect(key, call.session)
        box = [args]
        del args
        cfut = host.enqueue(call, box, lazy, boxed=True)
        del box, lazy
        cfut.add_done_callback(functools.partial(self._ended, call, key, message.inline, reply))

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
            outcome = Outcome(
                "error", error=RuntimeError(f"daskwg's host failed finishing {call.method!r}: {exc!r}")
            )
        reply(outcome)

    def _outcome(self, call: Call, key: str | None, inline: int, cfut: ConcurrentFuture) -> Outcome:
        host = self.host
        if cfut.cancelled():
            if key is not None:  # its future was cancelled before it ran
                host.results.fail(key, CallCancelledError(call.method, call.rank, key))
            return CANCELLED
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
                return CANCELLED
            return Outcome("error", error=error)
        host.calls.forget_cancelled(call)
        result = cfut.result()
        if not isinstance(result, serialization.Packed):
            result = serialization.dumps(result)  # a life-cycle call's (None, True)
        if key is None:
            return Outcome("OK", result.nbytes, result=result)
        host.results.put(key, result)
        small = result.nbytes <= inline and not result.buffers  # batches stay here (data plane)
        if small:
            return Outcome("OK", result.nbytes, result=result)
        return Outcome("OK", result.nbytes, info=_part_info(result, key, host.address))


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
