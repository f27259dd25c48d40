"""The submit path: non-blocking calls, sent straight to their ranks' workers like blocking
calls (one message per rank on the driver's call stream to that worker, no scheduler hop),
returning at once with one :class:`~daskwg.transport.owned.CallFuture` per rank, whose
result stays on the rank's worker under a key the driver owns.

The futures' keys read like task keys on the dashboard
(``"<group>.<method>-<call>-r<rank>-<id8>"``, :func:`daskwg.wire.messages.task_key`). Failures reach
them with the blocking path's errors: a rank that raised gives its ``RankError``, a stream
that closed a ``WorkerLostError``.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..config import Settings
from ..serialization import pickling as serialization
from ..wire import messages as wire
from ..wire.messages import Call
from .call_future import CallFuture
from .driver import GroupRanks, TaskCall
from .failure.state import TRANSFER_ERRORS, FailureState, transfer_error
from .leader import HostSubmit

__all__ = ["SubmitPath"]


#: Seconds a non-blocking call waits for a call stream being opened to take its messages.
OPENING_WAIT = 10.0


class SubmitPath:
    """Sends one group's non-blocking calls.

    Args:
        ranks: the group's ranks.
        failures: the group's failure state.
    """

    def __init__(self, ranks: GroupRanks, failures: FailureState):
        self.ranks = ranks
        self.failures = failures
        #: ``daskwg.fan-out``'s part: calls to hosts with several ranks through their leaders.
        self.leaders = HostSubmit(ranks, failures, self._reply)

    def submit(
        self,
        calls: list[Call],
        payloads: list[serialization.Packed],
        refs: list[list],
        keep: Sequence[Any],
        settings: Settings,
    ) -> list[CallFuture]:
        """Send one call per rank; returns their futures, in the order of ``calls``.

        Arguments of at most ``daskwg.scatter-above`` bytes are copied, and larger ones
        sent before this returns, so changing them afterwards changes nothing the ranks get.

        Args:
            calls: one per rank.
            payloads: each call's arguments, packed once.
            refs: per call, ``(kind, values)`` for each of its ``LazyArg``\\ s.
            keep: futures the calls read, kept alive until each call ends.
            settings: the call's settings.
        """
        ranks, driver = self.ranks, self.ranks.driver
        call_no = next(driver.call_numbers)
        now = time.monotonic()
        big = any(p.nbytes > settings.scatter_above for p in payloads)
        futures: list[CallFuture] = []
        messages = []
        try:
            for call, payload, call_refs in zip(calls, payloads, refs):
                key = wire.task_key(ranks.name, call.method, call_no, call.rank, ranks.group_id)
                future = driver.owned.create(call, key, ranks.address(call.rank), keep)
                driver.calls[future] = TaskCall(call, now, settings.paused_timeout)
                driver.inflight.add(ranks.slots[call.rank].server_id, future)
                futures.append(future)
                buffers = payload.buffers if big else [bytes(b) for b in payload.buffers]
                message = wire.CallMessage(
                    call,
                    payload.header,
                    key,
                    settings.inline_results,
                    settings.relay_wait,
                    pickle.dumps(call_refs) if call_refs else None,
                )
                messages.append((key, message.to_wire(), buffers))
            if settings.fan_out != "direct" and len(calls) > 1 and not any(refs):
                keys = [m[0] for m in messages]
                rest = self.leaders.send(calls, keys, payloads, settings, big, OPENING_WAIT)
                calls, messages = [calls[i] for i in rest], [messages[i] for i in rest]
            # Wait until the messages are written when they are large (they are not copied)
            # or when a stream must be opened first: a driver that closes its client right
            # after queuing calls (a script's last lines) would otherwise stop the client's
            # loop while the connection is still being made, and the calls never leave.
            # On open streams the write runs before anything the caller does next on the loop.
            # Waiting for a stream to open is bounded by OPENING_WAIT.
            opening = any(not driver.streams.is_open(ranks.address(c.rank), c.worker_id) for c in calls)
            written = threading.Event() if calls and (big or opening) else None
            if written is None:
                # Small calls on open streams are written from this thread, no hop to the loop.
                calls, messages = self._send_now(calls, messages)
            if calls:
                ranks.client.loop.add_callback(self._send_all, calls, messages, written)
        except BaseException:
            # Calls that were never sent must not hold up later ones on their workers.
            for call in calls:
                ranks.client.loop.add_callback(self._skip, call)
            raise
        if big and written is not None:
            written.wait()
        elif written is not None:
            # Bounded: a worker that cannot be reached fails these futures, not this call.
            written.wait(OPENING_WAIT)
        return futures

    def _send_now(self, calls: list[Call], messages: list) -> tuple[list[Call], list]:
        """Write what the streams take at once (``CallStreams.send_now``); returns the rest.
        ``messages``: per call ``(key, message, buffers)``, as :meth:`submit` makes them."""
        streams, address = self.ranks.driver.streams, self.ranks.address
        rest: tuple[list[Call], list] = ([], [])
        for call, (key, message, buffers) in zip(calls, messages):
            reply = functools.partial(self._reply, call, key)
            if not streams.send_now(address(call.rank), call.worker_id, message, buffers, reply):
                rest[0].append(call)
                rest[1].append((key, message, buffers))
        return rest

    def _send_all(self, calls: list[Call], messages: list, written: threading.Event | None) -> None:
        remaining = [len(calls)]

        def one_written() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and written is not None:
                written.set()

        for call, (key, message, buffers) in zip(calls, messages):
            asyncio.ensure_future(self._one(call, key, message, buffers, one_written))

    async def _one(self, call: Call, key: str, message: tuple, buffers: list, written: Any) -> None:
        driver, address = self.ranks.driver, self.ranks.address(call.rank)
        try:
            await driver.streams.send(
                address, call.worker_id, message, buffers, functools.partial(self._reply, call, key)
            )
        except OSError as exc:  # the stream closed, or could not be opened
            driver.owned.failed(key, await self.failures.connection_lost(call.rank, exc))
        finally:
            written()

    def _reply(self, call: Call, key: str, reply: Any, buffers: list) -> None:
        owned = self.ranks.driver.owned
        if isinstance(reply, BaseException):
            asyncio.ensure_future(self._lost(call, key, reply))
            return
        # A reply means the call has ended there (and every earlier one of this driver).
        self.ranks.driver.sequencer.note_finished(
            self.ranks.slots[call.rank].server_id, call.seq, call.session
        )
        answer = wire.Reply.from_wire(reply)
        if answer.status == "OK":
            inline = None if answer.header is None else serialization.Packed(answer.header, buffers)
            info = None if answer.info is None else _part_info(answer.info)
            owned.finished(key, answer.nbytes, inline, info)
        elif answer.status == "cancelled":
            owned.cancelled(key)
        else:
            try:
                exc = pickle.loads(answer.error)
            except TRANSFER_ERRORS as unpickling:
                exc = transfer_error(call.rank, self.ranks.address(call.rank), call.method, unpickling)
            asyncio.ensure_future(self._failed(call, key, exc))

    async def _failed(self, call: Call, key: str, exc: BaseException) -> None:
        self.ranks.driver.owned.failed(key, await self.failures.response_error(call, exc))

    async def _lost(self, call: Call, key: str, exc: BaseException) -> None:
        self.ranks.driver.owned.failed(key, await self.failures.connection_lost(call.rank, exc))

    async def _skip(self, call: Call) -> None:
        try:
            rpc = self.ranks.client.rpc(self.ranks.address(call.rank))
            await getattr(rpc, wire.Handler.SKIP)(session=call.session, seqs=[call.seq])
        except Exception:  # noqa: BLE001 - the worker may be gone; nothing waits there then
            pass


def _part_info(pickled: bytes) -> wire.PartInfo | None:
    """A reply's pickled ``PartInfo`` (``None`` if it does not unpickle here: the consuming
    ranks then ask for it)."""
    try:
        return pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - e.g. a meta_info of a class this driver cannot import
        return None
