"""Dropping results on their workers: :class:`Frees`.

A non-blocking call's result stays on its worker until the driver lets go of it
(``daskwg.transport.owned``); then its worker is told to drop it, with a ``("free", 0, keys)``
message on the driver's call stream to that worker. The keys dropped meanwhile go in one
message per worker, and that message rides with the next call written to the worker (a lead
of that write, :attr:`CallStreams.lead <daskwg.transport.streams.CallStreams.lead>`) when one
comes first: one write, and one wake-up of the worker, for both.

Threads: :meth:`Frees.free` from any thread; the timed flushes run on the client's loop.
"""

from __future__ import annotations

import asyncio
import threading

from distributed import Client

from ..wire.messages import FreeMessage
from .streams import CallStreams

__all__ = ["FREE_DELAY", "SMALL_FREE_DELAY", "SMALL_RESULT", "Frees"]

#: Seconds results dropped by the driver wait before their workers are told, so that the
#: results of several calls go in one message per worker (as Dask batches its releases):
#: a tight loop of small calls would otherwise send one more message per rank per call.
#: Meanwhile the next call written to that worker carries them (:meth:`Frees.free`).
FREE_DELAY = 0.01
#: ... for results of at most ``SMALL_RESULT`` bytes, which cost little to keep a while
#: longer: long enough that a loop of steps of small calls (an RL step on tiny data takes
#: some 10-30 ms here) frees them with its next step's calls, not with messages of their own.
SMALL_FREE_DELAY = 0.05
SMALL_RESULT = 2**20


class Frees:
    """The results one driver dropped, by worker process, until their workers are told.

    Args:
        client: the driver's client (its loop runs the timed flushes).
        streams: its call streams on the client's loop; their ``lead`` becomes :meth:`take`.
    """

    def __init__(self, client: Client, streams: CallStreams):
        self.client = client
        self.streams = streams
        self._frees: dict[tuple[str, str | None], list[str]] = {}
        # Reentrant: Future.__del__ (Owned.drop, then free) may run inside it, at an allocation.
        self._lock = threading.RLock()
        self._urgent: set[tuple[str, str | None]] = set()  # with a large one among them
        self._timed: set[tuple[str, str | None]] = set()  # with a flush due
        # The frees waiting for a worker go with the next call written to it, if one
        # comes first: one write, and one wake-up of the worker, for both.
        streams.lead = self.take

    def free(self, address: str, server_id: str | None, key: str, nbytes: int | None = None) -> None:
        """Drop the result ``key`` (``nbytes``: its size, ``None`` if unknown) on its worker:
        with the next call written to that worker on the client's loop, or after
        ``FREE_DELAY`` seconds (``SMALL_FREE_DELAY`` if all dropped meanwhile are small),
        with the others dropped meanwhile (any thread: a blocking replay settles its
        results on its own loop)."""
        target = (address, server_id)
        large = nbytes is None or nbytes > SMALL_RESULT
        with self._lock:
            keys = self._frees.setdefault(target, [])
            keys.append(key)
            if large and target not in self._urgent:
                self._urgent.add(target)
                delay = FREE_DELAY
            elif target not in self._timed:
                # One flush due per worker at a time: the calls written to it meanwhile
                # take the keys (as their lead), and the flush sends what is left, if any.
                delay = SMALL_FREE_DELAY
            else:
                return  # a flush is due already
            self._timed.add(target)
        loop = self.client.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # a calling thread outside any loop
            here = None
        if here is not None and getattr(loop, "asyncio_loop", None) is here:
            self._flush_later(target, delay)
        else:
            loop.add_callback(self._flush_later, target, delay)

    def _flush_later(self, target: tuple[str, str | None], delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self._flush_due, target)

    def _flush_due(self, target: tuple[str, str | None]) -> None:
        with self._lock:
            self._timed.discard(target)
        message = self.take(target)
        if message is not None:  # else a call took them first
            asyncio.ensure_future(self._post(target, message))

    def take(self, target: tuple[str, str | None]) -> tuple | None:
        with self._lock:
            keys = self._frees.pop(target, None)
            self._urgent.discard(target)
        return FreeMessage(keys).to_wire() if keys else None

    async def _post(self, target: tuple[str, str | None], message: tuple) -> None:
        try:
            await self.streams.post(target[0], target[1], message)
        except OSError:
            pass  # the worker is gone, and its results with it
