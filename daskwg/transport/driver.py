"""The per-client object of the driver side: :class:`Driver`, and :class:`GroupRanks`, the
identity of one group's ranks that every driver-side object of that group shares.

A :class:`Driver` holds two parts, split by the thread that owns each:

* :class:`~daskwg.transport.sequencing.Sequencer` (``driver.sequencer``): per-worker
  sequence numbers, the session, skips, and the calls a new one would queue behind; owned
  by the calling threads.
* :class:`~daskwg.transport.failure.health.WorkerHealth` (``driver.health``): what the
  scheduler, the nannies and the heartbeats said of the workers (lost, suspected, paused);
  owned by the client's event loop.

Each module's header gives its thread rule. The driver itself holds what both parts and
every path share: the client, its live groups' transports, the task-path records (the
futures in flight per worker, their calls, their placement), the results it owns and their
call streams, and each driver thread's :class:`Channel`. These records take their own locks
where threads meet (``SharedWeakSet``, ``Inflight``, ``Owned``) or are single dict
operations from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from distributed import Client, Future

from ..wire.messages import Call
from .channel import Channel
from .failure.calls import AbandonedCall, Inflight, SharedWeakSet, StuckCall, TaskCall
from .failure.health import WorkerHealth
from .owned import Owned
from .sequencing import Sequencer
from .streams import CallStreams

__all__ = ["Driver", "GroupRanks", "StuckCall", "AbandonedCall", "TaskCall"]

logger = logging.getLogger(__name__)


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
        return self.slots[rank].server_id in self.driver.health.lost


class Driver:
    """Per-client driver state shared by all groups of one ``Client``.

    Attributes:
        client: the driver's synchronous ``distributed.Client``.
        sequencer: the order of its calls on each worker (:class:`Sequencer`).
        health: what it knows of its workers' health (:class:`WorkerHealth`).
    """

    _registry: dict[str, Driver] = {}
    _registry_lock = threading.Lock()

    def __init__(self, client: Client):
        self.client = client
        #: the transports of this driver's live groups (``worker_lost(address, reason)``, ``broken``).
        self.transports = SharedWeakSet()
        self.inflight = Inflight()
        #: every task-path future of this driver -> its :class:`TaskCall`, while it lives.
        self.calls: weakref.WeakKeyDictionary[Future, TaskCall] = weakref.WeakKeyDictionary()
        self.call_numbers = itertools.count()
        self.local = threading.local()
        #: task key -> the worker address it is pinned to, while its future lives.
        self.placement: dict[str, str] = {}
        #: part key -> future of its ``wire.PartInfo``, while the part's future lives.
        self.part_infos: dict[str, Future] = {}
        self.health = WorkerHealth(self)
        self.sequencer = Sequencer(client, self.health)
        #: the results of this driver's non-blocking calls, and the streams they go on.
        self.streams = CallStreams(client.connection_args, self.health.stream_epochs)
        self.owned = Owned(client, self.streams)
        self.owned.lost_reason = self.health.lost_reason

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
            channel = self.local.channel = Channel(self.client.connection_args, self.health.stream_epochs)
        return channel

    def check_reconnected(self) -> None:
        """Begin a new session if the client reconnected to the scheduler since this
        driver last looked (same client id, a new connection).

        The scheduler dropped the client with its old connection, so it released the
        client's ranks (not those of detached groups) and the workers forgot its order:
        groups built before are broken (``GroupBrokenError``), and later calls number
        afresh in a new session (:func:`daskwg.wire.messages.session_id`).
        """
        comm = self.client.scheduler_comm
        if comm is None or self.client.status != "running":
            return
        transports = self.sequencer.renew_session(comm, self.transports)
        if transports is None:
            return
        logger.info(
            "client %s reconnected to the scheduler: new session %s", self.client.id, self.sequencer.session
        )
        # The scheduler forgot the old connection's topic subscriptions.
        self.health.reconnected()
        for transport in transports:
            transport.reconnected()

    def call_of(self, future: Any) -> Call | None:
        """The :class:`~daskwg.wire.messages.Call` a task-path future of this driver stands for, else ``None``."""
        try:
            entry = self.calls.get(future)
        except TypeError:  # not weak-referenceable: not one of ours
            return None
        return None if entry is None else entry.call
