"""The Dask future of a result the driver owns on a worker: :class:`CallFuture` (and its
key's state, :class:`OwnedState`); what the driver knows of the result is in
:class:`daskwg.transport.owned.Owned`, which makes them (see that module for how Dask sees
these futures).
"""

from __future__ import annotations

import asyncio
from typing import Any

from distributed import Future
from distributed.client import FutureState

__all__ = ["CallFuture", "OwnedState"]


class OwnedState(FutureState):
    """The Dask state of a :class:`CallFuture`'s key: ``finished`` with the call's reply
    (its Dask event waits for the scheduler to know the key, which waiting on it asks
    for), and it tells :class:`Owned` when Dask cancels it (``future.cancel()``,
    ``client.cancel``, a restart) or releases it (the last future of the key was dropped)."""

    __slots__ = ("owned", "_settled")

    #: the driver's ``daskwg.transport.owned.Owned``, which made it.
    owned: Any

    def __init__(self, key: str, owned: Any):
        super().__init__(key)
        self.owned = owned
        self._settled = asyncio.Event()

    def done(self) -> bool:
        return self.status != "pending"

    async def wait(self, timeout: float | None = None) -> None:
        # Dask waits for it (wait, as_completed, gather): the scheduler must know it first.
        self.owned.demand(self.key)
        await super().wait(timeout)

    async def settled(self) -> None:
        """Until the call's reply came (no registration needed)."""
        await self._settled.wait()

    def cancel(self, reason: Any = None, msg: Any = None) -> None:
        super().cancel(reason, msg)
        self._settled.set()
        # Dask's _release_key calls this once the key's reference count is gone; any other
        # caller (Client._cancel, the scheduler's cancelled-keys) leaves it in place.
        self.owned.on_cancel(self.key, released=self.key not in self.owned.client.refcount)


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

    def result(self, timeout: float | None = None) -> Any:
        """Dask's ``Future.result``: wait for the value and return it (raise the call's
        error). A result that came back with its reply is read here, without a hop to the
        client's loop and back (``Owned.fetch_inline``)."""
        state = self._state
        if isinstance(state, OwnedState) and state.status == "finished" and self.key in state.owned.records:
            values = state.owned.fetch_inline([self.key])
            if values is not None:
                return values[0]
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
