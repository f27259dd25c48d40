"""``client.gather`` of the results of non-blocking calls at ``daskwg.get``'s cost:
:func:`route_gather`.

Dask's ``Client.gather`` waits for each future's key through the scheduler, then asks the
scheduler for the values (or where they are): for the results of non-blocking calls, which
the driver knows where to find and may hold already (small ones come back with their
replies), that made the driver register them with the scheduler first and cost three round
trips instead of none. Dask offers no hook for it: the driver's client gets its own
``_gather`` (what ``client.gather``, ``Future.result`` and Dask's other gathers call), which
reads a set of futures that are all such results as ``daskwg.get`` reads them, and hands
anything else to Dask's own.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import CancelledError
from typing import Any

from distributed.utils_comm import pack_data, unpack_remotedata

__all__ = ["route_gather"]


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
