"""Calls through host leaders: one message per host, for blocking calls (:class:`LeaderPath`,
the direct path's) and non-blocking ones (:class:`HostSubmit`, the submit path's).

The direct path (``daskwg.transport.direct``) writes one message per rank and reads one
reply per rank: the driver's own work per call grows with the ranks, and at a few dozen
ranks it is the first per-call cost to pass 10 ms (``docs/scaling.md``). With
``daskwg.fan-out`` set to ``host`` (or to ``auto``, for hosts with at least
:data:`AUTO_RANKS` of the call's ranks and small payloads), the calls to the ranks of one
host go as one :class:`~daskwg.wire.messages.FanoutMessage` to the worker of the host's
lowest rank, the host leader (``daskwg.plugin.leader``), which hands them on over its
host's Unix-domain sockets and answers for all of them: one write and, when all goes well,
one read per host. A payload several ranks share (``ONE_TO_ALL``) crosses to the host once.
Monarch sends to its meshes the same way.

Everything else is the direct path's: the calls carry their per-worker sequence numbers
(so a rank runs them in the driver's order, whichever way they came), and the waiting,
deadlines, forensics and failure handling are :meth:`DirectPath.send`'s, per rank. A
member's error comes back at once (the leader does not hold it); a member whose worker is
gone is answered as lost by the leader and fails as a dropped connection to it would; a
leader that dies takes the host's unanswered calls with it: they fail with the leader's
:class:`~daskwg.errors.WorkerLostError`, and their places in the other workers' orders are
given up (``Sequencer.skip``; a call that did arrive is unaffected), so no later call
waits for a call the leader never handed on.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
from collections.abc import Callable, Sequence

from distributed.comm import get_address_host

from ..config import Settings
from ..serialization import pickling as serialization
from ..wire.memfiles import BUFFER_SMALLEST
from ..wire.messages import LOST, Call, FanoutMessage, Reply
from .direct import DirectPath, _when_drained
from .driver import GroupRanks
from .failure.state import FailureState
from .streams import CallStreams, StreamClosed

__all__ = ["LeaderPath", "HostSubmit", "AUTO_RANKS", "FAN_OUT_MODES"]

#: ``daskwg.fan-out``'s values.
FAN_OUT_MODES = ("direct", "host", "auto")

#: With ``daskwg.fan-out: auto``, a host's ranks of a call go through its leader from this
#: many on (measured: ``benchmarks/fanout.py``; see ``docs/architecture.md``).
AUTO_RANKS = 8


class LeaderPath(DirectPath):
    """:class:`DirectPath` with one message per host of at least ``min_ranks`` of a call's ranks.

    Args:
        ranks: the group's ranks.
        failures: the group's failure state.
        min_ranks: ranks of one host from which they go through its leader (at least 2).
        max_bytes: a host's payload bytes (buffers) above which its ranks are sent to
            directly (``None``: no limit): a large payload would cross twice.
    """

    def __init__(
        self, ranks: GroupRanks, failures: FailureState, min_ranks: int = 2, max_bytes: int | None = None
    ):
        super().__init__(ranks, failures)
        self.min_ranks = max(2, min_ranks)
        self.max_bytes = max_bytes

    def hosts(self, calls: Sequence[Call], payloads: Sequence[serialization.Packed]) -> list[list[int]]:
        """:func:`by_host` with this path's thresholds."""
        return by_host(self.ranks, calls, payloads, self.min_ranks, self.max_bytes)

    def _start_all(
        self,
        streams: CallStreams,
        calls: list[Call],
        payloads: list[serialization.Packed],
        refs: list,
        relay_wait: float,
        sent: list[asyncio.Future],
    ) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        tasks: list = [None] * len(calls)
        for members in self.hosts(calls, payloads):
            for i, outcome in zip(
                members, self._fan_out(streams, calls, payloads, members, relay_wait, sent, loop)
            ):
                tasks[i] = outcome
        alone = [i for i, t in enumerate(tasks) if t is None]
        if alone:
            direct = super()._start_all(
                streams,
                [calls[i] for i in alone],
                [payloads[i] for i in alone],
                [refs[i] for i in alone],
                relay_wait,
                [sent[i] for i in alone],
            )
            for i, outcome in zip(alone, direct):
                tasks[i] = outcome
        return tasks

    def _fan_out(
        self,
        streams: CallStreams,
        calls: list[Call],
        payloads: list[serialization.Packed],
        members: list[int],
        relay_wait: float,
        sent: list[asyncio.Future],
        loop: asyncio.AbstractEventLoop,
    ) -> list[asyncio.Future]:
        """Write one host's calls as one message to its leader; their outcomes' futures."""
        message, buffers = fanout_message(self.ranks, calls, payloads, members, None, 0, relay_wait)
        host_calls = [calls[i] for i in members]
        outcomes = [loop.create_future() for _ in members]
        on_reply = functools.partial(self._fanned, host_calls, outcomes, set())
        leader = host_calls[0]
        address = self.ranks.address(leader.rank)
        written = loop.create_future()
        written.add_done_callback(functools.partial(_all_sent, [sent[i] for i in members]))
        if streams.send_now(address, leader.worker_id, message, buffers, on_reply):
            if streams.backlogged(address, leader.worker_id):
                asyncio.ensure_future(_when_drained(streams, address, leader.worker_id, written))
            else:
                written.set_result(None)
        else:
            asyncio.ensure_future(self._send(streams, address, leader, message, buffers, on_reply, written))
        return outcomes

    async def _send(
        self,
        streams: CallStreams,
        address: str,
        leader: Call,
        message: tuple,
        buffers: list,
        on_reply: functools.partial,
        written: asyncio.Future,
    ) -> None:
        try:
            await streams.send(address, leader.worker_id, message, buffers, on_reply)
        except OSError as exc:  # the stream to the leader closed, or could not be opened
            on_reply(exc, [])
        finally:
            if not written.done():
                written.set_result(None)

    def _fanned(
        self, calls: list[Call], outcomes: list[asyncio.Future], answered: set, reply: object, buffers: list
    ) -> bool:
        """A leader's reply (or its stream's end); ``True`` once every member is answered
        (the stream then forgets the message). On the stream's loop; never raises."""
        if isinstance(reply, BaseException):
            # The leader is gone with the calls it had not answered: they fail with its
            # loss; a call it never handed on must not hold up later calls to that rank.
            leader = calls[0]
            for c, outcome in zip(calls, outcomes):
                if outcome.done():
                    continue
                if c is not leader:
                    slot = self.ranks.slots[c.rank]
                    self.ranks.driver.sequencer.skip(slot.address, c.worker_id, c.session, [c.seq])
                asyncio.ensure_future(self._fail(outcome, self.failures.connection_lost(leader.rank, reply)))
            answered.update(range(len(calls)))
            return True
        for index, fields, member_buffers in answers(reply, buffers):
            answered.add(index)
            c, outcome = calls[index], outcomes[index]
            if fields[0] == LOST:
                lost = StreamClosed(f"the host leader's stream to it closed: {fields[2]}")
                asyncio.ensure_future(self._fail(outcome, self.failures.connection_lost(c.rank, lost)))
            else:
                self._replied(c, self.ranks.address(c.rank), outcome, ("reply", 0, *fields), member_buffers)
        return len(answered) == len(calls)


class HostSubmit:
    """Non-blocking calls through host leaders (``daskwg.transport.submit``'s part of
    ``daskwg.fan-out``): one message per host; each rank's answer settles its future as the
    direct path's reply would (``SubmitPath._reply``), when the leader answers for its host.

    Args:
        ranks: the group's ranks.
        failures: the group's failure state.
        reply: ``SubmitPath._reply(call, key, reply, buffers)``.
    """

    def __init__(self, ranks: GroupRanks, failures: FailureState, reply: Callable[..., None]):
        self.ranks = ranks
        self.failures = failures
        self._reply = reply

    def send(
        self,
        calls: list[Call],
        keys: list[str],
        payloads: list[serialization.Packed],
        settings: Settings,
        big: bool,
        opening_wait: float,
    ) -> list[int]:
        """Send the calls of hosts with enough of them through their leaders (``settings.fan_out``);
        returns the indices of the others, which go direct. Arguments of at most
        ``daskwg.scatter-above`` bytes are copied first (``big``: they are not, and this waits
        until they are written); a stream being opened is waited for ``opening_wait`` seconds
        at most."""
        min_ranks, max_bytes = (2, None) if settings.fan_out == "host" else (AUTO_RANKS, AUTO_MAX_BYTES)
        groups = by_host(self.ranks, calls, payloads, min_ranks, max_bytes)
        if not groups:
            return list(range(len(calls)))
        if not big:
            copies: dict[int, serialization.Packed] = {}
            payloads = [
                copies.setdefault(id(p), serialization.Packed(p.header, [bytes(b) for b in p.buffers]))
                for p in payloads
            ]
        streams, loop = self.ranks.driver.streams, self.ranks.client.loop
        waits = []
        for members in groups:
            message, buffers = fanout_message(
                self.ranks, calls, payloads, members, keys, settings.inline_results, settings.relay_wait
            )
            host_calls, host_keys = [calls[i] for i in members], [keys[i] for i in members]
            on_reply = functools.partial(self._answered, host_calls, host_keys, set())
            leader = host_calls[0]
            address = self.ranks.address(leader.rank)
            if not big and streams.send_now(address, leader.worker_id, message, buffers, on_reply):
                continue
            written = threading.Event()
            waits.append(written)
            loop.add_callback(self._send, leader, message, buffers, on_reply, written)
        for written in waits:
            written.wait(None if big else opening_wait)
        taken = {i for members in groups for i in members}
        return [i for i in range(len(calls)) if i not in taken]

    async def _send(
        self, leader: Call, message: tuple, buffers: list, on_reply: Callable, written: threading.Event
    ) -> None:
        try:
            await self.ranks.driver.streams.send(
                self.ranks.address(leader.rank), leader.worker_id, message, buffers, on_reply
            )
        except OSError as exc:  # the stream to the leader closed, or could not be opened
            on_reply(exc, [])
        finally:
            written.set()

    def _answered(
        self, calls: list[Call], keys: list[str], answered: set, reply: object, buffers: list
    ) -> bool:
        if isinstance(reply, BaseException):
            leader = calls[0]
            for index, (c, key) in enumerate(zip(calls, keys)):
                if index in answered:
                    continue
                if c is not leader:
                    slot = self.ranks.slots[c.rank]
                    self.ranks.driver.sequencer.skip(slot.address, c.worker_id, c.session, [c.seq])
                asyncio.ensure_future(self._lost(key, leader.rank, reply))
            answered.update(range(len(calls)))
            return True
        for index, fields, member_buffers in answers(reply, buffers):
            answered.add(index)
            c, key = calls[index], keys[index]
            if fields[0] == LOST:
                lost = StreamClosed(f"the host leader's stream to it closed: {fields[2]}")
                asyncio.ensure_future(self._lost(key, c.rank, lost))
            else:
                self._reply(c, key, ("reply", 0, *fields), member_buffers)
        return len(answered) == len(calls)

    async def _lost(self, key: str, rank: int, exc: BaseException) -> None:
        self.ranks.driver.owned.failed(key, await self.failures.connection_lost(rank, exc))


def by_host(
    ranks: GroupRanks,
    calls: Sequence[Call],
    payloads: Sequence[serialization.Packed],
    min_ranks: int,
    max_bytes: int | None,
) -> list[list[int]]:
    """The calls (indices) that go through a leader, by host: hosts with at least
    ``min_ranks`` of them and (``max_bytes`` not ``None``) at most ``max_bytes`` bytes of
    payload; each list's first is the leader's (the host's lowest rank of the call)."""
    hosts: dict[str, list[int]] = {}
    for i, c in enumerate(calls):
        hosts.setdefault(get_address_host(ranks.address(c.rank)), []).append(i)
    groups = []
    for members in hosts.values():
        if len(members) < max(2, min_ranks):
            continue
        if max_bytes is not None and _payload_bytes(payloads, members) > max_bytes:
            continue
        groups.append(sorted(members, key=lambda i: calls[i].rank))
    return groups


def fanout_message(
    ranks: GroupRanks,
    calls: Sequence[Call],
    payloads: Sequence[serialization.Packed],
    members: list[int],
    keys: Sequence[str] | None,
    inline: int,
    relay_wait: float,
) -> tuple[tuple, list]:
    """One host's calls (``members``, indices) as a :class:`~daskwg.wire.messages.FanoutMessage`
    on the wire and its buffers; a payload several of them share (the same ``Packed``)
    travels once. ``keys``: per call, a non-blocking call's result key (``None``: blocking)."""
    headers: list[bytes] = []
    counts: list[int] = []
    buffers: list = []
    index_of: dict[int, int] = {}
    records = []
    for i in members:
        payload = payloads[i]
        k = index_of.get(id(payload))
        if k is None:
            k = index_of[id(payload)] = len(headers)
            headers.append(payload.header)
            counts.append(len(payload.buffers))
            buffers.extend(payload.buffers)
        c = calls[i]
        key = None if keys is None else keys[i]
        records.append((ranks.address(c.rank), c.worker_id, c.to_wire(), k, key, inline, relay_wait))
    return FanoutMessage(records, headers, counts).to_wire(), buffers


def answers(reply: tuple, buffers: list) -> list[tuple[int, tuple, list]]:
    """A leader's :data:`~daskwg.wire.messages.FANOUT` reply as ``(member index, (status,
    nbytes, error, header, info), its buffers)`` per member it answers."""
    out, at = [], 0
    for index, fields, n in pickle.loads(Reply.from_wire(reply).header):
        out.append((index, tuple(fields), buffers[at : at + n]))
        at += n
    return out


def _all_sent(sent: list[asyncio.Future], written: asyncio.Future) -> None:
    for s in sent:
        if not s.done():
            s.set_result(None)


def _payload_bytes(payloads: Sequence[serialization.Packed], members: list[int]) -> int:
    seen: set[int] = set()
    total = 0
    for i in members:
        p = payloads[i]
        if id(p) not in seen:
            seen.add(id(p))
            total += len(p.header) + sum(memoryview(b).nbytes for b in p.buffers)
    return total


#: With ``auto``, a host's payload bytes above which its ranks are sent to directly.
AUTO_MAX_BYTES = BUFFER_SMALLEST
