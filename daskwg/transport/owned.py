"""Results the driver owns on the workers: the futures of non-blocking calls.

A non-blocking call's result stays on its rank's worker under a key the driver owns
(``daskwg.plugin.results``); the driver holds a :class:`CallFuture`, a
``distributed.Future`` of that key, and :class:`Owned` keeps what it knows of each one
(:class:`OwnedResult`): the call, where the result is, its size, the result itself when it
was small enough to come back with the reply (as Ray returns small objects inline to their
owner), or the error the call raised.

Dask sees these futures as its own:

* once a result exists, the driver registers its key with the scheduler
  (``update_data``, as ``client.scatter`` does: the scheduler learns where the result is and
  its size, and never holds its bytes); from then on the future is ``finished`` for
  ``distributed.wait``, ``as_completed``, ``client.gather`` and ``future.done()``, it shows on
  the dashboard's memory views, and dropping it releases the result through Dask's own
  reference counting. daskwg's own waits (:meth:`Owned.wait`: group calls, ``daskwg.get``,
  ``DataProtoFuture.get()``) do not wait for that: they finish with the call's reply;
* a failed call's future is ``error`` with the call's ``RankError`` at once;
* ``future.cancel()`` reaches the rank (a queued call is skipped, an ``async def`` one
  interrupted, as on the task path), and a future dropped before its result exists has the
  result dropped on its worker when it comes.

Values come straight from the worker holding them (``daskwg_fetch``), never through the
scheduler: :meth:`Owned.values` (and :meth:`CallFuture.result`).

Threads: the calling threads create futures and wait; the client's event loop handles the
replies, registrations, cancellations and releases. :class:`OwnedResult` fields change only
on the loop; waiters read them under :attr:`Owned.cond`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client, Future
from distributed.client import FutureState
from distributed.comm.core import CommClosedError

from .. import serialization
from ..errors import GroupBrokenError, WorkerLostError
from ..wire import Call

__all__ = ["CallFuture", "Owned", "OwnedResult", "OwnedState"]

logger = logging.getLogger(__name__)

PENDING, FINISHED, ERROR, CANCELLED = "pending", "finished", "error", "cancelled"


@dataclass(eq=False)
class OwnedResult:
    """What the driver knows of one non-blocking call's result.

    Attributes:
        key: its key.
        call: the call.
        address: the worker holding it.
        status: ``"pending"``, ``"finished"``, ``"error"`` or ``"cancelled"``.
        nbytes: its size once finished.
        inline: the result itself, as a message part, when it came back with the reply
            (one with tensors is taken by the first read).
        error: the call's error.
        pinned: futures the call reads (its ``DataProtoFuture`` and future arguments), kept
            alive until it ends even if the program drops them.
        registering, registered: where its registration with the scheduler is.
    """

    key: str
    call: Call
    address: str
    state: OwnedState
    status: str = PENDING
    nbytes: int | None = None
    inline: dict | None = None
    error: BaseException | None = None
    pinned: tuple = ()
    registering: bool = False
    registered: bool = False


class OwnedState(FutureState):
    """The Dask state of a :class:`CallFuture`'s key, which tells :class:`Owned` when Dask
    cancels it (``future.cancel()``, ``client.cancel``, a restart) or releases it (the last
    future of the key was dropped)."""

    __slots__ = ("owned",)

    def __init__(self, key: str, owned: Owned):
        super().__init__(key)
        self.owned = owned

    def cancel(self, reason: Any = None, msg: Any = None) -> None:
        super().cancel(reason, msg)
        # Dask's _release_key calls this once the key's reference count is gone; any other
        # caller (Client._cancel, the scheduler's cancelled-keys) leaves it in place.
        self.owned.on_cancel(self.key, released=self.key not in self.owned.client.refcount)


class CallFuture(Future):
    """A ``distributed.Future`` of a non-blocking call's result, which stays on its rank's
    worker. Everything a Dask future does works on it; :meth:`result` fetches the value from
    that worker directly, never through the scheduler."""

    async def _result(self, raiseit: bool = True) -> Any:
        await self._state.wait()
        owned = getattr(self._state, "owned", None)
        if self.status != "finished" or owned is None:
            return await super()._result(raiseit)
        return (await owned.fetch([self.key], self.client.rpc))[0]


class Owned:
    """The non-blocking calls' results of one driver (one ``Client``).

    Args:
        client: the driver's client.
    """

    def __init__(self, client: Client):
        self.client = client
        self.records: dict[str, OwnedResult] = {}
        #: notified (from the client's loop) whenever a result finishes, fails or is cancelled.
        self.cond = threading.Condition()
        self._to_register: list[OwnedResult] = []
        self._registering = False

    # ---- creating (calling thread) ---------------------------------------------------

    def create(self, call: Call, key: str, address: str, pinned: Sequence[Any] = ()) -> CallFuture:
        """The future of ``call``'s result, which will be kept under ``key`` at ``address``."""
        state = OwnedState(key, self)
        self.records[key] = OwnedResult(key, call, address, state, pinned=tuple(pinned))
        # Future binds to the key's state in client.futures when there is one.
        self.client.futures[key] = state
        return CallFuture(key, self.client)

    def record(self, future: Any) -> OwnedResult | None:
        """The record of one of these futures (``None`` for any other future)."""
        state = getattr(future, "_state", None)
        if not isinstance(state, OwnedState) or state.owned is not self:
            return None
        return self.records.get(future.key)

    # ---- settling (the client's loop) ------------------------------------------------

    def finished(self, key: str, nbytes: int, inline: dict | None = None) -> None:
        """The call of ``key`` returned; its result (``nbytes``) is on its worker, and
        ``inline`` is the result itself as a message part when it came with the reply."""
        rec = self.records.get(key)
        if rec is None or rec.status != PENDING:
            if rec is not None:
                self._forget(rec)  # cancelled meanwhile: the result is nobody's
            return
        self._settle(rec, FINISHED, nbytes=nbytes, inline=inline)
        if self._alive(rec):
            rec.registering = True
            self._to_register.append(rec)
            if not self._registering:
                self._registering = True
                asyncio.ensure_future(self._register())
        else:
            self._forget(rec)

    def failed(self, key: str, error: BaseException) -> None:
        """The call of ``key`` failed with ``error`` (a daskwg error)."""
        rec = self.records.get(key)
        if rec is None or rec.status != PENDING:
            if rec is not None and rec.status == CANCELLED:
                self._forget(rec)
            return
        self._settle(rec, ERROR, error=error)
        if self._alive(rec):
            rec.state.set_error(error, None)
        else:
            self._forget(rec)

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

    def _alive(self, rec: OwnedResult) -> bool:
        """Whether the program still holds the future (its state is still the key's)."""
        return self.client.futures.get(rec.key) is rec.state

    def on_cancel(self, key: str, released: bool) -> None:
        """Dask cancelled or released ``key``'s state (any thread)."""
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
                asyncio.ensure_future(
                    self._tell(rec.address, "daskwg_cancel", session=rec.call.session, seqs=[rec.call.seq])
                )
            return  # settled by the reply: the result is dropped where it is
        if not rec.registering:
            self._forget(rec)

    def _forget(self, rec: OwnedResult) -> None:
        """The program let go of ``rec``: drop its result on the worker unless Dask releases it."""
        if self.records.get(rec.key) is rec:
            del self.records[rec.key]
        if not rec.registered:
            asyncio.ensure_future(self._tell(rec.address, "daskwg_free", keys=[rec.key]))

    async def _register(self) -> None:
        """Tell the scheduler where finished results are (a batch per round trip)."""
        client = self.client
        try:
            while self._to_register:
                batch, self._to_register = self._to_register, []
                try:
                    await client.scheduler.update_data(
                        who_has={r.key: [r.address] for r in batch},
                        nbytes={r.key: r.nbytes for r in batch},
                        client=client.id,
                    )
                except Exception as exc:  # noqa: BLE001 - e.g. a worker the scheduler removed
                    logger.debug("registering %d results with the scheduler failed: %s", len(batch), exc)
                    for r in batch:
                        r.registering = False
                        if self._alive(r):
                            r.state.finish()
                        else:
                            self._forget(r)
                    continue
                released = []
                for r in batch:
                    r.registering, r.registered = False, True
                    if self._alive(r):
                        r.state.finish()
                    else:
                        # Released before the scheduler knew the key: release it again.
                        released.append(r.key)
                        self.records.pop(r.key, None)
                if released and client.status == "running":
                    client._send_to_scheduler(
                        {"op": "client-releases-keys", "keys": released, "client": client.id}
                    )
        finally:
            self._registering = False

    async def _tell(self, address: str, handler: str, **kwargs: Any) -> None:
        try:
            await getattr(self.client.rpc(address), handler)(**kwargs)
        except Exception:  # noqa: BLE001 - the worker may be gone: nothing is held there then
            pass

    # ---- waiting and reading (calling threads) -------------------------------------

    def wait(self, records: Sequence[OwnedResult], timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds until one of ``records`` is no longer pending."""
        with self.cond:
            self.cond.wait_for(lambda: any(r.status != PENDING for r in records), timeout)

    async def fetch(self, keys: Sequence[str], rpc: Any) -> list:
        """The values of these finished results, each from its worker (``rpc``: the caller's
        loop's ``address -> rpc``), or their inline copies.

        Raises:
            WorkerLostError: a worker holding one cannot be reached.
            GroupBrokenError: one was released or its call failed meanwhile.
        """
        return list(await asyncio.gather(*(self._fetch_one(self.records.get(k), k, rpc) for k in keys)))

    async def _fetch_one(self, rec: OwnedResult | None, key: str, rpc: Any) -> Any:
        if rec is None:
            raise GroupBrokenError(f"the result {key!r} was released: keep its future until it is read")
        if rec.status == ERROR:
            raise rec.error
        part = rec.inline
        if part is not None:
            if "pickled" not in part:
                # Its tensors would be the received buffer's: taken once, so two reads of
                # the future never share memory (a later one fetches a copy of its own).
                rec.inline = None
            return serialization.unpack(part)
        call = rec.call
        try:
            response = await rpc(rec.address).daskwg_fetch(
                key=key, session=call.session, seq=call.seq, source=f"{call.group_name}.{call.method}"
            )
        except (OSError, CommClosedError) as exc:
            raise WorkerLostError(
                call.rank, rec.address, f"reading the result of {call.method!r}: {exc}"
            ) from None
        if response["status"] != "OK":
            raise response["exception"]
        return response["data"]
