"""Shared-memory files between the processes of one host: :class:`File`, :class:`SendFiles`.

Two routes move bytes between processes of one host through anonymous shared-memory files
(``memfd_create(2)``) instead of a socket:

* **Whole results read by many ranks** (``daskwg.plugin.shared``): the producer's worker
  writes a result once, each consumer maps it copy-on-write.
* **Large frames of a call stream** (:class:`daskwg.wire.frames.FrameStream`, this module's
  :class:`SendFiles`): a call's arguments sent by a driver to a worker of its own host, and
  the reply coming back. The sender copies each buffer of a megabyte or more into a file
  of its own (one copy, at memory speed: a 64 MiB batch takes about 13 ms here where
  loopback TCP takes 34 ms to send and as long again to receive) and sends only where the
  files are; the receiver maps them and takes the buffers as its own (a buffer it keeps
  holds its own file only, as a received one holds its own memory). Ray moves large arguments and results between a
  driver and its actors on one node the same way (its object store, in shared memory).

A file is named to a peer by its writer's process id and descriptor (the peer opens
``/proc/<pid>/fd/<fd>``) with its inode, device and a *generation* number written in its
first page, so a peer can tell the file it was told of from any other. A reader holds a
shared ``flock(2)`` on the file for as long as anything built over its mapping lives; a
writer rewrites a file only once it takes the lock exclusively.

A stream's file is read by one receiver only, which maps it shared (``MAP_SHARED``): its
in-place changes are written into the file's pages, which no other process reads, and the
sender's own buffers were copied, so they never see them. The receiver *claims* the file
(writes the generation into the first page's second word) when it maps it: the sender
reuses a file only once it is claimed and unlocked (the receiver let go), never between the
send and the claim, so a message in flight is never overwritten. Files are reused by size,
as receive buffers are (``daskwg.wire.buffers``); at most ``daskwg.buffer-pool`` bytes of files
no receiver maps are kept.

A reader's buffers over a shared mapping behave as its own memory, but for one thing: a
child it forks inherits the mapping shared, not copy-on-write (its in-place changes reach
the parent's buffers), and holds the file's lock while it lives (the writer then uses
another file). Call streams on TLS comms use files too: the bytes never leave the host, and
only processes of the same user (or root) can open another's descriptors.

Which streams use files: both ends on one host (the addresses' host parts), with
``daskwg.shared-memory`` on at both, ``memfd_create`` available, and each end able to open
the other's files, which the stream's opening checks once (:func:`probe`,
:func:`can_open`). Anything else travels over the socket as before.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from distributed.comm.addressing import parse_address, parse_host_port

from .buffers import pool_limit, receive_buffer

__all__ = [
    "File",
    "BUFFER_SMALLEST",
    "SendFiles",
    "InFile",
    "available",
    "can_open",
    "create",
    "layout",
    "open_mapping",
    "probe",
    "same_host",
    "send_files",
    "write",
]

#: Bytes from which a buffer of a message goes into a shared-memory file of its own
#: (smaller ones go over the socket: a file costs a few system calls on each side).
BUFFER_SMALLEST = 1 << 20

#: Files a process's :class:`SendFiles` keeps open at most (in flight, mapped or free), by
#: default: an eighth of the descriptor limit (each costs two), within 64 and 2048. A weight
#: sync of 32 tensors to 4 ranks through the driver writes 128 per step.
MAX_FILES: int | None = None


@functools.cache
def _max_files() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(64, min(2048, (soft if soft > 0 else 1024) // 8))


#: Bytes up to which a writer keeps its own mapping of a file between writes (mapping
#: again costs a fifth of the copy); a larger file's pages count in its readers only, so a
#: driver sending a large batch does not hold it twice.
KEEP_MAPPED = 32 << 20

#: Seconds after its send from which a file its reader still holds (a kept result) is no
#: longer mapped by the writer (a file a call holds for its run is written again soon).
HELD_UNMAP = 2.0

#: Seconds an unclaimed file of a closed stream is kept before it is closed.
UNCLAIMED_GRACE = 5.0

PAGE = mmap.PAGESIZE
_generations = itertools.count(1)


def available() -> bool:
    """Whether this platform has ``memfd_create`` (Linux)."""
    return hasattr(os, "memfd_create")


@dataclass(eq=False)
class File:
    """A shared-memory file of ``capacity`` bytes, ``fd`` in this process."""

    fd: int
    ino: int
    dev: int
    capacity: int
    #: the generation written last (0: none)
    generation: int = 0
    #: for a stream's file: whether its stream still lives, and when it was sent
    alive: Callable[[], bool] = field(default=lambda: True, repr=False)
    sent: float = 0.0
    #: this process's own shared mapping of it, made by the first :func:`write`
    mapping: mmap.mmap | None = field(default=None, repr=False)

    def unused(self) -> bool:
        """Whether no reader maps it: its exclusive lock is free."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return True

    def claimed(self) -> bool:
        """Whether the receiver of its last generation mapped it (:func:`open_mapping` with
        ``claim``)."""
        return int.from_bytes(os.pread(self.fd, 8, 8), "little") == self.generation

    def unmap(self) -> None:
        """Drop this process's own mapping (its pages then count in no process but the
        readers'); the next :func:`write` maps it again."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    def close(self) -> None:
        self.unmap()
        os.close(self.fd)


def create(name: str, size: int) -> File:
    """A new shared-memory file of ``size`` bytes (``memfd_create``).

    Raises:
        OSError: no file could be made (no ``memfd_create``, out of memory or descriptors).
    """
    fd = os.memfd_create(name[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    return File(fd, st.st_ino, st.st_dev, size)


def layout(views: list[memoryview]) -> tuple[list[int], int]:
    """Where ``views`` go in a file: page-aligned offsets after the header page, and the
    file's size in bytes."""
    offsets, position = [], PAGE
    for view in views:
        offsets.append(position)
        position += -(-view.nbytes // PAGE) * PAGE
    return offsets, position


def write(file: File, views: list[memoryview], offsets: list[int]) -> int:
    """Write ``views`` (flat bytes) at ``offsets`` and a new generation (returned, also in
    ``file.generation``) into ``file``, which the caller holds exclusively; the claim word
    is cleared first. The bytes are copied through this process's shared mapping of the
    file (a memory copy: ``pwrite`` into the page cache ran at half that speed here)."""
    if file.mapping is None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        file.mapping = mmap.mmap(file.fd, file.capacity, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapping = file.mapping
    generation = next(_generations)
    mapping[0:16] = bytes(16)
    for view, offset in zip(views, offsets):
        if view.nbytes:  # numpy's copy lets other threads run (the event loop's)
            np.frombuffer(mapping, np.uint8, view.nbytes, offset)[:] = np.frombuffer(view, np.uint8)
    mapping[0:8] = generation.to_bytes(8, "little")
    file.generation = generation
    return generation


def describe(file: File, size: int) -> dict:
    """How a peer finds ``file`` and its current generation (``size`` bytes of it)."""
    return {
        "pid": os.getpid(),
        "fd": file.fd,
        "ino": file.ino,
        "dev": file.dev,
        "generation": file.generation,
        "size": size,
    }


def open_mapping(described: dict, *, shared: bool = False, claim: bool = False) -> mmap.mmap:
    """Map the file a peer :func:`describe`\\ d, holding its shared lock until the mapping
    goes (the last object built over it). ``shared``: ``MAP_SHARED`` (writes reach the
    file: for a file this process alone reads), else copy-on-write; ``claim``: tell the
    writer it was mapped (:meth:`File.claimed`).

    Raises:
        OSError: the file cannot be opened, locked or mapped here, or is not the one
            described any more.
    """
    path = f"/proc/{described['pid']}/fd/{described['fd']}"
    fd = os.open(path, (os.O_RDWR if claim else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or (st.st_ino, st.st_dev) != (described["ino"], described["dev"])
            or st.st_size < described["size"]
        ):
            raise OSError(f"{path} is not the file described any more")
        if int.from_bytes(os.pread(fd, 8, 0), "little") != described["generation"]:
            raise OSError(f"{path} holds another generation now")
        if claim:
            os.pwrite(fd, described["generation"].to_bytes(8, "little"), 8)
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        if shared:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, described["size"], flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    # The mapping keeps a duplicate of the descriptor (mmap's own), which shares its open
    # file and so its lock until the mapping closes: one descriptor per mapping, not two.
    os.close(fd)
    global _mapped
    with _mapped_lock:
        _mapped += 1
    weakref.finalize(mapping, _unmapped).atexit = False
    return mapping


_mapped = 0  # mappings open_mapping made that are still alive (each holds a descriptor)
_mapped_lock = threading.RLock()  # finalizers may run at any allocation, under it too


def _unmapped() -> None:
    global _mapped
    with _mapped_lock:
        _mapped -= 1


@functools.cache
def _mapped_limit() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(4096, (soft if soft > 0 else 1024) // 4))


def mapped() -> int:
    """Mappings of peers' files alive in this process (each holds a file descriptor)."""
    return _mapped


def same_host(a: str, b: str) -> bool:
    """Whether the TCP/TLS addresses ``a`` and ``b`` (``"tcp://10.0.0.1:4000"``) name the same
    host (other schemes: ``False``)."""
    try:
        (scheme_a, loc_a), (scheme_b, loc_b) = parse_address(a), parse_address(b)
        if scheme_a not in ("tcp", "tls") or scheme_b not in ("tcp", "tls"):
            return False
        return parse_host_port(loc_a)[0] == parse_host_port(loc_b)[0]
    except ValueError:
        return False


@functools.cache
def _probe_file() -> File | None:
    try:
        file = create("daskwg-probe", PAGE)
    except OSError:
        return None
    write(file, [], [])
    return file


def probe() -> dict | None:
    """What a peer opens to learn whether it can map this process's files (a one-page file
    this process keeps), or ``None`` where none can be made."""
    file = _probe_file() if available() else None
    return None if file is None else describe(file, PAGE)


def can_open(described: dict | None) -> bool:
    """Whether this process can map the peer's :func:`probe` file."""
    if not described or not available():
        return False
    try:  # as InFile.take maps a file: read-write, shared, claimed
        open_mapping(described, shared=True, claim=True).close()
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


class InFile:
    """A frame's message whose large buffers are in shared-memory files, one file each:
    ``message``, and per such buffer its position among the message's buffers and its
    file's description (:func:`describe`); the others came with the frame. One file per
    buffer: a tensor the reader keeps holds its own bytes only, as a received buffer does."""

    __slots__ = ("message", "where")

    def __init__(self, message: Any, where: list[tuple[int, dict]]):
        self.message = message
        self.where = where

    def __reduce__(self) -> Any:
        return (InFile, (self.message, self.where))

    def take(self, inline: list) -> tuple[Any, list]:
        """The message and all its buffers, those in files as writable arrays over shared
        mappings of them (claimed: the sender may reuse each once its array is gone). Past
        ``_mapped_limit`` mappings held in this process the bytes are copied out instead
        and the file let go of at once (a caller keeping every result would otherwise use
        up its descriptors).

        Raises:
            OSError: a file cannot be mapped here.
        """
        buffers: list = [None] * (len(inline) + len(self.where))
        for index, described in self.where:
            mapping = open_mapping(described, shared=True, claim=True)
            nbytes = described["size"] - PAGE
            view = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=PAGE)
            if _mapped > _mapped_limit():
                own = receive_buffer(nbytes)
                own[:] = view
                del view
                mapping.close()
                view = own
            buffers[index] = view
        rest = iter(inline)
        for i, b in enumerate(buffers):
            if b is None:
                buffers[i] = next(rest)
        return self.message, buffers


class SendFiles:
    """A process's files for large frames (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: list[File] = []  # every file this process keeps, oldest first

    def put(self, message: Any, views: list[memoryview], alive: Callable[[], bool]) -> tuple[InFile, list]:
        """``message`` with each of ``views`` of :data:`BUFFER_SMALLEST` bytes or more copied
        into a file of its own (reused, or new), the others left to go inline; ``alive``:
        whether the stream it is sent on still lives (an unclaimed file of a closed one is
        closed).

        Raises:
            OSError: no file could be made (the caller sends the message over the socket).
        """
        where, inline = [], []
        try:
            for i, view in enumerate(views):
                if view.nbytes < BUFFER_SMALLEST:
                    inline.append(view)
                    continue
                where.append((i, self._write_one(view, alive)))
        except BaseException:
            self.give_back(InFile(message, where))
            raise
        return InFile(message, where), inline

    def _write_one(self, view: memoryview, alive: Callable[[], bool]) -> dict:
        offsets, size = layout([view])
        file = self._take(size)
        if file is None:
            file = create("daskwg-frame", size)
        try:
            fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no reader while it is written
            try:
                write(file, [view], offsets)
                if size > KEEP_MAPPED:
                    file.unmap()
            finally:
                fcntl.flock(file.fd, fcntl.LOCK_UN)
        except BaseException:
            file.close()
            raise
        file.alive, file.sent = alive, time.monotonic()
        with self._lock:
            self._files.append(file)
        return describe(file, size)

    def give_back(self, infile: InFile) -> None:
        """Files :meth:`put` wrote whose message was not sent after all: free again."""
        mine = {(d["fd"], d["generation"]) for _, d in infile.where}
        with self._lock:
            for file in self._files:
                if (file.fd, file.generation) in mine:
                    os.pwrite(file.fd, file.generation.to_bytes(8, "little"), 8)

    def _take(self, size: int) -> File | None:
        """A kept file of ``size`` to ``size`` + 25% bytes that its receiver let go of (claimed
        and unlocked: no process will map that generation again), taken out of the list (the
        smallest such); closes what is beyond the limits on the way."""
        now = time.monotonic()
        with self._lock:
            free, best = 0, None
            for file in list(self._files):
                if not file.claimed():
                    if not file.alive() and now - file.sent > UNCLAIMED_GRACE:
                        self._files.remove(file)
                        file.close()
                    continue
                if not file.unused():
                    if now - file.sent > HELD_UNMAP:  # kept by its reader: its pages count there
                        file.unmap()
                    if len(self._files) > (MAX_FILES or _max_files()):  # the reader's mapping keeps its pages
                        self._files.remove(file)
                        file.close()
                    continue
                if size <= file.capacity <= size + size // 4 and (
                    best is None or file.capacity < best.capacity
                ):
                    best = file
                free += file.capacity
            if best is not None:
                self._files.remove(best)
                free -= best.capacity
            limit = pool_limit()
            for file in list(self._files):
                if free <= limit and len(self._files) <= (MAX_FILES or _max_files()):
                    break
                if file.claimed() and file.unused():
                    self._files.remove(file)
                    file.close()
                    free -= file.capacity
        return best

    @property
    def nbytes(self) -> int:
        """Bytes of the files kept (in flight, mapped by receivers, or free)."""
        with self._lock:
            return sum(f.capacity for f in self._files)

    def close(self) -> None:
        """Close every file (readers' mappings stay valid)."""
        with self._lock:
            files, self._files = self._files, []
        for file in files:
            file.close()


_send_files: tuple[int, SendFiles] | None = None


def send_files() -> SendFiles:
    """This process's :class:`SendFiles` (a forked child gets its own: it must not rewrite
    files its parent sent)."""
    global _send_files
    current = _send_files
    if current is None or current[0] != os.getpid():
        current = _send_files = (os.getpid(), SendFiles())
    return current[1]
