"""Ownership snapshots: a rank's result packed as it was when its method returned.

:func:`snapshot` packs a rank's result at the moment its method returned (what Ray's
object store does by copying every result): tensors and arrays that the result owns
alone, which nothing else can change, are referenced without a copy; any other tensor
(``self.w``, a view of a buffer the rank keeps) is copied. :func:`private` asks the same
question of a value without packing it.

Ownership is read from reference counts, as the walk (:func:`_owned`) sees them; the
counts a value held only by its container has are measured (:func:`_calibrate`, a few
tensors walked) by the first :func:`snapshot` or :func:`private` of the process, not at
import: a process that imports daskwg without moving values (the driver before its first
call, a tool that only reads the package) neither pays for nor depends on them.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..protocol import DataProto
from ..wire import codec
from .pickling import Packed, _dump, _is_verl_dataproto

__all__ = ["snapshot", "private"]

_SCALARS = (str, bytes, int, float, bool, type(None))

# Placeholders until _calibrate has measured them (large enough that everything counts as
# private while its probes are walked).
_CHILD_REFS = dict.fromkeys(("list", "dict", "td", "array", "dp"), 1 << 30)
_STORAGE_USES = 1 << 30
_ROOT_REFS = 1 << 30
_calibrated = False
_calibrating = threading.Lock()

# What _owned counts references with: sys.getrefcount, or _calibrate's recording wrapper
# while it measures (swapped here, not in sys, so no other code of the process sees it).
_refcount = sys.getrefcount


_NO_EXTRA: Counter = Counter()


def _storage_private(t: torch.Tensor) -> bool:
    if not t.is_cpu or t.layout != torch.strided:
        return True  # packing copies it to host memory or into index/value tensors anyway
    storage = t.untyped_storage()
    if t._base is not None or storage.is_shared():  # Tensor.is_shared() without its TypedStorage
        return False
    # A storage on memory torch does not own (torch.from_numpy, DLPack) is not resizable;
    # one rebuilt here on received bytes is nobody else's.
    return (storage.resizable() or codec.received(t)) and torch._C._storage_Use_Count(
        storage._cdata
    ) <= _STORAGE_USES


def _owned(
    x: Any, expected: int, parent_private: bool, private: set[int], extra: Counter = _NO_EXTRA, shared=None
) -> None:
    """Add to ``private`` the ids of the tensors/arrays in ``x`` nothing else refers to
    (and to the list ``shared``, if given, whatever in ``x`` something else may hold).

    ``expected`` is the reference count ``x`` has when only its container holds it (as
    this walk visits it, measured once by :func:`_calibrate`); ``extra``
    counts the further references, by id, that do not count (the call's arguments).
    """
    alone = parent_private and _refcount(x) <= expected + extra.get(id(x), 0)
    mine = False  # x itself (a tensor or array) is private
    if isinstance(x, torch.Tensor):
        mine = alone and _storage_private(x)
    elif isinstance(x, np.ndarray) and x.dtype == object:
        for item in x.reshape(-1):
            if not isinstance(item, _SCALARS):
                _owned(item, _CHILD_REFS["array"], alone, private, extra, shared)
        mine = alone
    elif isinstance(x, np.ndarray):
        mine = alone and x.base is None and x.flags.owndata
    elif type(x) in (list, tuple):
        for item in x:
            _owned(item, _CHILD_REFS["list"], alone, private, extra, shared)
        mine = alone
    elif type(x) is dict:
        for item in x.values():
            _owned(item, _CHILD_REFS["dict"], alone, private, extra, shared)
        mine = alone
    elif type(x) is TensorDict:
        for item in x._tensordict.values():
            _owned(item, _CHILD_REFS["td"], alone, private, extra, shared)
        mine = alone
    elif isinstance(x, DataProto) or _is_verl_dataproto(type(x), x):
        for item in (x.batch, x.non_tensor_batch, x.meta_info):
            _owned(item, _CHILD_REFS["dp"], alone, private, extra, shared)
        mine = alone
    if mine and isinstance(x, (torch.Tensor, np.ndarray)) and x.dtype != object:
        private.add(id(x))
    elif not mine and shared is not None and not isinstance(x, _SCALARS):
        shared.append(x)  # held elsewhere, or an object of a class this walk does not open


def _root_owned(obj: Any) -> None:
    # Same frame depth as snapshot(obj) -> _owned(obj, ...).
    _owned(obj, 1 << 30, True, set())


def _calibrate() -> tuple[int, dict[str, int], int]:
    """Reference counts of values held only by their container, as :func:`_owned` sees them."""
    seen: dict[str, int] = {}

    def probe(label: str, make: Any) -> None:
        global _refcount
        container = make()
        observed = []
        original = sys.getrefcount

        def record(x: Any) -> int:
            n = original(x) - 1  # this wrapper's own argument
            observed.append(n)
            return n

        _refcount = record
        try:
            _owned(container, 1 << 30, True, set())
        finally:
            _refcount = original
        seen[label] = observed[-1]

    probe("list", lambda: [torch.zeros(1)])
    probe("dict", lambda: {"a": torch.zeros(1)})
    probe("td", lambda: TensorDict({"a": torch.zeros(1)}, batch_size=[1]))
    probe("array", lambda: np.array([None, torch.zeros(1)], dtype=object)[1:])
    probe("dp", lambda: DataProto(batch=None, meta_info={}))

    def root_probe() -> int:
        global _refcount
        value = [torch.zeros(1)]
        counts = []
        original = sys.getrefcount
        _refcount = lambda x: counts.append(original(x) - 1) or counts[-1]  # noqa: E731
        try:
            _root_owned(value)
        finally:
            _refcount = original
        return counts[0]

    fresh = torch.zeros(1)
    storage = fresh.untyped_storage()
    storage_uses = torch._C._storage_Use_Count(storage._cdata)
    return root_probe(), seen, storage_uses


def _ensure_calibrated() -> None:
    """Measure the counts :func:`_owned` compares with, once per process (any thread; the
    others wait for the first)."""
    global _ROOT_REFS, _CHILD_REFS, _STORAGE_USES, _calibrated
    if _calibrated:
        return
    with _calibrating:
        if not _calibrated:
            _ROOT_REFS, _CHILD_REFS, _STORAGE_USES = _calibrate()
            _calibrated = True


def snapshot(obj: Any, *, held: int = 1, arguments: Iterable[Any] = ()) -> Packed:
    """``obj`` packed as it is now: later in-place changes to its tensors do not show.

    Tensors and numeric arrays that only this result references (a tensor the method
    created and returned, directly or inside dicts, lists, tuples, DataProtos,
    TensorDicts, object arrays) keep their memory; every other one (an attribute of
    the rank, a view of one, a tensor built on a numpy array) is copied. The copy costs
    one ``memcpy`` of that tensor; nothing else is copied.

    Args:
        obj: the value.
        held: how many variables of the calling frames hold ``obj`` (a method's
            return value in the host: its local and the helper's argument, 2); any
            other reference to ``obj`` makes all of it count as shared.
        arguments: the containers (tuples, dicts) holding the call's arguments, which
            are alive but change nothing: a method that returns (a part of) its
            argument returns it without a copy.
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return _dump(obj, None)
    extra: Counter = Counter()
    for container in {id(c): c for c in arguments}.values():
        extra.update(id(v) for v in (container.values() if isinstance(container, dict) else container))
    private: set[int] = set()
    _ensure_calibrated()
    _owned(obj, _ROOT_REFS + held - 1, True, private, extra)
    return _dump(obj, private)


def private(obj: Any, *, held: int = 1) -> bool:
    """Whether ``obj`` is its holders' alone: nothing else refers to it or to any tensor,
    array or container in it (:func:`snapshot` would copy none of it), so it can be handed
    on as it is. Objects of classes :func:`snapshot` does not walk count as shared.

    Args:
        obj: the value.
        held: how many variables of the calling frames hold ``obj`` (as for :func:`snapshot`).
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return True
    shared: list = []
    _ensure_calibrated()
    _owned(obj, _ROOT_REFS + held - 1, True, set(), _NO_EXTRA, shared)
    return not shared
