"""Receive buffers that keep their pages: :func:`receive_buffer`.

Every large value that arrives (a relayed state dict, a batch's tensors) is read straight
into fresh memory that its receiver then owns. Fresh memory costs more than the copy into
it: the kernel zeroes each new page on first touch, which on this project's machines took a
quarter of the CPU of a relayed weight sync. An RL job receives buffers of the same sizes
every step (the same weights, batches of the same shapes) and drops the last step's ones.

So a buffer handed out here lies on a block this module keeps: when the last object
using the view's memory goes away (the tensors unpickled over it included), the block comes
back to a free list by its size, and the next request of that size takes it, its pages
still mapped. At most ``daskwg.buffer-pool`` bytes (per process; by default a tenth of a
worker's memory limit; in the driver, which receives every step's collected batch, a
sixteenth of the machine's memory, at most 1 GiB) wait in the free lists;
the oldest blocks beyond that are released to the allocator. Buffers below
:data:`SMALLEST` bytes come from numpy directly.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections import OrderedDict

import dask.config
import numpy as np
import psutil
from dask.utils import parse_bytes

__all__ = ["SMALLEST", "clear_pool", "pool_limit", "pooled_bytes", "receive_buffer"]

#: Buffers smaller than this are plain ``numpy.empty`` (the allocator keeps those warm).
SMALLEST = 1 << 20

# Reentrant: a view dying (its finalizer giving a block back) can happen in any thread at
# any allocation, this module's own included.
_lock = threading.RLock()
# (nbytes, id) -> block, oldest first; a block is here only while no view of it lives.
_free: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
_by_size: dict[int, list[tuple[int, int]]] = {}
_pooled = 0


def pool_limit() -> int:
    """``daskwg.buffer-pool`` in bytes; ``"auto"``: in a process with Dask workers a tenth
    of their memory limit (1 GiB without one), at most 4 GiB; elsewhere (the driver) a
    sixteenth of the machine's memory, at most 1 GiB (a 64 MiB DP_COMPUTE_PROTO round trip
    on 4 ranks: 130-139 -> 112-118 ms here, its replies arriving into warm pages)."""
    value = dask.config.get("daskwg.buffer-pool", "auto")
    if value == "auto":
        from distributed import Worker

        try:
            workers = list(Worker._instances)  # the Dask workers in this process
        except RuntimeError:  # one was being added or removed meanwhile
            return 0
        if not workers:
            return min(_total_memory() // 16, 1 << 30)
        limits = [getattr(w.memory_manager, "memory_limit", None) for w in workers]
        return min(min(limit // 10 if limit else 1 << 30 for limit in limits), 4 << 30)
    return int(parse_bytes(value) if isinstance(value, str) else value or 0)


@functools.cache
def _total_memory() -> int:
    # The machine's memory does not change; reading it costs a /proc parse (~0.2 ms).
    return psutil.virtual_memory().total


def receive_buffer(nbytes: int) -> np.ndarray:
    """A writable ``uint8`` array of ``nbytes`` bytes for a value about to arrive, whose
    memory the caller (and whatever it builds over it) owns until it drops it.

    Its content is undefined (not zeroed). Blocks of ``nbytes`` given back by earlier
    receivers are reused (see the module's docstring).

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"a buffer cannot have {nbytes} bytes")
    if nbytes < SMALLEST or nbytes > pool_limit():
        return np.empty(nbytes, dtype=np.uint8)
    global _pooled
    block = None
    with _lock:
        keys = _by_size.get(nbytes)
        if keys:
            key = keys.pop()
            if not keys:
                del _by_size[nbytes]
            block = _free.pop(key)
            _pooled -= nbytes
    if block is None:
        block = np.empty(nbytes, dtype=np.uint8)
    # Everything built on the buffer (arrays, memoryviews, tensors, at any depth) holds a
    # buffer export of the object that exported it first: a ctypes array over the block.
    # Its death is the block's release. (Neither an ndarray view nor a memoryview of the
    # block would do: numpy's views and memoryviews of them refer to the block itself, so
    # such a wrapper dies while its memory is still in use.)
    owner = (ctypes.c_ubyte * nbytes).from_buffer(block)
    weakref.finalize(owner, _give_back, block)
    return np.frombuffer(owner, dtype=np.uint8)


def _give_back(block: np.ndarray) -> None:
    """The last user of ``block``'s view is gone: keep it for the next receiver."""
    global _pooled
    limit = pool_limit()
    if block.nbytes > limit:
        return
    released = []  # freed outside the lock
    with _lock:
        key = (block.nbytes, id(block))
        _free[key] = block
        _by_size.setdefault(block.nbytes, []).append(key)
        _pooled += block.nbytes
        while _pooled > limit:
            old_key, old = _free.popitem(last=False)
            _by_size[old_key[0]].remove(old_key)
            if not _by_size[old_key[0]]:
                del _by_size[old_key[0]]
            _pooled -= old.nbytes
            released.append(old)
    del released


def pooled_bytes() -> int:
    """Bytes waiting in this process's free lists now."""
    return _pooled


def clear_pool() -> None:
    """Drop every block waiting in this process's free lists (their memory is freed now;
    blocks in use come back to the pool when their last view dies)."""
    global _pooled
    with _lock:
        released = list(_free.values())
        _free.clear()
        _by_size.clear()
        _pooled = 0
    del released
