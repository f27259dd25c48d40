"""Whole results read by ranks on the producer's host through shared memory: :class:`SharedResults`.

A result that ranks on other workers of the same host take whole (weights given to every
rollout rank, a shared batch) need not cross a socket at all. The producer's worker writes
its bytes once into an anonymous shared-memory file (``memfd_create(2)``), the first time a
consumer asks (``daskwg_shared``), and answers every consumer with where that file is (its
process id and descriptor) and the value's pickle header; each consumer opens the file
through ``/proc/<pid>/fd/<fd>``, maps it copy-on-write (``MAP_PRIVATE``) and builds the
value over the mapping. So the producer copies the value once whatever the number of
consumers, sends nothing but the header, and a consumer's in-place changes stay its own
(the kernel copies the pages it writes). Ray's object store gives its actors the same
route (one copy in shared memory, mapped by every reader on the host).

Files are reused, as receive buffers are (``daskwg.wire.buffers``): an RL job shares weights of
one size every step, and writing into pages already allocated costs a fraction of
allocating fresh ones. A consumer holds a shared ``flock(2)`` on the file for as long as
anything it built over the mapping lives; the producer rewrites a file only when it can take
the lock exclusively (no consumer maps it any more), and a generation number in the file's
first page lets a consumer that comes late tell a rewritten file from its own. When the
driver lets go of a result (:meth:`SharedResults.release`, from
:meth:`daskwg.plugin.results.ResultStore.free`) its file waits for the next result of about
its size; at most ``daskwg.buffer-pool`` bytes of files no consumer maps are kept (the
oldest beyond are closed), and 16 files in all.

A value under ``SMALLEST`` bytes is answered inline (as ``daskwg_fetch`` would), and a
consumer that cannot open, lock or map the file (another PID namespace, ``/proc`` hidden, no
``memfd_create``) falls back to fetching it over the comm. The driver asks for this route
only between workers whose addresses name the same host, and only with
``daskwg.shared-memory`` on (:func:`daskwg.transport.arguments.plan_relays`).

Threads: the handlers run on the worker's event loop; the copy into the file runs in a
thread of the loop's default executor.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

from distributed.protocol import to_serialize

from ..serialization import pickling as serialization
from ..wire.buffers import pool_limit
from ..wire.memfiles import File, available, create, layout, open_mapping, write
from ..wire.messages import Handler, ResultRef
from .exceptions import picklable
from .results import ResultStore
from .rows import part_released

__all__ = ["SharedResults", "SMALLEST", "available", "attach"]

logger = logging.getLogger(__name__)

#: Bytes of buffers below which a result is answered inline (a file costs more than it saves).
SMALLEST = 1 << 20

#: Seconds between checks, while files are open, for results Dask released (published
#: ones) and for files their consumers let go of.
SWEEP_INTERVAL = 1.0

#: Files kept open at most, in use or not.
MAX_FILES = 16


@dataclass(frozen=True, eq=False)
class _Segment:
    """A result's buffers in a file: generation ``generation``, at page-aligned ``offsets``."""

    file: File
    generation: int
    size: int
    header: bytes
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]

    def answer(self) -> dict:
        return {
            "status": "shared",
            "pid": os.getpid(),
            "fd": self.file.fd,
            "ino": self.file.ino,
            "dev": self.file.dev,
            "generation": self.generation,
            "size": self.size,
            "header": self.header,
            "sizes": list(self.sizes),
            "offsets": list(self.offsets),
        }


def _layout(packed: serialization.Packed) -> tuple[list[memoryview], list[int], int]:
    """The buffers, their offsets (after the generation's page, page-aligned), the bytes in all."""
    views = [memoryview(b).cast("B") for b in packed.buffers]
    offsets, size = layout(views)
    return views, offsets, size


def _write(key: str, packed: serialization.Packed, file: File | None) -> _Segment:
    """``packed``'s buffers written into ``file`` (locked exclusively by the caller, unlocked
    here) or a new file. Runs in an executor thread."""
    views, offsets, size = _layout(packed)
    fresh = file is None
    if fresh:
        file = create(f"daskwg-{key}", size)
    try:
        generation = write(file, views, offsets)
        file.unmap()  # the consumers' mappings hold the pages; this worker's memory does not
    except BaseException:
        file.close()
        raise
    finally:
        if not fresh:
            fcntl.flock(file.fd, fcntl.LOCK_UN)
    return _Segment(file, generation, size, packed.header, tuple(v.nbytes for v in views), tuple(offsets))


def attach(answer: dict) -> Any:
    """The value a ``daskwg_shared`` answer of status ``"shared"`` describes, built over a
    copy-on-write mapping of the producer's file, which stays locked (shared) until the
    mapping goes (the last object built over it).

    Raises:
        OSError: the file cannot be opened, locked or mapped here, or is not the one
            described (the caller fetches the value over the comm instead).
    """
    whole = memoryview(open_mapping(answer))
    buffers = [whole[o : o + n] for o, n in zip(answer["offsets"], answer["sizes"])]
    return pickle.loads(answer["header"], buffers=buffers)


class SharedResults:
    """Serves this worker's stored results to consumers on its host through shared memory.

    Args:
        worker: the Dask worker.
        store: its :class:`~daskwg.plugin.results.ResultStore` (which tells it, through
            :meth:`release`, of the results the driver let go of).
    """

    def __init__(self, worker: Any, store: ResultStore):
        self.worker = worker
        self.store = store
        self._segments: dict[str, _Segment] = {}
        self._making: dict[str, asyncio.Future] = {}
        self._pool: list[File] = []  # files of released results, oldest first
        self._sweeper: asyncio.Task | None = None

    def install(self) -> None:
        """Install the ``daskwg_shared`` handler and hear of freed results."""
        self.worker.handlers[Handler.SHARED] = self._handle_shared
        self.store.on_free.append(self.release)

    def release(self, keys: list[str]) -> None:
        """These results are gone: their files wait for the next results (consumers'
        mappings stay valid: a file is rewritten only once none maps it)."""
        if not self._segments:
            return  # the common case: none of this worker's results was shared
        pooled = len(self._pool)
        for key in keys:
            segment = self._segments.pop(key, None)
            if segment is not None:
                self._pool.append(segment.file)
        if len(self._pool) > pooled:
            self._trim()

    def close(self) -> None:
        """Close every file (the worker is closing)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for segment in self._segments.values():
            segment.file.close()
        for file in self._pool:
            file.close()
        self._segments.clear()
        self._pool.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the files of results held now."""
        return sum(s.file.capacity for s in self._segments.values())

    @property
    def pooled(self) -> int:
        """Bytes of the files waiting for a next result."""
        return sum(f.capacity for f in self._pool)

    async def _handle_shared(
        self, key: str, session: str, seq: int, source: str = "", finished: bool = False
    ) -> dict:
        """``daskwg_shared``: where the file holding the result ``key`` is (status
        ``"shared"``, written on the first request), or the value itself (status ``"OK"``,
        as ``daskwg_fetch`` answers) when it is small or no file can be made; its call's
        error (status ``"error"``) if that failed. ``finished``: a part whose rows a consumer
        reads (it learnt of the part from the part itself): not here means released, at once
        (a ``GroupBrokenError``), rather than not made yet; and where the value would come
        itself, status ``"unshared"`` comes instead (the consumer asks for its rows only)."""
        try:
            if finished:
                value = self._finished(key)
            else:
                value = await self.store.wait(
                    ResultRef(key, self.worker.address, session, seq, source=source)
                )
            packed = serialization.dumps(value)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(picklable(exc))}
        whole = {"status": "unshared"} if finished else {"status": "OK", "data": to_serialize(packed)}
        if not available() or packed.nbytes - len(packed.header) < SMALLEST:
            return whole
        try:
            segment = await self._segment(key, packed)
        except OSError as exc:
            logger.info("daskwg: no shared-memory file for %s (%s): sending it over the comm", key, exc)
            return whole
        return segment.answer()

    def _finished(self, key: str) -> Any:
        try:
            return self.store.get(key)
        except KeyError:
            raise part_released(key, self.worker.address) from None

    async def _segment(self, key: str, packed: serialization.Packed) -> _Segment:
        segment = self._segments.get(key)
        if segment is not None:
            return segment
        making = self._making.get(key)
        if making is not None:
            return await asyncio.shield(making)
        loop = asyncio.get_running_loop()
        making = self._making[key] = loop.create_future()
        try:
            self._sweep()
            segment = await loop.run_in_executor(
                None, _write, key, packed, self._reusable(_layout(packed)[2])
            )
            if key not in self.store:  # released while it was being written
                self._pool.append(segment.file)
                raise OSError(f"{key!r} was released while its file was written")
            self._segments[key] = segment
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = asyncio.ensure_future(self._sweep_while_open())
            making.set_result(segment)
            return segment
        except Exception as exc:
            making.set_exception(exc)
            making.exception()  # retrieved: there may be no other waiter
            raise
        except BaseException:
            making.cancel()
            raise
        finally:
            del self._making[key]

    def _reusable(self, size: int) -> File | None:
        """A pooled file of ``size`` to ``size`` + 25% bytes that no consumer maps, locked
        exclusively (taken out of the pool), or ``None``."""
        for file in self._pool:
            if size <= file.capacity <= size + size // 4:
                try:
                    fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue
                self._pool.remove(file)
                return file
        return None

    def _trim(self) -> None:
        """Close pooled files beyond ``MAX_FILES`` (oldest first), then unused ones beyond
        ``daskwg.buffer-pool`` bytes (oldest first). A file consumers still map costs
        nothing to keep: their mappings hold its pages anyway."""
        while len(self._pool) + len(self._segments) > MAX_FILES and self._pool:
            self._pool.pop(0).close()
        unused = [f for f in self._pool if f.unused()]
        excess = sum(f.capacity for f in unused) - pool_limit()
        for file in unused:
            if excess <= 0:
                break
            self._pool.remove(file)
            file.close()
            excess -= file.capacity

    def _sweep(self) -> None:
        """Release the files of results that left the store another way (published to Dask,
        then released by it: Dask frees those keys itself), and trim the pool."""
        self.release([k for k in self._segments if k not in self.store])
        self._trim()

    async def _sweep_while_open(self) -> None:
        # Until no result holds a file and every pooled one is unused and within the limit.
        while self._segments or not all(f.unused() for f in self._pool):
            await asyncio.sleep(SWEEP_INTERVAL)
            self._sweep()
