"""Dask's own verbs on the results of non-blocking calls at ``daskwg.get``'s cost:
:func:`route_gather` and :func:`route_scheduler`.

Dask's ``Client.gather`` waits for each future's key through the scheduler, then asks the
scheduler for the values (or where they are): for the results of non-blocking calls, which
the driver knows where to find and may hold already (small ones come back with their
replies), that made the driver register them with the scheduler first and cost three round
trips instead of none. Dask offers no hook for it: the driver's client gets its own
``_gather`` (what ``client.gather``, ``Future.result`` and Dask's other gathers call), which
reads a set of futures that are all such results as ``daskwg.get`` reads them, and hands
anything else to Dask's own.

``distributed.wait``, ``as_completed`` and ``add_done_callback`` wait on each future's
state (``OwnedState.wait``), which ends with the call's reply; they used to wait for the
key's registration with the scheduler too (a round trip to each worker and one to the
scheduler, and a release message per key once dropped). The registration is deferred
instead (``Owned.demand``), and what could tell the difference is put behind it
(:func:`route_scheduler`): the client's requests to the scheduler (``client.scheduler``:
``who_has``, ``nbytes``, ``has_what``, Dask's own gather, ``run_on_scheduler``) and its
messages on its stream to it (a graph naming the future, ``update-graph``) wait until the
results waited for so far are registered. So for this client the scheduler knows a key
waited for through Dask whenever it asks, as before; one that is read and dropped before
the client next talks to the scheduler (the RL loop's) never costs the scheduler anything.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from concurrent.futures import CancelledError
from typing import Any

from distributed.utils_comm import pack_data, unpack_remotedata

__all__ = ["route_gather", "route_scheduler"]


def route_gather(owned: Any) -> None:
    """Route ``owned.client``'s gathers of ``owned``'s futures (a
    :class:`~daskwg.transport.owned.Owned`) through it.

    The replacement reads futures that are all results of ``owned``'s calls: it waits for
    their replies, raises the first failed or cancelled one's error (as Dask's gather
    does), and fetches the values (``Owned.fetch``: from the replies, or each from its
    worker), never through the scheduler. Anything else (other futures among them,
    ``errors="skip"``) goes to Dask's own gather, the client class's method: a second
    ``Owned`` of the same client replaces the route, never chains it.
    """
    client = owned.client
    dask_gather = type(client)._gather.__get__(client)

    async def gather(
        futures: Any, errors: str = "raise", direct: Any = None, local_worker: Any = None
    ) -> Any:
        if errors == "raise":
            unpacked, found = unpack_remotedata(futures, byte_keys=True)
            found = list(found)
            # Their states are owned's (OwnedState), also once a cancelled one's record is gone.
            if found and all(f.client is client and getattr(f._state, "owned", None) is owned for f in found):
                return pack_data(unpacked, await _gather_owned(owned, found))
        return await dask_gather(futures, errors=errors, direct=direct, local_worker=local_worker)

    client._gather = gather


async def _gather_owned(owned: Any, futures: list) -> dict[str, Any]:
    await asyncio.gather(*(f._state.settled() for f in futures))
    for f in futures:
        state = f._state
        if state.status in ("error", "cancelled"):
            # A copy: the stored error, raised, would hold this gather's frames (and futures).
            raise copy.copy(state.exception) if state.exception is not None else CancelledError(f.key)
    keys = [f.key for f in futures]
    return dict(zip(keys, await owned.fetch(keys, owned.streams)))


def route_scheduler(owned: Any) -> None:
    """Put ``owned.client``'s traffic to the scheduler behind ``owned``'s due registrations
    (``Owned.flush``): its requests (``client.scheduler``) and the messages of its stream
    (``Client._send_to_scheduler_safe``, which Dask's ``_send_to_scheduler`` runs on the
    loop) wait while ``Owned.must_flush()`` says so, in their order. A ``close-client``
    message, and any message once the client is no longer running, goes at once, after
    those held. A second ``Owned`` of the same client replaces the route, never chains it.
    """
    client = owned.client
    send_now = type(client)._send_to_scheduler_safe.__get__(client)
    held: list[dict] = []

    async def release() -> None:
        while held:
            await owned.flush()
            batch = held[:]
            del held[:]
            for msg in batch:
                send_now(msg)

    def send(msg: dict) -> None:
        if client.status != "running" or msg.get("op") == "close-client":
            while held:
                send_now(held.pop(0))
            send_now(msg)
        elif held or owned.must_flush():
            held.append(msg)
            if len(held) == 1:
                asyncio.ensure_future(release())
        else:
            send_now(msg)

    client._send_to_scheduler_safe = send
    scheduler = client.scheduler
    if scheduler is not None:
        if isinstance(scheduler, AfterRegistrations):
            scheduler = scheduler.rpc
        client.scheduler = AfterRegistrations(scheduler, owned)


class AfterRegistrations:
    """The client's ``scheduler`` (a ``distributed.core.PooledRPCCall``), whose requests
    wait for ``owned``'s due registrations (``Owned.flush``) before they go.

    Args:
        rpc: the client's own ``scheduler``.
        owned: the driver's ``daskwg.transport.owned.Owned``.
    """

    def __init__(self, rpc: Any, owned: Any):
        self.rpc = rpc
        self.owned = owned

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.rpc, name)
        if name.startswith("_") or not inspect.iscoroutinefunction(attr):
            return attr  # address, addr, ...
        owned = self.owned

        async def request(*args: Any, **kwargs: Any) -> Any:
            if owned.must_flush():
                await owned.flush()
            return await attr(*args, **kwargs)

        return request

    def __repr__(self) -> str:
        return f"<AfterRegistrations of {self.rpc!r}>"
