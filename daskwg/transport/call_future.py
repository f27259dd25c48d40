"""The Dask future of a result the driver owns on a worker: :class:`CallFuture` (and its
key's state, :class:`OwnedState`); what the driver knows of the result is in
:class:`daskwg.transport.owned.Owned`, which makes them (see that module for how Dask sees
these futures).
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from distributed import Future
from distributed import wait as dask_wait
from distributed.client import FutureCancelledError, FutureState

from ..errors import CallCancelledError
from ..futures.future import cancel_futures

__all__ = ["CallFuture", "OwnedState", "CancelledCall"]

#: Seconds a future named in a Dask graph keeps asking for its key's registration.
REGISTER_RETRY_S = 10.0


class CancelledCall(CallCancelledError, FutureCancelledError):
    """The error of a cancelled call's future: daskwg's :class:`~daskwg.CallCancelledError`,
    and Dask's ``FutureCancelledError``, which Dask's own verbs (``distributed.wait``,
    ``as_completed``, ``client.gather``) expect of every cancelled future."""

    def __init__(
        self, method: str, rank: int = -1, key: str | None = None, reason: str | None = None, msg: Any = None
    ):
        self.method, self.rank, self.key, self.reason, self.msg = method, rank, key, reason, msg
        Exception.__init__(self, method, rank, key, reason)  # FutureCancelledError's takes other arguments

    __str__ = CallCancelledError.__str__

    def __reduce__(self):
        return (type(self), (self.method, self.rank, self.key, self.reason, self.msg))


class OwnedState(FutureState):
    """The Dask state of a :class:`CallFuture`'s key: ``finished`` with the call's reply
    (waiting on it through Dask asks for the key's registration with the scheduler before
    the client next talks to it; its Dask event is set once registered), and it tells
    :class:`Owned` when Dask cancels it (``future.cancel()``, ``client.cancel``, a restart)
    or releases it (the last future of the key was dropped)."""

    __slots__ = ("owned", "_settled", "told")

    #: the driver's ``daskwg.transport.owned.Owned``, which made it.
    owned: Any

    def __init__(self, key: str, owned: Any):
        super().__init__(key)
        self.owned = owned
        self._settled = asyncio.Event()
        #: the ``daskwg_cancel`` request to the rank's worker once the call was cancelled.
        self.told: asyncio.Future | None = None

    def done(self) -> bool:
        return self.status != "pending"

    async def wait(self, timeout: float | None = None) -> None:
        # Dask waits for it (wait, as_completed, add_done_callback, Dask's gather): until the
        # call's reply, as daskwg.get; the scheduler learns of the key before this client
        # next talks to it (Owned.demand, daskwg.transport.gather.route_scheduler).
        self.owned.demand(self.key)
        await asyncio.wait_for(self._settled.wait(), timeout)

    async def settled(self) -> None:
        """Until the call's reply came (no registration needed)."""
        await self._settled.wait()

    def cancel(self, reason: Any = None, msg: Any = None) -> None:
        client = self.owned.client
        # Dask's _release_key calls this once the key's reference count is gone; any other
        # caller (Client._cancel, the scheduler's cancelled-keys) leaves it in place.
        released = self.key not in client.refcount
        # Client._cancel (client.cancel, Future.cancel, DataProtoFuture.cancel) takes the
        # state out of client.futures first; a restart or the scheduler's cancelled-keys
        # cancel it in place, and a release after the last reference went.
        by_user = not released and client.futures.get(self.key) is not self
        super().cancel(reason, msg)
        if by_user:
            rec = self.owned.records.get(self.key)
            method, rank = (rec.call.method, rec.call.rank) if rec is not None else ("?", -1)
            self.exception = CancelledCall(method, rank, self.key, reason, msg)
        self._settled.set()
        self.owned.on_cancel(self.key, released=released)


class CallFuture(Future):
    """A ``distributed.Future`` of a non-blocking call's result, which stays on its rank's
    worker. Everything a Dask future does works on it; :meth:`result` fetches the value from
    that worker directly, never through the scheduler."""

    def release(self) -> None:
        """Drop this reference (Dask's ``Future.release``, which ``__del__`` calls). The last
        one of a result the scheduler never heard of is released in the driver alone:
        telling the scheduler, as Dask does, would cost it one message per rank per call
        for keys it does not know."""
        state = self._state
        if not isinstance(state, OwnedState):
            super().release()
            return
        self._verify_initialized()
        if not self._cleared and self.client.generation == self._generation:
            self._cleared = True
            state.owned.drop(self.key)

    def __dask_tokenize__(self) -> tuple:
        """Dask's token of the future, once the scheduler knows its key.

        A Dask graph that names this future (``client.submit(f, future)``, ``client.map``,
        ``dask.delayed``) tokenizes its arguments on the calling thread before the graph goes
        to the scheduler, which cancels a task whose dependency it does not know ("lost
        dependencies"). A result the scheduler has not been told of yet (see
        ``daskwg.transport.owned``) is registered first, so this waits for the call to
        finish, as ``distributed.wait`` would. Not where Dask does not tokenize
        (``client.submit(..., pure=False)``) nor on the client's own event loop (an
        asynchronous client): there, ``distributed.wait(future)`` before naming it in a graph.
        """
        self._known_to_scheduler()
        return super().__dask_tokenize__()

    def __reduce__(self) -> tuple:
        """Dask's ``Future.__reduce__`` (a graph pickled with the future in it), once the
        scheduler knows the key, as :meth:`__dask_tokenize__` says."""
        self._known_to_scheduler()
        return super().__reduce__()

    def _known_to_scheduler(self) -> None:
        state = self._state
        if not isinstance(state, OwnedState) or state.owned.on_loop():
            return
        owned = state.owned
        if not owned.unknown_to_scheduler(self.key):
            return
        dask_wait([self])
        # Registered now (Owned.flush). One that failed (a worker or the scheduler busy, a
        # comm error) leaves the future finished but unknown to the scheduler: ask again,
        # for a bounded time.
        end = time.monotonic() + REGISTER_RETRY_S
        while self.status == "finished" and owned.unknown_to_scheduler(self.key):
            self.client.sync(owned.flush, [self.key])
            if not owned.unknown_to_scheduler(self.key) or time.monotonic() >= end:
                break
            time.sleep(0.05)

    def cancel(self, reason: Any = None, msg: Any = None, **kwargs: Any) -> None:
        """Dask's ``Future.cancel``, returning once the rank's worker has taken the call off
        its queue (it then never runs) or interrupted it (:func:`~daskwg.futures.future.cancel_futures`)."""
        cancel_futures([self], reason=reason, msg=msg, **kwargs)

    def result(self, timeout: float | None = None) -> Any:
        """Dask's ``Future.result``: wait for the value and return it (raise the call's
        error). A result that came back with its reply is read here, without a hop to the
        client's loop and back (``Owned.fetch_inline``)."""
        state = self._state
        if isinstance(state, OwnedState):
            if state.status == "finished" and self.key in state.owned.records:
                values = state.owned.fetch_inline([self.key])
                if values is not None:
                    return values[0]
            elif isinstance(state.exception, CallCancelledError):
                raise copy.copy(state.exception)  # at once; a copy keeps no frames of this read
        return super().result(timeout)

    def batch_rows(self) -> int | None:
        """Rows of the batch this result is, once its call replied with them (the part's
        ``PartInfo``); ``None`` while it runs, or for a result that is no batch. What
        ``DataProtoFuture.known_rows`` asks its parts, so that a call given batches of
        different lengths is refused in the driver."""
        state = self._state
        if not isinstance(state, OwnedState):
            return None
        rec = state.owned.records.get(self.key)
        info = getattr(rec, "info", None) if rec is not None and rec.status == "finished" else None
        return None if info is None else info.rows

    async def _result(self, raiseit: bool = True) -> Any:
        state = self._state
        if isinstance(state, OwnedState):
            await state.settled()
            if state.status == "finished" and self.key in state.owned.records:
                return (await state.owned.fetch([self.key], state.owned.streams))[0]
        return await super()._result(raiseit)
