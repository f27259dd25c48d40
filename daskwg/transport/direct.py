"""The direct path: blocking calls sent straight to the hosting workers on call streams
(``daskwg.transport.streams``), like Dask actors: one round trip, no scheduler hop.

:meth:`DirectPath.send` runs on the calling thread's own event loop (a
:class:`~daskwg.transport.channel.Channel`, with streams of its own) or on the client's
(``client.sync``); the payloads are already packed once (:func:`daskwg.serialization.pickling.dumps`),
and their buffers go out as they are.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..deadlines import Limit
from ..errors import GroupBrokenError, RankError, WorkerLostError
from ..serialization import pickling as serialization
from ..wire.messages import Call, CallMessage, Reply
from .driver import GroupRanks
from .failure import root_cause
from .failure.state import CallWatch, FailureState, fresh_error, transfer_error
from .failure.waiting import timeout_error
from .streams import CallStreams

__all__ = ["DirectPath", "SendOptions"]


def _consume_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _when_drained(
    streams: CallStreams, address: str, server_id: str | None, sent: asyncio.Future
) -> None:
    # A call written with send_now is on its way once its stream has no backlog left.
    try:
        await streams.drain(address, server_id)
    finally:
        if not sent.done():
            sent.set_result(None)


@dataclass(frozen=True, slots=True)
class SendOptions:
    """How :meth:`DirectPath.send` sends one blocking call and waits for it.

    Attributes:
        grace: seconds the other ranks get after one raised (``daskwg.rank-failure-grace``,
            or the group's own settling time).
        private: the connection pool and streams belong to a loop that runs only while its
            thread is in a call (a :class:`~daskwg.transport.channel.Channel`'s).
        limit: the call's deadline (``None``: none).
        status_timeout: seconds a worker gets to answer the deadline report's status request
            (``daskwg.status-timeout``).
        poll: seconds between checks for a rank's worker taken as lost meanwhile
            (``daskwg.poll-interval``).
        relay_wait: ``daskwg.relay-wait`` (seconds), for relayed inputs.
        on_sent: called once every call is written (or its writing failed, or ``grace``
            passed): :meth:`daskwg.transport.channel.HeldInterrupt.release`.
    """

    grace: float = 0.0
    private: bool = False
    limit: Limit | None = None
    status_timeout: float = 2.0
    poll: float = 0.2
    relay_wait: float = 10.0
    on_sent: Callable[[], None] | None = None


class DirectPath:
    """Sends one group's blocking calls straight to its ranks' workers.

    Args:
        ranks: the group's ranks.
        failures: the group's failure state.
    """

    def __init__(self, ranks: GroupRanks, failures: FailureState):
        self.ranks = ranks
        self.failures = failures

    async def send(
        self,
        pool: Any,
        streams: CallStreams,
        calls: list[Call],
        payloads: list[serialization.Packed],
        refs: list | None,
        options: SendOptions,
    ) -> list:
        """Send ``calls`` (one per rank) with their packed ``payloads`` and wait for all.

        Args:
            pool: a Dask ``ConnectionPool``: the client's (on the client's event loop) or
                the calling thread's own (``options.private``), which saves the two thread
                hops of ``client.sync`` on every call; for the deadline report's status requests.
            streams: the :class:`~daskwg.transport.streams.CallStreams` of the same loop.
            calls: one :class:`~daskwg.wire.messages.Call` per rank.
            payloads: per call, a :class:`~daskwg.serialization.pickling.Packed`.
            refs: per call, ``(kind, values)`` for each of its ``LazyArg``\\ s, or ``None``
                (``None``: no call has any).
            options: the grace, deadline, polling and the like (:class:`SendOptions`).

        Returns:
            the per-rank results, in the order of ``calls``.

        Raises:
            RankError: a rank raised (at once; the others get ``grace`` seconds).
            WorkerLostError: a rank's worker is gone or its connection dropped.
            CallTimeoutError: ``options.limit`` passed.
        """
        grace, private, limit, poll = options.grace, options.private, options.limit, options.poll
        relay_wait, on_sent = options.relay_wait, options.on_sent
        t0 = time.monotonic()
        refs = refs or [None] * len(calls)
        loop = asyncio.get_running_loop()
        sent = [loop.create_future() for _ in calls]
        tasks = self._start_all(streams, calls, payloads, refs, relay_wait, sent)
        if on_sent is not None:
            writing = [s for s in sent if not s.done()]
            if writing:  # bounded: a worker may not be reading
                await asyncio.wait(writing, timeout=max(grace, poll))
            on_sent()
        lost = await self._wait(calls, tasks, limit, poll)
        errors = [
            t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None
        ]
        dead = None
        if errors and not lost:
            # A survivor's error (a reset connection in a collective) often comes before
            # the news that a peer's worker died: the lost worker is the error to raise.
            dead = await root_cause.find_lost_rank(self.failures, errors)
            lost = [i for i, (c, t) in enumerate(zip(calls, tasks)) if c.rank == dead and not t.done()]
        for i in lost:
            # Its answer, if any, would come only after the partition: the call is given
            # up, and its place skipped should the worker come back (WorkerHealth.revoke).
            tasks[i].cancel()
            self.ranks.driver.health.give_up(
                self.ranks.slots[calls[i].rank].server_id, calls[i].session, calls[i].seq
            )
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        pending_index = [i for i, t in enumerate(tasks) if not t.done() and i not in lost]
        pending_calls = [(calls[i], tasks[i]) for i in pending_index]
        for _, t in pending_calls:
            # They finish whenever the loop runs again; their error handling must still
            # run (e.g. giving up an undelivered call's place).
            t.add_done_callback(_consume_exception)
        unsent = [sent[i] for i in pending_index if not sent[i].done()]
        if unsent:
            # A private loop stops when this returns: the other ranks' calls must be on
            # their way first, or they would stay unsent (the rank idle, not in the
            # call) until this thread's next call. Bounded: a worker may not be reading.
            await asyncio.wait(unsent, timeout=max(grace, poll))
            if private:
                # Still not written (its stream still opening to a worker that does not
                # answer, or the socket full): it would go only with this thread's next
                # call, if any, and every later call to that worker waits for its turn.
                for i in pending_index:
                    if not sent[i].done():
                        c = calls[i]
                        self.ranks.driver.sequencer.skip(
                            self.ranks.address(c.rank), c.worker_id, c.session, [c.seq]
                        )
        # A private loop only runs while its thread is in a call, so its tasks cannot
        # tell when these ranks finish: ask their workers instead.
        pending = [
            (
                c.rank,
                CallWatch(self.ranks.driver, self.ranks.address(c.rank), c.seq, session=c.session)
                if private
                else t,
            )
            for c, t in pending_calls
        ]
        seqs = {c.rank: c.seq for c, _ in pending_calls}
        if dead is not None:
            if pending:
                self.failures.mark_stuck(calls[0].method, pending, seqs)
            raise root_cause.with_survivors(self.failures.lost(dead), errors)
        if failed:
            exc = await self.failures.blame_lost_producer(failed[0].exception())
            if pending and isinstance(exc, RankError):
                self.failures.unsettle(grace, calls[0].method, exc.rank, pending, seqs)
            elif pending and isinstance(exc, WorkerLostError):
                self.failures.mark_stuck(calls[0].method, pending, seqs)
            # A copy: the stored error, raised, would gather the caller's frames (and
            # with them the call's arguments) in a traceback its outcome keeps.
            raise fresh_error(exc)
        if lost:
            if pending:
                self.failures.mark_stuck(calls[0].method, pending)
            raise self.failures.lost(calls[lost[0]].rank)
        if pending:
            self.failures.abandon(calls[0].method, pending, "deadline", seqs)
            done = {c.rank for c, t in zip(calls, tasks) if t.done()}
            raise await timeout_error(
                self.ranks, pool, calls, done, limit, time.monotonic() - t0, options.status_timeout
            )
        return [t.result() for t in tasks]

    def _start_all(
        self,
        streams: CallStreams,
        calls: list[Call],
        payloads: list[serialization.Packed],
        refs: list,
        relay_wait: float,
        sent: list[asyncio.Future],
    ) -> list[asyncio.Future]:
        """Write every call (one message per rank); per call, the future of its outcome.
        Each of ``sent`` is set once its call is on its way (or its writing failed)."""
        loop = asyncio.get_running_loop()
        tasks = []
        for c, p, r, s in zip(calls, payloads, refs, sent):
            # A small call on an open stream is written here and now; its reply settles a
            # future (no task, no lock, no wait for the write per rank).
            replied = self._send_now(streams, c, p, r, relay_wait, loop)
            if replied is None:
                replied = asyncio.ensure_future(self._one(streams, c, p, r, relay_wait, s))
            elif streams.backlogged(self.ranks.address(c.rank), c.worker_id):
                # Not all of it went at once: on its way once the loop wrote the rest.
                asyncio.ensure_future(_when_drained(streams, self.ranks.address(c.rank), c.worker_id, s))
            else:
                s.set_result(None)
            tasks.append(replied)
        return tasks

    async def _wait(self, calls: list[Call], tasks: list, limit: Limit | None, poll: float) -> list[int]:
        """Wait until every task is done, one failed or ``limit`` passed; or until the
        worker of a pending call is taken as lost (its heartbeat, the scheduler), whose
        indices it returns: a partitioned worker's call would otherwise wait for the TCP
        timeout."""
        while True:
            timeout = poll if limit is None else min(poll, max(limit.remaining(), 0.0))
            done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            if not pending or any(not t.cancelled() and t.exception() is not None for t in done):
                return []
            lost = [
                i for i, (c, t) in enumerate(zip(calls, tasks)) if not t.done() and self.ranks.is_lost(c.rank)
            ]
            if lost or (limit is not None and limit.remaining() <= 0):
                return lost

    @staticmethod
    def _message(call: Call, payload: serialization.Packed, refs: list | None, relay_wait: float) -> tuple:
        pickled = None if refs is None else pickle.dumps(refs)
        return CallMessage(call, payload.header, relay_wait=relay_wait, refs=pickled).to_wire()

    def _decode(self, call: Call, address: str, reply: tuple, buffers: list) -> tuple[str, Any]:
        """A reply as ``("ok", value)``, ``("failed", error)`` (raise it as it is) or
        ``("raised", exception)`` (the rank's: ``FailureState.response_error`` shapes it).
        Never raises: a reply read on a stream must not fail the stream's other calls."""
        # A reply means the call has ended there (and, calls ending in order, every
        # earlier one of this driver): no later call waits behind those any more.
        self.ranks.driver.sequencer.note_finished(
            self.ranks.slots[call.rank].server_id, call.seq, call.session
        )
        answer = Reply.from_wire(reply)
        try:
            if answer.status == "OK":
                return "ok", serialization.loads(serialization.Packed(answer.header, buffers))
            if answer.error is None:
                return "raised", GroupBrokenError(f"{call.method!r} was cancelled")
            return "raised", pickle.loads(answer.error)
        except Exception as exc:  # noqa: BLE001 - TRANSFER_ERRORS, or a __setstate__ that raises
            # The result (or the error) could not be unpickled here: name the call instead
            # of a bare unpickling error.
            return "failed", transfer_error(call.rank, address, call.method, exc)

    def _send_now(
        self,
        streams: CallStreams,
        call: Call,
        payload: serialization.Packed,
        refs: list | None,
        relay_wait: float,
        loop: asyncio.AbstractEventLoop,
    ) -> asyncio.Future | None:
        """Write the call at once on its open stream (``CallStreams.send_now``); the future of
        its outcome, as :meth:`_one` gives it; ``None``: it was not written."""
        address = self.ranks.address(call.rank)
        outcome = loop.create_future()
        on_reply = functools.partial(self._replied, call, address, outcome)
        message = self._message(call, payload, refs, relay_wait)
        if not streams.send_now(address, call.worker_id, message, payload.buffers, on_reply):
            return None
        return outcome

    def _replied(self, call: Call, address: str, outcome: asyncio.Future, reply: Any, buffers: list) -> None:
        # On the stream's loop: what _one does after its request, without a task when it went well.
        if outcome.done():
            return  # given up (a lost worker)
        if isinstance(reply, BaseException):  # the stream closed
            asyncio.ensure_future(self._fail(outcome, self.failures.connection_lost(call.rank, reply)))
            return
        kind, value = self._decode(call, address, reply, buffers)
        if kind == "ok":
            outcome.set_result(value)
        elif kind == "failed":
            outcome.set_exception(value)
        else:
            asyncio.ensure_future(self._fail(outcome, self.failures.response_error(call, value)))

    @staticmethod
    async def _fail(outcome: asyncio.Future, error: Any) -> None:
        exc = await error
        if not outcome.done():
            outcome.set_exception(exc)

    async def _one(
        self,
        streams: CallStreams,
        call: Call,
        payload: serialization.Packed,
        refs: list | None,
        relay_wait: float,
        sent: asyncio.Future,
    ) -> Any:
        address = self.ranks.address(call.rank)
        message = self._message(call, payload, refs, relay_wait)
        try:
            reply, buffers = await streams.request(address, call.worker_id, message, payload.buffers, sent)
        except OSError as exc:  # the stream closed, or could not be opened
            raise await self.failures.connection_lost(call.rank, exc) from None
        kind, value = self._decode(call, address, reply, buffers)
        if kind == "ok":
            return value
        if kind == "failed":
            raise value
        raise await self.failures.response_error(call, value)
