"""Reading another process's memory on the same host: ``process_vm_readv(2)``.

The same-host route of the sharded sync (:mod:`daskwg.sync.shards`) lets each rollout rank
copy a trainer rank's shard straight from the trainer's memory into its own parameters: one
copy per byte received, no staging buffer on either side, nothing on a socket. This is
Linux's cross-memory attach, the mechanism MPI libraries (Open MPI's and MPICH's CMA, UCX)
use for large intra-node messages.

It works where the reader may ptrace the writer (same user, or ``CAP_SYS_PTRACE``; Yama's
``ptrace_scope`` 1 allows descendants only) and both are in one pid namespace. Whether it
works is found out, never assumed: :class:`Probe` is a word a process publishes (its pid,
the word's address and a random token); :func:`can_read` reads the word back from another
process and compares the token, so a refused read, another pid namespace (a pid naming some
other process) or another kernel all answer ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import secrets
from dataclasses import dataclass

__all__ = ["Probe", "can_read", "local_probe", "read_into", "read_many"]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _readv():
    """libc's ``process_vm_readv``, or ``None`` where the platform has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


def read_into(pid: int, address: int, into: int, nbytes: int) -> None:
    """Copy ``nbytes`` bytes at ``address`` in process ``pid`` to address ``into`` here.

    Args:
        pid: the process to read (same host, same pid namespace).
        address: where the bytes start there.
        into: where they go here (the caller keeps that memory alive and writable).
        nbytes: how many bytes.

    Raises:
        OSError: the kernel refused or the range is not mapped there (``errno`` says why:
            ``EPERM`` no ptrace permission, ``ESRCH`` no such process, ``EFAULT`` a bad
            address).
    """
    fn = _readv()
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    done = 0
    while done < nbytes:
        local = _Iovec(into + done, nbytes - done)
        remote = _Iovec(address + done, nbytes - done)
        # The kernel may stop early (a partial transfer); carry on from where it stopped.
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += got


#: iovecs per ``process_vm_readv`` call: Linux's ``UIO_MAXIOV`` (``IOV_MAX``).
IOV_MAX = 1024


def read_many(pid: int, ranges: list[tuple[int, int, int]]) -> None:
    """Copy many ranges of process ``pid``'s memory here, in as few system calls as the
    kernel takes (one per :data:`IOV_MAX` ranges, where none stops early): what
    :func:`read_into` does for one range, without a Python round per range.

    Args:
        pid: the process to read (same host, same pid namespace).
        ranges: ``(address there, address here, bytes)`` each; the caller keeps the memory
            here alive and writable. Ranges of 0 bytes are skipped.

    Raises:
        OSError: as :func:`read_into`.
    """
    fn = _readv()
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    ranges = [r for r in ranges if r[2] > 0]
    for first in range(0, len(ranges), IOV_MAX):
        part = ranges[first : first + IOV_MAX]
        local = (_Iovec * len(part))(*((here, n) for _, here, n in part))
        remote = (_Iovec * len(part))(*((there, n) for there, _, n in part))
        want = sum(n for _, _, n in part)
        got = fn(pid, local, len(part), remote, len(part), 0)
        if got == want:
            continue
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        # The kernel stopped early (a partial transfer ends at some range): finish
        # range by range from where it stopped, each raising what stopped it.
        for there, here, n in part:
            take = min(got, n)
            got -= take
            if take < n:
                read_into(pid, there + take, here + take, n - take)


@dataclass(frozen=True)
class Probe:
    """A word of this process that others read to find out whether they can read it.

    Attributes:
        pid: this process's id.
        address: the word's address here.
        token: the word's value (random, 62 bits).
    """

    pid: int
    address: int
    token: int


@functools.cache
def local_probe() -> Probe:
    """This process's :class:`Probe` (one per process, alive as long as it is)."""
    token = secrets.randbits(62)
    word = ctypes.c_int64(token)
    _keep.append(word)
    return Probe(os.getpid(), ctypes.addressof(word), token)


_keep: list = []


def can_read(probe: Probe) -> bool:
    """Whether this process can read the memory of the process that published ``probe``
    (it reads the word back and compares the token)."""
    if probe.pid == os.getpid():
        return True
    word = ctypes.c_int64(0)
    try:
        read_into(probe.pid, probe.address, ctypes.addressof(word), 8)
    except OSError:
        return False
    return word.value == probe.token
