"""Streaming a stored result to a consumer, and relayed broadcasts: :class:`Relays`.

A result that several ranks of one call take whole (a future passed to a ``ONE_TO_ALL``
method, ``DataProtoFuture.concat([f])`` given to every rank: weights, a shared batch) is
relayed along a chain of its consumers, which the driver orders: the first fetches it from
the producing rank's worker, each next one from the previous consumer's worker
(:attr:`daskwg.wire.messages.ResultRef.via`), chunk by chunk as the bytes arrive there. So the
producer sends the value once whatever the number of consumers, and the chain's transfers
overlap: the last consumer has it about one transfer plus one chunk per hop after the first
started. A consumer whose next consumer never asks (its worker died, its call never came)
withdraws its copy after ``daskwg.relay-wait`` seconds, and that one fetches from the
producer instead; a consumer whose previous one fails does the same, from where it stopped.

Each consumer receives straight into buffers of its own (numpy allocations, which get huge
pages), and its rank uses them in place, without a copy, once its next consumer has them all
(:attr:`daskwg.wire.messages.ResultRef.relays`): nothing a rank does to its argument reaches another.

The ``daskwg_relay`` handler answers a request with one message (the value's pickle header
and buffer sizes), then writes the buffers' bytes raw on the connection's stream, which the
consumer reads into its buffers (on a comm without a byte stream, in-process ones, as chunk
messages). Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed.comm.core import CommClosedError
from distributed.core import Status
from distributed.protocol import to_serialize

from ..errors import WorkerLostError
from ..serialization import pickling as serialization
from ..wire.buffers import receive_buffer
from ..wire.messages import Handler, ResultRef
from .exceptions import picklable
from .results import ResultStore

__all__ = ["Relays"]

#: Bytes written or read at once: the relay's pipelining grain.
CHUNK = 4 << 20


class _Redirect(Exception):
    """The worker asked holds no copy to relay: fetch from the producer."""


@dataclass(eq=False)
class _Replica:
    """A result arriving here, served on to the next consumers as its bytes arrive."""

    header: bytes | None = None
    buffers: list[np.ndarray] | None = None
    received: int = 0  # bytes of the buffers (in order, as one stream) received so far
    error: BaseException | None = None
    withdrawn: bool = False
    started: int = 0  # consumers that asked for it here
    served: int = 0  # ... and that have all of it (or whose connection broke)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def wait_change(self, timeout: float | None = None) -> None:
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def _views(buffers: list) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]


def _raw_stream(comm: Any) -> Any:
    """The byte stream under a Dask TCP/TLS comm (``None`` for other comms)."""
    stream = getattr(comm, "stream", None)
    return stream if stream is not None and hasattr(stream, "read_into") else None


class Relays:
    """Fetches whole results for this worker's calls, and serves them on.

    Args:
        worker: the Dask worker.
        store: this worker's :class:`~daskwg.plugin.results.ResultStore`.
    """

    def __init__(self, worker: Any, store: ResultStore):
        self.worker = worker
        self.store = store
        self._replicas: dict[str, _Replica] = {}
        self._announced: dict[str, asyncio.Event] = {}

    def install(self) -> None:
        """Install the ``daskwg_relay`` handler."""
        self.worker.handlers[Handler.RELAY] = self._handle_relay

    # ---- consuming -----------------------------------------------------------------

    async def fetch(self, ref: ResultRef, relay_wait: float) -> Any:
        """The value of ``ref``, received into buffers of this worker's own; with
        ``ref.relays`` consumers served from here first.

        Raises:
            Exception: the producing call's error if it failed.
            WorkerLostError: neither ``ref.via`` nor the producer's worker can be reached.
        """
        replica = _Replica()
        if ref.relays:
            self._replicas[ref.key] = replica
            announced = self._announced.pop(ref.key, None)
            if announced is not None:
                announced.set()
        try:
            sources = [ref.via, ref.address] if ref.via else [ref.address]
            for i, source in enumerate(sources):
                try:
                    await self._pull(source, ref, replica, source == ref.via, relay_wait)
                    break
                except (_Redirect, OSError, CommClosedError) as exc:
                    if i == len(sources) - 1:
                        raise WorkerLostError(
                            ref.rank, source, f"fetching the result of {ref.source or ref.key} failed: {exc}"
                        ) from None
            if ref.relays:
                await self._wait_for_next(replica, ref.relays, relay_wait)
        except BaseException as exc:
            replica.error = exc
            replica.notify()
            raise
        finally:
            if self._replicas.get(ref.key) is replica:
                del self._replicas[ref.key]
        return pickle.loads(replica.header, buffers=replica.buffers)

    async def _pull(
        self, address: str, ref: ResultRef, replica: _Replica, relayed: bool, relay_wait: float
    ) -> None:
        pool = self.worker.rpc
        comm = await pool.connect(address)
        clean = False
        try:
            await comm.write(
                {
                    "op": Handler.RELAY,
                    "key": ref.key,
                    "session": ref.session,
                    "seq": ref.seq,
                    "source": ref.source,
                    "start": replica.received,
                    "relayed": relayed,
                    "relay_wait": relay_wait,
                    "reply": False,
                }
            )
            meta = await comm.read()
            if meta["status"] == "redirect":
                clean = True
                raise _Redirect(f"{address} holds no copy of {ref.key!r}")
            if meta["status"] != "OK":
                clean = True
                raise meta["exception"]
            if replica.buffers is None:
                replica.header = meta["header"]
                replica.buffers = [receive_buffer(n) for n in meta["sizes"]]
                replica.notify()
            await self._receive(comm, replica)
            clean = True
        finally:
            if clean:
                pool.reuse(address, comm)
            else:
                comm.abort()

    async def _receive(self, comm: Any, replica: _Replica) -> None:
        stream = _raw_stream(comm)
        position = 0
        for view in _views(replica.buffers):
            start, end = position, position + view.nbytes
            position = end
            offset = max(replica.received - start, 0)
            while start + offset < end:
                piece = view[offset : min(offset + CHUNK, view.nbytes)]
                if stream is not None:
                    await stream.read_into(piece)
                else:
                    piece[:] = (await comm.read())["chunk"]
                offset += piece.nbytes
                replica.received = start + offset
                replica.notify()

    async def _wait_for_next(self, replica: _Replica, relays: int, relay_wait: float) -> None:
        """Until the next consumers have all of it: then the rank may change its copy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + relay_wait
        while replica.served < relays:
            if replica.started < relays and loop.time() >= deadline:
                replica.withdrawn = True  # later askers fetch from the producer
                break
            await replica.wait_change(max(deadline - loop.time(), 0.01))
        while replica.served < replica.started:
            await replica.wait_change()

    # ---- serving -------------------------------------------------------------------

    async def _handle_relay(
        self,
        comm: Any,
        key: str,
        session: str,
        seq: int,
        source: str = "",
        start: int = 0,
        relayed: bool = False,
        relay_wait: float = 10.0,
    ) -> Any:
        """``daskwg_relay``: stream a result stored here (``relayed`` false) or arriving here
        for a call of this worker (``relayed``) to the asking consumer, from byte ``start``."""
        if relayed:
            replica = await self._replica(key, relay_wait)
            if replica is None or replica.withdrawn or replica.error is not None:
                await comm.write({"status": "redirect"})
                return Status.dont_reply
            replica.started += 1
            try:
                while replica.buffers is None and replica.error is None:
                    await replica.wait_change()
                if replica.error is not None:
                    await comm.write({"status": "redirect"})
                    return Status.dont_reply
                await comm.write(
                    {"status": "OK", "header": replica.header, "sizes": [b.nbytes for b in replica.buffers]}
                )
                await self._send(comm, _views(replica.buffers), start, replica)
            finally:
                replica.served += 1
                replica.notify()
            return Status.dont_reply
        try:
            value = await self.store.wait(ResultRef(key, self.worker.address, session, seq, source=source))
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            await comm.write({"status": "error", "exception": to_serialize(picklable(exc))})
            return Status.dont_reply
        packed = serialization.dumps(value)
        views = _views(packed.buffers)
        await comm.write({"status": "OK", "header": packed.header, "sizes": [v.nbytes for v in views]})
        await self._send(comm, views, start, None)
        return Status.dont_reply

    async def _replica(self, key: str, relay_wait: float) -> _Replica | None:
        """The replica of ``key`` here, waiting up to ``relay_wait`` s for its call to arrive."""
        replica = self._replicas.get(key)
        if replica is None:
            announced = self._announced.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(announced.wait(), relay_wait)
            except asyncio.TimeoutError:
                pass
            finally:
                if self._announced.get(key) is announced:
                    del self._announced[key]
            replica = self._replicas.get(key)
        return replica

    async def _send(self, comm: Any, views: list[memoryview], start: int, replica: _Replica | None) -> None:
        stream = _raw_stream(comm)
        position = 0
        for view in views:
            begin, end = position, position + view.nbytes
            position = end
            offset = max(start - begin, 0)
            while begin + offset < end:
                stop = min(offset + CHUNK, view.nbytes)
                while replica is not None and replica.received < begin + stop:
                    if replica.error is not None:
                        raise CommClosedError("the relayed value failed to arrive")
                    await replica.wait_change()
                piece = view[offset:stop]
                if stream is not None:
                    await stream.write(piece)
                else:
                    await comm.write({"chunk": bytes(piece)})
                offset = stop
