"""One group's transport: :class:`GroupTransport`, the facade the group calls."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import pickle
import re
import time
import traceback
import weakref
from collections.abc import Sequence
from typing import Any

import dask.config
from dask._task_spec import Task
from dask.utils import apply
from distributed import Client, Future
from distributed import wait as dask_wait
from distributed.client import FuturesCancelledError
from distributed.comm.core import CommClosedError
from distributed.protocol.pickle import loads as _pickle_loads

import _daskwg_task

from .. import config as _config  # noqa: F401  (loads daskwg's dask.config defaults)
from .. import forensics, serialization  # serialization also installs the tensor serializer
from ..deadlines import Limit, current_limit
from ..errors import (
    CallTimeoutError,
    DispatchError,
    GroupBrokenError,
    RankError,
    WorkerGroupError,
    WorkerLostError,
)
from ..futures import DataProtoFuture
from ..plugin import rows as parts
from ..plugin import run_call
from ..wire import Call, LazyArg
from .driver import Driver
from .failures import CallWatch

__all__ = ["GroupTransport"]

logger = logging.getLogger(__name__)

_KEY_RANK = re.compile(r"-r(\d+)-[0-9a-f]{8}$")


#: Seconds a call whose connection dropped waits for the scheduler's or nanny's reason.
_LOST_REASON_WAIT = 3.0


class GroupTransport:
    """How the calls of one group reach its ranks, and what the driver knows of their state.

    Args:
        client: the group's synchronous ``distributed.Client``.
        slots: one ``pool.WorkerSlot`` per rank, in rank order.
        name: the group's name (task keys, messages).
        group_id: the group's unique id (the hosts key rank objects by it).
        owner: the client id that owns the group's ranks.

    Attributes:
        broken: the error every later call raises (a lost worker, ranks out of step),
            or ``None`` while the group is usable.
    """

    def __init__(self, client: Client, slots: Sequence[Any], name: str, group_id: str, owner: str):
        self.client = client
        self.driver = Driver.of(client)
        self.slots = list(slots)
        self.name = name
        self.group_id = group_id
        self.owner = owner
        self.broken: WorkerGroupError | None = None
        self.unsettled: tuple[float, str, int, list] | None = None
        self.driver.ensure_plugins()
        self.driver.transports.add(self)
        self.driver.watch(self.slots)

    def close(self) -> None:
        """Stop following the workers' events for this group."""
        self.driver.transports.discard(self)

    async def reserve_port(self, port: int | None) -> int:
        """Reserve ``MASTER_PORT`` on rank 0's host (``port``, or a free one).

        Raises:
            OSError: ``port`` is in use there.
        """
        try:
            return await self.client.rpc(self.slots[0].address).daskwg_reserve_port(port=port)
        except OSError as exc:
            raise OSError(str(exc)) from None

    def settle(self) -> None:
        """Decide whether an earlier failed call left ranks out of step.

        After a rank raised, the other ranks of that call get a grace period
        (``daskwg.rank-failure-grace`` seconds) to finish; ranks still running after
        it are stuck (typically in a collective waiting for the failed rank), so the
        group is broken.
        """
        if self.broken is None and self.client.status == "connecting":
            try:
                self.check_scheduler()
            except GroupBrokenError:
                return
        if self.unsettled is None or self.broken is not None:
            return
        deadline, method, failed_rank, pending = self.unsettled
        while time.monotonic() < deadline and not all(p.done() for _, p in pending):
            time.sleep(0.02)
        self.unsettled = None
        stuck = self.mark_stuck(method, pending)
        if stuck:
            self.broken = GroupBrokenError(
                f"group {self.name!r} is broken: rank {failed_rank} failed in {method!r} while other ranks "
                "were still running it (e.g. waiting in a collective); shut the group down and build a new "
                "one (restart the workers if their threads stay stuck: client.restart())"
            )

    def mark_stuck(self, method: str, pending: list) -> list:
        """Record ``(rank, future)`` pairs still running a failed call on the driver, so
        that nothing is queued behind them (:meth:`_Driver.check_not_stuck`)."""
        stuck = [(rank, p) for rank, p in pending if not p.done()]
        for rank, p in stuck:
            self.driver.stuck[self.slots[rank].server_id] = (self.name, method, p)
        return stuck

    def abandon(self, method: str, pending: list, why: str) -> None:
        """Record ``(rank, done-watch)`` pairs of a call the driver stopped waiting for
        (``why``: "deadline", "interrupted"), so later calls behind it say what they wait
        for (:meth:`Driver.warn_if_abandoned`) and shutdown does not wait on them."""
        now = time.monotonic()
        for rank, watch in pending:
            self.driver.abandoned[self.slots[rank].server_id] = (self.name, method, watch, now, why)

    def _abandon_calls(self, calls: list[Call], why: str) -> None:
        # Which ranks had finished is unknown here (the wait was interrupted): each
        # rank's worker says so through its progress counter.
        try:
            self.abandon(
                calls[0].method,
                [(c.rank, CallWatch(self.driver, self.slots[c.rank].address, c.seq)) for c in calls],
                why,
            )
        except Exception:  # noqa: BLE001 - the interrupt itself must surface
            pass

    def is_abandoned(self, slot: Any) -> bool:
        entry = self.driver.abandoned.get(slot.server_id)
        return entry is not None and not entry[2].done()

    def check_scheduler(self) -> None:
        """Mark the group broken once its client lost the scheduler.

        Dask workers close when their scheduler goes away (their Nannies restart them),
        so the ranks are gone even if the scheduler comes back; without this check an
        idle group would look healthy and its next call would wait for a connect timeout.
        """
        if self.client.status == "running":
            return
        if self.broken is not None:
            raise self.broken
        self.broken = GroupBrokenError(
            f"group {self.name!r} is broken: its client lost the scheduler at {self.client.scheduler.address} "
            f"(client status {self.client.status!r}); Dask workers close without a scheduler, so the ranks are "
            "gone: reconnect and build a new group"
        )
        raise self.broken

    def is_stuck(self, slot: Any) -> bool:
        entry = self.driver.stuck.get(slot.server_id)
        return entry is not None and not entry[2].done()

    def worker_lost(self, address: str, reason: str) -> None:
        for rank, slot in enumerate(self.slots):
            if slot.address == address and slot.server_id in self.driver.lost and self.broken is None:
                self.broken = WorkerLostError(rank, address, reason)

    def raise_if_lost(self, ranks: Sequence[int]) -> None:
        if isinstance(self.broken, WorkerLostError):
            raise self.broken
        for rank in ranks:
            slot = self.slots[rank]
            if slot.server_id in self.driver.lost:
                self.broken = WorkerLostError(rank, slot.address, self.driver.lost[slot.server_id])
                raise self.broken

    def send(
        self,
        method_name: str,
        ranks: list[int],
        payloads: list,
        *,
        blocking: bool,
        raw_payload: bool = False,
        check: bool = True,
        settle: float | None = None,
        timeout: float | None = None,
    ) -> list:
        """Send one call to each of ``ranks``; values if blocking, else Dask futures.

        Args:
            method_name: the method the ranks run (``"__init__"``/``"__del__"`` build and
                destroy the rank objects).
            ranks: the ranks to call, e.g. ``[0]`` or ``list(range(world_size))``.
            payloads: per rank in ``ranks``, ``(args, kwargs)`` (or the raw payload of a
                life-cycle call with ``raw_payload=True``).
            blocking: wait and return the per-rank values, or return Dask futures.
            check: refuse at once when a rank's worker is lost or stuck (off for shutdown).
            settle: seconds the other ranks get after one raised (default
                ``daskwg.rank-failure-grace``).
            timeout: the method's ``@register(timeout=...)``; the wait's deadline is
                :func:`daskwg.deadlines.current_limit` of it.
        Raises:
            RankError, WorkerLostError, GroupBrokenError: as the call fails.
            CallTimeoutError: a blocking call passed its deadline.
        """
        lazies: list[list[list]] = [[] for _ in ranks]
        keep: list = []
        if not raw_payload:
            payloads = [_extract_lazies(p, lz, self._part_infos, keep) for p, lz in zip(payloads, lazies)]
        direct = blocking and not any(lazies)
        # Packed (or, for a task, test-packed) before the call takes its place in the
        # order: an argument that cannot be pickled fails here, naming it, and no rank
        # ever waits for a call that cannot arrive.
        packed = [_pack_arguments(method_name, p, raw_payload) for p in payloads]
        if not direct:
            packed = payloads
        slots = [self.slots[r] for r in ranks]
        limit = current_limit(timeout)
        if check:
            # A lost worker fails at once (no connection attempt, no task that never
            # runs), and nothing is queued behind a rank stuck in a broken group's call.
            self.check_scheduler()
            self.raise_if_lost(ranks)
            self.driver.check_not_stuck(slots, f"{self.name}.{method_name}")
        self.driver.warn_if_abandoned(slots, f"{self.name}.{method_name}")
        if check and (not blocking or any(lazies)):
            self._wait_for_queue_room(slots, method_name, limit)
        seqs = self.driver.take_seqs([s.server_id for s in slots])
        calls = [
            Call(
                session=self.driver.session,
                seq=seq,
                group_id=self.group_id,
                group_name=self.name,
                rank=rank,
                method=method_name,
                owner=self.owner,
                worker_id=slot.server_id,
            )
            for rank, seq, slot in zip(ranks, seqs, slots)
        ]
        grace = float(dask.config.get("daskwg.rank-failure-grace")) if settle is None else settle
        if direct:
            channel = self.driver.channel()
            try:
                if channel is None:
                    return self.client.sync(
                        self._send_direct, self.client.rpc, calls, packed, grace, False, limit
                    )
                return channel.run(self._send_direct(channel.pool, calls, packed, grace, True, limit))
            except (KeyboardInterrupt, asyncio.CancelledError):
                self._abandon_calls(calls, "interrupted")
                raise
        futures = self._submit(calls, payloads, lazies, keep)
        if blocking:
            return self.gather(futures, method_name, grace, limit=limit)
        return futures

    async def _send_direct(
        self,
        pool: Any,
        calls: list[Call],
        payloads: list,
        grace: float,
        private: bool,
        limit: Limit | None = None,
    ) -> list:
        """Send ``calls`` straight to the hosting workers' ``daskwg_call`` handler and wait.

        ``payloads`` are already packed (:func:`daskwg.serialization.pack`).

        ``pool`` is a Dask ``ConnectionPool``: the client's (on the client's event loop)
        or the calling thread's own (:class:`_Channel`), which saves the two thread
        hops of ``client.sync`` on every call.
        """

        async def one(call: Call, payload: Any) -> Any:
            address = self.slots[call.rank].address
            try:
                response = await pool(address).daskwg_call(call=dataclasses.astuple(call), payload=payload)
            except (CommClosedError, OSError) as exc:
                sid = self.slots[call.rank].server_id
                reason = self.driver.lost.get(sid) or await self._lost_reason(
                    address, sid, f"connection lost: {exc}"
                )
                reason = self.driver.lost.setdefault(sid, reason)
                self.worker_lost(address, reason)
                raise self.broken or WorkerLostError(call.rank, address, str(exc)) from None
            except _TRANSFER_ERRORS as exc:
                # The arguments could not be unpickled on the worker, or the result here:
                # name the call instead of a bare Dask protocol error. If the call never
                # reached the host, its place in the order must be given up, or every
                # later call to this worker would wait behind it (skip is a no-op if it ran).
                try:
                    await pool(address).daskwg_skip(session=call.session, seqs=[call.seq])
                except Exception:  # noqa: BLE001 - the worker may be gone; nothing waits then
                    pass
                raise _transfer_error(call.rank, address, call.method, exc) from None
            if response.get("status") != "OK":
                raise self._response_error(call, response["exception"])
            try:
                return serialization.unpack(response["result"])
            except _TRANSFER_ERRORS as exc:
                raise _transfer_error(call.rank, address, call.method, exc) from None

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(one(c, p)) for c, p in zip(calls, payloads)]
        await asyncio.wait(
            tasks,
            timeout=None if limit is None else max(limit.remaining(), 0.0),
            return_when=asyncio.FIRST_EXCEPTION,
        )
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            first = failed[0]
            pending_calls = [(c, t) for c, t in zip(calls, tasks) if not t.done()]
            pending = [(c.rank, t) for c, t in pending_calls]
            for _, t in pending_calls:
                t.add_done_callback(_consume_exception)
            if private:
                # The private loop only runs while its thread is in a call, so its
                # tasks cannot tell when these ranks finish: ask their workers instead.
                # The tasks stay on that loop and finish whenever it runs again (their
                # error handling must still run: e.g. giving up an undelivered call's place).
                pending = [
                    (c.rank, CallWatch(self.driver, self.slots[c.rank].address, c.seq))
                    for c, _ in pending_calls
                ]
            exc = first.exception()
            if pending and isinstance(exc, RankError):
                self.unsettled = (time.monotonic() + grace, calls[0].method, exc.rank, pending)
            elif pending and isinstance(exc, WorkerLostError):
                self.mark_stuck(calls[0].method, pending)
            raise exc
        if not all(t.done() for t in tasks):
            pending_calls = [(c, t) for c, t in zip(calls, tasks) if not t.done()]
            for _, t in pending_calls:
                t.add_done_callback(_consume_exception)
            watches = [
                (c.rank, CallWatch(self.driver, self.slots[c.rank].address, c.seq) if private else t)
                for c, t in pending_calls
            ]
            self.abandon(calls[0].method, watches, "deadline")
            done = {c.rank for c, t in zip(calls, tasks) if t.done()}
            raise await self._timeout_error(pool, calls, done, limit, time.monotonic() - t0)
        return [t.result() for t in tasks]

    async def _lost_reason(self, address: str, server_id: str, fallback: str) -> str:
        # A dropped connection comes before the scheduler's or the nanny's word on why
        # (e.g. a restart for memory): give those a moment, on whichever loop runs this.
        deadline = time.monotonic() + _LOST_REASON_WAIT
        while True:
            reason = self.driver.lost_reason(address, server_id)
            if reason or time.monotonic() >= deadline:
                return reason or fallback
            await asyncio.sleep(0.05)

    def _response_error(self, call: Call, exc: BaseException) -> BaseException:
        """The error a failed direct call raises in the driver: never a bare
        ``CancelledError`` (a ``BaseException`` that ``except Exception`` misses)."""
        if isinstance(exc, Exception):
            return exc
        # The worker cancelled its handler: it is closing (retired, restarted, scaled
        # down, or its scheduler went away) while the call ran or waited.
        slot = self.slots[call.rank]
        reason = self.driver.lost.setdefault(
            slot.server_id, f"the worker closed while running {call.method!r} ({type(exc).__name__})"
        )
        self.worker_lost(slot.address, reason)
        return self.broken or WorkerLostError(call.rank, slot.address, reason)

    def _submit(
        self, calls: list[Call], payloads: list, lazies: list[list[list]], keep: Sequence[Future] = ()
    ) -> list[Future]:
        call_no = next(self.driver.call_numbers)
        futures = []
        try:
            keys = [f"{self.name}.{call.method}-{call_no}-r{call.rank}-{self.group_id[:8]}" for call in calls]
            staged = self._stage(keys, [self.slots[c.rank].address for c in calls], payloads)
            for call, key, payload, call_lazies in zip(calls, keys, staged, lazies):
                address = self.slots[call.rank].address
                future = self._submit_task(
                    functools.partial(run_call, call), (payload, call_lazies or None, key), key, address
                )
                _tag(future, call)
                if keep:
                    # The parts this call fetches rows of must outlive the call, even if the
                    # driver drops their DataProtoFuture right after this returns.
                    future.add_done_callback(functools.partial(_hold, tuple(keep)))
                future.add_done_callback(functools.partial(self._skip_if_not_run, address, call.seq))
                self.driver.submitted[future] = (time.monotonic(), call.rank, call.method)
                self.driver.inflight[self.slots[call.rank].server_id].add(future)
                futures.append(future)
        except BaseException:
            # Calls that were never submitted must not hold up later ones on their workers.
            for call in calls[len(futures) :]:
                self.client.loop.add_callback(self._send_skip, self.slots[call.rank].address, [call.seq])
            raise
        return futures

    def _submit_task(self, fn: Any, args: tuple, key: str, address: str | None) -> Future:
        """Submit ``fn(*args)`` as a Dask task pinned to ``address``, without retries.

        ``fn`` (and whatever it binds) travels as pickle bytes the scheduler does not
        open: the scheduler's environment needs neither torch nor daskwg.
        """
        if inspect.iscoroutinefunction(fn):
            # A coroutine function must be the task's own function for Dask to run it on
            # the worker's event loop: _daskwg_task.run, which needs no torch either.
            func, task_args = _daskwg_task.run, (serialization.inline(fn), *args)
        else:
            func, task_args = apply, (Task(None, _pickle_loads, serialization.inline(fn)), args)
        future = self.client.submit(
            func,
            *task_args,
            key=key,
            workers=None if address is None else [address],
            allow_other_workers=False,
            pure=False,
            retries=0,
        )
        if address is not None:
            placement = self.driver.placement
            placement[key] = address
            weakref.finalize(future, placement.pop, key, None)
        return future

    def _stage(self, keys: list[str], addresses: list[str], payloads: list) -> list[tuple]:
        """Per call, ``("inline", bytes)`` for a small payload, or ``("scattered",
        future)`` for one sent straight to its worker (never through the scheduler)."""
        limit = int(dask.config.get("daskwg.scatter-above"))
        packed = [serialization.dumps(p) for p in payloads]
        big = [i for i, pk in enumerate(packed) if pk.nbytes > limit]
        staged: list[tuple] = [
            ("inline", serialization.inline(p)) if i not in big else None for i, p in enumerate(payloads)
        ]
        if big:
            items = [(f"{keys[i]}-args", packed[i], addresses[i]) for i in big]
            for i, future in zip(big, self.client.sync(self._scatter, items)):
                staged[i] = ("scattered", future)
        return staged

    async def _scatter(self, items: list[tuple[str, Any, str]]) -> list[Future]:
        scattered = await asyncio.gather(
            *(
                self.client._scatter({name: value}, workers=[address], direct=True)
                for name, value, address in items
            )
        )
        return [s[name] for s, (name, _, _) in zip(scattered, items)]

    def _part_infos(self, future: DataProtoFuture) -> list[Future]:
        """A ``parts.PartInfo`` future for every part ``future`` reads, each computed
        once, next to its part."""
        _, part_futures = future.plan()
        infos = []
        for part in part_futures:
            key = str(part.key)
            info = self.driver.part_infos.get(key)
            if info is None or info.status in ("cancelled", "lost"):
                info = self._submit_task(
                    functools.partial(parts.part_info, key=part.key),
                    (part,),
                    f"{key}-rows-{next(self.driver.call_numbers)}",
                    self.driver.placement.get(key),
                )
                self.driver.part_infos[key] = info
                weakref.finalize(part, self.driver.part_infos.pop, key, None)
            infos.append(info)
        return infos

    def _skip_if_not_run(self, address: str, seq: int, future: Future) -> None:
        status = future.status
        if status == "finished":
            return
        if status == "cancelled":
            # Future.cancel() / client.cancel(): Dask lets go of the task but cannot stop
            # the rank; tell the worker (a queued call is skipped, an async one interrupted).
            self.client.loop.add_callback(self._send_cancel, address, [seq])
            return
        # Also after a RankError: it may be the error of a call this one depended on (a
        # DataProtoFuture's producer), in which case this call never reached its rank.
        # Skipping a call that ran is a no-op on the worker.
        self.client.loop.add_callback(self._send_skip, address, [seq])

    async def _send_cancel(self, address: str, seqs: list[int]) -> None:
        try:
            await self.client.rpc(address).daskwg_cancel(session=self.driver.session, seqs=seqs)
        except Exception:  # noqa: BLE001 - the worker may be gone; nothing runs there then
            pass

    async def _send_skip(self, address: str, seqs: list[int]) -> None:
        try:
            await self.client.rpc(address).daskwg_skip(session=self.driver.session, seqs=seqs)
        except Exception:  # noqa: BLE001 - the worker may be gone; nothing waits on it then
            pass

    def gather(
        self,
        futures: list[Future],
        method_name: str,
        grace: float | None = None,
        *,
        limit: Limit | None = None,
    ) -> list:
        """Wait for per-rank futures; the first failure raises at once. Never waits on a
        lost worker: its rank raises ``WorkerLostError`` within the poll interval.

        Raises:
            CallTimeoutError: ``limit`` (default: this thread's
                :func:`~daskwg.deadlines.current_limit`) passed first.
        """
        if limit is None:
            limit = current_limit()
        try:
            return self._gather(futures, method_name, grace, limit)
        except (KeyboardInterrupt, asyncio.CancelledError):
            pending = [
                (r, f) for r, f in zip(map(_rank_of, futures), futures) if r is not None and not f.done()
            ]
            self.abandon(method_name, pending, "interrupted")
            raise

    def _gather(
        self, futures: list[Future], method_name: str, grace: float | None, limit: Limit | None
    ) -> list:
        ranks = [_rank_of(f) for f in futures]
        poll = float(dask.config.get("daskwg.poll-interval"))
        warned: set[str] = set()
        t0 = time.monotonic()
        while True:
            failed = [f for f in futures if f.status in ("error", "cancelled")]
            pending = [f for f in futures if not f.done()]
            if failed:
                exc = self._future_error(failed[0], method_name)
                if pending and isinstance(exc, RankError):
                    wait_s = float(dask.config.get("daskwg.rank-failure-grace")) if grace is None else grace
                    pending_ranks = [(r, f) for r, f in zip(ranks, futures) if not f.done()]
                    self.unsettled = (time.monotonic() + wait_s, method_name, exc.rank, pending_ranks)
                raise exc
            if not pending:
                try:
                    return self.client.gather(futures)
                except _TRANSFER_ERRORS as exc:
                    raise _transfer_error(-1, "?", method_name, exc) from None
            try:
                self.check_scheduler()
                self.raise_if_lost([r for r, f in zip(ranks, futures) if not f.done()])
            except WorkerGroupError:
                self.mark_stuck(method_name, [(r, f) for r, f in zip(ranks, futures) if not f.done()])
                raise
            self._warn_if_paused([r for r, f in zip(ranks, futures) if not f.done()], method_name, warned)
            wait_s = poll
            if limit is not None:
                if limit.remaining() <= 0:
                    pending_ranks = [(r, f) for r, f in zip(ranks, futures) if r is not None and not f.done()]
                    self.abandon(method_name, pending_ranks, "deadline")
                    raise self._futures_timeout_error(futures, method_name, limit, time.monotonic() - t0)
                wait_s = min(poll, limit.remaining())
            try:
                self._wait_first(pending, max(wait_s, 0.001))
            except (TimeoutError, asyncio.TimeoutError, FuturesCancelledError):
                pass  # a cancelled future is reported by the next round

    def _wait_first(self, futures: list[Future], timeout: float) -> None:
        # distributed.wait runs on the *default* client's loop; with several clients in
        # one process that may not be the one owning these futures.
        with self.client.as_current():
            dask_wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def _futures_timeout_error(
        self, futures: list[Future], method_name: str, limit: Limit, waited: float
    ) -> CallTimeoutError:
        calls = self._calls_of(futures, method_name)
        done = {c.rank for c, f in zip(calls, futures) if f.done()}
        return self.client.sync(self._timeout_error, self.client.rpc, calls, done, limit, waited)

    def _calls_of(self, futures: list[Future], method_name: str) -> list[Call]:
        """The ``Call`` records behind task-path futures (what the status records name)."""
        calls = []
        for future in futures:
            rank = _rank_of(future)
            call = getattr(future, "daskwg_call", None)
            if call is None:
                call = Call(
                    self.driver.session, -1, self.group_id, self.name, rank or 0, method_name, self.owner
                )
            calls.append(call)
        return calls

    async def _timeout_error(
        self, rpc: Any, calls: list[Call], done: set[int], limit: Limit, waited: float
    ) -> CallTimeoutError:
        """A :class:`CallTimeoutError` whose ``ranks``/``stacks`` were read on the workers now."""
        addresses = {c.rank: self.slots[c.rank].address for c in calls}
        answers = await forensics.query_status(
            rpc,
            [a for r, a in addresses.items() if self.slots[r].server_id not in self.driver.lost],
            float(dask.config.get("daskwg.status-timeout")),
        )
        ranks, stacks, notes = forensics.call_states(calls, addresses, done, answers)
        method = calls[0].method
        message = forensics.verdict(self.name, method, waited, limit.seconds, ranks, notes, addresses)
        return CallTimeoutError(method, limit.seconds, ranks, stacks, message)

    def status(self) -> list[dict]:
        """Per rank, what its worker says it is doing (see :func:`forensics.rank_record`)."""
        addresses = [s.address for s in self.slots]
        live = [s.address for s in self.slots if s.server_id not in self.driver.lost]
        timeout = float(dask.config.get("daskwg.status-timeout"))
        channel = self.driver.channel()
        if channel is None:
            answers = self.client.sync(forensics.query_status, self.client.rpc, live, timeout)
        else:
            answers = channel.run(forensics.query_status(channel.pool, live, timeout))
        records = []
        for rank, (address, slot) in enumerate(zip(addresses, self.slots)):
            answer = (
                forensics.LOST if slot.server_id in self.driver.lost else answers.get(address, forensics.LOST)
            )
            if not isinstance(answer, str) and not any(
                r.get("group_id") == self.group_id and r.get("rank") == rank for r in answer
            ):
                answer = forensics.LOST  # the worker restarted: a new process without the rank
            records.append(forensics.rank_record(rank, address, self.group_id, answer))
        return records

    def _wait_for_queue_room(self, slots: Sequence[Any], method_name: str, limit: Limit | None) -> None:
        """Wait while a worker already has ``daskwg.max-queued-calls`` unfinished task-path
        calls of this driver, so queued calls cannot grow without bound."""
        most = int(dask.config.get("daskwg.max-queued-calls"))
        for slot in slots:
            while True:
                pending = [f for f in list(self.driver.inflight.get(slot.server_id, ())) if not f.done()]
                if len(pending) < most:
                    break
                if limit is not None and limit.remaining() <= 0:
                    raise CallTimeoutError(
                        method_name,
                        limit.seconds,
                        {},
                        {},
                        f"{self.name}.{method_name} passed its deadline of {limit.seconds:g} s waiting for a place "
                        f"in the queue of {slot.address}: {len(pending)} calls wait there "
                        "(daskwg.max-queued-calls); wait for some of them, or raise the setting",
                    )
                self.raise_if_lost([self.slots.index(slot)])
                try:
                    self._wait_first(pending, 0.5)
                except (TimeoutError, asyncio.TimeoutError, FuturesCancelledError):
                    pass

    def release_dropped(self, metadata_key: list | None = None) -> None:
        """Destroy the ranks of a group the program dropped without ``shutdown()``, and
        forget its scheduler metadata record (``metadata_key``).

        Called from a garbage-collection finaliser, which may run in any thread at any
        allocation: it only schedules the work on the client's event loop.
        """
        self.close()
        if self.client.status != "running":
            return
        try:
            self.client.loop.add_callback(self._release_async, metadata_key)
        except Exception:  # noqa: BLE001 - the loop may be closing with the interpreter
            pass

    async def _release_async(self, metadata_key: list | None) -> None:
        if metadata_key is not None:
            try:
                await self.client.scheduler.set_metadata(keys=metadata_key, value=None)
            except Exception:  # noqa: BLE001 - the scheduler may be gone
                pass
        ranks = [r for r, s in enumerate(self.slots) if s.server_id not in self.driver.lost]
        if not ranks:
            return
        slots = [self.slots[r] for r in ranks]
        seqs = self.driver.take_seqs([s.server_id for s in slots])
        calls = [
            Call(self.driver.session, seq, self.group_id, self.name, r, "__del__", self.owner, s.server_id)
            for r, seq, s in zip(ranks, seqs, slots)
        ]
        try:
            packed = [serialization.pack(None)] * len(calls)  # the direct path sends packed payloads
            await self._send_direct(self.client.rpc, calls, packed, 0.0, False)
        except Exception as exc:  # noqa: BLE001 - best effort, nobody waits on it
            logger.info("group %s: releasing the dropped group's ranks failed: %s", self.name, exc)
        else:
            logger.info("group %s was garbage-collected without shutdown(): released its ranks", self.name)

    def _warn_if_paused(self, ranks: Sequence[int | None], method_name: str, warned: set[str]) -> None:
        after = float(dask.config.get("daskwg.paused-warning"))
        for rank in ranks:
            if rank is None:
                continue
            address = self.slots[rank].address
            since = self.driver.paused.get(address)
            if since is None or address in warned or time.monotonic() - since < after:
                continue
            warned.add(address)
            logger.warning(
                "%s.%s: rank %d waits on worker %s, which is paused (its memory use is above "
                "distributed.worker.memory.pause) and starts no tasks until it frees memory; "
                "free memory there, raise the worker's memory_limit or the pause threshold",
                self.name,
                method_name,
                rank,
                address,
            )

    def _future_error(self, future: Future, method_name: str) -> BaseException:
        rank = _rank_of(future)
        address = self.slots[rank].address if rank is not None else "?"
        if future.status == "cancelled":
            if rank is not None:
                self._await_loss_news(self.slots[rank])
            if self.client.status != "running":
                try:
                    self.check_scheduler()
                except GroupBrokenError as exc:
                    return exc
            if rank is not None and self.slots[rank].server_id in self.driver.lost:
                slot = self.slots[rank]
                self.broken = self.broken or WorkerLostError(
                    rank, slot.address, self.driver.lost[slot.server_id]
                )
                return self.broken
            paused = self.driver.paused_out.pop(future.key, None)
            if paused is not None:
                return paused
            return GroupBrokenError(f"the call of {method_name!r} on rank {rank} was cancelled")
        exc = future.exception()
        if isinstance(exc, WorkerGroupError):
            return exc
        tb = "".join(traceback.format_tb(future.traceback())) if future.traceback() else ""
        return RankError(rank if rank is not None else -1, address, method_name, tb, exc)

    def _await_loss_news(self, slot: Any, seconds: float = 3.0) -> None:
        """A task cancelled by Dask (``client.restart()``, a retired worker) is followed
        by the scheduler's remove-worker event: give it a moment to arrive, so the
        error says the worker was lost instead of a bare "cancelled"."""
        end = time.monotonic() + seconds
        while (
            slot.server_id not in self.driver.lost
            and self.client.status == "running"
            and time.monotonic() < end
        ):
            time.sleep(0.02)

    def gather_any(self, futures: list) -> list:
        futures = list(futures)
        calls = [getattr(f, "daskwg_call", None) for f in futures]
        method = next((c.method for c in calls if c is not None), "DataProtoFuture.get")
        return self.gather(futures, method)


#: What Dask raises when a result cannot be serialised on the worker or deserialised here.
_TRANSFER_ERRORS = (TypeError, pickle.PicklingError, pickle.UnpicklingError, AttributeError, ImportError)


def _transfer_error(rank: int, address: str, method: str, exc: BaseException) -> RankError:
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


def _pack_arguments(method: str, payload: Any, raw: bool) -> dict:
    """``serialization.pack(payload)``, or a :class:`DispatchError` naming the argument that
    cannot be pickled (raised in the driver, before the call is sent anywhere)."""
    try:
        return serialization.pack(payload)
    except Exception as exc:  # noqa: BLE001 - pickling raises anything
        cause = exc
    label, value = "the arguments", payload
    if not raw:
        args, kwargs = payload
        labelled = [(f"positional argument {i}", v) for i, v in enumerate(args)]
        labelled += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for candidate, candidate_value in labelled:
            try:
                serialization.pack(candidate_value)
            except Exception as exc:  # noqa: BLE001
                label, value, cause = candidate, candidate_value, exc
                break
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise DispatchError(
        f"cannot send {method!r} to its ranks: {label} (a {kind}) cannot be pickled "
        f"({type(cause).__name__}: {cause}); arguments must be data the workers can rebuild (tensors, "
        "numpy arrays, DataProto, plain Python data, instances of importable classes): create objects "
        "such as locks, sockets or open files on the worker instead"
    ) from None


def _tag(future: Future, call: Call) -> None:
    # The Call a task-path future stands for: deadline reports find it in the workers'
    # status records, and DataProtoFuture.get() names the producing method.
    try:
        future.daskwg_call = call
    except AttributeError:  # a Future type without instance attributes
        pass


def _consume_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _rank_of(future: Future) -> int | None:
    match = _KEY_RANK.search(str(future.key))
    return int(match.group(1)) if match else None


def _source_of(futures: Sequence[Any]) -> str:
    """``"group.method (ranks 0, 1)"``: the call that produced these futures."""
    calls = [getattr(f, "daskwg_call", None) for f in futures]
    known = [c for c in calls if c is not None]
    if not known:
        return ""
    ranks = ", ".join(str(c.rank) for c in known)
    return f"{known[0].group_name}.{known[0].method} (ranks {ranks})"


def _hold(keep: tuple, future: Future) -> None:
    """Done callback whose only job is to keep ``keep`` referenced until then."""


def _extract_lazies(payload: tuple, lazies: list[list], part_infos: Any, keep: list) -> tuple:
    """Replace ``DataProtoFuture`` arguments by :class:`LazyArg` placeholders.

    What the rank needs of them is appended to ``lazies`` (a list the Dask task takes
    as an argument, so Dask resolves it on the worker): for a future that is a row
    range, a union or otherwise transformed, one ``parts.PartInfo`` future per part
    (``part_infos(future)``), the rank fetching only its rows itself, and the parts'
    futures go to ``keep``; for a single whole part, the part itself.

    Raises:
        ValueError: a transformed future whose parts are not plainly concatenated.
    """
    args, kwargs = payload

    def swap(value: Any) -> Any:
        if not isinstance(value, DataProtoFuture):
            return value
        whole_part = len(value.futures) == 1 and not (value.ops or value.rows is not None or value.pad_size)
        if value.row_addressable and not whole_part:
            plan, part_futures = value.plan()
            lazies.append(part_infos(value))
            keep.extend(part_futures)
            return LazyArg(
                len(lazies) - 1, functools.partial(parts.evaluate_on_worker, plan), _source_of(part_futures)
            )
        if value.ops or value.rows is not None:
            raise ValueError(
                "union/select/repeat/rename/chunk need a DataProtoFuture whose parts are concatenated "
                "(the default collect_fn) and no dispatch_fn"
            )
        lazies.append(list(value.futures))
        return LazyArg(len(lazies) - 1, value.transform, _source_of(value.futures))

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
