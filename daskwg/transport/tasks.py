"""The task path: calls that take futures no group call made (``client.submit``,
``client.scatter``: Dask must resolve them on the rank's worker), as Dask tasks whose results
stay on the workers as Dask futures. Every other call goes straight to its workers
(``direct``, ``submit``).

Each call is one task pinned to its rank's worker (``workers=[address]``,
``allow_other_workers=False``, ``pure=False``, no retries), keyed
``"<group>.<method>-<call>-r<rank>-<id>"`` (:func:`daskwg.wire.messages.task_key`). The scheduler
never holds a batch and never unpickles anything of torch or daskwg: the task's function
is ``_daskwg_task.run`` naming the worker-side function (:data:`daskwg.wire.messages.RUN_CALL`),
its arguments are plain data (the call as a tuple, the arguments pickled once), and
arguments over ``daskwg.scatter-above`` bytes are sent by the driver straight to the
rank's worker (``client.scatter(..., workers=[address], direct=True)``) and referenced
by key. A ``DataProtoFuture`` argument's parts of that kind reach a rank as one small
:class:`daskwg.wire.messages.PartInfo` per part; the rank then fetches only its rows from the
workers holding them.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Sequence
from typing import Any

from distributed import Future, fire_and_forget

import _daskwg_task

from ..config import Settings
from ..serialization import pickling as serialization
from ..wire import messages as wire
from ..wire.messages import Call
from .driver import GroupRanks, TaskCall

__all__ = ["TaskPath"]


def _hold(keep: tuple, future: Future) -> None:
    """Done callback whose only job is to keep ``keep`` referenced until then."""


class TaskPath:
    """Submits one group's task-path calls.

    Args:
        ranks: the group's ranks.
        keep_running: the calls run even when every future of them is released first
            (``distributed.fire_and_forget``): a detached group's calls still run after
            the driver that queued them exits, as a detached Ray actor's tasks do.
    """

    def __init__(self, ranks: GroupRanks, keep_running: bool = False):
        self.ranks = ranks
        self.keep_running = keep_running

    def submit(
        self,
        calls: list[Call],
        payloads: list[serialization.Packed],
        lazies: list[list],
        keep: Sequence[Future],
        settings: Settings,
    ) -> list[Future]:
        """Submit one task per call; returns their futures, in the order of ``calls``.

        Args:
            calls: one per rank.
            payloads: each call's arguments, packed once.
            lazies: per call, what Dask resolves on the worker for its ``LazyArg``\\ s.
            keep: futures (parts of ``DataProtoFuture`` arguments) to keep alive until
                the calls end.
            settings: the call's settings (``scatter_above``, ``paused_timeout``).
        """
        ranks, driver = self.ranks, self.ranks.driver
        call_no = next(driver.call_numbers)
        futures: list[Future] = []
        try:
            keys = [wire.task_key(ranks.name, c.method, call_no, c.rank, ranks.group_id) for c in calls]
            staged = self._stage(
                keys, [ranks.address(c.rank) for c in calls], payloads, settings.scatter_above
            )
            now = time.monotonic()
            for call, key, payload, call_lazies in zip(calls, keys, staged, lazies):
                address = ranks.address(call.rank)
                future = self.submit_task(
                    wire.RUN_CALL, (call.to_wire(), payload, call_lazies or None, key), key, address
                )
                driver.calls[future] = TaskCall(call, now, settings.paused_timeout)
                if keep:
                    # The parts this call fetches rows of must outlive the call, even if the
                    # driver drops their DataProtoFuture right after this returns.
                    future.add_done_callback(functools.partial(_hold, tuple(keep)))
                future.add_done_callback(
                    functools.partial(self._skip_if_not_run, address, call.session, call.seq, call.worker_id)
                )
                driver.inflight.add(ranks.slots[call.rank].server_id, future)
                futures.append(future)
        except BaseException:
            # Calls that were never submitted must not hold up later ones on their workers.
            for call in calls[len(futures) :]:
                driver.sequencer.skip(ranks.address(call.rank), call.worker_id, call.session, [call.seq])
            raise
        if self.keep_running:
            # Else a driver that exits (its client releasing every key) would drop the calls
            # still queued on the ranks without a word.
            fire_and_forget(futures)
        return futures

    def submit_task(self, target: str, args: tuple, key: str, address: str | None) -> Future:
        """Submit ``target(*args)`` (``"module:function"`` on the worker) as a Dask task
        pinned to ``address``, without retries."""
        client = self.ranks.client
        future = client.submit(
            _daskwg_task.run,
            target,
            *args,
            key=key,
            workers=None if address is None else [address],
            allow_other_workers=False,
            pure=False,
            retries=0,
        )
        if address is not None:
            placement = self.ranks.driver.placement
            placement[key] = address
            weakref.finalize(future, placement.pop, key, None)
        return future

    def _stage(
        self, keys: list[str], addresses: list[str], payloads: list[serialization.Packed], scatter_above: int
    ) -> list[tuple]:
        """Per call, ``(INLINE, header, buffers)`` for a small payload, or ``(SCATTERED,
        future)`` for one sent straight to its worker (never through the scheduler)."""
        big = [i for i, p in enumerate(payloads) if p.nbytes > scatter_above]
        staged: list[tuple] = [
            None if i in big else (wire.INLINE, p.header, [bytes(b) for b in p.buffers])
            for i, p in enumerate(payloads)
        ]
        if big:
            items = [(f"{keys[i]}-args", payloads[i], addresses[i]) for i in big]
            for i, future in zip(big, self.ranks.client.sync(self._scatter, items)):
                staged[i] = (wire.SCATTERED, future)
        return staged

    async def _scatter(self, items: list[tuple[str, Any, str]]) -> list[Future]:
        client = self.ranks.client
        scattered = await asyncio.gather(
            *(
                client._scatter({name: value}, workers=[address], direct=True)
                for name, value, address in items
            )
        )
        return [s[name] for s, (name, _, _) in zip(scattered, items)]

    def part_info(self, part: Future) -> Future:
        """The future of a ``DataProtoFuture`` part's :class:`~daskwg.wire.messages.PartInfo`, computed
        once, next to the part (a Dask task: the part is a future no group call made)."""
        driver = self.ranks.driver
        key = str(part.key)
        info = driver.part_infos.get(key)
        if info is None or info.status in ("cancelled", "lost"):
            info = self.submit_task(
                wire.PART_INFO,
                (part, key),
                f"{key}-rows-{next(driver.call_numbers)}",
                driver.placement.get(key),
            )
            driver.part_infos[key] = info
            weakref.finalize(part, driver.part_infos.pop, key, None)
        return info

    def _skip_if_not_run(
        self, address: str, session: str, seq: int, server_id: str | None, future: Future
    ) -> None:
        status = future.status
        if status == "finished":
            if server_id is not None:
                self.ranks.driver.sequencer.note_finished(server_id, seq, session)
            return
        loop = self.ranks.client.loop
        if status == "cancelled":
            # Future.cancel() / client.cancel(): Dask lets go of the task but cannot stop
            # the rank; tell the worker (a queued call is skipped, an async one interrupted).
            loop.add_callback(self._send, wire.Handler.CANCEL, address, session, [seq])
            return
        # Also after a RankError: it may be the error of a call this one depended on (a
        # DataProtoFuture's producer), in which case this call never reached its rank.
        # Skipping a call that ran is a no-op on the worker.
        self.ranks.driver.sequencer.skip(address, server_id, session, [seq])

    async def _send(self, handler: str, address: str, session: str, seqs: list[int]) -> None:
        try:
            await getattr(self.ranks.client.rpc(address), handler)(session=session, seqs=seqs)
        except Exception:  # noqa: BLE001 - the worker may be gone; nothing runs or waits there then
            pass
