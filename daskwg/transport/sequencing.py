"""The order of one driver's calls on each worker process: :class:`Sequencer`.

Every call of a driver, whatever its path (direct, submit, plan, task), gets per worker
process the next sequence number of the driver's session, and the worker runs them
strictly in that order (``daskwg.plugin``'s sequencer). So the driver must fill every
number it hands out: a call that never reaches its worker gives its place up
(:meth:`Sequencer.skip`), or every later call of the session waits there. A new session
begins when the client reconnects to the scheduler, which made the workers forget the old
one's order. The sequencer also knows which calls a new one would queue behind: the last
number known to have ended on each worker, a broken group's stragglers (stuck) and the
calls the driver stopped waiting for (abandoned).

Threads. The calling threads own this state: any driver thread, for any group, takes
numbers, and records and checks the calls it would queue behind.

* Numbers and the session are taken together under the sequencer's lock, so calls from
  several threads get the same relative order on every worker, and a reconnection noticed
  by another thread cannot come between a session and its numbers.
* The stuck and abandoned records are single dict assignments and lookups (atomic under
  the GIL); an entry whose call has ended is dropped by whichever thread looks at it.
* The ended numbers are raised by the loop that reads a reply (a driver thread's
  :class:`~daskwg.transport.channel.Channel`, or the client's): a lower bound, so two
  replies racing only keep an entry alive until its own watch says the call ended.
* :meth:`Sequencer.skip` is asked from any thread; its message and its retries run on
  the client's event loop.

What the scheduler and the heartbeats say of the workers is another part of the driver,
owned by the client's event loop (``transport.failure.health``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from distributed import Client

from ..config import Settings
from ..errors import GroupBrokenError
from ..wire.messages import Handler, concurrency_group_of, group_session, session_id
from .failure.calls import AbandonedCall, StuckCall
from .failure.forensics import describe_running, query_status, running_on
from .failure.health import WorkerHealth

__all__ = ["Sequencer", "SKIP_RETRY_S"]

logger = logging.getLogger(__name__)

#: Seconds :meth:`Sequencer.skip` keeps trying to reach a worker that does not answer.
SKIP_RETRY_S = 3600.0


class Sequencer:
    """One driver's per-worker sequence numbers, its session, and the calls a new call
    would queue behind.

    Sequence numbers, ended numbers and busy ranks are keyed by the worker process's id
    (``WorkerSlot.server_id``), not its address: a Nanny restarts a worker under the same
    name and, with a fixed port, the same address, and its fresh plugin counts from 0 again.

    Args:
        client: the driver's client (its id names the sessions; skips go through its loop).
        health: the driver's :class:`~daskwg.transport.failure.health.WorkerHealth`
            (a skip stops once its worker is lost).
    """

    def __init__(self, client: Client, health: WorkerHealth):
        self.client = client
        self.health = health
        # the session this driver's calls carry (:func:`daskwg.wire.messages.session_id`); a new one
        # after each reconnection of the client (:meth:`renew_session`).
        self._session = client.id
        self._epoch = 0
        self._scheduler_comm = client.scheduler_comm
        self._lock = threading.Lock()
        self._next_seq: dict[str, int] = defaultdict(int)
        # (server id, concurrency group) -> the next number of a named concurrency group's
        # calls there (@register(concurrency_group=...)): each group has an order of its own,
        # in the session daskwg.wire.messages.group_session gives.
        self._group_seq: dict[tuple[str, str], int] = defaultdict(int)
        #: server id -> the call its rank is stuck in (a broken group's straggler).
        self._stuck: dict[str, StuckCall] = {}
        # Calls the driver stopped waiting for (deadline, Ctrl-C) that may still run, by
        # server id. Later calls to that worker queue behind them, and say so.
        self._abandoned: dict[str, AbandonedCall] = {}
        #: server id -> the highest sequence number of this driver's calls known to have
        #: ended there: calls end in order, so every earlier one has ended too.
        self._finished: dict[str, int] = {}

    @property
    def session(self) -> str:
        """The session this driver's calls carry now."""
        return self._session

    def record_stuck(self, server_id: str, entry: StuckCall) -> None:
        """``server_id``'s rank is still running ``entry``'s call after its group broke:
        nothing is queued behind it (:meth:`check_not_stuck`)."""
        self._stuck[server_id] = entry

    def record_abandoned(self, server_id: str, entry: AbandonedCall) -> None:
        """The driver stopped waiting for ``entry``'s call on ``server_id``: later calls
        there say what they wait for (:meth:`warn_if_abandoned`)."""
        self._abandoned[server_id] = entry

    def is_stuck(self, server_id: str) -> bool:
        """Whether ``server_id``'s worker is still stuck in a broken group's call."""
        entry = self._stuck.get(server_id)
        return entry is not None and not entry.watch.done()

    def is_abandoned(self, server_id: str) -> bool:
        """Whether ``server_id``'s worker still runs a call the driver abandoned."""
        entry = self._abandoned.get(server_id)
        return entry is not None and not entry.watch.done()

    def take_seqs(self, server_ids: Sequence[str]) -> list[int]:
        """The next sequence number of this driver on each of these worker processes
        (one lock, so calls from several threads keep one relative order everywhere)."""
        return self.numbered(server_ids)[1]

    def numbered(
        self, server_ids: Sequence[str], concurrency_group: str | None = None
    ) -> tuple[str, list[int]]:
        """:meth:`take_seqs`, with the session they count in (taken together, so a
        reconnection in another thread cannot come between). A named ``concurrency_group``
        numbers in an order of its own, in the session
        :func:`~daskwg.wire.messages.group_session` gives."""
        with self._lock:
            if concurrency_group is not None:
                seqs = []
                for sid in server_ids:
                    seqs.append(self._group_seq[(sid, concurrency_group)])
                    self._group_seq[(sid, concurrency_group)] += 1
                return group_session(self._session, concurrency_group), seqs
            seqs = []
            for sid in server_ids:
                seqs.append(self._next_seq[sid])
                self._next_seq[sid] += 1
            return self._session, seqs

    def renew_session(self, comm: Any, groups: Iterable[Any]) -> list | None:
        """Begin a new session if ``comm``, the client's connection to the scheduler, is
        not the one this driver last numbered calls on.

        Returns:
            ``list(groups)`` taken under the same lock as the new session (the groups built
            before it, which a reconnection breaks: a group built after numbers its calls
            in the new session), or ``None`` when the connection is the same.
        """
        if comm is self._scheduler_comm:
            return None
        with self._lock:
            if comm is self._scheduler_comm:
                return None
            self._scheduler_comm = comm
            self._epoch += 1
            self._session = session_id(self.client.id, self._epoch)
            self._next_seq = defaultdict(int)
            self._group_seq = defaultdict(int)
            self._finished.clear()  # numbers of the old session
            return list(groups)

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
        while self.client.status in ("running", "connecting") and server_id not in self.health.lost:
            try:
                # Dask's rpc: a connect timeout (distributed.comm.timeouts.connect) bounds it.
                await getattr(self.client.rpc(address), Handler.SKIP)(session=session, seqs=seqs)
                return
            except Exception:  # noqa: BLE001 - not answering now; gone (then nothing waits there)
                if time.monotonic() + delay > give_up_at:
                    logger.warning(
                        "calls %s of session %s could not be skipped on %s", seqs, session, address
                    )
                    return
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)

    def note_finished(self, server_id: str, seq: int, session: str | None = None) -> None:
        """Call ``seq`` of this driver ended on worker process ``server_id`` (a reply came).
        ``session``: the call's; a named concurrency group's calls count in an order of
        their own, which says nothing of the default group's (what ``_finished`` holds)."""
        if session is not None and concurrency_group_of(session) is not None:
            return
        if seq > self._finished.get(server_id, -1):
            self._finished[server_id] = seq

    def _live(self, table: dict, server_id: str) -> Any:
        entry = table.get(server_id)
        if entry is None:
            return None
        if entry.watch.done() or 0 <= entry.seq <= self._finished.get(server_id, -1):
            table.pop(server_id, None)
            return None
        return entry

    def busy_call(self, slot: Any) -> StuckCall | AbandonedCall | None:
        """The call ``slot``'s worker is still busy with that nothing should queue behind
        silently: a broken group's straggler, or a call the driver abandoned."""
        return self._live(self._stuck, slot.server_id) or self._live(self._abandoned, slot.server_id)

    def warn_if_abandoned(
        self, slots: Sequence[Any], what: str, concurrency_group: str | None = None
    ) -> None:
        """Log, once per call, that ``what`` queues behind a call the driver abandoned.

        Calls run one at a time on a worker, so the new call waits until the abandoned
        one ends (its deadline, if any, still applies): it must not wait silently. The
        worker is asked which call holds it: when that is another driver's (two jobs on
        one cluster share the worker's order), the warning names that call, its group and
        its driver, and whether that driver left.
        """
        now = time.monotonic()
        for slot in slots:
            entry = self._live(self._abandoned, slot.server_id)
            if entry is None:
                continue
            busy = f"the worker is {entry.describe(now)}"
            holder = self._running_call(slot, concurrency_group)
            if holder is not None and holder.get("client") not in (None, self.client.id):
                by = (
                    "a deadline"
                    if entry.why == "deadline"
                    else "Ctrl-C"
                    if entry.why == "interrupted"
                    else entry.why
                )
                busy = (
                    f"the worker runs {describe_running(holder, self.client.id)}; this driver's call of "
                    f"{entry.method!r} of group {entry.group_name!r}, abandoned by {by} {now - entry.since:.1f} s "
                    "ago, waits behind it"
                )
            logger.warning(
                "%s waits on %s: %s; wg.status() shows where it is, wg.restart() replaces the process",
                what,
                slot.address,
                busy,
            )

    def _running_call(self, slot: Any, concurrency_group: str | None) -> dict | None:
        """The status record of the call of ``concurrency_group`` ``slot``'s worker runs now,
        whichever driver sent it; ``None`` if none, or if the worker cannot say."""
        try:
            answers = self.client.sync(
                query_status, self.client.rpc, [slot.address], Settings.current().status_timeout
            )
        except Exception:  # noqa: BLE001 - only a warning's detail: the plain one is logged then
            return None
        answer = answers.get(slot.address)
        return None if isinstance(answer, str) or answer is None else running_on(answer, concurrency_group)

    def check_not_stuck(self, slots: Sequence[Any], what: str) -> None:
        """Refuse to queue work behind a rank stuck in a call of a broken group.

        The worker runs calls one at a time, so anything sent there would wait until
        the stuck call returns (for a collective: its timeout, 30 min by default for
        gloo), which is a hang as far as the user can tell.
        """
        for slot, busy in self._busy(self._stuck, slots):
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
        for slot, busy in self._busy(self._abandoned, slots):
            raise GroupBrokenError(
                f"cannot build {what} on {slot.address}: the worker is {busy}, and calls run "
                "one at a time there, so the new rank would wait behind it with no deadline. Build the group "
                "on other workers (workers=...), wait for that call to end, give the build a deadline "
                "(with daskwg.deadline(s): ...) to wait behind it, or restart that worker "
                f"(client.restart_workers([{slot.address!r}]))"
            )

    def _busy(self, table: dict, slots: Sequence[Any]) -> list[tuple[Any, str]]:
        """``(slot, what it is busy with)`` for each of ``slots`` whose worker still runs a
        call recorded in ``table`` (stuck or abandoned)."""
        now = time.monotonic()
        entries = [(slot, self._live(table, slot.server_id)) for slot in slots]
        return [(slot, entry.describe(now)) for slot, entry in entries if entry is not None]
