"""Rows of several parts written by their producers into one file of the consumer:
:func:`gather`, :func:`install`.

A rank whose piece of a ``DataProtoFuture`` spans several parts held by other workers of
its host (a 4-rank group's output read by a 2-rank group: two parts each) would map each
part from its producer's shared-memory file and then concatenate them: the producers copy
their parts into their files, and the consumer copies every row once more into the
concatenated batch. Here the consumer instead lays out the batch it will get in a
shared-memory file of its own (one page-aligned region per column, as long as all its
rows), and asks every producer at once (``daskwg_write_rows``) to write its rows straight
into their places; the rank then gets tensors over that file, concatenated already. Each
row is copied once, by its producer, in parallel, and only the rows the rank needs
(MPI's and NCCL's shared-memory transports gather into the receiver's buffer the same way).

It applies where every part is a daskwg or verl ``DataProto`` whose ``batch`` holds only
dense CPU tensors (contiguous, no ``non_tensor_batch``) with the same columns, dtypes and
trailing shapes (:func:`columns_of`, carried by the :class:`~daskwg.wire.messages.PartInfo`), held by
other workers of this host, with ``daskwg.shared-memory`` on; anything else (or a producer
that cannot open the file) goes the usual way (:func:`daskwg.plugin.rows.evaluate_on_worker`).

The consumer's files are reused as receive buffers are (``daskwg.wire.buffers``): a file comes
back to this process's pool when the last tensor over it goes, its pages still mapped.
The rank owns its tensors: nobody else maps the file once the producers have written it.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from distributed.protocol import to_serialize
from tensordict import TensorDict

from ..protocol import DataProto
from ..wire.buffers import pool_limit
from ..wire.memfiles import PAGE, File, _max_files, available, create
from ..wire.messages import Handler
from .exceptions import picklable

__all__ = ["columns_of", "counts", "gather", "install", "SMALLEST"]

#: Bytes of a batch below which the parts are fetched the usual way (a file costs more).
SMALLEST = 1 << 20

#: The name of the consumers' files (``memfd_create``): the only files producers write into.
NAME = "daskwg-gathered"

#: Free files this process keeps at most (each within ``daskwg.buffer-pool`` in all).
MAX_FREE = 8

#: A producer maps the consumer's pages in one go (faulting them in one by one cost more
#: than the copy).
_SHARED_POPULATED = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

# Reentrant: a view dying (its finalizer giving a file back) can happen at any allocation.
_lock = threading.RLock()
_free: list[File] = []  # files no tensor uses any more, oldest first
_made = 0  # files made so far
_open = 0  # files open now (each holds a descriptor), in use or free


def counts() -> dict[str, int]:
    """This process's files: ``{"free": waiting for the next gather, "made": made so far,
    "open": open now}``."""
    return {"free": len(_free), "made": _made, "open": _open}


def _max_open() -> int:
    """Files open at most (a rank keeping every batch it got holds one each): half as many
    as a process's send files (``daskwg.wire.memfiles``: an eighth of the descriptor limit,
    within 64 and 2048); past it, parts come the usual way."""
    return max(4, _max_files() // 2)


def columns_of(value: Any) -> tuple | None:
    """``((key, dtype name, trailing shape, device), ...)`` of a ``DataProto`` (daskwg's)
    whose batch is only dense, contiguous CPU tensors and that has no ``non_tensor_batch``:
    what a consumer lays its file out by; ``None`` for anything else."""
    if not isinstance(value, DataProto) or value.non_tensor_batch or value.batch is None:
        return None
    batch = value.batch
    if type(batch) is not TensorDict or batch.batch_dims != 1 or batch.names[0] is not None:
        return None
    device = None if batch.device is None else str(batch.device)
    if device not in (None, "cpu"):
        return None
    columns = []
    for key, tensor in batch._tensordict.items():
        if not plain_column(tensor):
            return None
        columns.append((key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape[1:]), device))
    return tuple(columns)


def plain_column(tensor: Any) -> bool:
    """Whether a batch column is what a consumer's file holds: a dense, contiguous CPU
    ``torch.Tensor`` (not a subclass) without gradients."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and tensor.is_contiguous()
    )


def install(
    worker: Any,
    lookup: Callable[[str], Any],
    value_of: Callable[[Any], Any],
    released: Callable[[str, str], Exception],
) -> None:
    """Install the ``daskwg_write_rows`` handler on ``worker``: rows ``[start, stop)`` of
    the part stored under ``key`` (``lookup(key)``, its value ``value_of(stored)``) written
    into the consumer's file ``target`` (``{"pid", "fd", "ino", "dev", "offsets": {column:
    byte offset}}``), in an executor thread (``session``, ``seq`` and ``source`` name the
    producing call, as every fetch does). Answers ``{"status": "OK"}``; ``"unavailable"``
    when the file cannot be opened here (or is not a consumer's file of daskwg);
    ``"error"`` with the exception (a released part: ``released(key, address)``)."""

    async def handle_write_rows(
        key: str, session: str, seq: int, start: int, stop: int, target: dict, source: str = ""
    ) -> dict:
        try:
            stored = lookup(key)
        except KeyError:
            return {"status": "error", "exception": to_serialize(released(key, worker.address))}
        try:
            batch = value_of(stored).batch
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _write_rows, batch, start, stop, target)
        except OSError:
            return {"status": "unavailable"}
        except Exception as exc:  # noqa: BLE001 - the consumer raises it
            return {"status": "error", "exception": to_serialize(picklable(exc))}
        return {"status": "OK"}

    worker.handlers[Handler.WRITE_ROWS] = handle_write_rows


def _write_rows(batch: TensorDict, start: int, stop: int, target: dict) -> None:
    path = f"/proc/{int(target['pid'])}/fd/{int(target['fd'])}"
    if not os.readlink(path).startswith(f"/memfd:{NAME} "):  # only ever a file gather() made
        raise OSError(f"{path} is not a daskwg consumer's file")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_ino, st.st_dev) != (target["ino"], target["dev"]):
            raise OSError("not the consumer's file any more")
        for key, offset in target["offsets"].items():
            rows = batch._tensordict[key][start:stop]
            nbytes = rows.numel() * rows.element_size()
            if not nbytes:
                continue
            first = offset // PAGE * PAGE  # a mapping starts on a page
            with mmap.mmap(fd, offset + nbytes - first, flags=_SHARED_POPULATED, offset=first) as mapping:
                into = np.frombuffer(mapping, np.uint8, nbytes, offset - first)
                into[:] = rows.reshape(-1).view(torch.uint8).numpy()
                del into
    finally:
        os.close(fd)


def gather(
    requests: list[tuple], columns: tuple, write: Callable[[list[tuple]], list[dict]]
) -> DataProto | None:
    """The ``DataProto`` of ``requests`` concatenated, each producer having written its rows
    into a file of this process.

    Args:
        requests: ``(part, start, stop, wanted columns)`` in order, as
            :func:`daskwg.futures.interpreter.evaluate` fetches them; ``wanted columns``: ``None`` (all)
            or ``(batch keys or None, non-tensor keys or None)``.
        columns: the parts' common :func:`columns_of`.
        write: ``[(part, start, stop, target), ...] -> answers`` of ``daskwg_write_rows``,
            asked concurrently; it returns (or raises the first producer's error) only once
            every producer has answered.

    Returns:
        the batch (``meta_info`` empty: the caller merges the parts'), or ``None`` where
        this route does not apply (too small, no file, a producer cannot open it).

    Raises:
        Exception: what ``write`` raises (a released part, a lost worker).
    """
    wanted = requests[0][3]
    keys = [c for c in columns if wanted is None or wanted[0] is None or c[0] in wanted[0]]
    total = sum(stop - start for _, start, stop, _ in requests)
    widths = [math.prod(shape) * _dtype(dtype).itemsize for _, dtype, shape, _ in keys]
    starts, size = [], 0
    for width in widths:
        starts.append(size)
        size += -(-total * width // PAGE) * PAGE
    if not keys or size < SMALLEST or not available():
        return None
    try:
        file, view, reusable = _take(size)
    except OSError:
        return None
    asks, before = [], 0
    for part, start, stop, _ in requests:
        offsets = {key[0]: at + before * width for key, at, width in zip(keys, starts, widths)}
        target = {"pid": os.getpid(), "fd": file.fd, "ino": file.ino, "dev": file.dev, "offsets": offsets}
        asks.append((part, start, stop, target))
        before += stop - start
    try:
        answers = write(asks)
    except BaseException:
        reusable[0] = False  # a producer may still write into it: never handed out again
        raise
    if any(answer["status"] != "OK" for answer in answers):
        return None
    tensors = {}
    for (key, dtype, shape, _), at, width in zip(keys, starts, widths):
        if total * width:
            tensors[key] = torch.frombuffer(view[at : at + total * width], dtype=_dtype(dtype)).view(
                total, *shape
            )
        else:
            tensors[key] = torch.empty((total, *shape), dtype=_dtype(dtype))
    batch = TensorDict(tensors, batch_size=[total], device=keys[0][3])
    return DataProto(batch=batch, non_tensor_batch={}, meta_info={})


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name!r} is not a torch dtype")
    return dtype


def _take(size: int) -> tuple[File, np.ndarray, list]:
    """A file of ``size`` to ``size`` + 25% bytes mapped shared here (a free one, else a
    new one), a writable view of its first ``size`` bytes whose last user's death gives the
    file back, and the flag (``[True]``) that lets it be given back."""
    file = None
    with _lock:
        for candidate in _free:
            if size <= candidate.capacity <= size + size // 4:
                _free.remove(candidate)
                file = candidate
                break
    if file is None:
        global _made, _open
        if _open >= _max_open():
            raise OSError(f"{_open} files of gathered rows are open already")
        file = create(NAME, size)
        _made += 1
        _open += 1
        try:
            file.mapping = mmap.mmap(
                file.fd, size, flags=_SHARED_POPULATED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            _close(file)
            raise
    # As daskwg.wire.buffers does: everything built over the view holds an export of this ctypes
    # array, whose death is the file's release.
    owner = (ctypes.c_ubyte * size).from_buffer(file.mapping)
    reusable = [True]
    weakref.finalize(owner, _give_back, file, reusable).atexit = False
    return file, np.frombuffer(owner, dtype=np.uint8), reusable


def _give_back(file: File, reusable: list) -> None:
    """No tensor uses ``file`` any more: keep it for the next gather (within the limits)."""
    if not reusable[0]:
        _close(file)
        return
    closing = []
    with _lock:
        _free.append(file)
        limit = pool_limit()
        while len(_free) > MAX_FREE or sum(f.capacity for f in _free) > limit:
            closing.append(_free.pop(0))
    for old in closing:
        _close(old)


def _close(file: File) -> None:
    global _open
    file.close()
    with _lock:
        _open -= 1
