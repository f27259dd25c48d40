"""Results of non-blocking calls kept on this worker: :class:`ResultStore`.

A non-blocking call's result stays on its rank's worker under a key the driver owns
(:class:`daskwg.wire.ResultRef`), until the driver lets go of it. It is stored in the
worker's data the way ``client.scatter`` stores data (``Worker.update_data``), so Dask's
memory accounting, spilling and dashboard see it, and once the driver has registered the key
with the scheduler (which then knows where it is but never holds it), Dask's own gather,
``wait`` and release work on it too.

Consumers fetch results here directly, worker to worker or driver to worker, never through
the scheduler: ``daskwg_fetch`` (the value), ``daskwg_part_info`` (a ``DataProtoFuture``
part's rows and ``meta_info``); both wait while the call that makes the result is queued or
running, and answer with its error if it failed. ``daskwg_free`` drops results the driver
let go of before the scheduler knew them.

Threads: everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from distributed.protocol import to_serialize
from distributed.worker_state_machine import FreeKeysEvent

from .. import serialization
from ..errors import GroupBrokenError
from ..wire import ResultRef
from .exceptions import picklable
from .rows import part_info_of

__all__ = ["ResultStore"]

logger = logging.getLogger(__name__)

#: Seconds between checks, while a fetch waits for a call that has not reached this
#: worker yet, of whether that call was given up (it then never comes).
_ARRIVAL_POLL = 0.2

#: Keys of one driver remembered before those Dask released meanwhile are pruned.
_PRUNE_ABOVE = 4096


class ResultStore:
    """The results of the non-blocking calls of the ranks on one worker, by key.

    Args:
        worker: the Dask worker.
        seen: ``(session, seq) -> bool``: whether call ``seq`` of driver ``session`` has
            reached this worker (queued, run or given up).
    """

    def __init__(self, worker: Any, seen: Callable[[str, int], bool]):
        self.worker = worker
        self._seen = seen
        self._pending: dict[str, asyncio.Future] = {}
        self._failed: dict[str, BaseException] = {}
        self._dropped: set[str] = set()
        self._arrived = asyncio.Event()
        # Keys by driver session, so that a departed driver's results go with its ranks
        # (pruned of the keys Dask released as it grows).
        self._by_session: dict[str, set[str]] = {}

    def install(self) -> None:
        """Install the ``daskwg_fetch``, ``daskwg_part_info`` and ``daskwg_free`` handlers."""
        self.worker.handlers.update(
            {
                "daskwg_fetch": self._handle_fetch,
                "daskwg_part_info": self._handle_part_info,
                "daskwg_free": self._handle_free,
            }
        )

    # ---- the producing call's side -------------------------------------------------

    def expect(self, key: str, session: str) -> None:
        """The call that makes ``key`` arrived (from driver ``session``): fetches wait for it from now."""
        self._pending[key] = asyncio.get_running_loop().create_future()
        keys = self._by_session.setdefault(session, set())
        keys.add(key)
        if len(keys) > _PRUNE_ABOVE and len(keys) % _PRUNE_ABOVE == 1:
            keys.intersection_update(set(self._pending) | set(self._failed) | set(self.worker.data))
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    def put(self, key: str, packed: serialization.Packed) -> None:
        """Store the call's result (its snapshot) under ``key``."""
        if key in self._dropped:
            self._dropped.discard(key)
        else:
            self.worker.update_data({key: packed}, stimulus_id=f"daskwg-result-{time.time()}")
        self._settle(key)

    def fail(self, key: str, exc: BaseException) -> None:
        """The call that makes ``key`` failed with ``exc``: fetches raise it."""
        if key in self._dropped:
            self._dropped.discard(key)
        else:
            self._failed[key] = picklable(exc)
        self._settle(key)

    def _settle(self, key: str) -> None:
        waiter = self._pending.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def free(self, keys: list[str]) -> None:
        """Drop these results (the driver let go of them), or drop them as they come."""
        stored = []
        for key in keys:
            if self._failed.pop(key, None) is not None:
                continue
            if key in self._pending:
                self._dropped.add(key)
            elif key in self.worker.data:
                stored.append(key)
        if stored:
            self.worker.handle_stimulus(FreeKeysEvent(keys=stored, stimulus_id=f"daskwg-free-{time.time()}"))

    def forget_session(self, session: str) -> None:
        """Drop every result of driver ``session`` (it left)."""
        self.free(list(self._by_session.pop(session, ())))

    # ---- the consumers' side -------------------------------------------------------

    async def wait(self, ref: ResultRef) -> Any:
        """The stored value of ``ref`` (a ``serialization.Packed``, or its value once Dask
        spilled and reloaded it), once the call that makes it has finished.

        Raises:
            the call's own error (a ``RankError``) if it failed.
            GroupBrokenError: the result was released, or its call never came.
        """
        key = ref.key
        while True:
            if key in self.worker.data:
                return self.worker.data[key]
            waiter = self._pending.get(key)
            if waiter is not None:
                await asyncio.shield(waiter)
                continue
            failed = self._failed.get(key)
            if failed is not None:
                raise failed
            if self._seen(ref.session, ref.seq):
                raise GroupBrokenError(
                    f"the result {key!r} of {ref.source or 'an earlier call'} is no longer held by "
                    f"{self.worker.address}: it was released (keep its future until the call that consumes "
                    "it has been sent), its call never ran there, or the worker restarted"
                )
            arrived = self._arrived
            try:
                await asyncio.wait_for(arrived.wait(), _ARRIVAL_POLL)
            except asyncio.TimeoutError:
                pass

    async def _handle_fetch(self, key: str, session: str, seq: int, source: str = "") -> dict:
        """``daskwg_fetch``: ``{"status": "OK", "data": value}`` of a result here, once it exists,
        or ``{"status": "error", "exception": its error}``."""
        try:
            value = await self.wait(ResultRef(key, self.worker.address, session, seq, source=source))
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(picklable(exc))}
        return {"status": "OK", "data": to_serialize(serialization.dumps(value))}

    async def _handle_part_info(self, key: str, session: str, seq: int, source: str = "") -> dict:
        """``daskwg_part_info``: the :class:`~daskwg.wire.PartInfo` of a ``DataProtoFuture`` part here."""
        try:
            value = await self.wait(ResultRef(key, self.worker.address, session, seq, source=source))
            info = part_info_of(value, key, self.worker.address)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(picklable(exc))}
        return {"status": "OK", "info": to_serialize(info)}

    def _handle_free(self, keys: list[str]) -> None:
        """``daskwg_free``: :meth:`free`."""
        self.free(list(keys))
