"""What one driver knows of the health of its groups' workers: :class:`WorkerHealth`.

The scheduler's per-worker event topics (removal, closing, pause), the nannies' restarts
for memory, and the driver's own heartbeat verdicts (``failure.heartbeat``) all end here:
a worker process is lost (with the reason its groups' errors give), merely suspected (the
heartbeat found it unreachable, the scheduler still has it), or paused.

Threads. The client's event loop owns this state: it runs the scheduler's and nannies'
topic handlers, the heartbeats' verdicts (:meth:`WorkerHealth.unreachable`,
:meth:`WorkerHealth.revoke`) and the paused-call timer. Three things come from other
threads, each a single dict operation that the GIL makes atomic, so none takes a lock:

* :meth:`WorkerHealth.watch`, on the thread that builds a group: it records the group's
  workers before subscribing to their topics, so no event about them comes first;
* a calling thread's own verdict on a worker whose connection dropped under its call, or
  whose handler was cancelled (``setdefault``: the first word on why wins), and the calls
  it gave up on there (an append), both on the loop that ran the call (a driver thread's
  :class:`~daskwg.transport.channel.Channel` or the client's);
* after a reconnection of the client, forgetting the topic subscriptions the scheduler
  dropped with the old connection (:meth:`WorkerHealth.reconnected`), on the thread that
  noticed it;
* reads, from any thread, of one key at a time (``server id in lost``); nothing iterates
  these dicts off the client's loop.

Sequence numbers, sessions and skips are another part of the driver, owned by the
calling threads (``transport.sequencing``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes

from ...config import Settings
from ...errors import WorkerLostError, WorkerPausedError
from ...wire.messages import Handler
from . import losses

if TYPE_CHECKING:
    from ..driver import Driver

__all__ = ["WorkerHealth"]


class WorkerHealth:
    """The lost, suspected and paused workers of one driver, and why.

    Keyed by the worker process's id (``WorkerSlot.server_id``) where a process is meant,
    by its address where the scheduler's events name only that.

    Args:
        driver: the driver this is part of; its client, its live groups' transports, its
            task-path records, results and call streams are what a loss fails or forgets.
    """

    def __init__(self, driver: Driver):
        self.driver = driver
        self.client = driver.client
        self._watched: set[str] = set()
        self._server_ids: dict[str, set[str]] = defaultdict(set)
        #: server id -> when that worker process started (``WorkerSlot.started``)
        self._started: dict[str, float] = {}
        self._lost: dict[str, str] = {}
        #: server id -> the reason in ``lost`` of a worker lost only by this driver's own
        #: reckoning (its heartbeat found it unreachable): the process may still be there,
        #: and a new group re-checks (:meth:`is_suspect`).
        self._suspects: dict[str, str] = {}
        #: server id -> ``(session, seq)`` of the calls given up on when it was taken as lost
        #: (they may never have arrived: their places are skipped if it comes back).
        self._given_up: dict[str, list[tuple[str, int]]] = defaultdict(list)
        self._paused: dict[str, float] = {}
        self._paused_out: dict[str, WorkerPausedError] = {}
        # Worker address -> the nanny's "worker-restart-memory" event (rss, pid).
        self._memory_kills: dict[str, dict] = {}
        self._lost_by_address: dict[str, list[str]] = defaultdict(list)
        self._memory_limits: dict[str, int | None] = {}
        self._memory_events = False
        #: worker address -> the reason of its last ``closing-worker`` event (why it closed).
        self._closing: dict[str, str] = {}
        #: worker address -> ``(nanny address, pid)`` of the process watched there last.
        self._processes: dict[str, tuple[str | None, int | None]] = {}
        #: server id -> times its heartbeat found it unreachable: call streams opened
        #: before the last time are not reused (``CallStreams``).
        self._stream_epochs: dict[str, int] = {}
        self._lost_view = MappingProxyType(self._lost)
        self._stream_epochs_view = MappingProxyType(self._stream_epochs)

    @property
    def lost(self) -> Mapping[str, str]:
        """Server id -> why that worker process is lost to this driver's groups (a live,
        read-only view: one key at a time from other threads)."""
        return self._lost_view

    @property
    def stream_epochs(self) -> Mapping[str, int]:
        """Server id -> times its heartbeat found it unreachable (a live, read-only view):
        call streams opened before the last time are not reused (``CallStreams``)."""
        return self._stream_epochs_view

    def mark_lost(self, server_id: str, reason: str) -> str:
        """Take ``server_id`` as lost for ``reason`` unless it already is (a calling
        thread's connection dropped under its call). Returns the reason that stands."""
        return self._lost.setdefault(server_id, reason)

    def given_up_calls(self, server_id: str) -> list[tuple[str, int]]:
        """``(session, seq)`` of the calls given up on when ``server_id`` was taken as lost."""
        return list(self._given_up.get(server_id, ()))

    def paused_since(self, address: str) -> float | None:
        """``time.monotonic()`` when the worker at ``address`` paused, or ``None``."""
        return self._paused.get(address)

    def take_paused_error(self, key: str) -> WorkerPausedError | None:
        """The :class:`WorkerPausedError` that cancelled task ``key`` (once), or ``None``."""
        return self._paused_out.pop(key, None)

    def unreachable(self, address: str, server_id: str, reason: str) -> None:
        """The heartbeat found the worker process ``server_id`` at ``address`` unreachable:
        lost to this driver's groups on it, as a removed worker is, until a new group
        finds it answering again (:meth:`revoke`). Runs on the client's event loop."""
        if server_id in self._lost:
            return
        self._lost[server_id] = reason
        self._suspects[server_id] = reason
        self._stream_epochs[server_id] = self._stream_epochs.get(server_id, 0) + 1
        orphans = [f for f in self.driver.inflight.pop(server_id) if not f.done()]
        for future in orphans:
            entry = self.driver.calls.get(future)
            if entry is not None:
                self._given_up[server_id].append((entry.call.session, entry.call.seq))
        if orphans:
            asyncio.ensure_future(
                self.client._cancel(
                    orphans,
                    reason="worker-lost",
                    msg=f"WorkerLostError: the worker {address} was lost ({reason})",
                )
            )
        for transport in list(self.driver.transports):
            transport.worker_lost(address, reason)

    def is_suspect(self, server_id: str) -> bool:
        """Whether ``server_id`` is lost only because the heartbeat found it unreachable
        (the scheduler has not removed it since: that replaces the reason)."""
        reason = self._suspects.get(server_id)
        return reason is not None and self._lost.get(server_id) == reason

    def give_up(self, server_id: str, session: str, seq: int) -> None:
        """Record that the driver gave up on call ``seq`` to a worker it took as lost."""
        self._given_up[server_id].append((session, seq))

    def revoke(self, server_id: str) -> None:
        """Clear the lost mark :meth:`unreachable` set: the same process answers again.
        Groups already broken by it stay broken."""
        self._suspects.pop(server_id, None)
        self._lost.pop(server_id, None)
        self._given_up.pop(server_id, None)

    def reconnected(self) -> None:
        """The client reconnected to the scheduler, which forgot the old connection's topic
        subscriptions: :meth:`watch` subscribes again."""
        self._watched.clear()
        self._memory_events = False

    def watch(self, slots: Sequence[Any]) -> None:
        """Follow the scheduler's events about these workers (removal, pause), once each."""
        if not self._memory_events:
            # Nannies announce the workers they restart for memory (above
            # distributed.worker.memory.terminate); lost-worker errors then say so.
            self.client.subscribe_topic("worker-restart-memory", self._on_memory_restart)
            self._memory_events = True
        if any(slot.address not in self._watched for slot in slots):
            # Kept for the message about a worker its nanny restarts for memory, which
            # comes when the scheduler has forgotten that worker.
            for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
                self._memory_limits[address] = info.get("memory_limit")
        for slot in slots:
            self._server_ids[slot.address].add(slot.server_id)
            self._started[slot.server_id] = slot.started
            self._processes[slot.address] = (getattr(slot, "nanny", None), getattr(slot, "pid", None))
            if slot.address not in self._watched:
                self._watched.add(slot.address)
                self.client.subscribe_topic(
                    slot.address, functools.partial(self._on_worker_event, slot.address)
                )

    def _on_worker_event(self, address: str, event: tuple, exit_detail: str | None = None) -> None:
        when, msg = event
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "closing-worker":
            self._closing[address] = str(msg.get("reason", ""))
        elif msg.get("action") == "remove-worker":
            closing = self._closing.get(address)
            nanny, pid = self._processes.get(address, (None, None))
            if exit_detail is None and nanny and losses.needs_exit_detail(msg, closing):
                # Its process died without a word: ask its Nanny how (a moment, bounded).
                asyncio.ensure_future(self._on_removal_with_exit_detail(address, event, nanny, pid))
                return
            self._closing.pop(address, None)
            reason = self._memory_kill_reason(address) or losses.removal_reason(msg, closing, exit_detail)
            orphans = []
            removed = self._server_ids.pop(address, set())
            # Events can arrive after a group was already built on the restarted process
            # at the same address: a process that started after the removal stays.
            newer = {
                sid
                for sid in removed
                if isinstance(when, (int, float)) and self._started.get(sid, 0.0) > when
            }
            if newer:
                self._server_ids[address] = newer
            for sid in removed - newer:
                self._lost[sid] = reason
                self._lost_by_address[address].append(sid)
                orphans += [f for f in self.driver.inflight.pop(sid) if not f.done()]
            # Groups are broken before any waiting thread sees a failed future.
            for transport in list(self.driver.transports):
                transport.worker_lost(address, reason)
            # Results of non-blocking calls there fail as lost (their stream's close may
            # come late: a worker removed by the scheduler can still hold it open).
            owned_results = self.driver.owned
            owned = [f for f in orphans if owned_results.record(f) is not None]
            orphans = [f for f in orphans if owned_results.record(f) is None]
            owned_results.lost(
                [f.key for f in owned],
                lambda rec: WorkerLostError(rec.call.rank, address, reason, rec.call.group_name),
            )
            self.driver.streams.forget(address)
            if orphans:
                # A task pinned to a worker that is gone would wait forever ("no-worker"
                # state) in a plain future.result(): it fails with WorkerLostError.
                calls = self.driver.calls
                errors = [
                    WorkerLostError(calls[f].call.rank, address, reason, calls[f].call.group_name)
                    if f in calls
                    else WorkerLostError(-1, address, reason)
                    for f in orphans
                ]
                asyncio.ensure_future(losses.fail_futures(self.client, orphans, errors))
            self._paused.pop(address, None)
        elif msg.get("action") == "worker-status-change":
            # Paused workers (memory above distributed.worker.memory.pause) start no
            # tasks, so calls on the task path wait; _gather says so instead of waiting
            # silently. Handlers (the direct path) still run while paused.
            if msg.get("status") == "paused":
                if address not in self._paused:
                    since = self._paused[address] = time.monotonic()
                    asyncio.ensure_future(self._give_up_paused_calls(address, since))
            else:
                self._paused.pop(address, None)

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
        calls, owned = self.driver.calls, self.driver.owned
        while self._paused.get(address) == since:
            now = time.monotonic()
            try:
                expired = [
                    f
                    for sid in list(self._server_ids.get(address, ()))
                    for f in self.driver.inflight.of(sid)
                    if not f.done()
                    and f in calls
                    and owned.record(f) is None
                    and f.key not in self._paused_out
                    and now - max(since, calls[f].submitted) >= calls[f].paused_timeout
                ]
            except RuntimeError:  # a driver thread submitted meanwhile ("changed size"): next round
                expired = []
            if expired:
                figures = await self._memory_figures(address)
                if self._paused.get(address) != since:
                    return  # resumed meanwhile: the calls run
                for f in expired:
                    call = calls[f].call
                    self._paused_out[f.key] = WorkerPausedError(
                        call.rank,
                        address,
                        call.method,
                        memory=figures.get("memory"),
                        memory_limit=figures.get("memory_limit"),
                        pause_fraction=figures.get("pause") or None,
                        paused_for=now - since,
                    )
                    await losses.fail_futures(self.client, [f], [self._paused_out[f.key]])
            await asyncio.sleep(poll)

    async def _memory_figures(self, address: str) -> dict:
        try:
            return await asyncio.wait_for(getattr(self.client.rpc(address), Handler.MEMORY)(), 10)
        except Exception:  # noqa: BLE001 - the message then goes without the figures
            return {}

    def _on_memory_restart(self, event: tuple) -> None:
        _, msg = event
        if not isinstance(msg, dict) or "worker" not in msg:
            return
        address = msg["worker"]
        self._memory_kills[address] = msg
        # The worker's removal may have been reported first: say why now.
        reason = self._memory_kill_reason(address)
        for sid in self._lost_by_address.get(address, ()):
            self._lost[sid] = reason
        for transport in list(self.driver.transports):
            if isinstance(transport.broken, WorkerLostError) and transport.broken.address == address:
                transport.broken.detail = reason

    def _memory_kill_reason(self, address: str) -> str | None:
        msg = self._memory_kills.get(address)
        if msg is None:
            return None
        limit = self._memory_limits.get(address)
        return (
            f"its nanny restarted it for memory: the process used {format_bytes(msg.get('rss', 0))}"
            + (f" of its memory_limit {format_bytes(limit)}" if limit else "")
            + ", above distributed.worker.memory.terminate; give the workers a larger memory_limit, "
            "or hold less in the ranks"
        )

    def lost_reason(self, address: str, server_id: str) -> str | None:
        """Why the worker at ``address`` went away, if the nanny or scheduler said so."""
        return self._memory_kill_reason(address) or self._lost.get(server_id)
