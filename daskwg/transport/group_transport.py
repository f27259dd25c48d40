"""One group's transport: :class:`GroupTransport`, the facade ``daskwg.groups.group`` calls.

It picks the path of every call: the direct path for blocking calls (``direct``) and the
submit path for non-blocking ones (``submit``), both straight to the ranks' workers, with
futures of earlier calls among the arguments fetched by the ranks themselves
(``arguments``); the task path (``tasks``) only for calls taking futures no group call made,
which Dask must resolve. It gives each call its per-worker sequence numbers and owns the
group's failure state. Several ways to send, one order: the worker runs calls strictly in
sequence-number order whichever way they came.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future

from ..config import Settings
from ..deadlines import current_limit
from ..errors import DispatchError, WorkerGroupError
from ..serialization import pickling as serialization
from ..serialization import registration  # noqa: F401  (results, parts and scattered arguments cross Dask as Packed)
from ..wire.memfiles import BUFFER_SMALLEST
from ..wire.messages import Call, Handler
from .arguments import MAX_ITEMS, extract_futures, needs_dask, plan_relays, ref_keys
from .channel import HeldInterrupt
from .direct import DirectPath, SendOptions
from .driver import Driver, GroupRanks
from .failure import forensics
from .failure.heartbeat import Heartbeats
from .failure.state import FailureState
from .failure.waiting import Waiter
from .leader import AUTO_MAX_BYTES, AUTO_RANKS, LeaderPath
from .submit import SubmitPath
from .tasks import TaskPath

__all__ = ["GroupTransport", "pack_arguments"]

logger = logging.getLogger(__name__)


class GroupTransport:
    """How the calls of one group reach its ranks, and what the driver knows of their state.

    Args:
        client: the group's synchronous ``distributed.Client``.
        slots: one ``pool.WorkerSlot`` per rank, in rank order.
        name: the group's name (task keys, messages).
        group_id: the group's unique id (the hosts key rank objects by it).
        owner: the client id that owns the group's ranks.
        detached: the group outlives its driver: its non-blocking calls run even if the
            driver exits or drops their futures first (as a detached Ray actor's tasks do).

    Attributes:
        ranks: the group's :class:`~daskwg.transport.driver.GroupRanks`.
        failures: its :class:`~daskwg.transport.failure.state.FailureState`.
    """

    def __init__(
        self,
        client: Client,
        slots: Sequence[Any],
        name: str,
        group_id: str,
        owner: str,
        *,
        detached: bool = False,
    ):
        driver = Driver.of(client)
        driver.check_reconnected()  # before this group joins the ones a reconnection breaks
        self.ranks = GroupRanks(client, driver, tuple(slots), name, group_id, owner)
        self.failures = FailureState(self.ranks)
        self.direct = DirectPath(self.ranks, self.failures)
        #: ``daskwg.fan-out``'s paths through host leaders: ``host`` and ``auto``.
        self.leaders = {
            "host": LeaderPath(self.ranks, self.failures),
            "auto": LeaderPath(self.ranks, self.failures, AUTO_RANKS, AUTO_MAX_BYTES),
        }
        self.submit = SubmitPath(self.ranks, self.failures)
        self.tasks = TaskPath(self.ranks, keep_running=detached)
        self.waiter = Waiter(self.ranks, self.failures)
        settings = Settings.current()
        Heartbeats.of(driver).follow(
            self, self.ranks.slots, settings.heartbeat_interval, settings.heartbeat_timeout
        )
        driver.transports.add(self)
        driver.health.watch(self.ranks.slots)

    @property
    def driver(self) -> Driver:
        return self.ranks.driver

    @staticmethod
    def driver_of(client: Client) -> Driver:
        """The :class:`~daskwg.transport.driver.Driver` of ``client`` (what it knows of the workers)."""
        return Driver.of(client)

    @property
    def broken(self) -> WorkerGroupError | None:
        """The error every later call raises, or ``None`` while the group is usable."""
        return self.failures.broken

    def close(self) -> None:
        """Stop following the workers' events for this group."""
        self.driver.transports.discard(self)
        Heartbeats.of(self.driver).unfollow(self)

    def reconnected(self) -> None:
        """The client reconnected to the scheduler: this group's ranks were released."""
        self.failures.reconnected()

    def worker_lost(self, address: str, reason: str) -> None:
        """The driver learnt that the worker at ``address`` is gone."""
        self.failures.worker_lost(address, reason)

    def settle(self) -> None:
        """:meth:`FailureState.settle`: decide whether a failed call left ranks out of step."""
        self.failures.settle()

    def is_stuck(self, slot: Any) -> bool:
        return self.failures.is_stuck(slot)

    def is_abandoned(self, slot: Any) -> bool:
        return self.failures.is_abandoned(slot)

    def busy_call(self, slot: Any) -> Any:
        """The call ``slot``'s worker is still busy with (a broken group's straggler or an
        abandoned call: ``.describe(now)``), or ``None``."""
        return self.driver.sequencer.busy_call(slot)

    def check(self, method_name: str, ranks: list[int], limit: Any = None) -> None:
        """Refuse at once a call that would fail, or wait without a word: a lost worker,
        the scheduler gone, a rank stuck in a broken group's call, and, for a group's
        ``__init__`` without a deadline (``limit`` ``None``), a call the driver abandoned.

        Raises:
            WorkerLostError, GroupBrokenError: naming the worker and the call in the way.
        """
        slots = [self.ranks.slots[r] for r in ranks]
        self.failures.check_scheduler()
        self.failures.raise_if_lost(ranks)
        self.driver.sequencer.check_not_stuck(slots, f"{self.ranks.name}.{method_name}")
        if method_name == "__init__" and limit is None:
            self.driver.sequencer.check_not_behind_abandoned(slots, f"group {self.ranks.name!r}")

    async def reserve_port(self, port: int | None) -> int:
        """Reserve ``MASTER_PORT`` on rank 0's host (``port``, or a free one).

        Raises:
            OSError: ``port`` is in use there.
        """
        try:
            return await getattr(self.ranks.client.rpc(self.ranks.address(0)), Handler.RESERVE_PORT)(
                port=port
            )
        except OSError as exc:
            raise OSError(str(exc)) from None

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
        concurrency_group: str | None = None,
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
            concurrency_group: the method's ``@register(concurrency_group=...)``: its calls
                number in that group's own order on each worker (``None``: the default group).

        Raises:
            DispatchError: an argument cannot be pickled (before anything is sent).
            RankError, WorkerLostError, GroupBrokenError: as the call fails.
            CallTimeoutError: a blocking call passed its deadline.
        """
        settings = Settings.current()
        self.driver.check_reconnected()
        lazies: list[list] = [[] for _ in ranks]
        keep: list = []
        if not raw_payload:
            payloads = [
                extract_futures(p, lz, self.driver, self.tasks.part_info, keep)
                for p, lz in zip(payloads, lazies)
            ]
        # Packed before the call takes its place in the order: an argument that cannot be
        # pickled fails here, naming it, and no rank ever waits for a call that cannot arrive.
        packed = pack_all(method_name, payloads, raw_payload)
        # Futures no group call made need Dask to resolve them: those calls go as tasks.
        task_path = needs_dask(lazies)
        slots = [self.ranks.slots[r] for r in ranks]
        if any(lazies) and not task_path:
            # Another thread's calls and the client's loop change the records meanwhile
            # (with --async, a rollout's results finish while the trainer calls).
            sizes = self.driver.owned.sizes(ref_keys(lazies))
            plan_relays(
                lazies, [s.address for s in slots], sizes, settings.relay_above, settings.shared_memory
            )
        limit = current_limit(timeout, settings.call_timeout)
        failures, driver = self.failures, self.driver
        if check:
            # A lost worker fails at once (no connection attempt, no task that never
            # runs), and nothing is queued behind a rank stuck in a broken group's call.
            self.check(method_name, ranks, limit)
            driver.sequencer.warn_if_abandoned(slots, f"{self.ranks.name}.{method_name}", concurrency_group)
        if check and not blocking:
            self.waiter.wait_for_queue_room(slots, method_name, limit, settings)
        session, seqs = driver.sequencer.numbered([s.server_id for s in slots], concurrency_group)
        calls = [
            Call(
                session=session,
                seq=seq,
                group_id=self.ranks.group_id,
                group_name=self.ranks.name,
                rank=rank,
                method=method_name,
                owner=self.ranks.owner,
                worker_id=slot.server_id,
                concurrency_group=concurrency_group,
            )
            for rank, seq, slot in zip(ranks, seqs, slots)
        ]
        grace = settings.rank_failure_grace if settle is None else settle
        if task_path:
            values = [[v for _, v in lz] for lz in lazies]
            futures = self.tasks.submit(calls, packed, values, keep, settings)
            if blocking:
                return self.waiter.gather(futures, method_name, settings, grace, limit=limit)
            return futures
        refs = [lz or None for lz in lazies]
        if not blocking:
            return self.submit.submit(calls, packed, refs, keep, settings)
        channel = driver.channel()
        # This thread writes the calls itself: a Ctrl-C waits until they are on their way,
        # for calls whose writing takes a while (a buffer copied into a file, or a large
        # one onto a socket: milliseconds); holding costs ~30 µs, a small call's write less.
        large = channel is not None and any(
            memoryview(b).nbytes >= BUFFER_SMALLEST for p in packed for b in p.buffers
        )
        held = HeldInterrupt() if large else None
        options = SendOptions(
            grace=grace,
            private=channel is not None,
            limit=limit,
            status_timeout=settings.status_timeout,
            poll=settings.poll_interval,
            relay_wait=settings.relay_wait,
            on_sent=None if held is None else held.release,
        )
        path = self.direct
        if settings.fan_out != "direct" and not raw_payload and not any(refs) and len(calls) > 1:
            path = self.leaders[settings.fan_out]
        try:
            if channel is None:
                client = self.ranks.client
                return client.sync(path.send, client.rpc, driver.streams, calls, packed, refs, options)
            return channel.run(
                path.send(channel.pool, channel.streams, calls, packed, refs, options), fresh=False
            )
        except (KeyboardInterrupt, asyncio.CancelledError):
            failures.abandon_calls(calls, "interrupted")
            raise
        finally:
            if held is not None:
                held.release()

    def gather(self, futures: list[Future], method_name: str) -> list:
        """:meth:`Waiter.gather` with the settings in force now."""
        return self.waiter.gather(futures, method_name, Settings.current())

    def gather_any(self, futures: list) -> list:
        """:meth:`Waiter.gather_any` with the settings in force now (``DataProtoFuture.get``)."""
        return self.waiter.gather_any(futures, Settings.current())

    def status(self) -> list[dict]:
        """Per rank, what its worker says it is doing (see :func:`forensics.rank_record`)."""
        ranks = self.ranks
        live = [s.address for r, s in enumerate(ranks.slots) if not ranks.is_lost(r)]
        timeout = Settings.current().status_timeout
        channel = self.driver.channel()
        if channel is None:
            answers = ranks.client.sync(forensics.query_status, ranks.client.rpc, live, timeout)
        else:
            answers = channel.run(forensics.query_status(channel.pool, live, timeout))
        records = []
        for rank, slot in enumerate(ranks.slots):
            answer = forensics.LOST if ranks.is_lost(rank) else answers.get(slot.address, forensics.LOST)
            if not isinstance(answer, str) and not any(
                r.get("group_id") == ranks.group_id and r.get("rank") == rank for r in answer
            ):
                answer = forensics.LOST  # the worker restarted: a new process without the rank
            records.append(forensics.rank_record(rank, slot.address, ranks.group_id, answer, ranks.client.id))
        return records

    def release_dropped(self, metadata_key: list | None = None) -> None:
        """Destroy the ranks of a group the program dropped without ``shutdown()``, and
        forget its scheduler metadata record (``metadata_key``).

        Called from a garbage-collection finaliser, which may run in any thread at any
        allocation: it only schedules the work on the client's event loop.
        """
        self.close()
        client = self.ranks.client
        if client.status != "running":
            return
        try:
            client.loop.add_callback(self._release_async, metadata_key)
        except Exception:  # noqa: BLE001 - the loop may be closing with the interpreter
            pass

    async def _release_async(self, metadata_key: list | None) -> None:
        ranks, driver = self.ranks, self.driver
        if metadata_key is not None:
            try:
                await ranks.client.scheduler.set_metadata(keys=metadata_key, value=None)
            except Exception:  # noqa: BLE001 - the scheduler may be gone
                pass
        alive = [r for r in range(len(ranks.slots)) if not ranks.is_lost(r)]
        if not alive:
            return
        session, seqs = driver.sequencer.numbered([ranks.slots[r].server_id for r in alive])
        calls = [
            Call(
                session,
                seq,
                ranks.group_id,
                ranks.name,
                r,
                "__del__",
                ranks.owner,
                ranks.slots[r].server_id,
            )
            for r, seq in zip(alive, seqs)
        ]
        try:
            packed = [serialization.dumps(None)] * len(calls)
            await self.direct.send(ranks.client.rpc, driver.streams, calls, packed, None, SendOptions())
        except Exception as exc:  # noqa: BLE001 - best effort, nobody waits on it
            logger.info("group %s: releasing the dropped group's ranks failed: %s", ranks.name, exc)
        else:
            logger.info("group %s was garbage-collected without shutdown(): released its ranks", ranks.name)


def pack_all(method: str, payloads: list, raw: bool) -> list[serialization.Packed]:
    """:func:`pack_arguments` of each rank's payload; a payload holding the very objects of
    the one before (``ONE_TO_ALL``, ``execute_all``: every rank gets the same arguments) is
    pickled once, and its ``Packed`` shared (read-only on the way out)."""
    packed: list[serialization.Packed] = []
    for i, payload in enumerate(payloads):
        if i and _same_objects(payload, payloads[i - 1], raw):
            packed.append(packed[-1])
        else:
            packed.append(pack_arguments(method, payload, raw))
    return packed


def _same_objects(payload: Any, before: Any, raw: bool) -> bool:
    if payload is before:
        return True
    if raw:
        return False
    (args, kwargs), (args_before, kwargs_before) = payload, before
    return (
        len(args) == len(args_before)
        and all(a is b for a, b in zip(args, args_before))
        and kwargs.keys() == kwargs_before.keys()
        and all(v is kwargs_before[k] for k, v in kwargs.items())
    )


def pack_arguments(method: str, payload: Any, raw: bool) -> serialization.Packed:
    """``serialization.dumps(payload)``, or a :class:`DispatchError` naming the argument
    that cannot be pickled (raised in the driver, before the call is sent anywhere)."""
    try:
        return serialization.dumps(payload, arguments=not raw)
    except Exception as exc:  # noqa: BLE001 - pickling raises anything
        cause = exc
    label, value = "the arguments", payload
    if not raw:
        args, kwargs = payload
        labelled = [(f"positional argument {i}", v) for i, v in enumerate(args)]
        labelled += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for candidate, candidate_value in labelled:
            try:
                serialization.dumps(candidate_value, arguments=True)
            except Exception as exc:  # noqa: BLE001
                label, value, cause = candidate, candidate_value, exc
                break
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(cause, serialization.NestedFutureError):
        raise DispatchError(
            f"cannot send {method!r} to its ranks: {label} holds {cause}, where the ranks cannot resolve it; "
            "pass a future (or a DataProtoFuture) as an argument itself, or as an item of a list, tuple or "
            f"dict argument (of at most {MAX_ITEMS} items), and each rank gets its value; or get the value "
            "first with daskwg.get(future)"
        ) from None
    raise DispatchError(
        f"cannot send {method!r} to its ranks: {label} (a {kind}) cannot be pickled "
        f"({type(cause).__name__}: {cause}); arguments must be data the workers can rebuild (tensors, "
        "numpy arrays, DataProto, plain Python data, instances of importable classes): create objects "
        "such as locks, sockets or open files on the worker instead"
    ) from None
