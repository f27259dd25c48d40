"""The per-client state of the driver side: :class:`Driver`."""

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
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import format_bytes
from distributed import Client, Future

from .. import config as _config  # noqa: F401  (loads daskwg's dask.config defaults)
from ..dashboard import DashboardPlugin
from ..errors import GroupBrokenError, WorkerLostError, WorkerPausedError
from ..plugin import HostPlugin
from ..scheduler import ReleaseOnClientExit
from ..wire import PLUGIN_NAME
from .channel import Channel

if TYPE_CHECKING:
    from .group_transport import GroupTransport

__all__ = ["Driver"]

logger = logging.getLogger(__name__)


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
        self.transports: weakref.WeakSet[GroupTransport] = weakref.WeakSet()
        self.watched: set[str] = set()
        self.server_ids: dict[str, set[str]] = defaultdict(set)
        #: server id -> when that worker process started (``WorkerSlot.started``)
        self.started: dict[str, float] = {}
        self.lost: dict[str, str] = {}
        self.paused: dict[str, float] = {}
        self.stuck: dict[str, tuple[str, str, Any]] = {}
        # Calls the driver stopped waiting for (deadline, Ctrl-C) that may still run:
        # server_id -> (group name, method, done-watch, since, why). Later calls to that
        # worker queue behind them, and say so.
        self.abandoned: dict[str, tuple[str, str, Any, float, str]] = {}
        self.inflight: dict[str, weakref.WeakSet[Future]] = defaultdict(weakref.WeakSet)
        # Per task-path future: (when it was submitted, rank, method), so that a call
        # waiting on a paused worker is given up after daskwg.paused-timeout.
        self.submitted: weakref.WeakKeyDictionary[Future, tuple[float, int, str]] = (
            weakref.WeakKeyDictionary()
        )
        self.paused_out: dict[str, WorkerPausedError] = {}
        # Worker address -> the nanny's "worker-restart-memory" event (rss, pid).
        self.memory_kills: dict[str, dict] = {}
        self.lost_by_address: dict[str, list[str]] = defaultdict(list)
        self.memory_limits: dict[str, int | None] = {}
        self.plugins_ready = False
        self.call_numbers = itertools.count()
        self.local = threading.local()
        #: task key -> the worker address it is pinned to, while its future lives.
        self.placement: dict[str, str] = {}
        #: part key -> future of its ``parts.PartInfo``, while the part's future lives.
        self.part_infos: dict[str, Future] = {}

    @classmethod
    def of(cls, client: Client) -> Driver:
        with cls._registry_lock:
            driver = cls._registry.get(client.id)
            if driver is None or driver.client is not client:
                driver = cls._registry[client.id] = cls(client)
            return driver

    def ensure_plugins(self) -> None:
        if self.plugins_ready:
            return
        self.client.register_plugin(HostPlugin(), name=PLUGIN_NAME)
        try:
            self.client.register_plugin(ReleaseOnClientExit(), name="daskwg-release")
            self.client.register_plugin(DashboardPlugin(), name=DashboardPlugin.name)
        except Exception as exc:  # noqa: BLE001 - the scheduler may not have daskwg installed
            logger.warning(
                "could not install daskwg's scheduler plugin (%s): groups of a driver that "
                "exits without shutdown() stay on the workers until they restart",
                exc,
            )
        # Nannies announce the workers they restart for memory (above
        # distributed.worker.memory.terminate); lost-worker errors then say so.
        self.client.subscribe_topic("worker-restart-memory", self._on_memory_restart)
        self.plugins_ready = True

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
        with self.lock:
            seqs = []
            for sid in server_ids:
                seqs.append(self.next_seq[sid])
                self.next_seq[sid] += 1
            return seqs

    def watch(self, slots: Sequence[Any]) -> None:
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
        timeout = float(dask.config.get("daskwg.paused-timeout"))
        poll = float(dask.config.get("daskwg.poll-interval"))
        while self.paused.get(address) == since:
            now = time.monotonic()
            try:
                expired = [
                    f
                    for sid in list(self.server_ids.get(address, ()))
                    for f in list(self.inflight.get(sid, ()))
                    if not f.done()
                    and f in self.submitted
                    and now - max(since, self.submitted[f][0]) >= timeout
                ]
            except RuntimeError:  # a driver thread submitted meanwhile ("changed size"): next round
                expired = []
            if expired:
                figures = await self._memory_figures(address)
                if self.paused.get(address) != since:
                    return  # resumed meanwhile: the calls run
                for f in expired:
                    _, rank, method = self.submitted.pop(f)
                    self.paused_out[f.key] = WorkerPausedError(
                        rank,
                        address,
                        method,
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
            group_name, method, watch, since, why = entry
            if watch.done():
                self.abandoned.pop(slot.server_id, None)
                continue
            logger.warning(
                "%s waits on %s behind %r of group %r, abandoned %.1f s ago (%s) and still running; "
                "wg.status() shows where it is, wg.restart() replaces the process",
                what,
                slot.address,
                method,
                group_name,
                time.monotonic() - since,
                why,
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
            group_name, method, future = entry
            if future.done():
                self.stuck.pop(slot.server_id, None)
                continue
            raise GroupBrokenError(
                f"cannot run {what} on {slot.address}: its host thread is still stuck in {method!r} of the "
                f"broken group {group_name!r} (a rank failed while this one waited, e.g. in a collective), "
                "and calls run one at a time there. Restart the workers (client.restart()), or let the "
                "collective time out (pass a short timeout= to init_process_group) and retry"
            )
