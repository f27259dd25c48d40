"""Waiting for a group's task-path futures: :class:`Waiter`, and the deadline report of any
wait (:func:`timeout_error`).

A wait never blocks on a lost worker: it polls (``daskwg.poll-interval``) for lost
workers, the scheduler's state and its deadline between waits on the futures, so a lost
rank raises ``WorkerLostError`` within a poll interval and a deadline raises
``CallTimeoutError`` naming what each rank is doing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Sequence
from typing import Any

from distributed import Future
from distributed import wait as dask_wait
from distributed.client import FuturesCancelledError

from ...config import Settings
from ...deadlines import Limit, current_limit
from ...errors import (
    CallCancelledError,
    CallTimeoutError,
    GroupBrokenError,
    RankError,
    WorkerGroupError,
    WorkerLostError,
)
from ...wire.messages import Call
from ..driver import GroupRanks
from . import forensics, root_cause
from .state import TRANSFER_ERRORS, FailureState, fresh_error, transfer_error

__all__ = ["Waiter", "timeout_error"]


class _Done:
    """``done()`` of a future as daskwg's waits see it (for the failure records)."""

    __slots__ = ("_waiter", "future")

    def __init__(self, waiter: Waiter, future: Any):
        self._waiter, self.future = waiter, future

    def done(self) -> bool:
        return self._waiter.done(self.future)


logger = logging.getLogger(__name__)


async def timeout_error(
    ranks: GroupRanks,
    rpc: Any,
    calls: list[Call],
    done: set[int],
    limit: Limit,
    waited: float,
    status_timeout: float,
) -> CallTimeoutError:
    """A :class:`CallTimeoutError` whose ``ranks``/``stacks`` were read on the workers now.

    Args:
        rpc: ``address -> rpc`` (a Dask ``ConnectionPool`` or ``client.rpc``).
        calls: the calls that passed their deadline, one per rank.
        done: the ranks among them that finished.
        limit: the deadline that passed.
        waited: seconds the driver waited.
        status_timeout: seconds each worker gets to answer the status request.
    """
    addresses = {c.rank: ranks.address(c.rank) for c in calls}
    answers = await forensics.query_status(
        rpc, [a for r, a in addresses.items() if not ranks.is_lost(r)], status_timeout
    )
    states, stacks, notes = forensics.call_states(calls, addresses, done, answers)
    method = calls[0].method
    message = forensics.verdict(ranks.name, method, waited, limit.seconds, states, notes, addresses)
    return CallTimeoutError(method, limit.seconds, states, stacks, message)


class Waiter:
    """Waits for the task-path futures of one group's calls.

    Args:
        ranks: the group's ranks.
        failures: the group's failure state (set broken by what the waits see).
    """

    def __init__(self, ranks: GroupRanks, failures: FailureState):
        self.ranks = ranks
        self.failures = failures

    def status(self, future: Any) -> str:
        """A future's status as daskwg's waits see it: a non-blocking call's result is
        ``"finished"`` with the call's reply, before the scheduler has heard of it."""
        rec = self.ranks.driver.owned.record(future)
        return future.status if rec is None else rec.status

    def done(self, future: Any) -> bool:
        return self.status(future) not in ("pending", "lost", None)

    def rank_of(self, future: Any) -> int | None:
        """The rank a future of this driver's task-path calls stands for (``None``: unknown)."""
        call = self.ranks.driver.call_of(future)
        return None if call is None or call.group_id != self.ranks.group_id else call.rank

    def gather(
        self,
        futures: list[Future],
        method_name: str,
        settings: Settings,
        grace: float | None = None,
        *,
        limit: Limit | None = None,
    ) -> list:
        """Wait for per-rank futures; the first failure raises at once. Never waits on a
        lost worker: its rank raises ``WorkerLostError`` within the poll interval.

        Args:
            futures: the calls' Dask futures.
            method_name: named in errors.
            settings: the call's settings.
            grace: seconds the other ranks get after one raised (default
                ``settings.rank_failure_grace``).
            limit: the deadline (default: this thread's :func:`~daskwg.deadlines.current_limit`).

        Returns:
            the values, in the order of ``futures``.

        Raises:
            RankError, WorkerLostError, GroupBrokenError, WorkerPausedError: as a call failed.
            CallTimeoutError: ``limit`` passed first.
        """
        if limit is None:
            limit = current_limit(None, settings.call_timeout)
        try:
            return self._gather(futures, method_name, settings, grace, limit)
        except (KeyboardInterrupt, asyncio.CancelledError):
            pending = [
                (r, f)
                for r, f in zip(map(self.rank_of, futures), futures)
                if r is not None and not self.done(f)
            ]
            self.failures.abandon(method_name, pending, "interrupted")
            raise

    def _gather(
        self,
        futures: list[Future],
        method_name: str,
        settings: Settings,
        grace: float | None,
        limit: Limit | None,
    ) -> list:
        ranks = [self.rank_of(f) for f in futures]
        warned: set[str] = set()
        t0 = time.monotonic()
        while True:
            failed = [f for f in futures if self.status(f) in ("error", "cancelled")]
            pending = [f for f in futures if not self.done(f)]
            if failed:
                exc = self._root_cause(
                    self.future_error(failed[0], method_name), [f for f in futures if not self.done(f)]
                )
                if pending and isinstance(exc, RankError):
                    self.failures.unsettle(
                        settings.rank_failure_grace if grace is None else grace,
                        method_name,
                        exc.rank,
                        [(r, _Done(self, f)) for r, f in zip(ranks, futures) if not self.done(f)],
                    )
                try:
                    raise exc
                finally:
                    # No cycle exception -> traceback -> this frame -> exception: the call's
                    # futures go as soon as the caller drops the error, not at the next
                    # garbage collection.
                    del exc
            if not pending:
                try:
                    return self.values(futures)
                except TRANSFER_ERRORS as exc:
                    raise transfer_error(-1, "?", method_name, exc) from None
            running = [(r, _Done(self, f)) for r, f in zip(ranks, futures) if not self.done(f)]
            try:
                self.failures.check_scheduler()
                self.failures.raise_if_lost([r for r, _ in running if r is not None])
            except WorkerGroupError:
                self.failures.mark_stuck(method_name, [(r, f) for r, f in running if r is not None])
                raise
            # Non-blocking calls' results are not Dask tasks: paused workers run them.
            on_tasks = [r for r, d in running if self.ranks.driver.owned.record(d.future) is None]
            self._warn_if_paused(on_tasks, method_name, warned, settings.paused_warning)
            wait_s = settings.poll_interval
            if limit is not None:
                if limit.remaining() <= 0:
                    self.failures.abandon(
                        method_name, [(r, f) for r, f in running if r is not None], "deadline"
                    )
                    raise self._futures_timeout_error(
                        futures, method_name, limit, time.monotonic() - t0, settings.status_timeout
                    )
                wait_s = min(wait_s, limit.remaining())
            try:
                self.wait_first(pending, max(wait_s, 0.001), every=True)
            except (TimeoutError, asyncio.TimeoutError, FuturesCancelledError):
                pass  # a cancelled future is reported by the next round

    def _root_cause(self, exc: BaseException, pending: list) -> BaseException:
        """``exc``, or the ``WorkerLostError`` of a worker of the group lost around it
        (:func:`~daskwg.transport.failure.root_cause.find_lost_rank`), carrying ``exc``."""
        if isinstance(exc, WorkerLostError) or not isinstance(exc, RankError):
            return exc
        client = self.ranks.client
        dead = client.sync(root_cause.find_lost_rank, self.failures, [exc])
        if dead is None:
            return exc
        running = [
            (r, _Done(self, f))
            for r, f in zip(map(self.rank_of, pending), pending)
            if r is not None and r != dead
        ]
        self.failures.mark_stuck(exc.method, running)
        return root_cause.with_survivors(self.failures.lost(dead), [exc])

    def wait_first(self, futures: list[Future], timeout: float, *, every: bool = False) -> None:
        """Wait up to ``timeout`` seconds for the first of ``futures`` to finish;
        ``every=True``, where all are results of non-blocking calls: for all of them, or
        the first that fails (one wake-up per call, not one per rank)."""
        owned = self.ranks.driver.owned
        records = [r for r in map(owned.record, futures) if r is not None]
        others = [f for f in futures if owned.record(f) is None]
        if not others:
            owned.wait(records, timeout, every=every)
            return
        # distributed.wait runs on the *default* client's loop; with several clients in
        # one process that may not be the one owning these futures.
        with self.ranks.client.as_current():
            # With results of non-blocking calls among them, which Dask's wait does not see
            # finish, look at those again soon.
            dask_wait(
                others, timeout=min(timeout, 0.05) if records else timeout, return_when="FIRST_COMPLETED"
            )

    def values(self, futures: list[Future]) -> list:
        """The values of finished futures, each read from the worker holding it (results of
        non-blocking calls: never through the scheduler; others through ``client.gather``)."""
        owned = self.ranks.driver.owned
        mine = [i for i, f in enumerate(futures) if owned.record(f) is not None]
        values: list[Any] = [None] * len(futures)
        if len(mine) < len(futures):
            others = [i for i in range(len(futures)) if owned.record(futures[i]) is None]
            for i, value in zip(others, self.ranks.client.gather([futures[i] for i in others], direct=True)):
                values[i] = value
        if mine:
            keys = [futures[i].key for i in mine]
            channel = self.ranks.driver.channel()
            fetched = owned.fetch_inline(keys)
            if fetched is not None:
                pass  # every one came back with its reply: no loop needed
            elif channel is None:
                fetched = self.ranks.client.sync(owned.fetch, keys, owned.streams)
            else:
                fetched = channel.run(owned.fetch(keys, channel.streams), fresh=False)
            for i, value in zip(mine, fetched):
                values[i] = value
        return values

    def _futures_timeout_error(
        self, futures: list[Future], method_name: str, limit: Limit, waited: float, status_timeout: float
    ) -> CallTimeoutError:
        calls = self.calls_of(futures, method_name)
        done = {c.rank for c, f in zip(calls, futures) if self.done(f)}
        client = self.ranks.client
        return client.sync(timeout_error, self.ranks, client.rpc, calls, done, limit, waited, status_timeout)

    def calls_of(self, futures: list[Future], method_name: str) -> list[Call]:
        """The ``Call`` records behind task-path futures (what the status records name)."""
        ranks = self.ranks
        calls = []
        for future in futures:
            call = ranks.driver.call_of(future)
            if call is None or call.group_id != ranks.group_id:
                call = Call(
                    ranks.driver.sequencer.session,
                    -1,
                    ranks.group_id,
                    ranks.name,
                    0,
                    method_name,
                    ranks.owner,
                )
            calls.append(call)
        return calls

    def wait_for_queue_room(
        self, slots: Sequence[Any], method_name: str, limit: Limit | None, settings: Settings
    ) -> None:
        """Wait while a worker already has ``daskwg.max-queued-calls`` unfinished task-path
        calls of this driver, so queued calls cannot grow without bound.

        Raises:
            CallTimeoutError: ``limit`` passed while waiting.
            WorkerLostError: the worker is gone.
        """
        most = settings.max_queued_calls
        inflight = self.ranks.driver.inflight
        for slot in slots:
            if inflight.count(slot.server_id) < most:
                continue  # fewer futures alive there than places: no need to look at each
            while True:
                pending = [f for f in inflight.of(slot.server_id) if not self.done(f)]
                if len(pending) < most:
                    break
                if limit is not None and limit.remaining() <= 0:
                    raise CallTimeoutError(
                        method_name,
                        limit.seconds,
                        {},
                        {},
                        f"{self.ranks.name}.{method_name} passed its deadline of {limit.seconds:g} s waiting for "
                        f"a place in the queue of {slot.address}: {len(pending)} calls wait there "
                        "(daskwg.max-queued-calls); wait for some of them, or raise the setting",
                    )
                self.failures.raise_if_lost([self.ranks.slots.index(slot)])
                try:
                    self.wait_first(pending, 0.5)
                except (TimeoutError, asyncio.TimeoutError, FuturesCancelledError):
                    pass

    def _warn_if_paused(
        self, ranks: Sequence[int | None], method_name: str, warned: set[str], after: float
    ) -> None:
        health = self.ranks.driver.health
        for rank in ranks:
            if rank is None:
                continue
            address = self.ranks.address(rank)
            since = health.paused_since(address)
            if since is None or address in warned or time.monotonic() - since < after:
                continue
            warned.add(address)
            logger.warning(
                "%s.%s: rank %d waits on worker %s, which is paused (its memory use is above "
                "distributed.worker.memory.pause) and starts no tasks until it frees memory; "
                "free memory there, raise the worker's memory_limit or the pause threshold",
                self.ranks.name,
                method_name,
                rank,
                address,
            )

    def future_error(self, future: Future, method_name: str) -> BaseException:
        """The error a failed or cancelled task-path future raises in the driver: typed,
        never Dask's bare ``CancelledError``."""
        rank = self.rank_of(future)
        address = self.ranks.address(rank) if rank is not None else "?"
        rec = self.ranks.driver.owned.record(future)
        if rec is not None and rec.status == "error":
            return fresh_error(rec.error)  # a copy, as below: no traceback cycle keeps futures
        if self.status(future) == "cancelled":
            cancelled = getattr(future._state, "exception", None)
            if isinstance(cancelled, CallCancelledError) and not (
                rank is not None and self.ranks.is_lost(rank)
            ):
                # The program cancelled it (client.cancel, Future.cancel): no loss to wait for.
                return CallCancelledError(cancelled.method, cancelled.rank, cancelled.key, cancelled.reason)
            if rank is not None:
                self.failures.await_loss_news(rank)
            if self.ranks.client.status != "running":
                try:
                    self.failures.check_scheduler()
                except GroupBrokenError as exc:
                    return exc
            if rank is not None and self.ranks.is_lost(rank):
                return self.failures.lost(rank)
            paused = self.ranks.driver.health.take_paused_error(future.key)
            if paused is not None:
                return paused
            return GroupBrokenError(f"the call of {method_name!r} on rank {rank} was cancelled")
        exc = future.exception()
        if isinstance(exc, WorkerGroupError):
            self.ranks.driver.health.take_paused_error(future.key)
            # A copy: raising the object the future's state stores would hang this wait's
            # frames (and the futures they hold) on its traceback, keeping every future
            # of the call alive for as long as the client holds that state
            # (dask/distributed#8790): failed calls would never let go of their keys.
            return fresh_error(exc)
        tb = "".join(traceback.format_tb(future.traceback())) if future.traceback() else ""
        return RankError(rank if rank is not None else -1, address, method_name, tb, exc)

    def gather_any(self, futures: list, settings: Settings) -> list:
        """:meth:`gather` of futures from any call of this driver (a ``DataProtoFuture``'s
        parts), naming the producing method in errors."""
        futures = list(futures)
        calls = [self.ranks.driver.call_of(f) for f in futures]
        method = next((c.method for c in calls if c is not None), "DataProtoFuture.get")
        return self.gather(futures, method, settings)
