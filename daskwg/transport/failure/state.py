"""What the driver knows of one group's failures: :class:`FailureState`, and
:class:`CallWatch`, which tells when a call the driver stopped waiting for has ended.

A group is usable until its :attr:`FailureState.broken` is set (a lost worker, ranks out
of step, the scheduler gone); every later call raises that error. Calls of a broken
group that are still running are recorded on the :class:`~daskwg.transport.driver.Driver`
(``stuck``, ``abandoned``) so that nothing is queued behind them without a word.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import GroupBrokenError, RankError, WorkerGroupError, WorkerLostError
from ...wire.messages import Call, Handler
from ..driver import AbandonedCall, Driver, GroupRanks, StuckCall

__all__ = ["CallWatch", "FailureState", "Unsettled", "TRANSFER_ERRORS", "transfer_error"]

#: Seconds a call whose connection dropped waits for the scheduler's or nanny's reason.
_LOST_REASON_WAIT = 4.0

#: What Dask raises when a result cannot be serialised on the worker or deserialised here.
TRANSFER_ERRORS = (TypeError, pickle.PicklingError, pickle.UnpicklingError, AttributeError, ImportError)


def transfer_error(rank: int, address: str, method: str, exc: BaseException) -> RankError:
    """The :class:`RankError` of arguments or a result that could not cross processes."""
    return RankError(
        rank,
        address,
        method,
        "",
        TypeError(
            f"the arguments or the result of {method!r} could not cross between the driver and the worker: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; the workers must be able to "
            "import every class and function sent to them (install its module there), and results must be "
            "tensors, numpy arrays, DataProto or plain data"
        ),
    )


class CallWatch:
    """Tells when one call on one worker has finished, by polling the worker's
    ``daskwg_progress`` from the client's event loop. ``done()`` like a future."""

    def __init__(
        self, driver: Driver, address: str, seq: int, interval: float = 0.1, session: str | None = None
    ):
        self.seq = seq
        self._event = threading.Event()
        driver.client.loop.add_callback(
            self._poll, driver, address, seq, interval, session or driver.sequencer.session
        )

    def done(self) -> bool:
        """Whether the call has ended (or its worker is gone)."""
        return self._event.is_set()

    async def _poll(self, driver: Driver, address: str, seq: int, interval: float, session: str) -> None:
        try:
            while await getattr(driver.client.rpc(address), Handler.PROGRESS)(session=session) < seq:
                await asyncio.sleep(interval)
                interval = min(interval * 1.5, 1.0)  # a stuck collective may take minutes
        except Exception:  # noqa: BLE001 - a worker that is gone runs nothing any more
            pass
        self._event.set()


class _Numbered:
    """A watch (``done()``) with the sequence number of the call it follows."""

    def __init__(self, watch: Any, seq: int):
        self.watch = watch
        self.seq = seq

    def done(self) -> bool:
        return self.watch.done()


@dataclass(frozen=True)
class Unsettled:
    """A call that failed on one rank while others still ran it.

    Attributes:
        deadline: ``time.monotonic()`` until which the others may finish.
        method: the call's method.
        failed_rank: the rank that raised.
        pending: ``(rank, watch)`` of the ranks still running; ``watch.done()``.
    """

    deadline: float
    method: str
    failed_rank: int
    pending: list


@dataclass
class FailureState:
    """The failure state of one group's ranks, as the driver knows it.

    Attributes:
        ranks: the group's :class:`~daskwg.transport.driver.GroupRanks`.
        broken: the error every later call raises (a lost worker, ranks out of step, the
            scheduler gone), or ``None`` while the group is usable.
        unsettled: a failed call whose other ranks may still be running, until
            :meth:`settle` decides.
    """

    ranks: GroupRanks
    broken: WorkerGroupError | None = None
    unsettled: Unsettled | None = field(default=None)

    @property
    def driver(self) -> Driver:
        return self.ranks.driver

    def settle(self) -> None:
        """Decide whether an earlier failed call left ranks out of step.

        After a rank raised, the other ranks of that call get a grace period
        (``daskwg.rank-failure-grace`` seconds) to finish; ranks still running after
        it are stuck (typically in a collective waiting for the failed rank), so the
        group is broken. So is a group whose client reconnected to the scheduler since.
        """
        self.driver.check_reconnected()
        if self.broken is None and self.ranks.client.status == "connecting":
            try:
                self.check_scheduler()
            except GroupBrokenError:
                return
        unsettled = self.unsettled
        if unsettled is None or self.broken is not None:
            return
        while time.monotonic() < unsettled.deadline and not all(w.done() for _, w in unsettled.pending):
            time.sleep(0.02)
        self.unsettled = None
        if self.mark_stuck(unsettled.method, unsettled.pending):
            self.broken = GroupBrokenError(
                f"group {self.ranks.name!r} is broken: rank {unsettled.failed_rank} failed in "
                f"{unsettled.method!r} while other ranks were still running it (e.g. waiting in a "
                "collective): wg.restart() brings it back on fresh worker processes, or shut the group down "
                "and build a new one (restart the workers if their threads stay stuck: client.restart())"
            )

    def unsettle(
        self, grace: float, method: str, failed_rank: int, pending: list, seqs: dict | None = None
    ) -> None:
        """Record that ``method`` failed on ``failed_rank`` while ``pending`` (``(rank, watch)``)
        still ran it; :meth:`settle` decides after ``grace`` seconds. ``seqs``: rank ->
        the call's sequence number, where the watches do not tell it."""
        if seqs:
            pending = [(rank, _Numbered(watch, seqs.get(rank, -1))) for rank, watch in pending]
        self.unsettled = Unsettled(time.monotonic() + grace, method, failed_rank, pending)

    def mark_stuck(self, method: str, pending: list, seqs: dict | None = None) -> list:
        """Record ``(rank, watch)`` pairs still running a failed call on the driver, so
        that nothing is queued behind them
        (:meth:`~daskwg.transport.sequencing.Sequencer.check_not_stuck`). Returns them."""
        stuck = [(rank, w) for rank, w in pending if not w.done()]
        now = time.monotonic()
        for rank, w in stuck:
            self.driver.sequencer.record_stuck(
                self.ranks.slots[rank].server_id,
                StuckCall(self.ranks.name, method, w, now, self._seq_of(rank, w, seqs)),
            )
        return stuck

    def abandon(self, method: str, pending: list, why: str, seqs: dict | None = None) -> None:
        """Record ``(rank, watch)`` pairs of a call the driver stopped waiting for
        (``why``: "deadline", "interrupted"), so later calls behind it say what they wait
        for (:meth:`~daskwg.transport.sequencing.Sequencer.warn_if_abandoned`) and shutdown does
        not wait on them."""
        now = time.monotonic()
        for rank, watch in pending:
            self.driver.sequencer.record_abandoned(
                self.ranks.slots[rank].server_id,
                AbandonedCall(self.ranks.name, method, watch, now, why, self._seq_of(rank, watch, seqs)),
            )

    def _seq_of(self, rank: int, watch: Any, seqs: dict | None) -> int:
        """The sequence number of the call ``watch`` follows (-1: unknown), so that a later
        call's reply from the same worker says it has ended."""
        if seqs and rank in seqs:
            return seqs[rank]
        if isinstance(watch, (CallWatch, _Numbered)):
            return watch.seq
        call = self.driver.call_of(watch)
        return -1 if call is None else call.seq

    def abandon_calls(self, calls: list[Call], why: str) -> None:
        """:meth:`abandon` for calls whose finished ranks are not known here (an
        interrupted wait): each rank's worker says so through its progress counter."""
        try:
            self.abandon(
                calls[0].method,
                [
                    (c.rank, CallWatch(self.driver, self.ranks.address(c.rank), c.seq, session=c.session))
                    for c in calls
                ],
                why,
            )
        except Exception:  # noqa: BLE001 - the interrupt itself must surface
            pass

    def is_abandoned(self, slot: Any) -> bool:
        """Whether ``slot``'s worker still runs a call the driver abandoned."""
        return self.driver.sequencer.is_abandoned(slot.server_id)

    def is_stuck(self, slot: Any) -> bool:
        """Whether ``slot``'s worker is still stuck in a broken group's call."""
        return self.driver.sequencer.is_stuck(slot.server_id)

    def check_scheduler(self) -> None:
        """Mark the group broken once its client lost the scheduler.

        Dask workers close when their scheduler goes away (their Nannies restart them),
        so the ranks are gone even if the scheduler comes back; without this check an
        idle group would look healthy and its next call would wait for a connect timeout.

        Raises:
            GroupBrokenError: the client is not connected.
        """
        client = self.ranks.client
        if client.status == "running":
            return
        if self.broken is not None:
            raise fresh_error(self.broken)
        self.broken = GroupBrokenError(
            f"group {self.ranks.name!r} is broken: its client lost the scheduler at {client.scheduler.address} "
            f"(client status {client.status!r}); Dask workers close without a scheduler, so the ranks are "
            "gone: reconnect and build a new group"
        )
        raise fresh_error(self.broken)

    def reconnected(self) -> None:
        """The client reconnected to the scheduler (:meth:`Driver.check_reconnected`): the
        group's ranks were released with the old connection."""
        if self.broken is None:
            self.broken = GroupBrokenError(
                f"group {self.ranks.name!r} is broken: its client's connection to the scheduler dropped and was "
                "re-established, and the scheduler released the client's ranks when it dropped it (a detached "
                "group's ranks stay: attach to it again by name); build the group again"
            )

    def worker_lost(self, address: str, reason: str) -> None:
        """The scheduler (or a dropped connection) says the worker at ``address`` is gone."""
        for rank, slot in enumerate(self.ranks.slots):
            if slot.address == address and slot.server_id in self.driver.health.lost and self.broken is None:
                self.broken = WorkerLostError(rank, address, reason, self.ranks.name)

    def raise_if_lost(self, ranks: Sequence[int]) -> None:
        """Raise the group's :class:`WorkerLostError` if a worker of ``ranks`` is gone."""
        if isinstance(self.broken, WorkerLostError):
            raise fresh_error(self.broken)
        for rank in ranks:
            if self.ranks.is_lost(rank):
                raise self.lost(rank)

    def lost(self, rank: int) -> WorkerGroupError:
        """The group's error now that ``rank``'s worker is known to be gone (set once)."""
        slot = self.ranks.slots[rank]
        self.broken = self.broken or WorkerLostError(
            rank, slot.address, self.driver.health.lost[slot.server_id], self.ranks.name
        )
        return fresh_error(self.broken)

    async def connection_lost(self, rank: int, exc: BaseException) -> WorkerGroupError:
        """The error of a call whose connection to ``rank``'s worker dropped: the worker is
        taken as lost, with the scheduler's or nanny's reason when it comes within a moment."""
        slot = self.ranks.slots[rank]
        reason = self.driver.health.lost.get(slot.server_id) or await self._lost_reason(
            slot.address, slot.server_id, f"connection lost: {exc}"
        )
        reason = self.driver.health.mark_lost(slot.server_id, reason)
        self.worker_lost(slot.address, reason)
        return (
            fresh_error(self.broken)
            if self.broken
            else WorkerLostError(rank, slot.address, str(exc), self.ranks.name)
        )

    async def _lost_reason(self, address: str, server_id: str, fallback: str) -> str:
        # A dropped connection comes before the scheduler's or the nanny's word on why
        # (e.g. a restart for memory): give those a moment, on whichever loop runs this.
        deadline = time.monotonic() + _LOST_REASON_WAIT
        while True:
            reason = self.driver.health.lost_reason(address, server_id)
            if reason or time.monotonic() >= deadline:
                return reason or fallback
            await asyncio.sleep(0.05)

    async def blame_lost_producer(self, exc: BaseException) -> BaseException:
        """``exc`` as the caller should see it: a consuming rank's ``RankError`` whose rank
        could not fetch an input because the producing rank's worker went away becomes that
        producer's :class:`WorkerLostError`, naming the producing group (the one that is
        broken: the consuming group is not) and, when the nanny or scheduler says so within
        a moment, why it went (a signal, a restart for memory); any other error as it is."""
        lost = exc.exception if isinstance(exc, RankError) else None
        if not isinstance(lost, WorkerLostError):
            return exc
        slot, group = None, lost.group
        for transport in list(self.driver.transports):
            slots = transport.ranks.slots
            if 0 <= lost.rank < len(slots) and slots[lost.rank].address == lost.address:
                slot, group = slots[lost.rank], transport.ranks.name
                break
        reason = None
        if slot is not None:
            reason = self.driver.health.lost.get(slot.server_id) or await self._lost_reason(
                slot.address, slot.server_id, ""
            )
        detail = f"{lost.detail} ({reason})" if reason else lost.detail
        return WorkerLostError(
            lost.rank,
            lost.address,
            f"{detail}; {self.ranks.name}.{exc.method} on rank {exc.rank} reads that result "
            f"({self.ranks.name!r} itself is not broken)",
            group,
        )

    async def response_error(self, call: Call, exc: BaseException) -> BaseException:
        """The error a failed direct call raises in the driver: never a bare
        ``CancelledError`` (a ``BaseException`` that ``except Exception`` misses)."""
        if isinstance(exc, Exception):
            return exc
        # The worker cancelled its handler: it is closing (retired, restarted, scaled
        # down, or its scheduler went away) while the call ran or waited; the scheduler's
        # word on why comes a moment later.
        slot = self.ranks.slots[call.rank]
        reason = await self._lost_reason(
            slot.address,
            slot.server_id,
            f"the worker closed while running {call.method!r} ({type(exc).__name__})",
        )
        reason = self.driver.health.mark_lost(slot.server_id, reason)
        self.worker_lost(slot.address, reason)
        return (
            fresh_error(self.broken)
            if self.broken
            else WorkerLostError(call.rank, slot.address, reason, call.group_name)
        )

    def await_loss_news(self, rank: int, seconds: float = 3.0) -> None:
        """A task cancelled by Dask (``client.restart()``, a retired worker) is followed
        by the scheduler's remove-worker event: give it a moment to arrive, so the
        error says the worker was lost instead of a bare "cancelled"."""
        end = time.monotonic() + seconds
        while (
            not self.ranks.is_lost(rank) and self.ranks.client.status == "running" and time.monotonic() < end
        ):
            time.sleep(0.02)


def fresh_error(exc: BaseException) -> BaseException:
    """``exc`` as a new object without a traceback (the same object where it cannot be
    copied), to raise a group's stored error again: raising the stored object itself
    would append each raise's frames to its traceback, and keep them alive, on every call
    to a broken group."""
    try:
        return copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception class that does not rebuild from its args
        return exc
