"""A ``DataProtoFuture`` as a Dask collection of its parts: :class:`DaskCollection`.

``__dask_graph__`` maps each part's key to its ``distributed.Future``, as a persisted Dask
collection's graph does, so Dask's own verbs act on the parts: ``client.cancel(fut)`` (and
``DataProtoFuture.cancel()``, :func:`cancel_futures`) cancel the producing calls,
``distributed.wait(fut)`` waits for them, ``dask.compute(fut)`` / ``client.compute(fut)``
give its value, put together by a Dask task on a worker (``__dask_postcompute__``, whose
function is ``_daskwg_task.finalize`` naming :func:`finalize`, so that the scheduler
imports neither daskwg nor torch). ``client.gather`` and ``as_completed`` take futures
only: they return a ``DataProtoFuture`` unchanged (or refuse it); ``fut.get()``,
``daskwg.get(fut)`` or ``fut.futures`` are what to give them.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

import cloudpickle
from distributed import Future
from distributed import wait as dask_wait

import _daskwg_task

__all__ = ["DaskCollection", "cancel_futures", "gather_parts", "finalize"]


class DaskCollection:
    """The Dask collection protocol of ``DataProtoFuture``, over its ``plan()`` parts and
    its ``_finish()`` (what ``get()`` applies to their values)."""

    def __dask_graph__(self) -> dict:
        """Each part's key -> its ``distributed.Future`` (what ``futures_of`` walks)."""
        return {part.key: part for part in self.plan()[1]}

    def __dask_keys__(self) -> list:
        return [part.key for part in self.plan()[1]]

    #: The graph is the parts' futures: there is nothing to optimize.
    __dask_optimize__ = None

    @property
    def __dask_scheduler__(self) -> Callable:
        """The client of the parts' ``get`` (Dask's default client wins where there is one)."""
        return self.plan()[1][0].client.get

    def __dask_tokenize__(self) -> tuple:
        return (type(self).__name__, tuple(self.__dask_keys__()), id(self))

    def __dask_postcompute__(self) -> tuple:
        """Dask's compute (``dask.compute``, ``client.compute``) of this future: the parts
        are waited for here, and registered with the scheduler (a task may only read keys
        the scheduler knows), then a Dask task applies what :meth:`get` applies to them.

        Raises:
            RankError, WorkerLostError: a producing call failed.
            CallCancelledError: a producing call was cancelled.
            ValueError: as :meth:`get`.
        """
        finish, parts = self._finish()
        _known_to_scheduler(parts)
        return _daskwg_task.finalize, (f"{__name__}:finalize", cloudpickle.dumps(finish))


#: Seconds :func:`cancel_futures` waits for the ranks' workers to answer.
CANCEL_WAIT = 10.0


def cancel_futures(futures: Sequence[Any], reason: Any = None, msg: Any = None, **kwargs: Any) -> None:
    """``client.cancel(futures)``, then wait (up to :data:`CANCEL_WAIT` seconds) until the
    workers of the group calls among them have answered: a call still queued there never
    runs once this returns, a running ``async def`` one has been interrupted. (``client.cancel``
    alone returns as soon as the request is on its way, as Dask's does.)"""
    by_client: dict[int, tuple[Any, list]] = {}
    for future in futures:
        by_client.setdefault(id(future.client), (future.client, []))[1].append(future)
    for client, mine in by_client.values():
        client.cancel(mine, reason=reason, msg=msg, **kwargs)
        # A group call's state keeps its daskwg_cancel request (daskwg.transport.call_future).
        told = [t for t in (getattr(f._state, "told", None) for f in mine) if t is not None]
        if told:
            client.sync(asyncio.wait, told, timeout=CANCEL_WAIT)


def _known_to_scheduler(parts: list) -> None:
    """Wait for ``parts`` through Dask's own wait, and have the driver register those that
    are results of non-blocking calls with the scheduler (``Owned.flush``); raise the error
    of one that failed or was cancelled."""
    for client in {id(p.client): p.client for p in parts}.values():
        mine = [p for p in parts if p.client is client]
        with client.as_current():
            try:
                dask_wait(mine)
            except CancelledError:
                pass  # raised below, with the part's own error
        for owned in {id(o): o for o in (getattr(p._state, "owned", None) for p in mine) if o}.values():
            client.sync(owned.flush, [p.key for p in mine])
    for part in parts:
        if part.status in ("error", "cancelled"):
            error = part._state.exception
            raise copy.copy(error) if error is not None else part.exception()


def finalize(parts: list, finish: bytes) -> Any:
    """The value of a computed ``DataProtoFuture``, in the Dask task that
    ``__dask_postcompute__`` names: ``finish`` (pickled) applied to the parts' values."""
    from ..serialization.pickling import Packed, loads

    # A part published on this very worker is still the packed result daskwg keeps.
    values = [loads(v) if isinstance(v, Packed) else v for v in parts]
    return cloudpickle.loads(finish)(values)


def gather_parts(futures: list) -> list:
    """The values of a ``DataProtoFuture``'s parts (its default ``gather``)."""
    # Each future's own result: a non-blocking call's comes straight from its worker
    # (daskwg's CallFuture), not through the scheduler as client.gather's would.
    futures = list(futures)

    async def one(future: Any) -> Any:
        if type(future) is Future:  # a plain Dask future: from the worker holding it too
            return (await future.client._gather([future], direct=True))[0]
        return await future._result()

    async def results() -> list:
        return list(await asyncio.gather(*map(one, futures)))

    return futures[0].client.sync(results)
