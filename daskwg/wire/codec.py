"""The one tensor codec: a tensor as its own bytes, and back.

:func:`reduce_tensor` turns a tensor into the arguments of :func:`rebuild_tensor`: its
dtype, shape, device and one flat byte buffer (a ``pickle.PickleBuffer``, sent out of
band by pickle protocol 5: no copy for a contiguous CPU tensor). A view carries only its
own elements, never its base storage (torch's own pickling writes the whole storage);
a tensor whose strides reach no more memory than it has elements (an ``expand``-ed
tensor with stride 0, channels-last and other permuted layouts) travels as that memory
and its strides, as torch pickles it, so it arrives with the same strides and memory
format and is never materialised; any dtype travels (the bytes are reinterpreted, not
converted: bf16, fp8); sparse tensors (COO and compressed) travel as their index and
value tensors. Both daskwg's pickler
(``daskwg.serialization.pickling``) and plain ``pickle`` of a ``DataProto``
(:func:`tensordict_state`) use it.

A wide TensorDict (many small columns: ids, masks, log-probs, per-token rewards) would pay
that per column at each end; daskwg's pickler sends its small plain columns together in
one buffer instead (:func:`reduce_columns` / :func:`rebuild_columns`), so a batch costs
about its bytes, not its keys.
"""

from __future__ import annotations

import math
import pickle
import weakref
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from . import buffers

__all__ = [
    "device_available",
    "reduce_tensor",
    "rebuild_tensor",
    "received",
    "rebuild_tensordict",
    "reduce_columns",
    "rebuild_columns",
    "TensorBytes",
    "tensordict_state",
    "tensordict_from_state",
]


def device_available(device: str | None) -> bool:
    """Whether this process has ``device`` (``None`` and ``"cpu"`` always; ``"cuda:i"``
    when CUDA is available with more than ``i`` devices; other kinds when their backend
    says it is available)."""
    if device is None:
        return True
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index is None or dev.index < torch.cuda.device_count())
    backend = getattr(torch, dev.type, None)
    return backend is not None and bool(getattr(backend, "is_available", lambda: False)())


SPARSE_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _writable(buf: Any) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=np.uint8)
    # torch tensors are writable; a read-only buffer (bytes) must be copied once.
    return arr if arr.flags.writeable else arr.copy()


#: Tensors rebuilt here on received bytes, by id: their memory (a receive buffer) is
#: theirs alone although torch sees it as borrowed from numpy.
_RECEIVED: dict[int, weakref.ref] = {}


def received(t: torch.Tensor) -> bool:
    """Whether ``t`` was rebuilt here on received bytes: its memory is its own, although
    torch sees it as borrowed from numpy."""
    ref = _RECEIVED.get(id(t))
    return ref is not None and ref() is t


def owned_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on a block of :func:`daskwg.wire.buffers.receive_buffer`:
    one of the same size that an earlier result gave back (its pages still mapped), else
    fresh memory from numpy, which asks the kernel for huge pages for large blocks. A copy
    into fresh torch pages ran at 2.0 GB/s here, into numpy's at 3.1, into a warm block at
    5.3. Counted as this process's own (:func:`received`), as torch's own memory is: a
    result built on it is handed on without a copy. Below :data:`daskwg.wire.buffers.SMALLEST`
    bytes: ``torch.empty`` itself (its allocator keeps small blocks warm)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < buffers.SMALLEST:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffers.receive_buffer(nbytes), dtype=dtype)
    t = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)
    del flat
    key = id(t)
    _RECEIVED[key] = weakref.ref(t, lambda _, key=key: _RECEIVED.pop(key, None))
    return t


def rebuild_tensor(
    dtype: str, shape: tuple, device: str, requires_grad: bool, buf: Any, stride: tuple | None = None
) -> torch.Tensor:
    """The tensor :func:`reduce_tensor` took apart, on ``buf``'s memory (writable: a
    read-only buffer is copied once); on ``device`` when this process has it, else on CPU.

    ``stride`` (elements per dimension) comes with a tensor that travelled as the memory
    its strides reach (an expanded or permuted layout): it is rebuilt with those strides;
    ``None``: contiguous."""
    torch_dtype = getattr(torch, dtype)
    if not shape or all(shape):
        flat = torch.frombuffer(_writable(buf), dtype=torch_dtype)
        # set_ rather than reshape: a view would keep ``flat`` as its ``_base``, and
        # snapshot() takes tensors with a base as shared.
        layout = (shape,) if stride is None else (shape, stride)
        t = torch.empty(0, dtype=torch_dtype).set_(flat.untyped_storage(), 0, *layout)
        del flat
        key = id(t)
        _RECEIVED[key] = weakref.ref(t, lambda _, key=key: _RECEIVED.pop(key, None))
    else:
        t = torch.empty(shape, dtype=torch_dtype)
    if device != "cpu" and device_available(device):
        # Tensor.to keeps dense strides (channels-last) but not overlapping ones (stride
        # 0): move the memory the strides reach, then lay the strides on it again.
        t = t.to(device) if stride is None else _to_device_strided(t, device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _span(t: torch.Tensor) -> int:
    """Elements of storage that ``t``'s shape and strides reach from its first element
    (torch's strides are never negative)."""
    return 1 + sum((size - 1) * step for size, step in zip(t.shape, t.stride())) if t.numel() else 0


def _to_device_strided(t: torch.Tensor, device: str) -> torch.Tensor:
    memory = torch.as_strided(t, (_span(t),), (1,)).to(device)
    return torch.as_strided(memory, tuple(t.shape), tuple(t.stride()))


def _rebuild_sparse_coo(indices: torch.Tensor, values: torch.Tensor, shape: tuple, coalesced: bool, rg: bool):
    t = torch.sparse_coo_tensor(indices, values, shape, is_coalesced=coalesced)
    return t.requires_grad_(True) if rg else t


def _rebuild_sparse_compressed(layout: str, compressed, plain, values, shape: tuple, rg: bool):
    t = torch.sparse_compressed_tensor(compressed, plain, values, shape, layout=getattr(torch, layout))
    return t.requires_grad_(True) if rg else t


def rebuild_tensordict(batch_size: tuple, device: str | None, names: Any, entries: dict) -> TensorDict:
    """A TensorDict of ``entries``; on CPU when this process lacks ``device``.

    ``entries`` are the columns of a TensorDict the sender held (each of its batch size,
    on its device): a CPU TensorDict without dimension names is rebuilt without checking
    each column again (``TensorDict``'s own checks cost 0.3 µs a column, 13% of a rank's
    time on a 512-key call), anything else through ``TensorDict(...)``.
    """
    device = device if device_available(device) else None
    if names is None and device in (None, "cpu") and _new_unsafe is not None:
        return _new_unsafe(entries, batch_size=torch.Size(batch_size), device=device)
    td = TensorDict(entries, batch_size=batch_size, device=device)
    if names is not None:
        td.names = names
    return td


#: ``TensorDict._new_unsafe`` (tensordict's constructor without checks, which its own
#: operations use), where this tensordict has it.
_new_unsafe = getattr(TensorDict, "_new_unsafe", None)


#: Bytes up to which a TensorDict column travels inside its TensorDict's one shared buffer
#: (:func:`reduce_columns`) rather than as a buffer of its own.
SMALL_COLUMN = 32 << 10
#: Columns from which a TensorDict packs its small ones together.
_PACK_FROM = 4
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def reduce_columns(entries: dict) -> tuple[dict, tuple, Any] | None:
    """The small plain columns of a TensorDict's ``entries`` (``{key: value}``) in one
    byte buffer: ``(rest, packed, buffer)``, or ``None`` when fewer than ``_PACK_FROM``
    columns qualify.

    Every tensor that travels on its own costs a reduce, a pickle-5 buffer (a frame on
    the wire) and a rebuild at each end: ~35 us a column here, 36 ms of driver CPU for a
    512-key batch on 2 ranks, against 7 ms for chunking and concatenating it in the
    driver. Contiguous CPU tensors without gradients of at most :data:`SMALL_COLUMN`
    bytes are copied into one buffer instead (a copy: the buffer is the snapshot of the
    columns, whoever else holds them), largest element size first so that every column
    starts aligned to its element size.

    Returns:
        ``rest``: ``entries`` without the packed columns; ``packed``: ``(key, dtype name,
        shape, byte offset)`` per packed column; ``buffer``: a ``pickle.PickleBuffer``.
    """
    # dtype -> shape -> [(key, column)]: within a dtype, columns of one shape are laid
    # side by side (in their order), so that the other end rebuilds each such run with
    # one torch call (rebuild_columns).
    by_dtype: dict[torch.dtype, dict[tuple, list]] = {}
    count = 0
    for key, t in entries.items():
        if (
            type(t) is torch.Tensor
            and t.layout == torch.strided
            and t.is_cpu
            and not t.requires_grad
            and 0 < t.nbytes <= SMALL_COLUMN
            and t.is_contiguous()
            and not t.dtype.is_complex  # conjugate and negative bits live on complex tensors
        ):
            by_dtype.setdefault(t.dtype, {}).setdefault(t.shape, []).append((key, t))
            count += 1
    if count < _PACK_FROM:
        return None
    flats, packed, taken, offset = [], [], set(), 0
    # One flat copy per dtype (a ``Tensor.view(dtype)`` per column costs more than the
    # copy of a small one; a dtype of several shapes is copied twice, a stack per shape
    # and their concatenation), largest element size first: every column starts aligned.
    for dtype in sorted(by_dtype, key=lambda d: -d.itemsize):
        shapes = by_dtype[dtype]
        # A run of one shape is one torch.stack (no Python per column, unlike a flatten).
        runs = [torch.stack([t for _, t in run]).view(-1) for run in shapes.values()]
        flats.append((runs[0] if len(runs) == 1 else torch.cat(runs)).view(torch.uint8))
        name = _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, _dtype_name(dtype))
        for shape, run in shapes.items():
            shape, nbytes = tuple(shape), run[0][1].nbytes
            for key, _ in run:
                packed.append((key, name, shape, offset))
                taken.add(key)
                offset += nbytes
    flat = flats[0] if len(flats) == 1 else torch.cat(flats)
    rest = {key: value for key, value in entries.items() if key not in taken}
    return rest, tuple(packed), pickle.PickleBuffer(flat.numpy())


def rebuild_columns(
    batch_size: tuple, device: str | None, names: Any, keys: tuple, rest: dict, packed: tuple, buf: Any
) -> TensorDict:
    """The TensorDict :func:`reduce_columns` took apart: its packed columns rebuilt on
    ``buf``'s memory, no copy (they share it), in the order of ``keys``."""
    raw = torch.frombuffer(_writable(buf), dtype=torch.uint8)
    columns = {}
    i, count = 0, len(packed)
    while i < count:
        # A run of columns of one dtype and shape, each right after the one before (as
        # reduce_columns lays them out): one view of the run, unbound into its columns
        # (one torch call for the run, not one or two per column).
        _, dtype, shape, offset = packed[i]
        torch_dtype = getattr(torch, dtype)
        nbytes = math.prod(shape) * torch_dtype.itemsize
        j = i + 1
        while (
            j < count
            and packed[j][1] == dtype
            and packed[j][2] == shape
            and packed[j][3] == offset + (j - i) * nbytes
        ):
            j += 1
        if nbytes and offset % torch_dtype.itemsize == 0:
            run = raw[offset : offset + (j - i) * nbytes].view(torch_dtype).view(j - i, *shape).unbind(0)
            for entry, column in zip(packed[i:j], run):
                columns[entry[0]] = column
        else:
            for key, _, shape_, at in packed[i:j]:
                columns[key] = torch.empty(0, dtype=torch_dtype).set_(
                    raw.untyped_storage(), at // torch_dtype.itemsize, shape_
                )
        i = j
    entries = {key: columns[key] if key in columns else rest[key] for key in keys}
    return rebuild_tensordict(batch_size, device, names, entries)


def reduce_tensor(t: torch.Tensor, copy: bool) -> Any:
    """``(rebuild function, args)`` of ``t`` for pickle's ``reducer_override`` /
    ``__reduce_ex__``, or ``NotImplemented`` for tensors torch must pickle itself (nested,
    quantized, meta).

    Args:
        t: the tensor (any device: CUDA tensors are copied to host memory).
        copy: give the buffer memory of its own (a snapshot of a tensor something else
            may still change); otherwise it shares the tensor's memory where it can.
    """
    layout = t.layout
    rg = bool(t.requires_grad)
    if layout == torch.sparse_coo:
        return _rebuild_sparse_coo, (t._indices(), t._values(), tuple(t.shape), t.is_coalesced(), rg)
    if layout in SPARSE_COMPRESSED:
        first, second = SPARSE_COMPRESSED[layout]
        parts = (getattr(t, first)(), getattr(t, second)(), t.values())
        return _rebuild_sparse_compressed, (str(layout).removeprefix("torch."), *parts, tuple(t.shape), rg)
    if layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
        return NotImplemented  # torch's own pickling
    device = str(t.device)
    # Each torch call below goes through the dispatcher and lets go of the GIL: only the
    # ones this tensor needs are made (a plain CPU tensor: none but the byte view).
    data = t.detach() if rg else t
    if _travels_strided(data):
        return _reduce_strided(data, device, rg, copy)
    fresh = False
    if not data.is_cpu:
        data, fresh = data.cpu(), True
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    if not data.is_contiguous():
        data, fresh = data.contiguous(), True
    if copy and not fresh:
        data = data.clone()
    flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
    return rebuild_tensor, (
        _dtype_name(t.dtype),
        tuple(t.shape),
        device,
        rg,
        pickle.PickleBuffer(flat.numpy()),
    )


def _travels_strided(t: torch.Tensor) -> bool:
    """Whether ``t`` travels as the memory its strides reach, with its strides: a
    non-contiguous layout that reaches no more elements than it has (stride-0
    ``expand``, channels-last, transposes). A strided slice of a larger tensor reaches
    more than its own elements: it travels contiguous, carrying only its own bytes."""
    return (
        t.numel() > 0
        and not t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and _span(t) <= t.numel()
    )


def _reduce_strided(t: torch.Tensor, device: str, rg: bool, copy: bool) -> Any:
    memory = torch.as_strided(t, (_span(t),), (1,))
    if memory.device.type != "cpu":
        memory = memory.cpu()
    elif copy:
        memory = memory.clone()
    return rebuild_tensor, (
        _dtype_name(t.dtype),
        tuple(t.shape),
        device,
        rg,
        pickle.PickleBuffer(memory.view(torch.uint8).numpy()),
        tuple(t.stride()),
    )


class TensorBytes:
    """A tensor that plain ``pickle`` writes with :func:`reduce_tensor` (its own bytes,
    out of band under protocol 5) instead of torch's own pickling; unpickles as the tensor."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __reduce_ex__(self, protocol: int) -> Any:
        reduced = reduce_tensor(self.tensor, copy=False)
        if reduced is NotImplemented:
            return self.tensor.__reduce_ex__(protocol)
        rebuild, args = reduced
        # Buffers need protocol 5 (below it their bytes go in band); a sparse tensor's
        # index and value tensors go the same way as any tensor.
        return rebuild, tuple(
            TensorBytes(a)
            if isinstance(a, torch.Tensor)
            else bytes(a.raw())
            if isinstance(a, pickle.PickleBuffer) and protocol < 5
            else a
            for a in args
        )


def tensordict_state(td: TensorDictBase) -> tuple:
    """``td`` as plain data whose tensors pickle with :func:`reduce_tensor` (what
    ``DataProto.__getstate__`` stores); :func:`tensordict_from_state` rebuilds it.
    TensorDict subclasses (lazy stacks, tensorclasses) keep tensordict's own pickling."""
    if type(td) is not TensorDict:
        return ("o", td)
    entries = {
        key: tensordict_state(value)
        if isinstance(value, TensorDictBase)
        else TensorBytes(value)
        if isinstance(value, torch.Tensor)
        else ("o", value)
        for key, value in td.items()
    }
    names = td.names if td._has_names() else None
    return ("d", tuple(td.batch_size), None if td.device is None else str(td.device), names, entries)


def tensordict_from_state(state: tuple) -> Any:
    """The TensorDict :func:`tensordict_state` described: its tensors rebuilt by pickle, or
    still in their :class:`TensorBytes` when the state was not pickled (``copy.copy``)."""
    if state[0] == "o":
        return state[1]
    _, batch_size, device, names, entries = state
    source = {
        key: value
        if isinstance(value, torch.Tensor)
        else value.tensor
        if isinstance(value, TensorBytes)
        else tensordict_from_state(value)
        for key, value in entries.items()
    }
    return rebuild_tensordict(batch_size, device, names, source)
