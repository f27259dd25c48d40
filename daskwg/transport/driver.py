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
from ..wire import Call
from .channel import Channel
from .owned import Owned
from .streams import CallStreams

__all__ = ["Driver", "GroupRanks", "StuckCall", "AbandonedCall", "TaskCall"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StuckCall:
    """A rank's call still running after its group broke: nothing is queued behind it.

    Attributes:
        group_name: the broken group.
        method: the call's method.
        watch: has ``done()``: whether the call has ended on the rank.
    """

    group_name: str
    method: str
    watch: Any


@dataclass(frozen=True)
class AbandonedCall:
    """A call the driver stopped waiting for (a deadline, Ctrl-C) that may still run.

    Attributes:
        group_name, method: the call.
        watch: has ``done()``: whether the call has ended on the rank.
        since: ``time.monotonic()`` when it was abandoned.
        why: ``"deadline"`` or ``"interrupted"``.
    """

    group_name: str
    method: str
    watch: Any
    since: float
    why: str


@dataclass(frozen=True)
class TaskCall:
    """What the driver knows of one task-path future, for deadline reports and paused workers.

    Attributes:
        call: the call it stands for.
        submitted: ``time.monotonic()`` when it was submitted.
        paused_timeout: the call's ``daskwg.paused-timeout`` (seconds).
    """

    call: Call
    submitted: float
    paused_timeout: float


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
        self.session = client.id
        self.lock = threading.Lock()
        # Sequence numbers, lost marks and busy ranks are keyed by the worker process's
        # id (``WorkerSlot.server_id``), not its address: a Nanny restarts a worker under
        # the same name and, with a fixed port, the same address, and its fresh plugin
        # counts from 0 again.
        self.next_seq: dict[str, int] = defaultdict(int)
        #: the transports of this driver's live groups (``worker_lost(address, reason)``, ``broken``).
        self.transports: weakref.WeakSet = weakref.WeakSet()
        self.watched: set[str] = set()
        self.server_ids: dict[str, set[str]] = defaultdict(set)
        #: server id -> when that worker process started (``WorkerSlot.started``)
        self.started: dict[str, float] = {}
        self.lost: dict[str, str] = {}
        self.paused: dict[str, float] = {}
        #: server id -> the call its rank is stuck in (a broken group's straggler).
        self.stuck: dict[str, StuckCall] = {}
        # Calls the driver stopped waiting for (deadline, Ctrl-C) that may still run, by
        # server id. Later calls to that worker queue behind them, and say so.
        self.abandoned: dict[str, AbandonedCall] = {}
        self.inflight: dict[str, weakref.WeakSet[Future]] = defaultdict(weakref.WeakSet)
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
        #: the results of this driver's non-blocking calls, and the streams they go on.
        self.streams = CallStreams(client.connection_args)
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
            channel = self.local.channel = Channel(self.client.connection_args)
        return channel

    def take_seqs(self, server_ids: Sequence[str]) -> list[int]:
        """The next sequence number of this driver on each of these worker processes
        (one lock, so calls from several threads keep one relative order everywhere)."""
        with self.lock:
            seqs = []
            for sid in server_ids:
                seqs.append(self.next_seq[sid])
                self.next_seq[sid] += 1
            return seqs

    def call_of(self, future: Any) -> Call | None:
        """The :class:`~daskwg.wire.Call` a task-path future of this driver stands for, else ``None``."""
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
            if slot.address not in self.watched:
                self.watched.add(slot.address)
                self.client.subscribe_topic(
                    slot.address, functools.partial(self._on_worker_event, slot.address)
                )

    def _on_worker_event(self, address: str, event: tuple) -> None:
        when, msg = event
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "remove-worker":
            reason = self._memory_kill_reason(address) or msg.get("stimulus_id", "")
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
                orphans += [f for f in self.inflight.pop(sid, ()) if not f.done()]
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
                # state) in a plain future.result(): cancel it, saying why.
                asyncio.ensure_future(
                    self.client._cancel(
                        orphans,
                        reason="worker-lost",
                        msg=f"WorkerLostError: the worker {address} was lost ({reason})",
                    )
                )
            self.paused.pop(address, None)
            for transport in list(self.transports):
                transport.worker_lost(address, reason)
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
                    for f in list(self.inflight.get(sid, ()))
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
                    await self.client._cancel(
                        [f], reason="worker-paused", msg=f"WorkerPausedError: {self.paused_out[f.key]}"
                    )
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

    def warn_if_abandoned(self, slots: Sequence[Any], what: str) -> None:
        """Log, once per call, that ``what`` queues behind a call the driver abandoned.

        Calls run one at a time on a worker, so the new call waits until the abandoned
        one ends (its deadline, if any, still applies): it must not wait silently.
        """
        for slot in slots:
            entry = self.abandoned.get(slot.server_id)
            if entry is None:
                continue
            if entry.watch.done():
                self.abandoned.pop(slot.server_id, None)
                continue
            logger.warning(
                "%s waits on %s behind %r of group %r, abandoned %.1f s ago (%s) and still running; "
                "wg.status() shows where it is, wg.restart() replaces the process",
                what,
                slot.address,
                entry.method,
                entry.group_name,
                time.monotonic() - entry.since,
                entry.why,
            )

    def check_not_stuck(self, slots: Sequence[Any], what: str) -> None:
        """Refuse to queue work behind a rank stuck in a call of a broken group.

        The worker runs calls one at a time, so anything sent there would wait until
        the stuck call returns (for a collective: its timeout, 30 min by default for
        gloo), which is a hang as far as the user can tell.
        """
        for slot in slots:
            entry = self.stuck.get(slot.server_id)
            if entry is None:
                continue
            if entry.watch.done():
                self.stuck.pop(slot.server_id, None)
                continue
            raise GroupBrokenError(
                f"cannot run {what} on {slot.address}: its host thread is still stuck in {entry.method!r} of the "
                f"broken group {entry.group_name!r} (a rank failed while this one waited, e.g. in a collective), "
                "and calls run one at a time there. Restart the workers (client.restart()), or let the "
                "collective time out (pass a short timeout= to init_process_group) and retry"
            )
