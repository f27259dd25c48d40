"""The driver's heartbeat to the workers of its groups: :class:`Heartbeats`, which finds a
worker unreachable within ``daskwg.heartbeat-timeout`` seconds.

Dask finds a partitioned worker only when a connection's TCP timeout passes
(``distributed.comm.timeouts.tcp``, 30 s), and then the scheduler removes it. The driver
keeps one idle Dask connection to each worker process its groups use and lets the kernel
probe it (TCP keepalive every ``daskwg.heartbeat-interval`` seconds, given up
``daskwg.heartbeat-timeout`` seconds after the worker's host last acknowledged anything).
Only the worker host's kernel answers those probes, never its event loop, so a worker
that is merely busy (a long call, a blocked event loop) is never taken for a lost one. A
broken heartbeat marks the worker lost to this driver
(:meth:`~daskwg.transport.failure.health.WorkerHealth.unreachable`); a worker found
answering again when a new group uses it is forgiven
(:meth:`~daskwg.transport.failure.health.WorkerHealth.revoke`).

Everything here runs on the client's event loop except :meth:`Heartbeats.follow` and
:meth:`Heartbeats.unfollow`, which the group's thread calls.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from distributed.comm import connect
from distributed.comm.addressing import parse_address, parse_host_port

from ...wire.messages import Handler
from ..driver import Driver

__all__ = ["Heartbeats", "keep_alive", "unreachable_error"]

logger = logging.getLogger(__name__)

#: What a connection to a host that stopped answering ends with.
_UNREACHABLE = {errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}

#: Seconds between the checks whether a heartbeat is still needed.
_CHECK_EVERY = 2.0

#: Seconds a kernel-level connection attempt gets when the Dask one failed.
_PROBE_TIMEOUT = 2.0


class Heartbeats:
    """One driver's heartbeats, one per worker process its live groups use.

    Args:
        driver: the driver whose workers they watch.
    """

    _of: weakref.WeakKeyDictionary[Driver, Heartbeats] = weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self, driver: Driver):
        self.driver = driver
        self._lock = threading.Lock()
        #: server id -> the transports (groups) whose ranks are there.
        self._users: dict[str, weakref.WeakSet] = defaultdict(weakref.WeakSet)
        #: server ids with a heartbeat running.
        self._beating: set[str] = set()

    @classmethod
    def of(cls, driver: Driver) -> Heartbeats:
        """The heartbeats of ``driver`` (made on first use)."""
        with cls._of_lock:
            beats = cls._of.get(driver)
            if beats is None:
                beats = cls._of[driver] = cls(driver)
            return beats

    def follow(self, transport: Any, slots: Sequence[Any], interval: float, timeout: float) -> None:
        """Keep a heartbeat to every worker of ``slots`` while ``transport`` uses it.

        A worker the driver took as lost only because an earlier heartbeat broke is first
        asked again (waiting up to ``timeout`` seconds): if the same process answers, its
        lost mark is cleared, the places of the calls given up on there are skipped, and
        the new group can use it; if not, the mark stays and the group's calls fail with
        ``WorkerLostError`` at once.

        Args:
            transport: the group's transport (weakly referenced).
            slots: its ``pool.WorkerSlot``\\ s.
            interval: seconds between keepalive probes (``daskwg.heartbeat-interval``).
            timeout: seconds without an answer before the worker is unreachable
                (``daskwg.heartbeat-timeout``).
        """
        driver = self.driver
        if interval <= 0 or timeout <= 0:
            return
        unique = list({s.server_id: s for s in slots}.values())
        for slot in unique:
            if driver.health.is_suspect(slot.server_id):
                driver.client.sync(self._recheck, slot, interval, timeout)
        start = []
        with self._lock:
            for slot in unique:
                self._users[slot.server_id].add(transport)
                if slot.server_id not in self._beating and slot.server_id not in driver.health.lost:
                    self._beating.add(slot.server_id)
                    start.append(slot)
        for slot in start:
            driver.client.loop.add_callback(self._beat, slot, interval, timeout)

    def unfollow(self, transport: Any) -> None:
        """``transport`` no longer needs its workers' heartbeats."""
        with self._lock:
            for users in self._users.values():
                users.discard(transport)

    def _needed(self, server_id: str) -> bool:
        if self.driver.client.status not in ("running", "connecting"):
            return False
        with self._lock:
            return bool(self._users.get(server_id)) and server_id not in self.driver.health.lost

    async def _beat(self, slot: Any, interval: float, timeout: float, comm: Any = None) -> None:
        """The heartbeat of one worker process, until it is no longer needed or breaks."""
        driver, server_id = self.driver, slot.server_id
        reader = None
        try:
            while comm is None:
                try:
                    comm, answered = await self._connect(slot.address, interval, timeout)
                except OSError as exc:
                    if await _host_answers(slot.address) and self._needed(server_id):
                        # Its kernel accepts connections: the process is busy, not cut off.
                        await asyncio.sleep(interval)
                        continue
                    driver.health.unreachable(
                        slot.address,
                        server_id,
                        f"unreachable from the driver: no connection within {timeout:g} s "
                        f"(daskwg.heartbeat-timeout): {exc}",
                    )
                    return
                if answered != server_id:
                    return  # another process answers there: the scheduler reports this one's end
            reader = asyncio.ensure_future(comm.read())
            while not reader.done() and self._needed(server_id):
                await asyncio.wait([reader], timeout=_CHECK_EVERY)
            if not reader.done():
                return
            reason = unreachable_error(reader.exception(), timeout)
            if reason is not None:
                driver.health.unreachable(slot.address, server_id, reason)
            # Otherwise the worker closed the connection (it is closing): the scheduler's
            # remove-worker event says so, as for any worker that leaves.
        finally:
            with self._lock:
                self._beating.discard(server_id)
                if not self._users.get(server_id):
                    self._users.pop(server_id, None)
            if reader is not None and not reader.done():
                reader.add_done_callback(_consume)
            if comm is not None:
                comm.abort()

    async def _connect(self, address: str, interval: float, timeout: float) -> tuple[Any, str | None]:
        """A Dask connection to ``address`` probed by keepalive, and the id of the worker
        process that answers there (Dask's ``identity``)."""
        comm = await connect(address, timeout=timeout, **self.driver.client.connection_args)
        try:
            keep_alive(comm, interval, timeout)
            await comm.write({"op": "identity", "reply": True})
            # No timeout of its own: the keepalive bounds it if the host stops answering,
            # and a busy event loop only answers late.
            identity = await comm.read()
        except BaseException:
            comm.abort()
            raise
        return comm, identity.get("id") if isinstance(identity, dict) else None

    async def _recheck(self, slot: Any, interval: float, timeout: float) -> None:
        """Ask a worker taken as unreachable again; clear its mark if the same process answers."""
        driver, server_id = self.driver, slot.server_id
        try:
            comm, answered = await asyncio.wait_for(self._connect(slot.address, interval, timeout), timeout)
        except (OSError, asyncio.TimeoutError):
            return
        try:
            if answered != server_id:
                comm.abort()  # a new process there: the old one's mark stays
                return
            by_session: dict[str, list[int]] = defaultdict(list)
            for session, seq in driver.health.given_up_calls(server_id):
                by_session[session].append(seq)
            for session, seqs in by_session.items():
                # Calls that never arrived would hold every later call of their session.
                await comm.write(
                    {"op": Handler.SKIP, "session": session, "seqs": sorted(seqs), "reply": True}
                )
                await comm.read()
        except (OSError, asyncio.TimeoutError):
            comm.abort()
            return
        except BaseException:
            comm.abort()
            raise
        driver.health.revoke(server_id)
        logger.info("the worker %s answers the driver again: its lost mark is cleared", slot.address)
        with self._lock:
            if server_id in self._beating:
                comm.abort()
                return
            self._beating.add(server_id)
        asyncio.ensure_future(self._beat(slot, interval, timeout, comm))


def keep_alive(comm: Any, interval: float, timeout: float) -> bool:
    """Have the kernel probe ``comm``'s socket every ``interval`` seconds once idle, and
    abort it ``timeout`` seconds after the peer's host last acknowledged anything
    (``TCP_KEEPIDLE``/``TCP_KEEPINTVL``/``TCP_KEEPCNT`` and, on Linux,
    ``TCP_USER_TIMEOUT``); whole seconds, at least 1. Returns whether it could (a TCP or
    TLS comm on Linux); elsewhere Dask's own keepalive stays."""
    stream = getattr(comm, "stream", None)
    sock = getattr(stream, "socket", None)
    if sock is None or not sys.platform.startswith("linux"):
        return False
    every = max(1, round(interval))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, round(timeout / every)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(max(timeout, 1.0) * 1000))
    except (OSError, AttributeError) as exc:
        logger.debug("could not set the heartbeat's keepalive on %s: %s", comm, exc)
        return False
    return True


def unreachable_error(exc: BaseException | None, timeout: float) -> str | None:
    """Why a heartbeat's connection ended, if its worker's host stopped answering
    (a timed-out or unroutable connection), else ``None`` (the worker closed it)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
            return (
                f"unreachable from the driver: its host acknowledged nothing for {timeout:g} s "
                f"(daskwg.heartbeat-timeout; {errno.errorcode.get(exc.errno, exc.errno)}): the network "
                "between them is down, or the host is"
            )
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _host_answers(address: str) -> bool:
    """Whether the kernel of ``address``'s host accepts a TCP connection to its port now."""
    try:
        _, location = parse_address(address)
        host, port = parse_host_port(location)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _PROBE_TIMEOUT)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    writer.close()
    return True
