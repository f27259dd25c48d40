"""The per-client state of the driver side: :class:`Driver`, and :class:`GroupRanks`, the
identity of one group's ranks that every driver-side object of that group shares.

Threads: the driver's own threads (calls) and the client's event loop (the scheduler's
events, polling) both touch a :class:`Driver`; sequence numbers are taken under its lock,
the rest are single assignments and dict updates that need none.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes
from distributed import Client, Future

from ..config import Settings
from ..errors import GroupBrokenError, WorkerLostError, WorkerPausedError
from ..wire.messages import Call, session_id
from .channel import Channel
from .failure import losses
from .failure.calls import AbandonedCall, Inflight, SharedWeakSet, StuckCall, TaskCall
from .owned import Owned
from .streams import CallStreams

__all__ = ["Driver", "GroupRanks", "StuckCall", "AbandonedCall", "TaskCall"]

logger = logging.getLogger(__name__)

#: Seconds :meth:`Driver.skip` keeps trying to reach a worker that does not answer.
SKIP_RETRY_S = 3600.0


@dataclass(frozen=True)
class GroupRanks:
    """One group's ranks as the driver side sees them.

    Attributes:
        client: the group's synchronous ``distributed.Client``.
        driver: that client's :class:`Driver`.
        slots: one ``pool.WorkerSlot`` per rank, in rank order.
        name: the group's name (task keys, messages).
        group_id: the group's unique id (the hosts key rank objects by it).
        owner: the client id that owns the group's ranks.
    """

    client: Client
    driver: Driver
    slots: tuple
    name: str
    group_id: str
    owner: str

    def address(self, rank: int) -> str:
        """The Dask address of ``rank``'s worker."""
        return self.slots[rank].address

    def is_lost(self, rank: int) -> bool:
        """Whether ``rank``'s worker process is known to be gone."""
        return self.slots[rank].server_id in self.driver.lost


class Driver:
    """Per-client driver state shared by all groups of one ``Client``.

    Holds the sequence counter per worker (one lock, so that calls from several
    threads and groups get the same relative order on every worker) and the
    subscriptions to the scheduler's per-worker event topics, through which groups
    learn that a worker was removed.
    """

    _registry: dict[str, Driver] = {}
    _registry_lock = threading.Lock()

    def __init__(self, client: Client):
        self.client = client
        #: the session this driver's calls carry (:func:`daskwg.wire.messages.session_id`); a new one
        #: after each reconnection of the client (:meth:`check_reconnected`).
        self.session = client.id
        self.epoch = 0
        self._scheduler_comm = client.scheduler_comm
        self.lock = threading.Lock()
        # Sequence numbers, lost marks and busy ranks are keyed by the worker process's
        # id (``WorkerSlot.server_id``), not its address: a Nanny restarts a worker under
        # the same name and, with a fixed port, the same address, and its fresh plugin
        # counts from 0 again.
        self.next_seq: dict[str, int] = defaultdict(int)
        #: the transports of this driver's live groups (``worker_lost(address, reason)``, ``broken``).
        self.transports = SharedWeakSet()
        self.watched: set[str] = set()
        self.server_ids: dict[str, set[str]] = defaultdict(set)
        #: server id -> when that worker process started (``WorkerSlot.started``)
        self.started: dict[str, float] = {}
        self.lost: dict[str, str] = {}
        #: server id -> the reason in ``lost`` of a worker lost only by this driver's own
        #: reckoning (its heartbeat found it unreachable): the process may still be there,
        #: and a new group re-checks (:meth:`is_suspect`).
        self.suspects: dict[str, str] = {}
        #: server id -> ``(session, seq)`` of the calls given up on when it was taken as lost
        #: (they may never have arrived: their places are skipped if it comes back).
        self.given_up: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self.paused: dict[str, float] = {}
        #: server id -> the call its rank is stuck in (a broken group's straggler).
        self.stuck: dict[str, StuckCall] = {}
        # Calls the driver stopped waiting for (deadline, Ctrl-C) that may still run, by
        # server id. Later calls to that worker queue behind them, and say so.
        self.abandoned: dict[str, AbandonedCall] = {}
        #: server id -> the highest sequence number of this driver's calls known to have
        #: ended there: calls end in order, so every earlier one has ended too.
        self.finished: dict[str, int] = {}
        self.inflight = Inflight()
        #: every task-path future of this driver -> its :class:`TaskCall`, while it lives.
        self.calls: weakref.WeakKeyDictionary[Future, TaskCall] = weakref.WeakKeyDictionary()
        self.paused_out: dict[str, WorkerPausedError] = {}
        # Worker address -> the nanny's "worker-restart-memory" event (rss, pid).
        self.memory_kills: dict[str, dict] = {}
        self.lost_by_address: dict[str, list[str]] = defaultdict(list)
        self.memory_limits: dict[str, int | None] = {}
        self.memory_events = False
        self.call_numbers = itertools.count()
        self.local = threading.local()
        #: task key -> the worker address it is pinned to, while its future lives.
        self.placement: dict[str, str] = {}
        #: part key -> future of its ``wire.PartInfo``, while the part's future lives.
        self.part_infos: dict[str, Future] = {}
        #: worker address -> the reason of its last ``closing-worker`` event (why it closed).
        self.closing: dict[str, str] = {}
        #: worker address -> ``(nanny address, pid)`` of the process watched there last.
        self.processes: dict[str, tuple[str | None, int | None]] = {}
        #: server id -> times its heartbeat found it unreachable: call streams opened
        #: before the last time are not reused (``CallStreams``).
        self.stream_epochs: dict[str, int] = {}
        #: the results of this driver's non-blocking calls, and the streams they go on.
        self.streams = CallStreams(client.connection_args, self.stream_epochs)
        self.owned = Owned(client, self.streams)

    @classmethod
    def of(cls, client: Client) -> Driver:
        with cls._registry_lock:
            driver = cls._registry.get(client.id)
            if driver is None or driver.client is not client:
                driver = cls._registry[client.id] = cls(client)
            return driver

    def channel(self) -> Channel | None:
        """The calling thread's :class:`Channel`, or ``None`` where the thread already
        runs an event loop (e.g. Jupyter) and must go through ``client.sync``."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return None
        channel = getattr(self.local, "channel", None)
        if channel is None:
            channel = self.local.channel = Channel(self.client.connection_args, self.stream_epochs)
        return channel

    def take_seqs(self, server_ids: Sequence[str]) -> list[int]:
        """The next sequence number of this driver on each of these worker processes
        (one lock, so calls from several threads keep one relative order everywhere)."""
        return self.numbered(server_ids)[1]

    def numbered(self, server_ids: Sequence[str]) -> tuple[str, list[int]]:
        """:meth:`take_seqs`, with the session they count in (taken together, so a
        reconnection in another thread cannot come between)."""
        with self.lock:
            seqs = []
            for sid in server_ids:
                seqs.append(self.next_seq[sid])
                self.next_seq[sid] += 1
            return self.session, seqs

    def check_reconnected(self) -> None:
        """Begin a new session if the client reconnected to the scheduler since this
        driver last looked (same client id, a new connection).

        The scheduler dropped the client with its old connection, so it released the
        client's ranks (not those of detached groups) and the workers forgot its order:
        groups built before are broken (``GroupBrokenError``), and later calls number
        afresh in a new session (:func:`daskwg.wire.messages.session_id`).
        """
        comm = self.client.scheduler_comm
        if comm is self._scheduler_comm or comm is None or self.client.status != "running":
            return
        with self.lock:
            if comm is self._scheduler_comm:
                return
            self._scheduler_comm = comm
            self.epoch += 1
            self.session = session_id(self.client.id, self.epoch)
            self.next_seq = defaultdict(int)
            self.finished.clear()  # numbers of the old session
            transports = list(self.transports)
        logger.info("client %s reconnected to the scheduler: new session %s", self.client.id, self.session)
        # The scheduler forgot the old connection's topic subscriptions.
        self.watched.clear()
        self.memory_events = False
        for transport in transports:
            transport.reconnected()

    def unreachable(self, address: str, server_id: str, reason: str) -> None:
        """The heartbeat found the worker process ``server_id`` at ``address`` unreachable:
        lost to this driver's groups on it, as a removed worker is, until a new group
        finds it answering again (:meth:`revoke`). Runs on the client's event loop."""
        if server_id in self.lost:
            return
        self.lost[server_id] = reason
        self.suspects[server_id] = reason
        self.stream_epochs[server_id] = self.stream_epochs.get(server_id, 0) + 1
        orphans = [f for f in self.inflight.pop(server_id) if not f.done()]
        for future in orphans:
            entry = self.calls.get(future)
            if entry is not None:
                self.given_up[server_id].append((entry.call.session, entry.call.seq))
        if orphans:
            asyncio.ensure_future(
                self.client._cancel(
                    orphans,
                    reason="worker-lost",
                    msg=f"WorkerLostError: the worker {address} was lost ({reason})",
                )
            )
        for transport in list(self.transports):
            transport.worker_lost(address, reason)

    def is_suspect(self, server_id: str) -> bool:
        """Whether ``server_id`` is lost only because the heartbeat found it unreachable
        (the scheduler has not removed it since: that replaces the reason)."""
        reason = self.suspects.get(server_id)
        return reason is not None and self.lost.get(server_id) == reason

    def give_up(self, server_id: str, session: str, seq: int) -> None:
        """Record that the driver gave up on call ``seq`` to a worker it took as lost."""
        self.given_up[server_id].append((session, seq))

    def skip(self, address: str, server_id: str | None, session: str, seqs: list[int]) -> None:
        """Give up the places of calls ``seqs`` of ``session`` on the worker process
        ``server_id`` at ``address``: they did not reach it (one that still comes is then
        refused), and every later call of the session would wait for them there. Any
        thread: sent from the client's event loop, and sent again while the worker does not
        answer (stopped, its event loop blocked), for up to :data:`SKIP_RETRY_S` seconds,
        until it is lost or the client closes."""
        self.client.loop.add_callback(self._skip, address, server_id, session, list(seqs))

    async def _skip(self, address: str, server_id: str | None, session: str, seqs: list[int]) -> None:
        give_up_at, delay = time.monotonic() + SKIP_RETRY_S, 0.2
        while self.client.status in ("running", "connecting") and server_id not in self.lost:
            try:
                # Dask's rpc: a connect timeout (distributed.comm.timeouts.connect) bounds it.
                await self.client.rpc(address).daskwg_skip(session=session, seqs=seqs)
                return
            except Exception:  # noqa: BLE001 - not answering now; gone (then nothing waits there)
                if time.monotonic() + delay > give_up_at:
                    logger.warning(
                        "calls %s of session %s could not be skipped on %s", seqs, session, address
                    )
                    return
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)

    def revoke(self, server_id: str) -> None:
        """Clear the lost mark :meth:`unreachable` set: the same process answers again.
        Groups already broken by it stay broken."""
        self.suspects.pop(server_id, None)
        self.lost.pop(server_id, None)
        self.given_up.pop(server_id, None)

    def call_of(self, future: Any) -> Call | None:
        """The :class:`~daskwg.wire.messages.Call` a task-path future of this driver stands for, else ``None``."""
        try:
            entry = self.calls.get(future)
        except TypeError:  # not weak-referenceable: not one of ours
            return None
        return None if entry is None else entry.call

    def watch(self, slots: Sequence[Any]) -> None:
        """Follow the scheduler's events about these workers (removal, pause), once each."""
        if not self.memory_events:
            # Nannies announce the workers they restart for memory (above
            # distributed.worker.memory.terminate); lost-worker errors then say so.
            self.client.subscribe_topic("worker-restart-memory", self._on_memory_restart)
            self.memory_events = True
        if any(slot.address not in self.watched for slot in slots):
            # Kept for the message about a worker its nanny restarts for memory, which
            # comes when the scheduler has forgotten that worker.
            for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
                self.memory_limits[address] = info.get("memory_limit")
        for slot in slots:
            self.server_ids[slot.address].add(slot.server_id)
            self.started[slot.server_id] = slot.started
            self.processes[slot.address] = (getattr(slot, "nanny", None), getattr(slot, "pid", None))
            if slot.address not in self.watched:
                self.watched.add(slot.address)
                self.client.subscribe_topic(
                    slot.address, functools.partial(self._on_worker_event, slot.address)
                )

    def _on_worker_event(self, address: str, event: tuple, exit_detail: str | None = None) -> None:
        when, msg = event
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "closing-worker":
            self.closing[address] = str(msg.get("reason", ""))
        elif msg.get("action") == "remove-worker":
            closing = self.closing.get(address)
            nanny, pid = self.processes.get(address, (None, None))
            if exit_detail is None and nanny and losses.needs_exit_detail(msg, closing):
                # Its process died without a word: ask its Nanny how (a moment, bounded).
                asyncio.ensure_future(self._on_removal_with_exit_detail(address, event, nanny, pid))
                return
            self.closing.pop(address, None)
            reason = self._memory_kill_reason(address) or losses.removal_reason(msg, closing, exit_detail)
            orphans = []
            removed = self.server_ids.pop(address, set())
            # Events can arrive after a group was already built on the restarted process
            # at the same address: a process that started after the removal stays.
            newer = {
                sid for sid in removed if isinstance(when, (int, float)) and self.started.get(sid, 0.0) > when
            }
            if newer:
                self.server_ids[address] = newer
            for sid in removed - newer:
                self.lost[sid] = reason
                self.lost_by_address[address].append(sid)
                orphans += [f for f in self.inflight.pop(sid) if not f.done()]
            # Groups are broken before any waiting thread sees a failed future.
            for transport in list(self.transports):
                transport.worker_lost(address, reason)
            # Results of non-blocking calls there fail as lost (their stream's close may
            # come late: a worker removed by the scheduler can still hold it open).
            owned = [f for f in orphans if self.owned.record(f) is not None]
            orphans = [f for f in orphans if self.owned.record(f) is None]
            self.owned.lost(
                [f.key for f in owned], lambda rec: WorkerLostError(rec.call.rank, address, reason)
            )
            self.streams.forget(address)
            if orphans:
                # A task pinned to a worker that is gone would wait forever ("no-worker"
                # state) in a plain future.result(): it fails with WorkerLostError.
                errors = [
                    WorkerLostError(self.calls[f].call.rank if f in self.calls else -1, address, reason)
                    for f in orphans
                ]
                asyncio.ensure_future(losses.fail_futures(self.client, orphans, errors))
            self.paused.pop(address, None)
        elif msg.get("action") == "worker-status-change":
            # Paused workers (memory above distributed.worker.memory.pause) start no
            # tasks, so calls on the task path wait; _gather says so instead of waiting
            # silently. Handlers (the direct path) still run while paused.
            if msg.get("status") == "paused":
                if address not in self.paused:
                    since = self.paused[address] = time.monotonic()
                    asyncio.ensure_future(self._give_up_paused_calls(address, since))
            else:
                self.paused.pop(address, None)

    async def _on_removal_with_exit_detail(
        self, address: str, event: tuple, nanny: str, pid: int | None
    ) -> None:
        detail = await losses.exit_detail(self.client.rpc(nanny), pid)
        self._on_worker_event(address, event, exit_detail=detail or "")

    async def _give_up_paused_calls(self, address: str, since: float) -> None:
        """While ``address`` stays paused, cancel its task-path calls that have waited
        ``daskwg.paused-timeout`` seconds (since they were sent or the pause began,
        whichever is later), each with a :class:`WorkerPausedError`: a pause caused by
        memory a rank holds may never end."""
        poll = Settings.current().poll_interval
        while self.paused.get(address) == since:
            now = time.monotonic()
            try:
                expired = [
                    f
                    for sid in list(self.server_ids.get(address, ()))
                    for f in self.inflight.of(sid)
                    if not f.done()
                    and f in self.calls
                    and self.owned.record(f) is None
                    and f.key not in self.paused_out
                    and now - max(since, self.calls[f].submitted) >= self.calls[f].paused_timeout
                ]
            except RuntimeError:  # a driver thread submitted meanwhile ("changed size"): next round
                expired = []
            if expired:
                figures = await self._memory_figures(address)
                if self.paused.get(address) != since:
                    return  # resumed meanwhile: the calls run
                for f in expired:
                    call = self.calls[f].call
                    self.paused_out[f.key] = WorkerPausedError(
                        call.rank,
                        address,
                        call.method,
                        memory=figures.get("memory"),
                        memory_limit=figures.get("memory_limit"),
                        pause_fraction=figures.get("pause") or None,
                        paused_for=now - since,
                    )
                    await losses.fail_futures(self.client, [f], [self.paused_out[f.key]])
            await asyncio.sleep(poll)

    async def _memory_figures(self, address: str) -> dict:
        try:
            return await asyncio.wait_for(self.client.rpc(address).daskwg_memory(), 10)
        except Exception:  # noqa: BLE001 - the message then goes without the figures
            return {}

    def _on_memory_restart(self, event: tuple) -> None:
        _, msg = event
        if not isinstance(msg, dict) or "worker" not in msg:
            return
        address = msg["worker"]
        self.memory_kills[address] = msg
        # The worker's removal may have been reported first: say why now.
        reason = self._memory_kill_reason(address)
        for sid in self.lost_by_address.get(address, ()):
            self.lost[sid] = reason
        for transport in list(self.transports):
            if isinstance(transport.broken, WorkerLostError) and transport.broken.address == address:
                transport.broken.detail = reason

    def _memory_kill_reason(self, address: str) -> str | None:
        msg = self.memory_kills.get(address)
        if msg is None:
            return None
        limit = self.memory_limits.get(address)
        return (
            f"its nanny restarted it for memory: the process used {format_bytes(msg.get('rss', 0))}"
            + (f" of its memory_limit {format_bytes(limit)}" if limit else "")
            + ", above distributed.worker.memory.terminate; give the workers a larger memory_limit, "
            "or hold less in the ranks"
        )

    def lost_reason(self, address: str, server_id: str) -> str | None:
        """Why the worker at ``address`` went away, if the nanny or scheduler said so."""
        return self._memory_kill_reason(address) or self.lost.get(server_id)

    def note_finished(self, server_id: str, seq: int) -> None:
        """Call ``seq`` of this driver ended on worker process ``server_id`` (a reply came)."""
        if seq > self.finished.get(server_id, -1):
            self.finished[server_id] = seq

    def _live(self, table: dict, server_id: str) -> Any:
        entry = table.get(server_id)
        if entry is None:
            return None
        if entry.watch.done() or 0 <= entry.seq <= self.finished.get(server_id, -1):
            table.pop(server_id, None)
            return None
        return entry

    def busy_call(self, slot: Any) -> StuckCall | AbandonedCall | None:
        """The call ``slot``'s worker is still busy with that nothing should queue behind
        silently: a broken group's straggler, or a call the driver abandoned."""
        return self._live(self.stuck, slot.server_id) or self._live(self.abandoned, slot.server_id)

    def warn_if_abandoned(self, slots: Sequence[Any], what: str) -> None:
        """Log, once per call, that ``what`` queues behind a call the driver abandoned.

        Calls run one at a time on a worker, so the new call waits until the abandoned
        one ends (its deadline, if any, still applies): it must not wait silently.
        """
        now = time.monotonic()
        for slot in slots:
            entry = self._live(self.abandoned, slot.server_id)
            if entry is not None:
                logger.warning(
                    "%s waits on %s: the worker is %s; wg.status() shows where it is, wg.restart() replaces "
                    "the process",
                    what,
                    slot.address,
                    entry.describe(now),
                )

    def check_not_stuck(self, slots: Sequence[Any], what: str) -> None:
        """Refuse to queue work behind a rank stuck in a call of a broken group.

        The worker runs calls one at a time, so anything sent there would wait until
        the stuck call returns (for a collective: its timeout, 30 min by default for
        gloo), which is a hang as far as the user can tell.
        """
        for slot, busy in self._busy(self.stuck, slots):
            raise GroupBrokenError(
                f"cannot run {what} on {slot.address}: its host thread is {busy}, and calls "
                "run one at a time there. Wait for that call to end and retry, let the collective time out "
                "(pass a short timeout= to init_process_group), or restart that worker "
                f"(client.restart_workers([{slot.address!r}]))"
            )

    def check_not_behind_abandoned(self, slots: Sequence[Any], what: str) -> None:
        """Refuse to build a group's ranks, without a deadline, behind a call the driver
        abandoned: the build would wait for a call that may never end (a rank in an
        infinite loop), without a word.

        Raises:
            GroupBrokenError: naming the call, its group and age, and what to do.
        """
        for slot, busy in self._busy(self.abandoned, slots):
            raise GroupBrokenError(
                f"cannot build {what} on {slot.address}: the worker is {busy}, and calls run "
                "one at a time there, so the new rank would wait behind it with no deadline. Build the group "
                "on other workers (workers=...), wait for that call to end, give the build a deadline "
                "(with daskwg.deadline(s): ...) to wait behind it, or restart that worker "
                f"(client.restart_workers([{slot.address!r}]))"
            )

    def _busy(self, table: dict, slots: Sequence[Any]) -> list[tuple[Any, str]]:
        """``(slot, what it is busy with)`` for each of ``slots`` whose worker still runs a
        call recorded in ``table`` (:attr:`stuck` or :attr:`abandoned`)."""
        now = time.monotonic()
        entries = [(slot, self._live(table, slot.server_id)) for slot in slots]
        return [(slot, entry.describe(now)) for slot, entry in entries if entry is not None]
