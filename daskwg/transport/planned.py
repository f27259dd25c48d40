"""The plan path: one replay of a step plan (``daskwg.plan``) sent as one message per worker.

:class:`PlanPath` numbers every call of the replay in one go (so each worker's calls have
consecutive sequence numbers, and no other thread's call comes between them), groups the
calls by worker process, packs each worker's arguments once and writes one
:class:`daskwg.wire.messages.PlanMessage` on that worker's call stream. The calls whose results the
driver sees get :class:`~daskwg.transport.owned.CallFuture`\\ s, settled from the one reply:
with the submit path's errors (a rank that raised gives its ``RankError``, a stream that
closed a ``WorkerLostError``), so waiting on them is waiting on ordinary non-blocking calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..deadlines import Limit
from ..errors import GroupBrokenError, RankError
from ..serialization import pickling as serialization
from ..wire import messages as wire
from ..wire.messages import Call, Slot
from .call_future import CallFuture
from .driver import Driver, TaskCall
from .failure import forensics, root_cause
from .failure.state import TRANSFER_ERRORS, transfer_error
from .failure.waiting import timeout_error
from .group_transport import pack_arguments
from .streams import CallStreams
from .submit import OPENING_WAIT

__all__ = ["PlanEntry", "PlanPath", "Replay"]

logger = logging.getLogger(__name__)


@dataclass
class PlanEntry:
    """One call of a replay on one rank.

    Attributes:
        transport: the rank's group's ``GroupTransport``.
        rank: the rank.
        method: the method.
        call_number: the driver's number of the group call this is a rank's part of (keys).
        payload: ``(args, kwargs)``; a :class:`~daskwg.wire.messages.Slot` among them names the
            entry (its index in the replay) whose output it is, on the same rank.
        result: what becomes of its result: ``"keep"`` (it stays on the worker under the key
            of a future the driver gets), ``"return"`` (it comes back with the reply, as a
            blocking call's does) or ``"none"`` (only that the call ended comes back).
        blocking: the method is registered blocking: if it fails, the replay's later calls
            on its worker do not run (the calls one by one would stop there).
    """

    transport: Any
    rank: int
    method: str
    call_number: int
    payload: tuple
    result: str
    blocking: bool = False


class PlanPath:
    """Sends the replays of step plans of one driver.

    Args:
        driver: the driver (one per client).
    """

    def __init__(self, driver: Driver):
        self.driver = driver

    def send(self, entries: list[PlanEntry], settings: Settings, wait: tuple | None = None) -> Replay:
        """Send one replay; returns its :class:`Replay` (per entry kept, a future).

        Arguments of at most ``daskwg.scatter-above`` bytes are copied, larger ones written
        before this returns, so changing them afterwards changes nothing the ranks get.

        Args:
            wait: ``(limit, name)``: wait for the whole replay (:meth:`Replay.wait`) before
                returning. A replay that keeps nothing on the workers then runs on the
                calling thread's own loop and call streams (``daskwg.transport.channel``),
                as a blocking call does: no hop to the client's loop and back.
        """
        driver = self.driver
        slots = [e.transport.ranks.slots[e.rank] for e in entries]
        session, seqs = driver.sequencer.numbered([s.server_id for s in slots])
        calls = [
            Call(
                session,
                seq,
                e.transport.ranks.group_id,
                e.transport.ranks.name,
                e.rank,
                e.method,
                e.transport.ranks.owner,
                slot.server_id,
            )
            for e, seq, slot in zip(entries, seqs, slots)
        ]
        by_worker: dict[tuple[str, str | None], list[int]] = {}
        for i, slot in enumerate(slots):
            by_worker.setdefault((slot.address, slot.server_id), []).append(i)
        now = time.monotonic()
        replay = Replay(entries, calls, len(by_worker), self.driver)
        futures, keys = replay.futures, replay.keys
        batches = []
        try:
            for (address, server_id), indices in by_worker.items():
                local = {i: j for j, i in enumerate(indices)}
                uses = [0] * len(indices)
                payloads = []
                for i in indices:
                    args, kwargs = entries[i].payload
                    args = tuple(_local(a, local, uses) for a in args)
                    kwargs = {k: _local(v, local, uses) for k, v in kwargs.items()}
                    payloads.append((args, kwargs))
                wire_entries = []
                for j, i in enumerate(indices):
                    e, call = entries[i], calls[i]
                    if e.result == "keep":
                        ranks = e.transport.ranks
                        keys[i] = wire.task_key(ranks.name, e.method, e.call_number, e.rank, ranks.group_id)
                        futures[i] = driver.owned.create(call, keys[i], address)
                        driver.calls[futures[i]] = TaskCall(call, now, settings.paused_timeout)
                        driver.inflight.add(server_id, futures[i])
                    wire_entries.append((call.to_wire(), keys[i], e.result, uses[j], e.blocking))
                packed = _pack(payloads, [entries[i].method for i in indices])
                message = wire.PlanMessage(wire_entries, packed.header, settings.inline_results).to_wire()
                batches.append((address, server_id, indices, message, packed))
            big = any(p.nbytes > settings.scatter_above for *_, p in batches)
            batches = [
                (a, s, ix, m, p.buffers if big else [bytes(b) for b in p.buffers])
                for a, s, ix, m, p in batches
            ]
            channel = driver.channel() if wait is not None and not any(futures_of(entries)) else None
            if channel is not None:
                replay.blocking = True
                channel.run(self._send_and_wait(replay, batches, channel, settings, *wait), fresh=False)
                return replay
            opening = any(not driver.streams.is_open(a, s) for a, s, *_ in batches)
            written = threading.Event() if big or opening else None
            if written is None:  # small messages on open streams: written from this thread
                batches = [b for b in batches if not self._send_now(replay, b, driver.streams)]
            if batches:
                client = entries[0].transport.ranks.client
                client.loop.add_callback(self._send_all, replay, batches, written, driver.streams)
        except BaseException:
            # Calls that were never sent must not hold up later ones on their workers.
            for e, call in zip(entries, calls):
                e.transport.ranks.client.loop.add_callback(e.transport.submit._skip, call)
            raise
        if big:
            written.wait()
        elif written is not None:
            written.wait(OPENING_WAIT)  # bounded: an unreachable worker fails the futures
        if wait is not None:
            replay.blocking = True
            replay.wait(*wait, settings)
        return replay

    def part_rows(self, futures: list[Any], timeout: float) -> list[int]:
        """Rows of finished ``DataProtoFuture`` parts (non-blocking calls' results), asked of
        the workers holding them (``daskwg_part_info``), never fetched.

        Raises:
            the producing call's error; ``OSError``/``TimeoutError``: a worker did not answer.
        """
        owned, client = self.driver.owned, self.driver.client

        async def one(future: Any) -> int:
            rec = owned.records[future.key]
            response = await asyncio.wait_for(
                getattr(client.rpc(rec.address), wire.Handler.PART_INFO)(
                    key=future.key, session=rec.call.session, seq=rec.call.seq
                ),
                timeout,
            )
            if response["status"] != "OK":
                raise response["exception"]
            return response["info"].rows

        async def every() -> list[int]:
            return list(await asyncio.gather(*map(one, futures)))

        return client.sync(every)

    async def _send_and_wait(
        self, replay: Replay, batches: list, channel: Any, settings: Settings, limit: Limit | None, name: str
    ) -> None:
        replay.event = asyncio.Event()
        streams = channel.streams
        for address, server_id, indices, message, buffers in batches:
            batch = _Batch(address, server_id, indices, replay)
            # Written here and now on an open stream (its reply settles the replay); else a task.
            if not streams.send_now(
                address, server_id, message, buffers, functools.partial(self._reply, batch)
            ):
                asyncio.ensure_future(self._one(batch, message, buffers, _nothing, streams))
        # Every worker replied, so what the socket did not take at once went out meanwhile;
        # after a failure, the rest goes out whenever this loop runs again (as a task would).
        await replay.wait_async(limit, settings, name, channel.pool)

    def _send_now(self, replay: Replay, batch: tuple, streams: CallStreams) -> bool:
        address, server_id, indices, message, buffers = batch
        reply = functools.partial(self._reply, _Batch(address, server_id, indices, replay))
        return streams.send_now(address, server_id, message, buffers, reply)

    def _send_all(self, replay: Replay, batches: list, written: Any, streams: CallStreams) -> None:
        remaining = [len(batches)]

        def one_written() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and written is not None:
                written.set()

        for address, server_id, indices, message, buffers in batches:
            batch = _Batch(address, server_id, indices, replay)
            asyncio.ensure_future(self._one(batch, message, buffers, one_written, streams))

    async def _one(
        self, batch: _Batch, message: tuple, buffers: list, written: Any, streams: CallStreams
    ) -> None:
        try:
            await streams.send(
                batch.address, batch.server_id, message, buffers, functools.partial(self._reply, batch)
            )
        except OSError as exc:  # the stream closed, or could not be opened
            await self._lost(batch, exc)
        finally:
            written()

    def _reply(self, batch: _Batch, reply: Any, buffers: list) -> None:
        if isinstance(reply, BaseException):
            asyncio.ensure_future(self._lost(batch, reply))
            return
        replay, owned = batch.replay, self.driver.owned
        self.driver.sequencer.note_finished(batch.server_id, replay.calls[batch.indices[-1]].seq)
        records = pickle.loads(wire.Reply.from_wire(reply).header)
        start, failed = 0, []
        for i, (status, nbytes, error, header, count) in zip(batch.indices, records):
            result_buffers, start = buffers[start : start + count], start + count
            key, entry, call = replay.keys[i], replay.entries[i], replay.calls[i]
            if status == "OK":
                if key is not None:
                    owned.finished(
                        key, nbytes, None if header is None else serialization.Packed(header, result_buffers)
                    )
                elif entry.result == "return":
                    replay.values[i] = serialization.Packed(header, result_buffers)
            elif status == "cancelled":
                if key is not None:
                    owned.cancelled(key)
                replay.errors[i] = GroupBrokenError(f"the call of {call.method!r} was cancelled")
            else:
                try:
                    exc = pickle.loads(error)
                except TRANSFER_ERRORS as unpickling:
                    exc = transfer_error(call.rank, batch.address, call.method, unpickling)
                failed.append((i, exc))
        if failed:
            asyncio.ensure_future(self._failed(batch, failed))
        else:
            replay.replied(batch.indices)

    async def _failed(self, batch: _Batch, failed: list) -> None:
        replay = batch.replay
        for i, exc in failed:
            call = replay.calls[i]
            error = await replay.entries[i].transport.failures.response_error(call, exc)
            if replay.keys[i] is not None:
                self.driver.owned.failed(replay.keys[i], error)
            elif not replay.blocking:
                logger.info(
                    "step plan: %s.%s rank %d failed: %s", call.group_name, call.method, call.rank, error
                )
            replay.errors[i] = error
        replay.replied(batch.indices)

    async def _lost(self, batch: _Batch, exc: BaseException) -> None:
        replay = batch.replay
        for i in batch.indices:
            error = await replay.entries[i].transport.failures.connection_lost(replay.calls[i].rank, exc)
            if replay.keys[i] is not None:
                self.driver.owned.failed(replay.keys[i], error)
            replay.errors.setdefault(i, error)
        replay.replied(batch.indices)


class Replay:
    """What the driver knows of one replay of a step plan, as its workers reply.

    Attributes:
        entries, calls: the replay's entries and their calls, in the driver's order.
        futures: per entry, its future (the ``"keep"`` ones), else ``None``.
        keys: the futures' keys.
        values: entry index -> the result that came back (``"return"`` entries).
        errors: entry index -> the error its call failed with.
        blocking: a caller waits for the whole replay (:meth:`wait`).
    """

    def __init__(self, entries: list[PlanEntry], calls: list[Call], batches: int, driver: Driver):
        self.entries = entries
        self.calls = calls
        self.futures: list[CallFuture | None] = [None] * len(entries)
        self.keys: list[str | None] = [None] * len(entries)
        self.values: dict[int, serialization.Packed] = {}
        self.errors: dict[int, BaseException] = {}
        self.blocking = False
        self.driver = driver
        self._waiting = batches
        self._cond = threading.Condition()
        self.event: asyncio.Event | None = None  # set on each reply, when waited on its own loop
        self._replied: set[int] = set()

    def replied(self, indices: list[int]) -> None:
        """The reply of the worker of these entries is in (the loop the replay was sent on)."""
        with self._cond:
            self._replied.update(indices)
            self._waiting -= 1
            # The waiter has news only when the last worker replied or a call failed (its
            # errors are in before this); until then its periodic look (_check) suffices.
            news = self._waiting <= 0 or bool(self.errors)
            if news:
                self._cond.notify_all()
        if news and self.event is not None:
            self.event.set()

    def wait(self, limit: Limit | None, name: str, settings: Settings) -> None:
        """Until every worker replied. A failed call raises: the first in the driver's order,
        once every worker replied or ``daskwg.rank-failure-grace`` after the first failure
        (the others' may still come), as a group call raises its first rank's error.

        Raises:
            RankError, WorkerLostError, GroupBrokenError: a call failed.
            CallTimeoutError: ``limit`` passed first (the report names the calls still running).
        """
        t0, failed_at = time.monotonic(), [None]
        try:
            while True:
                with self._cond:
                    try:
                        wait_s = self._verdict(limit, settings, failed_at)
                    except RankError as exc:
                        client = self.entries[0].transport.ranks.client
                        raise client.sync(self._root_cause, exc) from None
                    if wait_s is None:
                        return
                    if wait_s > 0:
                        self._cond.wait(wait_s)
                self._check()
                if limit is not None and limit.remaining() <= 0 and self._waiting > 0:
                    client = self.entries[0].transport.ranks.client
                    raise client.sync(
                        _timeout_error, *self._deadline(limit, time.monotonic() - t0, settings, client.rpc)
                    )
        except (KeyboardInterrupt, asyncio.CancelledError):
            self._abandon("interrupted")
            raise

    async def wait_async(self, limit: Limit | None, settings: Settings, name: str, pool: Any) -> None:
        """:meth:`wait` on the loop the replay was sent on (``pool``: that loop's connections)."""
        t0, failed_at = time.monotonic(), [None]
        try:
            while True:
                try:
                    wait_s = self._verdict(limit, settings, failed_at)
                except RankError as exc:
                    raise await self._root_cause(exc) from None
                if wait_s is None:
                    return
                self.event.clear()
                if wait_s > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.event.wait(), wait_s)
                self._check()
                if limit is not None and limit.remaining() <= 0 and self._waiting > 0:
                    raise await _timeout_error(*self._deadline(limit, time.monotonic() - t0, settings, pool))
        except (KeyboardInterrupt, asyncio.CancelledError):
            self._abandon("interrupted")
            raise

    def _verdict(self, limit: Limit | None, settings: Settings, failed_at: list) -> float | None:
        """``None`` when the wait is over (or raises the replay's first error); else the
        seconds to wait for news before looking again."""
        if self.errors and failed_at[0] is None:
            failed_at[0] = time.monotonic()
        if self._waiting <= 0 or (
            failed_at[0] is not None and time.monotonic() - failed_at[0] >= settings.rank_failure_grace
        ):
            if self.errors:
                raise self.errors[min(self.errors)]
            if self._waiting <= 0:
                return None
        wait_s = settings.poll_interval
        return wait_s if limit is None else min(wait_s, limit.remaining())

    async def _root_cause(self, exc: RankError) -> BaseException:
        """``exc``, or the ``WorkerLostError`` of a worker lost around it in one of the
        replay's groups (:func:`~daskwg.transport.failure.root_cause.find_lost_rank`)."""
        errors = list(self.errors.values())
        for transport in {id(e.transport): e.transport for e in self.entries}.values():
            own = [
                e
                for e in errors
                if isinstance(e, RankError) and e.address in {slot.address for slot in transport.ranks.slots}
            ]
            dead = await root_cause.find_lost_rank(transport.failures, own or [exc])
            if dead is not None:
                self._abandon("lost")
                return root_cause.with_survivors(transport.failures.lost(dead), errors)
        return exc

    def _check(self) -> None:
        """Raise at once for the scheduler gone or a worker taken as lost (its heartbeat)
        while its part of the replay has not replied."""
        checked: set[tuple[int, int | None]] = set()  # (transport, rank), (transport, None)
        for i in self._unfinished():
            transport, rank = self.entries[i].transport, self.calls[i].rank
            if (id(transport), rank) in checked:
                continue  # a rank's calls: one look is enough
            if (id(transport), None) not in checked:
                transport.failures.check_scheduler()
                checked.add((id(transport), None))
            checked.add((id(transport), rank))
            if transport.ranks.is_lost(rank):
                self._abandon("lost")
                raise transport.failures.lost(rank)

    def _unfinished(self) -> list[int]:
        """Entries of the workers that have not replied."""
        return [i for i in range(len(self.entries)) if i not in self._replied]

    def _abandon(self, why: str) -> None:
        by_transport: dict[int, tuple[Any, list[Call]]] = {}
        for i in self._unfinished():
            entry = self.entries[i]
            by_transport.setdefault(id(entry.transport), (entry.transport, []))[1].append(self.calls[i])
        for transport, calls in by_transport.values():
            transport.failures.abandon_calls(calls, why)

    def _deadline(self, limit: Limit, waited: float, settings: Settings, rpc: Any) -> tuple:
        """Give up the unfinished calls; the arguments of :func:`_timeout_error` for them."""
        unfinished = self._unfinished()
        self._abandon("deadline")
        first = self.entries[unfinished[0]].transport
        candidates: dict[int, list[Call]] = {}
        for i in unfinished:
            if self.entries[i].transport is first:
                candidates.setdefault(self.calls[i].rank, []).append(self.calls[i])
        return first.ranks, rpc, candidates, limit, waited, settings.status_timeout


def _pack(payloads: list, methods: list[str]) -> serialization.Packed:
    """The worker's calls' arguments pickled together; an argument that cannot be pickled
    raises the ``DispatchError`` naming it that the call made alone raises."""
    try:
        return serialization.dumps(payloads, arguments=True)
    except Exception:  # noqa: BLE001 - pickling raises anything: find the argument
        for method, payload in zip(methods, payloads):
            pack_arguments(method, payload, False)
        raise


def futures_of(entries: list[PlanEntry]) -> list[PlanEntry]:
    """The entries whose results stay on the workers, with futures in the driver."""
    return [e for e in entries if e.result == "keep"]


def _nothing() -> None:
    pass


async def _timeout_error(
    ranks: Any,
    rpc: Any,
    candidates: dict[int, list[Call]],
    limit: Limit,
    waited: float,
    status_timeout: float,
) -> BaseException:
    """:func:`~daskwg.transport.failure.waiting.timeout_error` of the calls the ranks are running
    (per rank, the one of its unfinished ``candidates`` its worker runs, else the first)."""
    addresses = {rank: ranks.address(rank) for rank in candidates}
    answers = await forensics.query_status(rpc, list(set(addresses.values())), status_timeout)
    chosen = []  # (not running, rank, call): the report names the first one's method
    for rank, mine in candidates.items():
        answer = answers.get(addresses[rank])
        running = set()
        if not isinstance(answer, str) and answer is not None:
            running = {(r.get("session"), r.get("seq")) for r in answer if r.get("state") == "running"}
        call = next((c for c in mine if (c.session, c.seq) in running), None)
        chosen.append((call is None, rank, call or mine[0]))
    calls = [call for *_, call in sorted(chosen, key=lambda t: t[:2])]
    return await timeout_error(ranks, rpc, calls, set(), limit, waited, status_timeout)


@dataclass
class _Batch:
    """One worker's part of a replay: its entries' indices, and the replay's records."""

    address: str
    server_id: str | None
    indices: list[int]
    replay: Replay


def _local(value: Any, local: dict[int, int], uses: list[int]) -> Any:
    """``value`` with a :class:`Slot` naming a replay's entry renumbered for its worker's message."""
    if not isinstance(value, Slot):
        return value
    j = local.get(value.index)
    if j is None:
        raise ValueError(f"entry {value.index} of the replay is not on this worker")
    uses[j] += 1
    return Slot(j, value.rows)
