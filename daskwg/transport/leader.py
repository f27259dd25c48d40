"""The direct path through host leaders: one message per host (:class:`LeaderPath`).

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
from collections.abc import Sequence

from distributed.comm import get_address_host

from ..serialization import pickling as serialization
from ..wire.memfiles import BUFFER_SMALLEST
from ..wire.messages import LOST, Call, FanoutMessage, Reply
from .direct import DirectPath, _when_drained
from .driver import GroupRanks
from .failure.state import FailureState
from .streams import CallStreams, StreamClosed

__all__ = ["LeaderPath", "AUTO_RANKS", "FAN_OUT_MODES"]

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
        """The calls (indices) that go through a leader, by host; each list's first is the
        leader's (the host's lowest rank of the call)."""
        by_host: dict[str, list[int]] = {}
        for i, c in enumerate(calls):
            by_host.setdefault(get_address_host(self.ranks.address(c.rank)), []).append(i)
        groups = []
        for members in by_host.values():
            if len(members) < self.min_ranks:
                continue
            if self.max_bytes is not None and _payload_bytes(payloads, members) > self.max_bytes:
                continue
            groups.append(sorted(members, key=lambda i: calls[i].rank))
        return groups

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
        headers: list[bytes] = []
        counts: list[int] = []
        buffers: list = []
        index_of: dict[int, int] = {}
        records = []
        for i in members:
            payload = payloads[i]
            k = index_of.get(id(payload))
            if k is None:  # a payload ranks share (one pickle) travels once
                k = index_of[id(payload)] = len(headers)
                headers.append(payload.header)
                counts.append(len(payload.buffers))
                buffers.extend(payload.buffers)
            c = calls[i]
            records.append((self.ranks.address(c.rank), c.worker_id, c.to_wire(), k, None, 0, relay_wait))
        host_calls = [calls[i] for i in members]
        outcomes = [loop.create_future() for _ in members]
        on_reply = functools.partial(self._fanned, host_calls, outcomes, set())
        message = FanoutMessage(records, headers, counts).to_wire()
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
        answer = Reply.from_wire(reply)
        at = 0
        for index, fields, n in pickle.loads(answer.header):
            member_buffers = buffers[at : at + n]
            at += n
            answered.add(index)
            c, outcome = calls[index], outcomes[index]
            if fields[0] == LOST:
                lost = StreamClosed(f"the host leader's stream to it closed: {fields[2]}")
                asyncio.ensure_future(self._fail(outcome, self.failures.connection_lost(c.rank, lost)))
            else:
                self._replied(c, self.ranks.address(c.rank), outcome, ("reply", 0, *fields), member_buffers)
        return len(answered) == len(calls)


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
