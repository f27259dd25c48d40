"""A replayed step plan's part on this worker (``daskwg.plan``): :class:`PlanRunner`.

One ``("plan", ...)`` message on a driver's call stream (:class:`daskwg.wire.messages.PlanMessage`)
carries every call that one replay of a step makes on this worker's ranks, in the driver's
order, under consecutive sequence numbers of the driver's session. They take their place
in that order as one item and run in one turn of the host thread: each call as an ordinary
call runs (the rank's environment, ``status()``, metrics, errors shaped for the driver), and
the output of one call that a later call on the same rank reads (a
:class:`daskwg.wire.messages.Slot` among its arguments) is handed over in this process, never sent
anywhere. One reply goes back when the last of them has run.

A call whose input failed fails with that input's error; the other calls still run, as
ordinary calls with independent inputs do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import foreign
from ..errors import GroupBrokenError, RankError
from ..futures.future import rows_of
from ..serialization import pickling as serialization
from ..serialization.snapshots import private
from ..wire.messages import Call, Slot
from .exceptions import picklable, unpickling_error
from .rank import snapshot

if TYPE_CHECKING:
    from .host import HostPlugin

__all__ = ["PlanRunner"]

logger = logging.getLogger(__name__)


class PlanRunner:
    """Runs the step plans that arrive at one worker.

    Args:
        host: the worker's host plugin (its order, call table, result store and the
            ``execute`` that runs one call on the host thread).
    """

    def __init__(self, host: HostPlugin):
        self.host = host

    async def run(self, entries: list[tuple], payload: serialization.Packed, inline: int) -> list[tuple]:
        """:meth:`start` one replay's calls on this worker and wait for their outcomes, on the
        worker's event loop."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def reply(outcomes: list[tuple]) -> None:
            loop.call_soon_threadsafe(_resolve, done, outcomes)

        self.start(entries, payload, inline, reply)
        return await done

    def start(
        self, entries: list[tuple], payload: serialization.Packed, inline: int, reply: Callable
    ) -> None:
        """Start one replay's calls on this worker (on its event loop); ``reply(outcomes)``
        gets, per call, ``(status, nbytes, error, result)`` as ``HostPlugin.start`` gives it
        (``result``: the snapshot to send back, or ``None``), on the host thread once the last
        call ran (on the loop if they never reach it).

        Args:
            entries: per call ``(call fields, key, result, uses, stop)``: ``result`` ``"keep"``
                (the result stays here under ``key``, the key of its future in the driver),
                ``"return"`` (it goes back with the reply) or ``"none"``; ``uses``: how many
                later calls here read it; ``stop``: if it fails, the later calls do not run.
            payload: the calls' ``(args, kwargs)``, pickled together, in order.
            inline: bytes up to which a kept result (a step's output) comes back with the
                reply as well, tensors included.
            reply: gets the outcomes.
        """
        host = self.host
        calls = [Call.from_wire(e[0]) for e in entries]
        try:
            payloads = serialization.loads(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the worker cannot import
            for call in calls:
                host.skip(call)
            error = unpickling_error(calls[0], host.address, exc)
            reply([("error", None, error, None)] * len(calls))
            return
        del payload
        for call, (_, key, result, *_rest) in zip(calls, entries):
            if result == "keep":
                host.results.expect(key, call.session)
        first = calls[0]
        host.calls.queue(first)
        cfut = host.take_turn(
            first, functools.partial(self._execute, calls, entries, payloads), span=len(calls)
        )
        del payloads
        cfut.add_done_callback(functools.partial(self._ended, first, entries, inline, reply))

    def _ended(self, first: Call, entries: list[tuple], inline: int, reply: Callable, cfut: Any) -> None:
        # On the host thread as the last call returns; on the loop if refused at once. A done
        # callback's exception is only logged by concurrent.futures: the reply must go anyway.
        try:
            replies = self._replies(first, entries, inline, cfut)
        except Exception as exc:  # noqa: BLE001 - a defect: the driver must still hear of the calls
            logger.exception("daskwg: finishing a step plan's calls failed")
            replies = [("error", None, RuntimeError(f"daskwg's host failed: {exc!r}"), None)] * len(entries)
        reply(replies)

    def _replies(self, first: Call, entries: list[tuple], inline: int, cfut: Any) -> list[tuple]:
        host = self.host
        exc = None if cfut.cancelled() else cfut.exception()
        if cfut.cancelled() or exc is not None:  # refused: a departed driver, a number twice
            host.calls.dequeue(first)
            error = picklable(exc if exc is not None else GroupBrokenError("the step's calls were cancelled"))
            outcomes = [(False, error)] * len(entries)
        else:
            outcomes = cfut.result()
        replies = []
        for (_, key, result, *_rest), (ok, value) in zip(entries, outcomes):
            if not ok:
                if result == "keep":
                    host.results.fail(key, value)
                replies.append(("error", None, value, None))
            elif result == "keep":
                host.results.put(key, value)
                # Kept entries are the step's outputs, which the replay returns: a small one
                # comes back with the reply, tensors and all (an ordinary call's batches stay).
                small = value.nbytes <= inline
                replies.append(("OK", value.nbytes, None, value if small else None))
            elif result == "return":
                replies.append(("OK", value.nbytes, None, value))
            else:  # a result nobody reads again: only that the call ended goes back
                replies.append(("OK", 0, None, None))
        return replies

    def _execute(self, calls: list[Call], entries: list[tuple], payloads: list) -> list[tuple]:
        """On the host thread: every call in turn; per call ``(ok, snapshot or error)``."""
        host = self.host
        held: dict[int, tuple] = {}  # index -> (snapshot or error, uses left, also kept or sent back)
        outcomes: list[tuple] = []
        stopped: BaseException | None = None  # a blocking call failed: the rest does not run
        for i, (call, entry) in enumerate(zip(calls, entries)):
            _, _key, result, uses, stop = entry
            args, kwargs = payloads[i]
            payloads[i] = None
            if stopped is not None:
                outcomes.append((False, stopped))
                held[i] = (stopped, uses, False)
                continue
            try:
                args = tuple(self._take(a, held, call) for a in args)
                kwargs = {k: self._take(v, held, call) for k, v in kwargs.items()}
            except BaseException as exc:  # noqa: BLE001 - an input's own error, or a shape check
                outcomes.append((False, exc))
                held[i] = (exc, uses, False)
                stopped = exc if stop else None
                continue
            # A result only the next call here reads goes to it as it is, if the rank kept
            # nothing of it (else as a snapshot, as any result).
            box = _HandOff([(args, kwargs)]) if result == "none" and uses == 1 else [(args, kwargs)]
            del args, kwargs
            try:
                packed = host.execute(call, box, None, True)
            except BaseException as exc:  # noqa: BLE001 - shaped by _execute for the driver
                error = picklable(exc)
                outcomes.append((False, error))
                held[i] = (error, uses, False)
                stopped = error if stop else None
                continue
            if uses:
                held[i] = (packed, uses, result != "none")
            outcomes.append((True, None if result == "none" else packed))
            del packed
        return outcomes

    def _take(self, value: Any, held: dict, call: Call) -> Any:
        if not isinstance(value, Slot):
            return value
        stored, uses, kept = held[value.index]
        if isinstance(stored, BaseException):
            raise stored
        uses -= 1
        if uses:
            held[value.index] = (stored, uses, kept)
        else:
            del held[value.index]
        if isinstance(stored, _Live):
            out = stored.value
        else:
            # The last reader of a result that neither stays nor goes back uses it in place;
            # any other reader gets its own.
            out = serialization.loads(stored, copy=bool(uses or kept))
        del stored
        if value.rows and _rows(out) != value.rows:
            problem = ValueError(
                f"the call before {call.method!r} returned {_rows(out)} rows on rank {call.rank} where the step's "
                f"earlier replays had {value.rows} on every rank: a step plan passes a DP_COMPUTE_PROTO output "
                "on to the next DP_COMPUTE_PROTO call rank by rank, which is what the calls without a plan do "
                "only while every rank's output has as many rows; record this step with "
                "daskwg.plan(compiled=False) if its stages return data-dependent numbers of rows"
            )
            raise RankError(call.rank, self.host.address, call.method, "", problem)
        return out


class _Live:
    """A result handed to the next call as it is (nothing else holds any of it)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _HandOff(list):
    """The box of a call whose result only the next call on its rank reads:
    ``HostPlugin._invoke`` packs the result with :meth:`pack` instead of a snapshot."""

    @staticmethod
    def pack(result: Any, call: Call, arguments: tuple) -> Any:
        # Held by _invoke's local and this argument, as rank.snapshot counts them.
        if private(result, held=2):
            return _Live(result)
        return snapshot(result, call, arguments)


def _rows(value: Any) -> int | None:
    """Rows of a batch (daskwg's or verl's ``DataProto``, a ``TensorDict``); ``None`` for anything else."""
    if foreign.is_verl_dataproto(value):
        return len(value)
    try:
        return rows_of(value)
    except TypeError:
        return None


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
