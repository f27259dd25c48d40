"""Results the driver owns on the workers: the futures of non-blocking calls.

A non-blocking call's result stays on its rank's worker under a key the driver owns
(``daskwg.plugin.results``); the driver holds a :class:`CallFuture`, a
``distributed.Future`` of that key, and :class:`Owned` keeps what it knows of each one
(:class:`OwnedResult`): the call, where the result is, its size, the result itself when it
was small enough to come back with the reply (as Ray returns small objects inline to their
owner), or the error the call raised.

Dask sees these futures as its own:

* a future is ``finished`` (``future.done()``, ``future.status``) with its call's reply,
  and daskwg's own waits (:meth:`Owned.wait`: group calls, ``daskwg.get``,
  ``DataProtoFuture.get()``), :meth:`CallFuture.result` and ``client.gather``
  (``daskwg.transport.gather``) need nothing more;
* Dask's own waits (``distributed.wait``, ``as_completed``, ``add_done_callback``) end
  with the call's reply, as ``daskwg.get`` does; the driver registers the key with the
  scheduler (``update_data``, as ``client.scatter`` does: the scheduler learns where the
  result is and its size, and never holds its bytes) once it has lived for
  :data:`REGISTER_AFTER` seconds, or, for one waited for through Dask, before this client
  next tells or asks the scheduler anything (:meth:`Owned.flush`, which
  ``daskwg.transport.gather.route_scheduler`` puts in front of the client's scheduler
  traffic: ``who_has``, ``nbytes``, a graph naming it), and a graph naming it waits for its
  registration (``CallFuture.__dask_tokenize__``). So Dask's own gather, the dashboard's
  memory views and Dask tasks taking the future work on it, and dropping it releases the
  result through Dask's reference counting. Results dropped before that (most of an RL
  step's, waited for through Dask or not) never cost the scheduler anything: the driver
  drops them on their workers itself;
* a failed call's future is ``error`` with the call's ``RankError`` at once;
* ``future.cancel()`` reaches the rank (a queued call is skipped, an ``async def`` one
  interrupted), its error is a ``CallCancelledError``; a future dropped before its result
  exists has the result dropped on its worker when it comes.

Values come straight from the worker holding them (a ``fetch`` message on the reader's
call stream to it), never through the scheduler: :meth:`Owned.fetch` (and
:meth:`CallFuture.result`); those that came back with their replies are read in the
calling thread (:meth:`Owned.fetch_inline`).

Threads: the calling threads create futures and wait; the client's event loop handles the
replies, registrations and cancellations. The last reference to a result that came back and
that the scheduler was not told of is released on the thread that drops it (:meth:`Owned.drop`);
other releases go to the loop. :class:`OwnedResult` fields change on the loop, and on a
dropping thread under :attr:`Owned.cond`, which the loop holds while it settles a result or
decides on its registration; waiters read them under it too.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client
from distributed.comm.core import CommClosedError
from distributed.core import rpc

from ..errors import GroupBrokenError, WorkerLostError
from ..serialization import pickling as serialization
from ..wire import messages as wire
from ..wire.messages import Call
from .call_future import CallFuture, OwnedState
from .frees import Frees
from .gather import route_gather, route_scheduler
from .streams import CallStreams

#: Seconds a read of a result whose stream dropped waits for the word on why its worker went.
LOST_REASON_WAIT = 4.0

__all__ = ["Owned", "OwnedResult", "REGISTER_AFTER"]

logger = logging.getLogger(__name__)

PENDING, FINISHED, ERROR, CANCELLED = "pending", "finished", "error", "cancelled"

#: Seconds after which a result the program still holds is registered with the scheduler
#: even if nothing waited for it through Dask (so Dask's views and tasks see it).
REGISTER_AFTER = 0.5
#: ... registered at most this many seconds later (the results finished within it share a timer).
REGISTER_SLACK = 0.05


@dataclass(eq=False)
class OwnedResult:
    """What the driver knows of one non-blocking call's result.

    Attributes:
        key: its key.
        call: the call.
        address: the worker holding it.
        status: ``"pending"``, ``"finished"``, ``"error"`` or ``"cancelled"``.
        nbytes: its size once finished.
        inline: the result itself (pickled) when it came back with the reply (one with
            tensors is taken by the first read).
        info: its ``wire.PartInfo`` once finished, when it is a batch kept on its worker.
        error: the call's error.
        pinned: futures the call reads (its ``DataProtoFuture`` and future arguments), kept
            alive until it ends even if the program drops them.
        wanted: something waited for it through Dask (register it before this client next
            talks to the scheduler, :meth:`Owned.flush`).
        registering, registered: where its registration with the scheduler is.
    """

    key: str
    call: Call
    address: str
    state: OwnedState
    status: str = PENDING
    nbytes: int | None = None
    inline: serialization.Packed | None = None
    info: Any = None
    error: BaseException | None = None
    pinned: tuple = ()
    wanted: bool = False
    registering: bool = False
    registered: bool = False


class Owned:
    """The non-blocking calls' results of one driver (one ``Client``).

    Args:
        client: the driver's client.
        streams: its call streams on the client's loop (results are dropped on a worker
            with a message on its stream).
    """

    def __init__(self, client: Client, streams: CallStreams):
        self.client = client
        self.records: dict[str, OwnedResult] = {}
        #: held while a result settles (on the client's loop) and while a waiter checks them.
        self.cond = threading.Condition()
        # Calling threads waiting in wait(): (their event, what they wait for); an event is
        # set only once what its thread waits for holds, so a thread waiting for a whole
        # call's results wakes once, not at every rank's reply.
        self._waiters: list[tuple[threading.Event, Any]] = []
        self.streams = streams
        #: ``(address, server id) -> why that worker process went away`` (``None``: not
        #: known), the driver's ``WorkerHealth.lost_reason``.
        self.lost_reason: Callable[[str, str], str | None] = lambda address, server_id: None
        #: results dropped here, on their way to be dropped on their workers.
        self.frees = Frees(client, streams)
        self._drops: list[str] = []  # released references, for the loop (queue_drop)
        # Reentrant: Future.__del__ (queue_drop) may run inside it, at an allocation.
        self._drops_lock = threading.RLock()
        self._to_register: list[OwnedResult] = []
        #: keys of results waited for through Dask and not registered yet (flush() registers them).
        self._wanted: set[str] = set()
        self._register_task: asyncio.Future | None = None
        #: Dask's own write of a message onto the client's stream to the scheduler (on the
        #: loop), which route_scheduler's hold does not delay.
        self.send_to_scheduler: Callable[[dict], None] = type(client)._send_to_scheduler_safe.__get__(client)
        self._young: collections.deque[tuple[float, str]] = collections.deque()  # (due, key)
        self._registering = False
        route_gather(self)  # client.gather of these futures reads them as daskwg.get does
        route_scheduler(self)  # the client's scheduler traffic goes after flush()

    # ---- creating (calling thread) ---------------------------------------------------

    def create(self, call: Call, key: str, address: str, pinned: Sequence[Any] = ()) -> CallFuture:
        """The future of ``call``'s result, which will be kept under ``key`` at ``address``."""
        state = OwnedState(key, self)
        self.records[key] = OwnedResult(key, call, address, state, pinned=tuple(pinned))
        # Future binds to the key's state in client.futures when there is one.
        self.client.futures[key] = state
        return CallFuture(key, self.client)

    def sizes(self, keys: Any) -> dict[str, int]:
        """Bytes of those of ``keys`` whose results have finished (key -> bytes).

        Safe from any thread: it looks keys up one by one, while the client's loop and
        other calling threads add and drop records.
        """
        out = {}
        for key in keys:
            rec = self.records.get(key)
            if rec is not None and rec.nbytes is not None:
                out[key] = rec.nbytes
        return out

    def record(self, future: Any) -> OwnedResult | None:
        """The record of one of these futures (``None`` for any other future)."""
        state = getattr(future, "_state", None)
        if not isinstance(state, OwnedState) or state.owned is not self:
            return None
        return self.records.get(future.key)

    # ---- settling (the client's loop) ------------------------------------------------

    def finished(
        self, key: str, nbytes: int, inline: serialization.Packed | None = None, info: Any = None
    ) -> None:
        """The call of ``key`` returned; its result (``nbytes``) is on its worker, and
        ``inline`` is the result itself when it came with the reply, ``info`` its
        ``PartInfo`` when it is a batch."""
        rec = self.records.get(key)
        if rec is None or rec.status != PENDING:
            if rec is not None:
                self._forget(rec)  # cancelled meanwhile: the result is nobody's
            return
        with self.cond:  # against drop() on a calling thread
            self._settle(rec, FINISHED, nbytes=nbytes, inline=inline, info=info)
            if not self._alive(rec):
                self._forget(rec)
            else:
                self._young.append((time.monotonic() + REGISTER_AFTER, key))
                if len(self._young) == 1:
                    asyncio.get_running_loop().call_later(REGISTER_AFTER, self._register_due)

    def failed(self, key: str, error: BaseException) -> None:
        """The call of ``key`` failed with ``error`` (a daskwg error)."""
        rec = self.records.get(key)
        if rec is None or rec.status != PENDING:
            if rec is not None and rec.status == CANCELLED:
                self._forget(rec)
            return
        with self.cond:  # against drop() on a calling thread
            self._settle(rec, ERROR, error=error)
            alive = self._alive(rec)
            if not alive:
                self._forget(rec)
        if alive:
            rec.state.set_error(error, None)

    def cancelled(self, key: str) -> None:
        """The rank's worker says the call of ``key`` was cancelled (skipped or interrupted)."""
        rec = self.records.get(key)
        if rec is not None:
            if rec.status == PENDING:
                self._settle(rec, CANCELLED)
            self._forget(rec)

    def lost(self, keys: Iterable[str], error_of: Any) -> None:
        """Their worker is gone: ``error_of(record)`` is each one's error."""
        for key in list(keys):
            rec = self.records.get(key)
            if rec is not None and rec.status == PENDING:
                self.failed(key, error_of(rec))

    def _settle(self, rec: OwnedResult, status: str, **fields: Any) -> None:
        with self.cond:
            rec.status = status
            for name, value in fields.items():
                setattr(rec, name, value)
            rec.pinned = ()
            self.cond.notify_all()
            for event, ready in self._waiters:
                if not event.is_set() and ready():
                    event.set()
        if status == FINISHED and rec.state.status == PENDING:
            rec.state.status = FINISHED
        rec.state._settled.set()

    def demand(self, key: str) -> None:
        """Something waits for ``key`` through Dask (on the client's loop): register it before
        this client next talks to the scheduler (:meth:`flush`), or after
        :data:`REGISTER_AFTER` seconds, whichever comes first. Not at once: a wait whose
        futures are read and dropped (``distributed.wait`` + ``client.gather``,
        ``as_completed``) then costs the scheduler, the workers and this loop nothing more
        than ``daskwg.get``."""
        with self.cond:  # against drop() on a calling thread
            rec = self.records.get(key)
            if rec is None or rec.registered or rec.registering:
                return
            rec.wanted = True
            self._wanted.add(key)

    def must_flush(self) -> bool:
        """Whether a registration is due before the client's next word to the scheduler (one
        waited for through Dask, or one in flight); on the client's loop."""
        return self._registering or bool(self._wanted)

    async def flush(self, keys: Iterable[str] | None = None) -> None:
        """Register the finished results of ``keys`` (``None``: those waited for through
        Dask) that the program still holds and the scheduler has not been told of, in one
        batch, and return once that and any registration in flight are done (on the client's
        loop). A registration that fails (a worker gone) leaves its results unknown to the
        scheduler, as Dask leaves a future whose data was lost; nothing is raised."""
        with self.cond:  # against drop() on a calling thread
            for key in list(self._wanted if keys is None else keys):
                rec = self.records.get(key)
                if (
                    rec is not None
                    and rec.status == FINISHED
                    and not (rec.registered or rec.registering)
                    and self._alive(rec)
                ):
                    self._queue_registration(rec)
        task = self._register_task
        if self._registering and task is not None:
            # Every result queued so far goes in one of its batches (it runs until none is left).
            await asyncio.wait({task})

    def _register_due(self) -> None:
        # One timer for the results that finished in the last REGISTER_AFTER seconds (a
        # timer each cost a heap entry per rank per call); most are dropped before it comes.
        young, now = self._young, time.monotonic()
        while young and young[0][0] <= now:
            self._register_if_alive(young.popleft()[1])
        if young:
            delay = max(young[0][0] - now, REGISTER_SLACK)
            asyncio.get_running_loop().call_later(delay, self._register_due)

    def _register_if_alive(self, key: str) -> None:
        with self.cond:  # against drop() on a calling thread
            rec = self.records.get(key)
            if rec is not None and not (rec.registered or rec.registering) and self._alive(rec):
                self._queue_registration(rec)

    def _queue_registration(self, rec: OwnedResult) -> None:
        rec.registering = True
        self._to_register.append(rec)
        if not self._registering:
            self._registering = True
            self._register_task = asyncio.ensure_future(self._register())

    def unknown_to_scheduler(self, key: str) -> bool:
        """Whether ``key`` is a result of this driver the scheduler has not been told of
        (running, or finished and not registered yet)."""
        with self.cond:
            rec = self.records.get(key)
            return rec is not None and not rec.registered

    def on_loop(self) -> bool:
        """Whether this runs on the client's event loop (where nothing may block)."""
        return self._on_loop()

    def _on_loop(self) -> bool:
        """Whether this runs on the client's event loop (where tornado's ``add_callback``
        would still write to the loop's self-pipe and wait for the next turn)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return here is getattr(self.client.loop, "asyncio_loop", None)

    def _alive(self, rec: OwnedResult) -> bool:
        """Whether the program still holds the future (its state is still the key's)."""
        return self.client.futures.get(rec.key) is rec.state

    def on_cancel(self, key: str, released: bool) -> None:
        """Dask cancelled or released ``key``'s state (any thread)."""
        if self._on_loop():
            self._on_cancel(key, released)
            return
        try:
            self.client.loop.add_callback(self._on_cancel, key, released)
        except Exception:  # noqa: BLE001 - the loop is closing with the client
            pass

    def _on_cancel(self, key: str, released: bool) -> None:
        rec = self.records.get(key)
        if rec is None:
            return
        if rec.status == PENDING:
            if not released:
                # A cancelled call never runs if it is still queued (an async one is
                # interrupted): the rank's worker is told; dropping is not cancelling.
                self._settle(rec, CANCELLED)
                rec.state.told = asyncio.ensure_future(  # fut.cancel() waits for the answer
                    self._tell(
                        rec.address, wire.Handler.CANCEL, session=rec.call.session, seqs=[rec.call.seq]
                    )
                )
            return  # settled by the reply: the result is dropped where it is
        if not rec.registering:
            self._forget(rec)

    def _forget(self, rec: OwnedResult) -> None:
        """The program let go of ``rec``: drop its result on the worker unless Dask releases it."""
        if self.records.get(rec.key) is rec:
            del self.records[rec.key]
        self._wanted.discard(rec.key)
        if not rec.registered:
            self.frees.free(rec.address, rec.call.worker_id, rec.key, rec.nbytes)

    async def _register(self) -> None:
        """Tell the scheduler where finished results are (a batch per round trip), once
        their workers have moved them into their Dask data (``daskwg_publish``).

        ``update_data`` goes without ``client=``: a client's wish for the keys goes on its
        own stream (``client-desires-keys``), in order with its ``close-client``. A
        ``client=`` on the RPC could arrive after that, and the scheduler would make a record
        of the departed client (``Scheduler.client_desires_keys``) that holds the keys until
        the cluster closes, and then logs that it lost scattered data."""
        client = self.client
        try:
            while self._to_register:
                batch, self._to_register = self._to_register, []
                published: dict[str, int] = {}
                if client.status == "running":  # a closing client's results are dropped instead
                    by_address: dict[str, list[OwnedResult]] = {}
                    for r in batch:
                        by_address.setdefault(r.address, []).append(r)
                    for answer in await asyncio.gather(
                        *(self._publish(a, rs) for a, rs in by_address.items())
                    ):
                        published.update(answer)  # every worker at once: one round trip
                if published:
                    try:
                        # A connection of its own: the client's pool aborts its requests when
                        # it closes, and the scheduler may then have taken one in or not; this
                        # one always answers, so the keys are known to be registered.
                        async with rpc(client.scheduler.address, connection_args=client.connection_args) as s:
                            await s.update_data(
                                who_has={
                                    k: [self.records[k].address] for k in published if k in self.records
                                },
                                nbytes=published,
                            )
                    except Exception as exc:  # noqa: BLE001 - e.g. a worker the scheduler removed
                        logger.debug(
                            "registering %d results with the scheduler failed: %s", len(published), exc
                        )
                        published = {}
                if published and client.status != "running":
                    # The client closed meanwhile: nobody wants them; their workers drop them
                    # and tell the scheduler (Dask's release-worker-data).
                    await self._drop_published(batch, published)
                    published = {}
                released = []
                for r in batch:
                    with self.cond:  # against drop() on a calling thread
                        r.registered = r.key in published
                        r.registering = False
                        if r.registered:
                            self._wanted.discard(r.key)
                    if self._alive(r):
                        r.state.finish()
                    elif r.registered:
                        # Released before the scheduler knew the key: release it again.
                        released.append(r.key)
                        self.records.pop(r.key, None)
                    else:
                        self._forget(r)
                # Straight onto the client's stream (this is the loop): route_scheduler holds
                # the client's other messages until this registration is done.
                if published:
                    self.send_to_scheduler(
                        {"op": "client-desires-keys", "keys": list(published), "client": client.id}
                    )
                if released:
                    self.send_to_scheduler(
                        {"op": "client-releases-keys", "keys": released, "client": client.id}
                    )
        finally:
            self._registering = False

    async def _drop_published(self, batch: list[OwnedResult], published: dict[str, int]) -> None:
        """Drop the ``published`` results of ``batch`` on their workers, directly (the
        client's call streams close with it); the workers tell the scheduler."""
        by_address: dict[str, list[str]] = {}
        for r in batch:
            if r.key in published:
                by_address.setdefault(r.address, []).append(r.key)

        async def drop(address: str, keys: list[str]) -> None:
            try:  # not the client's connection pool: it closed with the client
                async with rpc(address, connection_args=self.client.connection_args) as worker:
                    await getattr(worker, wire.Handler.FREE)(keys=keys, registered=True)
            except Exception as exc:  # noqa: BLE001 - the worker is closing too: they go with it
                logger.debug("dropping %d results on %s failed: %s", len(keys), address, exc)

        await asyncio.gather(*(drop(a, ks) for a, ks in by_address.items()))

    async def _publish(self, address: str, records: list[OwnedResult]) -> dict[str, int]:
        try:  # the results into the worker's Dask data: {key: bytes} of those it had
            return await getattr(self.client.rpc(address), wire.Handler.PUBLISH)(
                keys=[r.key for r in records]
            )
        except Exception as exc:  # noqa: BLE001 - the worker is gone: reading them says so
            logger.debug("publishing %d results on %s failed: %s", len(records), address, exc)
            return {}

    def drop(self, key: str) -> None:
        """A :class:`CallFuture` of ``key`` was released (any thread). The last reference to a
        result that came back (or failed) and that the scheduler was not told of is dropped here
        and then: an RL loop drops every step's futures, and a hop to the client's loop for
        each call's costs a wake-up of that thread, which then contends with the caller's
        next call for the GIL. Any other goes through the loop (:meth:`queue_drop`), as does
        this one when a lock it needs is taken: ``Future.__del__`` calls this wherever the
        garbage collector runs, also inside code that holds one of them (never wait there)."""
        if not self.cond.acquire(blocking=False):  # the loop settles and registers under it
            self.queue_drop(key)
            return
        try:
            rec = self.records.get(key)
            if (
                rec is None
                or rec.status not in (FINISHED, ERROR)
                or rec.registering
                or rec.registered
                or not self._alive(rec)
            ):
                rec = None
            elif not self.client._refcount_lock.acquire(blocking=False):
                rec = None
            else:
                client = self.client
                try:
                    left = client.refcount.get(key, 0) - 1
                    if left > 0:
                        client.refcount[key] = left
                        return
                    client.refcount.pop(key, None)
                finally:
                    client._refcount_lock.release()
                client.futures.pop(key, None)
                # No future of the key is left to see its state; it ends cancelled, as
                # Dask's release leaves it.
                rec.state.status = CANCELLED
                self._forget(rec)
        finally:
            self.cond.release()
        if rec is None:
            self.queue_drop(key)

    def queue_drop(self, key: str) -> None:
        """:meth:`drop_reference` of ``key`` on the client's loop (any thread). References
        dropped together (a call's per-rank futures, a gathered list) go in one callback:
        waking the loop from another thread costs a write to its self-pipe each time."""
        with self._drops_lock:
            self._drops.append(key)
            if len(self._drops) > 1:
                return  # a callback is due already
        try:
            self.client.loop.add_callback(self._drop_queued)
        except TypeError:  # pragma: no cover - shutting down: add_callback may be None
            pass

    def _drop_queued(self) -> None:
        with self._drops_lock:
            keys, self._drops = self._drops, []
        for key in keys:
            self.drop_reference(key)

    def drop_reference(self, key: str) -> None:
        """A :class:`CallFuture` of ``key`` was released (on the client's loop): Dask's
        ``Client._dec_ref``, without the scheduler message for a key it never knew."""
        client = self.client
        rec = self.records.get(key)
        if rec is None or rec.registered or rec.registering:
            client._dec_ref(key)
            return
        with client._refcount_lock:
            client.refcount[key] -= 1
            if client.refcount[key] > 0:
                return
            del client.refcount[key]
        state = client.futures.pop(key, None)
        if state is not None:
            state.cancel()  # OwnedState.cancel: the result is dropped on its worker

    async def _tell(self, address: str, handler: str, **kwargs: Any) -> None:
        try:
            await getattr(self.client.rpc(address), handler)(**kwargs)
        except Exception:  # noqa: BLE001 - the worker may be gone: nothing is held there then
            pass

    # ---- waiting and reading (calling threads) -------------------------------------

    def wait(self, records: Sequence[OwnedResult], timeout: float | None, *, every: bool = False) -> None:
        """Wait up to ``timeout`` seconds until one of ``records`` is no longer pending;
        ``every=True``: until none is pending, or one failed or was cancelled."""

        def ready() -> bool:
            if every:
                return all(r.status != PENDING for r in records) or any(
                    r.status in (ERROR, CANCELLED) for r in records
                )
            return any(r.status != PENDING for r in records)

        with self.cond:
            if ready():
                return
            waiter = (threading.Event(), ready)
            self._waiters.append(waiter)
        try:
            waiter[0].wait(timeout)
        finally:
            with self.cond:
                self._waiters.remove(waiter)

    async def fetch(self, keys: Sequence[str], streams: CallStreams) -> list:
        """The values of these finished results, each from its worker (a ``fetch`` message on
        ``streams``, the caller's loop's call streams), or their inline copies.

        Raises:
            WorkerLostError: a worker holding one cannot be reached.
            GroupBrokenError: one was released or its call failed meanwhile.
        """
        return list(await asyncio.gather(*(self._fetch_one(self.records.get(k), k, streams) for k in keys)))

    def fetch_inline(self, keys: Sequence[str]) -> list | None:
        """:meth:`fetch` without a loop when every one of these results came back with its
        reply (or failed): their values; ``None`` when one must be fetched from its worker.

        Raises:
            what :meth:`fetch` raises for a released or failed result.
        """
        with self.cond:  # two threads reading one future: one takes an inline copy
            records = [self.records.get(k) for k in keys]
            if any(r is not None and r.status != ERROR and r.inline is None for r in records):
                return None
            held = [self._held(rec, key) for rec, key in zip(records, keys)]
        if not all(h for h, _ in held):
            return None
        return [value for _, value in held]

    def _held(self, rec: OwnedResult | None, key: str) -> tuple[bool, Any]:
        """``(True, value)`` of a result that came back with its reply (its inline copy),
        ``(False, None)`` of one only its worker holds.

        Raises:
            the call's error (a copy); ``GroupBrokenError`` for a released result.
        """
        if rec is None:
            raise GroupBrokenError(f"the result {key!r} was released: keep its future until it is read")
        if rec.status == ERROR:
            # A copy: the stored error, raised, would hold this read's frames (and futures).
            try:
                error = copy.copy(rec.error)
            except Exception:  # noqa: BLE001 - an error class that does not rebuild from its args
                error = rec.error
            raise error
        packed = rec.inline
        if packed is None:
            return False, None
        if packed.buffers:
            # Its tensors would be the received buffers': taken once, so two reads of
            # the future never share memory (a later one fetches a copy of its own).
            rec.inline = None
        return True, serialization.loads(packed)

    async def _lost_reason(self, address: str, server_id: str) -> str | None:
        deadline = time.monotonic() + LOST_REASON_WAIT
        while True:
            reason = self.lost_reason(address, server_id)
            if reason or time.monotonic() >= deadline:
                return reason
            await asyncio.sleep(0.05)

    async def _fetch_one(self, rec: OwnedResult | None, key: str, streams: CallStreams) -> Any:
        held, value = self._held(rec, key)
        if held:
            return value
        call = rec.call
        message = wire.FetchMessage(key, call.session, call.seq, f"{call.group_name}.{call.method}").to_wire()
        try:
            reply, buffers = await streams.request(rec.address, call.worker_id, message, [])
        except (OSError, CommClosedError) as exc:
            # A dropped stream comes before the nanny's or the scheduler's word on why
            # (a signal, a restart for memory): give those a moment.
            reason = await self._lost_reason(rec.address, call.worker_id)
            raise WorkerLostError(
                call.rank,
                rec.address,
                f"{call.group_name}.{call.method} (rank {call.rank}) kept its result there "
                f"({reason or f'reading it failed: {exc}'})",
                call.group_name,
            ) from None
        answer = wire.Reply.from_wire(reply)
        if answer.status != "OK":
            raise pickle.loads(answer.error)
        # The buffers were received into memory of this process's own: used in place.
        return serialization.loads(serialization.Packed(answer.header, buffers))
