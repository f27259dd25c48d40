"""Results of non-blocking calls kept on this worker: :class:`ResultStore`.

A non-blocking call's result stays on its rank's worker under a key the driver owns
(:class:`daskwg.wire.messages.ResultRef`), until the driver lets go of it. When the driver registers
the key with the scheduler (something waits for it through Dask, or it has lived a while;
most results of an RL step are dropped before), the result moves into the worker's data the
way ``client.scatter`` stores data (``daskwg_publish``: ``Worker.update_data``), so Dask's
memory accounting, spilling, ``get_data`` and release apply to it from then on; until then
it costs none of the Dask worker state machine's bookkeeping.

Consumers fetch results here directly, worker to worker or driver to worker, never through
the scheduler: ``daskwg_fetch`` (the value), ``daskwg_part_info`` (a ``DataProtoFuture``
part's rows and ``meta_info``); both wait while the call that makes the result is queued or
running, and answer with its error if it failed. ``daskwg_free`` drops results the driver
let go of before the scheduler knew them (as does a ``free`` message on a call stream).
Drivers fetch with a ``fetch`` message on their call stream (:meth:`ResultStore.packed`),
which saves Dask's message framing.

Threads: everything here runs on the worker's event loop, except :meth:`ResultStore.put`
and :meth:`ResultStore.fail`, which the host thread calls as a call ends (its reply goes out
from there, without a wake-up of the loop); a lock guards the tables both touch, and a fetch
waiting for the result is woken on its loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.protocol import to_serialize
from distributed.worker_state_machine import FreeKeysEvent

from ..errors import GroupBrokenError
from ..serialization import pickling as serialization
from ..wire.messages import Handler, ResultRef
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
        # Results not published to Dask yet (most never are: dropped before that).
        self._values: dict[str, serialization.Packed] = {}
        self._pending: dict[str, asyncio.Future | None] = {}
        self._failed: dict[str, BaseException] = {}
        self._dropped: set[str] = set()
        self._arrived: asyncio.Event | None = None
        # put/fail (host thread) against wait/free/publish (the loop).
        self._lock = threading.Lock()
        # Keys by driver session, so that a departed driver's results go with its ranks
        # (pruned of the keys released meanwhile as it grows).
        self._by_session: dict[str, set[str]] = {}
        #: called with the keys of every :meth:`free` (``daskwg.plugin.shared`` closes their files).
        self.on_free: list[Callable[[list[str]], None]] = []

    def for_dask(self, value: Any) -> Any:
        """What Dask's data holds for a result: its value, read from the ``Packed`` snapshot
        (zero-copy over its buffers). Dask hands what its data holds as it is to the tasks of
        the same worker (and, where comms do not serialise, ``inproc://``, to ``client.gather``
        too): the ``Packed`` itself would reach user code."""
        if isinstance(value, serialization.Packed):
            return serialization.loads(value)
        return value

    def install(self) -> None:
        """Install the ``Handler.FETCH``, ``PART_INFO``, ``FREE`` and ``PUBLISH`` handlers."""
        self.worker.handlers.update(
            {
                Handler.FETCH: self._handle_fetch,
                Handler.PART_INFO: self._handle_part_info,
                Handler.FREE: self._handle_free,
                Handler.PUBLISH: self._handle_publish,
            }
        )

    def get(self, key: str) -> Any:
        """The stored value of ``key`` (``KeyError`` if it is not here)."""
        with self._lock:
            value = self._values.get(key)
        return self.worker.data[key] if value is None else value

    def kept(self, key: str) -> tuple[bool, Any]:
        """From any thread: ``(True, stored value)`` of a result here that Dask does not hold
        yet, ``(True, error)`` (an exception) of one whose call failed, or ``(False, None)``
        (it is pending, released, or in Dask's data: ask :meth:`wait` on the loop)."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                return True, value
            failed = self._failed.get(key)
        return (True, failed) if failed is not None else (False, None)

    def __contains__(self, key: str) -> bool:
        return key in self._values or key in self.worker.data

    # ---- the producing call's side -------------------------------------------------

    def expect(self, key: str, session: str) -> None:
        """The call that makes ``key`` arrived (from driver ``session``): fetches wait for it from now."""
        with self._lock:
            self._pending[key] = None
        keys = self._by_session.setdefault(session, set())
        keys.add(key)
        if len(keys) > _PRUNE_ABOVE and len(keys) % _PRUNE_ABOVE == 1:
            keys.intersection_update(
                [k for k in keys if k in self or k in self._pending or k in self._failed]
            )
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def put(self, key: str, packed: serialization.Packed) -> None:
        """Store the call's result (its snapshot) under ``key`` (any thread)."""
        self._settle(self._values, key, packed)

    def fail(self, key: str, exc: BaseException) -> None:
        """The call that makes ``key`` failed with ``exc``: fetches raise it (any thread)."""
        self._settle(self._failed, key, picklable(exc))

    def _settle(self, table: dict, key: str, value: Any) -> None:
        # Kept in ``table`` unless the driver dropped it meanwhile; a fetch waiting for it
        # is woken on its loop.
        with self._lock:
            if key in self._dropped:
                self._dropped.discard(key)
            else:
                table[key] = value
            waiter = self._pending.pop(key, None)
        _wake(waiter)

    def free(self, keys: list[str]) -> None:
        """Drop these results (the driver let go of them), or drop them as they come."""
        for hook in self.on_free:
            hook(keys)
        published = []
        with self._lock:
            for key in keys:
                if self._values.pop(key, None) is not None or self._failed.pop(key, None) is not None:
                    continue
                if key in self._pending:
                    self._dropped.add(key)
                elif key in self.worker.data:
                    published.append(key)
        if published:
            self.worker.handle_stimulus(
                FreeKeysEvent(keys=published, stimulus_id=f"daskwg-free-{time.time()}")
            )

    def forget_session(self, session: str) -> None:
        """Drop every result of driver ``session`` (it left)."""
        self.free(list(self._by_session.pop(session, ())))

    def _handle_publish(self, keys: list[str]) -> dict[str, int]:
        """``daskwg_publish``: move these results into the worker's data, as ``client.scatter``
        stores data, before the driver tells the scheduler where they are (from then on Dask's
        memory accounting, spilling, ``get_data`` and release apply to them). Returns
        ``{key: bytes}`` of those that are here."""
        with self._lock:
            values = {k: self._values.pop(k) for k in keys if k in self._values}
        if values:
            self.worker.update_data(
                {k: self.for_dask(v) for k, v in values.items()}, stimulus_id=f"daskwg-publish-{time.time()}"
            )
        return {k: v.nbytes for k, v in values.items()}

    # ---- the consumers' side -------------------------------------------------------

    async def wait(self, ref: ResultRef) -> Any:
        """The stored value of ``ref`` (a ``serialization.Packed``, or its value once Dask
        spilled and reloaded it), once the call that makes it has finished.

        Raises:
            RankError: the call's own error if it failed.
            GroupBrokenError: the result was released, or its call never came.
        """
        key = ref.key
        while True:
            with self._lock:
                value = self._values.get(key)
                waiter = None
                if value is None and key in self._pending:
                    waiter = self._pending[key]
                    if waiter is None:
                        waiter = self._pending[key] = asyncio.get_running_loop().create_future()
                failed = self._failed.get(key)
            if value is not None:
                return value
            if key in self.worker.data:
                return self.worker.data[key]
            if waiter is not None:
                await asyncio.shield(waiter)
                continue
            if failed is not None:
                raise failed
            if self._seen(ref.session, ref.seq):
                raise GroupBrokenError(
                    f"the result {key!r} of {ref.source or 'an earlier call'} is no longer held by "
                    f"{self.worker.address}: it was released (keep its future until the call that consumes "
                    "it has been sent), its call never ran there, or the worker restarted"
                )
            if self._arrived is None:
                self._arrived = asyncio.Event()
            try:
                await asyncio.wait_for(self._arrived.wait(), _ARRIVAL_POLL)
            except asyncio.TimeoutError:
                pass

    async def packed(self, key: str, session: str, seq: int, source: str = "") -> serialization.Packed:
        """The pickled value of the result ``key`` here (call ``seq`` of driver ``session``
        makes it; ``source`` names that call in errors), once it exists: what a ``fetch``
        message on a call stream answers (``daskwg.plugin.stream``).

        Raises:
            what :meth:`wait` raises, made picklable.
        """
        try:
            value = await self.wait(ResultRef(key, self.worker.address, session, seq, source=source))
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            raise picklable(exc) from None
        return serialization.dumps(value)

    async def _handle_fetch(self, key: str, session: str, seq: int, source: str = "") -> dict:
        """``daskwg_fetch``: ``{"status": "OK", "data": value}`` of a result here, once it exists,
        or ``{"status": "error", "exception": its error}``."""
        try:
            packed = await self.packed(key, session, seq, source)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(exc)}
        return {"status": "OK", "data": to_serialize(packed)}

    async def _handle_part_info(self, key: str, session: str, seq: int, source: str = "") -> dict:
        """``daskwg_part_info``: the :class:`~daskwg.wire.messages.PartInfo` of a ``DataProtoFuture`` part here."""
        try:
            value = await self.wait(ResultRef(key, self.worker.address, session, seq, source=source))
            info = part_info_of(value, key, self.worker.address)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(picklable(exc))}
        return {"status": "OK", "info": to_serialize(info)}

    def _handle_free(self, keys: list[str], registered: bool = False) -> None:
        """``daskwg_free``: :meth:`free`. ``registered``: the driver registered the keys with
        the scheduler as its client closed, when this worker may have dropped them already
        (:meth:`forget_session`): the scheduler is told of those no longer here too (Dask's
        ``release-worker-data``), or it would hold them until the worker leaves, and then
        log that it lost them."""
        gone = [k for k in keys if k not in self.worker.data] if registered else []
        self.free(list(keys))
        for key in gone:
            self.worker.batched_send(
                {"op": "release-worker-data", "key": key, "stimulus_id": f"daskwg-free-{time.time()}"}
            )


def _wake(waiter: asyncio.Future | None) -> None:
    """Resolve a fetch's waiter on its own loop (from the host thread or the loop)."""
    if waiter is not None:
        try:
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # its loop is closed: the worker is closing
            pass


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
