"""The batch container that flows through worker groups: :class:`DataProto`.

A :class:`DataProto` holds one batch of ``N`` rows in three parts:

* ``batch``: a :class:`tensordict.TensorDict` with ``batch_size == [N]`` (or ``None``),
* ``non_tensor_batch``: a dict of numpy arrays whose first dimension is ``N`` (strings,
  lists, dicts, ... live in 1-D ``object`` arrays),
* ``meta_info``: a plain dict that applies to the whole batch.

It mirrors ``verl.protocol.DataProto`` so verl code ports unchanged, and fixes a few of
its defects; every docstring that departs from verl says "verl does X; daskwg does Y".
Pickling turns every tensor into a flat byte view, so pickle protocol 5 (used by Dask)
ships tensors as out-of-band buffers without copying them, bf16 and fp8 included.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensordict
import torch
from tensordict import TensorDict, TensorDictBase

from .errors import BatchDimsError, ConcatError, ConflictError, MetaInfoConflictError
from .wire import codec

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoConfig",
    "all_gather_data_proto",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "pad_rows",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
    "unpad_rows",
]

logger = logging.getLogger(__name__)

# verl pins the non-legacy lazy behaviour of tensordict; do the same so views and
# stacks behave identically in both projects. Older tensordicts lack the switch.
try:
    tensordict.set_lazy_legacy(False).set()
except Exception:  # pragma: no cover - depends on the tensordict version
    pass


class _DataProtoConfigMeta(type):
    """Gives :class:`DataProtoConfig` a class-level ``auto_padding`` property."""

    _config: dict[str, Any] = {}
    auto_padding_key = "_daskwg_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        from_env = os.getenv("DASKWG_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return from_env or bool(cls._config.get(cls.auto_padding_key, False))

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(
                f"DataProtoConfig.auto_padding takes a bool, got {enabled!r} ({type(enabled).__name__})"
            )
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings, mirroring verl's ``DataProtoConfig``.

    ``DataProtoConfig.auto_padding`` is true when the environment variable
    ``DASKWG_AUTO_PADDING`` is ``1``/``true`` or after ``DataProtoConfig.auto_padding = True``.
    verl reads ``VERL_AUTO_PADDING``; daskwg reads ``DASKWG_AUTO_PADDING``. daskwg's
    ``DP_COMPUTE_PROTO`` dispatch pads uneven batches whatever this says; the flag is kept
    so code written against verl keeps working and for
    [`DataProto.is_padding_enabled`][daskwg.DataProto.is_padding_enabled]. Setting a non-bool raises
    ``TypeError``.
    """


@dataclass
class DataProtoItem:
    """One row of a [`DataProto`][daskwg.DataProto], as returned by ``data[i]`` (verl's ``DataProtoItem``).

    Attributes:
        batch: the row of the TensorDict (``batch_size == []``), or ``None``.
        non_tensor_batch: ``{key: value of row i}``.
        meta_info: the meta_info of the DataProto it came from.
    """

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array with one element per value.

    ``np.array(values, dtype=object)`` turns equal-length lists into a 2-D array, which
    breaks the ``[N]`` shape every non-tensor field must have; filling an empty array
    element by element keeps each value whole.
    """
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _as_non_tensor(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(
                f"non_tensors[{key!r}] is a 0-d array; give one value per row (shape [batch, ...])"
            )
        return value
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"non_tensors[{key!r}] is a torch.Tensor; pass tensors in `tensors`, not `non_tensors`"
        )
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise TypeError(
            f"non_tensors[{key!r}] must be a numpy array or a sequence with one value per row, "
            f"got {type(value).__name__}"
        )
    return _object_array(value)


def _values_equal(a: Any, b: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Deep equality that treats NaN as equal to NaN and compares arrays/tensors by value.

    Containers met again on the same path (an object array holding itself) count as equal,
    so self-referencing values do not recurse forever.
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return bool(torch.equal(a, b))
    if type(a) is not type(b) and not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (np.ndarray, dict, list, tuple)):
        pair = (id(a), id(b))
        seen = set() if _seen is None else _seen
        if pair in seen:
            return True
        seen.add(pair)
        try:
            return _containers_equal(a, b, seen)
        finally:
            seen.discard(pair)
    try:
        return bool(a == b)
    except Exception:  # e.g. objects whose __eq__ returns something without a truth value
        return False


def _containers_equal(a: Any, b: Any, seen: set[tuple[int, int]]) -> bool:
    if isinstance(a, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        return all(_values_equal(x, y, seen) for x, y in zip(a.flat, b.flat))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k], seen) for k in a)
    return len(a) == len(b) and all(_values_equal(x, y, seen) for x, y in zip(a, b))


def _row_index(idxs: Any, n: int) -> np.ndarray:
    """Normalise a row selection into a 1-D numpy int64 or bool array, validated against ``n``."""
    if isinstance(idxs, torch.Tensor):
        arr = idxs.detach().cpu().numpy()
    elif isinstance(idxs, np.ndarray):
        arr = idxs
    elif isinstance(idxs, (list, tuple, range)):
        if len(idxs) == 0:
            arr = np.zeros(0, dtype=np.int64)
        elif all(isinstance(i, (bool, np.bool_)) for i in idxs):
            arr = np.asarray(idxs, dtype=bool)
        else:
            arr = np.asarray(idxs)
    else:
        raise TypeError(f"row indices must be a list, numpy array or torch tensor, got {type(idxs).__name__}")
    if arr.ndim != 1:
        raise IndexError(f"row indices must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == bool:
        if arr.shape[0] != n:
            raise IndexError(f"boolean mask has {arr.shape[0]} entries but the DataProto has {n} rows")
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row indices must be integers or booleans, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.max() >= n or arr.min() < -n:
        raise IndexError(f"row index out of range for a DataProto of {n} rows (got {arr.min()}..{arr.max()})")
    return arr


def _merge_metrics(merged: dict[str, list[Any]], metrics: Any, part: int) -> None:
    """Add one part's ``meta_info["metrics"]`` to ``merged`` (name -> list of values)."""
    if metrics is None:
        return
    # verl workers also report metrics as a list of per-step dicts; accept both shapes.
    entries = metrics if isinstance(metrics, list) else [metrics]
    for entry in entries:
        if not isinstance(entry, dict):
            raise TypeError(
                f"meta_info['metrics'] of part {part} must be a dict of name -> value(s) "
                f"(or a list of such dicts), got {type(entry).__name__}"
            )
        for name, value in entry.items():
            bucket = merged.setdefault(name, [])
            if isinstance(value, list):
                bucket.extend(value)
            else:
                bucket.append(value)


def _check_trailing_shapes(what: str, shapes: Sequence[Sequence[int]]) -> None:
    """Raise :class:`ConcatError` unless every shape is the same after dim 0."""
    trailing = [tuple(shape[1:]) for shape in shapes]
    if len(set(trailing)) > 1:
        raise ConcatError(
            f"{what} has different shapes after dim 0",
            {i: list(shape) for i, shape in enumerate(shapes)},
            hint="every part must have the same shape except the number of rows; pad each part to a "
            "common length (e.g. the longest response of the whole batch) before concatenating",
        )


def concat_tensordicts(parts: Sequence[TensorDictBase]) -> TensorDictBase:
    """``torch.cat(parts, dim=0)`` after checking that every leaf has matching trailing dims.

    Raises:
        ConcatError: a leaf's shape differs after dim 0 between parts (field and shapes named).
    """
    for key in parts[0].keys(include_nested=True, leaves_only=True):
        shapes = []
        for part in parts:
            value = part.get(key)
            shape = getattr(value, "shape", None)
            if shape is None or getattr(value, "is_nested", False):
                break
            shapes.append(tuple(shape))
        else:
            name = ".".join(key) if isinstance(key, tuple) else key
            _check_trailing_shapes(f"batch key {name!r}", shapes)
    large = _cat_large(parts)
    return large if large is not None else torch.cat(list(parts), dim=0)


#: Bytes of a concatenated column from which its memory comes from numpy (huge pages).
_LARGE_CAT = 1 << 20


def concat_small_columns(parts: list[Any]) -> Any:
    """``DataProto.concat(parts)`` of parts whose columns are all small (a wide batch: many
    keys of few bytes, as ranks return them), with one ``torch.cat`` per key and no other
    Python per key and part: ``None`` where the parts are not such (not flat TensorDicts,
    columns of :data:`_LARGE_CAT` bytes or more, non-tensor entries, parts that disagree),
    and the caller concatenates them as before. ``parts``: DataProtos, left as they are.

    ``torch.cat`` is what ``DataProto.concat`` runs per key too (through ``tensordict``), so
    its result is the same: each column a tensor of its own, dtypes promoted as it does,
    gradients tracked as it does. Parts whose keys differ, or whose shapes do not
    concatenate, go to the ordinary path, which raises ``DataProto.concat``'s errors.
    """
    if len(parts) < 2 or not all(
        p.batch is not None
        and type(p.batch) is TensorDict
        and p.batch.device in (None, torch.device("cpu"))
        and p.batch.batch_dims == 1
        and p.batch.names[0] is None
        for p in parts
    ):
        return None
    columns = [p.batch._tensordict for p in parts]
    first = columns[0]
    if any(len(cols) != len(first) for cols in columns):
        return None
    count = len(parts)
    out: dict[str, Any] = {}
    try:
        for key, t in first.items():
            if type(t) is not torch.Tensor or not t.dim() or t.nbytes * count >= _LARGE_CAT:
                return None
            out[key] = torch.cat([cols[key] for cols in columns])
    except (KeyError, RuntimeError, TypeError, ValueError):
        return None
    shells = [type(p)(batch=None, non_tensor_batch=p.non_tensor_batch, meta_info=p.meta_info) for p in parts]
    merged = DataProto.concat(shells)
    rows = sum(p.batch.batch_size[0] for p in parts)
    batch = TensorDict(out, batch_size=[rows], device=parts[0].batch.device)
    return type(merged)(batch=batch, non_tensor_batch=merged.non_tensor_batch, meta_info=merged.meta_info)


def _cat_large(parts: Sequence[TensorDictBase]) -> TensorDict | None:
    """``torch.cat(parts)`` of plain TensorDicts of CPU tensors, each column of at least
    :data:`_LARGE_CAT` bytes written into one block from :func:`daskwg.wire.codec.owned_empty`
    (collecting a 64 MiB batch: 18 -> 12 ms here); ``None`` for anything else."""
    first = parts[0]
    if any(type(p) is not TensorDict for p in parts) or first.batch_dims < 1 or first.names[0] is not None:
        return None
    # Small batches (every tiny call of an RL step) leave at once: no column can reach the
    # threshold when the largest per-row size times all the rows stays below it.
    rows = sum(p.batch_size[0] for p in parts)
    tallest = max(parts, key=lambda p: p.batch_size[0])._tensordict.values()
    widest = max(
        (v.nbytes // v.shape[0] for v in tallest if isinstance(v, torch.Tensor) and v.numel()), default=0
    )
    if widest * rows < _LARGE_CAT:
        return None
    keys = list(first._tensordict)
    columns = {}
    large = False
    for key in keys:
        values = [p._tensordict.get(key) for p in parts]
        if (
            not all(
                type(v) is torch.Tensor
                and v.layout is torch.strided
                and v.device.type == "cpu"
                and not v.requires_grad
                for v in values
            )
            or len({v.dtype for v in values}) != 1
            or any(len(p._tensordict) != len(keys) for p in parts)
        ):
            return None
        shape = (sum(v.shape[0] for v in values), *values[0].shape[1:])
        if math.prod(shape) * values[0].element_size() >= _LARGE_CAT:
            large = True
            columns[key] = torch.cat(values, 0, out=codec.owned_empty(shape, values[0].dtype))
        else:
            columns[key] = torch.cat(values, 0)
    if not large:
        return None
    return TensorDict(columns, batch_size=[rows, *first.batch_size[1:]], device=first.device)


def _check_union_tensors(td1: TensorDictBase, td2: TensorDictBase, what: str) -> None:
    if td1.batch_size != td2.batch_size:
        raise ConflictError(
            f"cannot union TensorDicts of batch sizes {list(td1.batch_size)} and {list(td2.batch_size)}"
        )
    for key in td2.keys():
        if key in td1.keys() and not _values_equal(td1[key], td2[key]):
            raise ConflictError(f"cannot union: {what} {key!r} differs between the two sides")


def _check_union_arrays(d1: dict[str, Any], d2: dict[str, Any], what: str) -> None:
    for key, value in d2.items():
        if key not in d1:
            continue
        for side, array in (("first", d1[key]), ("second", value)):
            if not isinstance(array, np.ndarray):
                raise TypeError(
                    f"{what} {key!r} of the {side} side is a {type(array).__name__}, not a numpy array"
                )
        if not _values_equal(d1[key], value):
            # The first sentence is verl's (union_numpy_dict), which callers match on.
            raise ConflictError(
                f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object. "
                f"Cannot union: {what} {key!r} differs between the two sides"
            )


# ------------------------------------------------------------- zero-copy pickling

#: The version of ``DataProto.__getstate__``'s state (2: tensors through ``daskwg.wire.codec``).
_STATE_VERSION = 2


# --------------------------------------------------------------------- DataProto


@dataclass(eq=False, repr=False)
class DataProto:
    """A batch of ``N`` rows: tensors, non-tensor values and batch-wide metadata.

    Mirrors ``verl.protocol.DataProto``.

    Attributes:
        batch: ``TensorDict`` with ``batch_size == [N]``, or ``None`` when there are no tensors.
        non_tensor_batch: ``{key: np.ndarray of shape [N, ...]}``; non-numeric values are kept
            in 1-D ``object`` arrays.
        meta_info: ``dict`` of values that apply to the whole batch.

    Raises (at construction, via [`check_consistency`][daskwg.DataProto.check_consistency]):
        TypeError: a part has the wrong type.
        ValueError: the parts disagree on ``N`` or the TensorDict has more than one batch dim.
    """

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ------------------------------------------------------------------ building

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build a DataProto from ``{key: tensor [N, ...]}`` and ``{key: N values}``.

        Mirrors verl's ``DataProto.from_dict``. Lists in ``non_tensors`` become 1-D object
        arrays of length ``N`` even when every element is a list of the same length (verl's
        ``np.array(..., dtype=object)`` makes those 2-D). The input dicts are not modified
        (verl writes the converted arrays, and the padding flag, back into them).

        Args:
            tensors: tensors sharing dim 0 (``N``).
            non_tensors: numpy arrays ``[N, ...]`` or sequences of ``N`` values.
            meta_info: batch-wide metadata (copied shallowly).
            num_batch_dims: must be 1; kept for verl's signature.
            auto_padding: mark this DataProto as padding-enabled
                ([`is_padding_enabled`][daskwg.DataProto.is_padding_enabled]).

        Returns:
            DataProto with ``len == N`` (``batch`` is ``None`` when ``tensors`` is empty).

        Raises:
            BatchDimsError: ``num_batch_dims != 1`` (a ``ValueError`` and an ``AssertionError``).
            ValueError: tensors disagree on ``N``, or lengths differ.
            TypeError: a non-tensor value is not an array or sequence.
        """
        if num_batch_dims != 1:
            raise BatchDimsError(
                f"DataProto has exactly one batch dimension, got num_batch_dims={num_batch_dims}; "
                "build it with one batch dim and use fold_batch_dim to group rows"
            )
        tensors = dict(tensors or {})
        meta = dict(meta_info or {})
        batch_size: torch.Size | None = None
        pivot = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dim() == 0:
                raise ValueError(f"tensors[{key!r}] is 0-d; every tensor needs a batch dimension")
            if batch_size is None:
                batch_size, pivot = tensor.shape[:1], key
            elif tensor.shape[:1] != batch_size:
                raise ValueError(
                    f"tensors disagree on the batch size: {pivot!r} has {batch_size[0]} rows, "
                    f"{key!r} has {tensor.shape[0]}"
                )
        converted = {key: _as_non_tensor(key, value) for key, value in (non_tensors or {}).items()}
        batch = TensorDict(tensors, batch_size=batch_size) if tensors else None
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=converted, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls,
        data: dict[str, torch.Tensor | np.ndarray],
        meta_info: dict[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build a DataProto from one dict, routing tensors to ``batch`` and numpy arrays to
        ``non_tensor_batch``. Mirrors verl's ``DataProto.from_single_dict``.

        Raises:
            TypeError: a value is neither a ``torch.Tensor`` nor a ``np.ndarray``.
        """
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data[{key!r}] is a {type(value).__name__}; from_single_dict takes torch.Tensor or "
                    "np.ndarray values (use from_dict for lists)"
                )
        return cls.from_dict(
            tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding
        )

    def check_consistency(self) -> None:
        """Check the types and that every field has the same number of rows.

        Mirrors verl's ``DataProto.check_consistency`` (which asserts; daskwg raises).

        Raises:
            TypeError: ``batch`` is not a TensorDict, or a non-tensor value is not an ndarray.
            ValueError: the TensorDict has more or fewer than one batch dim, a non-tensor
                array is 0-d, or the fields disagree on the number of rows.
        """
        n = None
        if self.batch is not None:
            if not isinstance(self.batch, TensorDictBase):
                raise TypeError(
                    f"DataProto.batch must be a TensorDict or None, got {type(self.batch).__name__}"
                )
            if len(self.batch.batch_size) != 1:
                raise ValueError(
                    f"DataProto.batch must have exactly one batch dim, got batch_size={list(self.batch.batch_size)}"
                )
            n = self.batch.batch_size[0]
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] must be a numpy array (dtype=object for non-numbers), "
                    f"got {type(value).__name__}; DataProto.from_dict converts lists for you"
                )
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is 0-d; it needs one value per row")
            if n is None:
                n = value.shape[0]
            elif value.shape[0] != n:
                raise ValueError(f"non_tensor_batch[{key!r}] has {value.shape[0]} rows, expected {n}")

    # ----------------------------------------------------------------- basics

    def __len__(self) -> int:
        """Number of rows; taken from the non-tensor fields when ``batch`` is None, 0 if empty."""
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def __repr__(self) -> str:
        fields: list[str] = []
        if self.batch is not None:
            for key, t in self.batch.items(include_nested=True, leaves_only=True):
                if isinstance(t, torch.Tensor):
                    fields.append(f"{key}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} {t.device}")
                else:
                    fields.append(f"{key}: {type(t).__name__}")
        non_tensor = [f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.non_tensor_batch.items()]
        return (
            f"{type(self).__name__}(len={len(self)}, batch={{{', '.join(fields)}}}, "
            f"non_tensor_batch={{{', '.join(non_tensor)}}}, meta_info_keys={list(self.meta_info)})"
        )

    def _derive(self, batch: TensorDictBase | None, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        # Each derived DataProto gets its own meta_info dict so that editing one chunk's
        # meta_info does not change its siblings (verl hands them all the same dict).
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """Index rows. Mirrors verl's ``DataProto.__getitem__``.

        Args:
            item: ``int`` -> :class:`DataProtoItem`; ``slice`` -> :meth:`slice`;
                list / ``np.ndarray`` / ``torch.Tensor`` of ints or bools -> :meth:`select_idxs`.

        Raises:
            IndexError: an int out of range.
            TypeError: any other index type.
        """
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, range, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} is out of range for a DataProto of {n} rows")
            row = self.batch[int(item)] if self.batch is not None else None
            values = {key: value[item] for key, value in self.non_tensor_batch.items()}
            return DataProtoItem(batch=row, non_tensor_batch=values, meta_info=self.meta_info)
        raise TypeError(f"DataProto cannot be indexed with {type(item).__name__}")

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Keep a subset of the keys; ``None`` keeps all keys of that part.

        Mirrors verl's ``DataProto.select``: missing non-tensor and meta keys are skipped,
        missing batch keys raise ``KeyError``. With ``deepcopy=True`` verl copies only the
        non-tensor and meta parts; daskwg clones the tensors too.

        Returns:
            DataProto with the same ``N`` rows.

        Raises:
            KeyError: a batch key is missing, or batch keys were given for a tensor-less DataProto.
        """
        batch = self.batch
        if batch_keys is not None:
            if batch is None:
                raise KeyError(f"batch_keys={list(batch_keys)} given but this DataProto has no tensors")
            batch = batch.select(*batch_keys)
        if non_tensor_batch_keys is not None:
            wanted = set(non_tensor_batch_keys)
            non_tensor = {k: v for k, v in self.non_tensor_batch.items() if k in wanted}
        else:
            non_tensor = dict(self.non_tensor_batch)
        if meta_info_keys is not None:
            wanted = set(meta_info_keys)
            meta = {k: v for k, v in self.meta_info.items() if k in wanted}
        else:
            meta = dict(self.meta_info)
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def select_idxs(self, idxs: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor) -> DataProto:
        """Select rows by integer indices or a boolean mask. Mirrors verl's ``select_idxs``.

        Args:
            idxs: 1-D ints (any order, repeats allowed, negatives count from the end) or a
                bool mask of length ``N``; as a list, ``np.ndarray`` or ``torch.Tensor``.

        Returns:
            DataProto with ``len(idxs)`` rows (``mask.sum()`` for a mask); tensors are copies.

        Raises:
            IndexError: an index out of range, a mask of the wrong length, or a 2-D index.
            TypeError: an index of another dtype or type.
        """
        index = _row_index(idxs, len(self))
        batch = self.batch[torch.from_numpy(index)] if self.batch is not None else None
        non_tensor = {key: value[index] for key, value in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as a DataProto (``data[a:b]``). Mirrors verl's ``DataProto.slice``.

        Tensors are views of this DataProto's tensors, as with torch slicing.

        Raises:
            ValueError: ``step`` is not positive (torch cannot take negative steps).
        """
        if step is not None and step <= 0:
            raise ValueError(f"slice step must be positive, got {step}")
        sl = slice(start, end, step)
        batch = self.batch[sl] if self.batch is not None else None
        non_tensor = {key: value[sl] for key, value in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove keys from this DataProto (in place, like ``dict.pop``) and return them.

        Mirrors verl's ``DataProto.pop``.

        Returns:
            DataProto holding the popped keys (``batch`` is None when no batch key was popped).

        Raises:
            KeyError: a key is missing; nothing is removed in that case.
        """
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(batch_keys or []),
            list(non_tensor_batch_keys or []),
            list(meta_info_keys or []),
        )
        have = set(self.batch.keys()) if self.batch is not None else set()
        for part, keys, present in (
            ("batch", batch_keys, have),
            ("non_tensor_batch", non_tensor_batch_keys, self.non_tensor_batch),
            ("meta_info", meta_info_keys, self.meta_info),
        ):
            missing = [k for k in keys if k not in present]
            if missing:
                raise KeyError(f"cannot pop {missing} from {part}; it has {sorted(present)}")
        tensors = {key: self.batch.pop(key) for key in batch_keys}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys}
        meta = {key: self.meta_info.pop(key) for key in meta_info_keys}
        return type(self).from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename keys in place and return ``self``. Mirrors verl's ``DataProto.rename``.

        verl renames batch keys only; daskwg also renames a key found in ``non_tensor_batch``.

        Raises:
            TypeError: keys are not a str or a list of str.
            ValueError: the two lists differ in length.
            KeyError: an old key exists in neither part.
        """

        def as_list(keys: Any, name: str) -> list[str]:
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
                return list(keys)
            raise TypeError(f"{name} must be a str or a list of str, got {keys!r}")

        old, new = as_list(old_keys, "old_keys"), as_list(new_keys, "new_keys")
        if len(old) != len(new):
            raise ValueError(f"old_keys has {len(old)} keys but new_keys has {len(new)}")
        batch_keys = set(self.batch.keys()) if self.batch is not None else set()
        for o in old:
            if o not in batch_keys and o not in self.non_tensor_batch:
                raise KeyError(f"cannot rename {o!r}: no such key in batch or non_tensor_batch")
        for o, n in zip(old, new):
            if o in batch_keys:
                self.batch.rename_key_(o, n)
            else:
                self.non_tensor_batch[n] = self.non_tensor_batch.pop(o)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other``'s keys into this DataProto (in place, like verl) and return ``self``.

        Mirrors verl's ``DataProto.union``. Keys present on both sides must hold equal values
        (NaN equals NaN). Everything is checked before anything is changed, so a failed
        union leaves ``self`` as it was (verl may have merged the batch before failing).

        Raises:
            TypeError: ``other`` is not a DataProto.
            ConflictError: the row counts differ, or a shared key holds different values (a
                ``ValueError`` and, as verl asserts here, an ``AssertionError``).
        """
        if not isinstance(other, DataProto):
            raise TypeError(f"union takes a DataProto, got {type(other).__name__}")
        if self._has_fields() and other._has_fields() and len(self) != len(other):
            raise ConflictError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        if self.batch is not None and other.batch is not None:
            _check_union_tensors(self.batch, other.batch, "batch key")
        _check_union_arrays(self.non_tensor_batch, other.non_tensor_batch, "non_tensor_batch key")
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise ConflictError(
                    f"cannot union: meta_info key {key!r} differs ({self.meta_info[key]!r} vs {value!r})"
                )
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch
            else:
                for key in other.batch.keys():
                    if key not in self.batch.keys():
                        self.batch[key] = other.batch[key]
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        return self

    def _has_fields(self) -> bool:
        return self.batch is not None or bool(self.non_tensor_batch)

    # --------------------------------------------------------- splitting, joining

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split the rows into exactly ``chunks`` consecutive pieces.

        Mirrors verl's ``DataProto.chunk`` with a fix: verl follows ``torch.chunk`` (pieces of
        ``ceil(N/k)`` rows), so it can return fewer pieces than asked (14 for 124 rows into
        15) and split non-tensor fields at other boundaries than tensors. daskwg always
        returns ``chunks`` pieces, tensors and non-tensors cut at the same rows: equal pieces
        when ``chunks`` divides ``N``, otherwise the first ``N % chunks`` pieces get one extra
        row. Every piece gets a shallow copy of ``meta_info``.

        Args:
            chunks: number of pieces ``k``, ``1 <= k <= N``.

        Returns:
            list of ``k`` DataProtos, piece ``i`` has ``N // k + (i < N % k)`` rows.

        Raises:
            TypeError: ``chunks`` is not an int.
            ValueError: ``chunks < 1`` or ``N < chunks`` (pad first with
                [`pad_dataproto_to_divisor`][daskwg.pad_dataproto_to_divisor]).
        """
        if not isinstance(chunks, (int, np.integer)) or isinstance(chunks, bool):
            raise TypeError(f"chunks must be an int, got {type(chunks).__name__}")
        n = len(self)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if n < chunks:
            raise ValueError(
                f"cannot split {n} rows into {chunks} non-empty chunks; pad first with "
                f"pad_dataproto_to_divisor(data, {chunks}) and unpad the result"
            )
        base, extra = divmod(n, int(chunks))
        sizes = [base + (1 if i < extra else 0) for i in range(chunks)]
        bounds = np.cumsum(sizes)[:-1]
        batches = list(self.batch.split(sizes, dim=0)) if self.batch is not None else [None] * chunks
        pieces_per_key = {key: np.split(value, bounds) for key, value in self.non_tensor_batch.items()}
        return [
            self._derive(batches[i], {key: pieces[i] for key, pieces in pieces_per_key.items()})
            for i in range(chunks)
        ]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into pieces of ``split_size`` rows; the last one may be shorter.

        Mirrors verl's ``DataProto.split``.

        Returns:
            ``ceil(N / split_size)`` DataProtos (views of this one's tensors).

        Raises:
            ValueError: ``split_size < 1``.
        """
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate DataProtos along the rows. Mirrors verl's ``DataProto.concat``.

        ``meta_info`` keys other than ``"metrics"`` must agree across parts (a key missing in
        some parts is fine) and are kept once. ``meta_info["metrics"]`` is gathered from every
        part into ``{name: [values in part order]}``: a scalar adds one element, a list
        extends; a part may also give a list of such dicts (verl's format). Older verl releases
        kept only the first part's metrics.

        Every field must have the same shape after dim 0 in every part; verl lets ``torch.cat``
        fail with a message naming neither field nor part, daskwg names both.

        Args:
            data: non-empty list of DataProtos with the same batch and non-tensor keys.

        Returns:
            DataProto with ``sum(len(d))`` rows, of the type of ``data[0]``.

        Raises:
            ValueError: ``data`` is empty, parts differ in keys or in having tensors.
            ConcatError: a tensor or numeric non-tensor field has different shapes after dim 0
                in different parts (the field and each part's shape are named).
            MetaInfoConflictError: two parts give different values for a non-metric meta key
                (the key and each part's value are named; it is also an ``AssertionError``,
                what verl raises).
            TypeError: an element is not a DataProto.
        """
        parts = list(data)
        if not parts:
            raise ValueError("DataProto.concat needs at least one DataProto")
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise TypeError(f"DataProto.concat: element {i} is a {type(part).__name__}, not a DataProto")
        has_batch = [p.batch is not None for p in parts]
        if any(has_batch) and not all(has_batch):
            raise ValueError(
                f"DataProto.concat: parts {[i for i, h in enumerate(has_batch) if not h]} have no tensors "
                "while others do"
            )
        batch = None
        if all(has_batch):
            keys0 = set(parts[0].batch.keys(True, True))
            for i, part in enumerate(parts[1:], start=1):
                keys = set(part.batch.keys(True, True))
                if keys != keys0:
                    raise ValueError(
                        f"DataProto.concat: part {i} has batch keys {sorted(map(str, keys))}, "
                        f"part 0 has {sorted(map(str, keys0))}"
                    )
            batch = concat_tensordicts([p.batch for p in parts])
        keys0 = list(parts[0].non_tensor_batch)
        for i, part in enumerate(parts[1:], start=1):
            if set(part.non_tensor_batch) != set(keys0):
                raise ValueError(
                    f"DataProto.concat: part {i} has non-tensor keys {sorted(part.non_tensor_batch)}, "
                    f"part 0 has {sorted(keys0)}"
                )
        for key in keys0:
            _check_trailing_shapes(
                f"non_tensor_batch key {key!r}", [p.non_tensor_batch[key].shape for p in parts]
            )
        non_tensor = {key: np.concatenate([p.non_tensor_batch[key] for p in parts], axis=0) for key in keys0}

        meta: dict[str, Any] = {}
        metrics: dict[str, list[Any]] = {}
        saw_metrics = False
        conflicts: list[str] = []
        for i, part in enumerate(parts):
            for key, value in part.meta_info.items():
                if key == "metrics":
                    saw_metrics = saw_metrics or value is not None
                    _merge_metrics(metrics, value, i)
                elif key not in meta:
                    meta[key] = value
                elif key not in conflicts and not _values_equal(meta[key], value):
                    conflicts.append(key)
        if conflicts:
            key = conflicts[0]
            raise MetaInfoConflictError(
                f"Conflicting values for meta_info key {key!r}",
                {i: p.meta_info[key] for i, p in enumerate(parts) if key in p.meta_info},
                hint="non-metric meta_info keys must be equal in every part; put per-part values in "
                "meta_info['metrics'] (merged into lists) or in non_tensor_batch (one value per row)",
            )
        if saw_metrics:
            meta["metrics"] = metrics
        return type(parts[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ------------------------------------------------------------ reshaping rows

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Permute the rows in place (as verl does): row ``i`` becomes old row ``indices[i]``.

        Mirrors verl's ``DataProto.reorder``; accepts lists and numpy arrays too.

        Raises:
            IndexError / TypeError: as [`select_idxs`][daskwg.DataProto.select_idxs].
        """
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times. Mirrors verl's ``DataProto.repeat``.

        ``interleave=True`` gives ``a, a, b, b, c, c``; ``False`` gives ``a, b, c, a, b, c``.

        Returns:
            DataProto with ``N * repeat_times`` rows (copies).

        Raises:
            ValueError: ``repeat_times`` is negative or not an int.
        """
        if not isinstance(repeat_times, (int, np.integer)) or repeat_times < 0:
            raise ValueError(f"repeat_times must be a non-negative int, got {repeat_times!r}")
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self.select_idxs(index)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row ``i`` ``repeat_times[i]`` times, keeping row order.

        Mirrors verl's ``DataProto.sample_level_repeat``: ``[3, 1, 2]`` on ``a, b, c`` gives
        ``a, a, a, b, c, c``.

        Returns:
            DataProto with ``sum(repeat_times)`` rows.

        Raises:
            ValueError: ``repeat_times`` is not 1-D of length ``N`` or has negative entries.
        """
        if isinstance(repeat_times, torch.Tensor):
            times = repeat_times.detach().cpu().numpy()
        else:
            times = np.asarray(list(repeat_times) if isinstance(repeat_times, tuple) else repeat_times)
        if times.ndim != 1 or times.shape[0] != len(self):
            raise ValueError(
                f"repeat_times must have one entry per row ({len(self)}), got shape {times.shape}"
            )
        if times.size and (times.dtype.kind not in "iu" or times.min() < 0):
            raise ValueError(f"repeat_times must be non-negative ints, got {times.tolist()}")
        return self.select_idxs(np.repeat(np.arange(len(self)), times.astype(np.int64)))

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut dim 1 of ``split_keys`` into ``n_split`` pieces and move them into the rows.

        Mirrors verl's ``DataProto.unfold_column_chunks``: keys in ``split_keys`` go from
        ``[N, C, ...]`` to ``[N * n_split, C // n_split, ...]``; the other keys repeat each
        row ``n_split`` times. A non-tensor split key holding lists of one length ``C`` (a
        1-D object array in daskwg, 2-D in verl) gives verl's result, a 2-D object array
        ``[N * n_split, C // n_split]`` of the elements: ``[["a1", "a2"], ["b1", "b2"]]``
        split in 2 is ``[["a1"], ["a2"], ["b1"], ["b2"]]``. Lists of different lengths
        (verl cannot split them) are each cut into ``n_split`` slices, kept 1-D.

        Returns:
            DataProto with ``N * n_split`` rows.

        Raises:
            ValueError: ``n_split < 1`` or a split key's dim 1 (or element length) is not
                divisible by ``n_split``.
        """
        if n_split < 1:
            raise ValueError(f"n_split must be >= 1, got {n_split}")
        split = set(split_keys or [])

        def cut_columns(key: str, value: Any) -> Any:
            if value.ndim < 2 or value.shape[1] % n_split:
                raise ValueError(
                    f"{key!r} has shape {tuple(value.shape)}; dim 1 must be divisible by {n_split}"
                )
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        def cut_elements(key: str, value: np.ndarray) -> np.ndarray:
            lengths = {len(e) if isinstance(e, (list, tuple, np.ndarray)) else -1 for e in value}
            if len(lengths) == 1 and (width := lengths.pop()) >= 0:
                table = np.empty((len(value), width), dtype=object)
                for i, element in enumerate(value):
                    for j, item in enumerate(element):
                        table[i, j] = item
                return cut_columns(key, table)
            pieces = []
            for element in value:
                if len(element) % n_split:
                    raise ValueError(
                        f"{key!r} holds an element of length {len(element)}, not divisible by {n_split}"
                    )
                width = len(element) // n_split
                pieces.extend(element[j * width : (j + 1) * width] for j in range(n_split))
            return _object_array(pieces)

        batch = None
        if self.batch is not None:
            source = {
                k: cut_columns(k, v) if k in split else v.repeat_interleave(n_split, dim=0)
                for k, v in self.batch.items()
            }
            batch = TensorDict(source, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensor = {}
        for k, v in self.non_tensor_batch.items():
            if k not in split:
                non_tensor[k] = np.repeat(v, n_split, axis=0)
            elif v.ndim == 1 and v.dtype == object:
                non_tensor[k] = cut_elements(k, v)
            else:
                non_tensor[k] = cut_columns(k, v)
        return self._derive(batch, non_tensor)

    def fold_batch_dim(self, new_batch_size: int) -> DataProto:
        """Group rows: ``[N, ...]`` -> ``[new_batch_size, N // new_batch_size, ...]``.

        Mirrors verl's module-level ``fold_batch_dim(data, new_batch_size)``. Non-tensor
        arrays become ``[new_batch_size, N // new_batch_size, ...]`` too. The result's batch
        dimension is the first one, so chunking it keeps groups together.

        Raises:
            ValueError: ``N`` is not divisible by ``new_batch_size``.
        """
        n = len(self)
        if new_batch_size < 1 or n % new_batch_size:
            raise ValueError(
                f"cannot fold {n} rows into {new_batch_size} groups; {n} must be a multiple of it"
            )
        batch = None
        if self.batch is not None:
            batch = self.batch.reshape(new_batch_size, -1)
            batch.batch_size = torch.Size([new_batch_size])
        non_tensor = {
            k: v.reshape(new_batch_size, n // new_batch_size, *v.shape[1:])
            for k, v in self.non_tensor_batch.items()
        }
        return self._derive(batch, non_tensor)

    def unfold_batch_dim(self, batch_dims: int = 2) -> DataProto:
        """Flatten the first ``batch_dims`` dims into the rows; the inverse of
        [`fold_batch_dim`][daskwg.DataProto.fold_batch_dim].

        Mirrors verl's module-level ``unfold_batch_dim(data, batch_dims)``, without changing
        this DataProto's batch size as a side effect (verl does).

        Raises:
            ValueError: the tensors do not share their first ``batch_dims`` dims.
        """
        batch = None
        if self.batch is not None:
            widened = self.batch.copy()
            widened.auto_batch_size_(batch_dims=batch_dims)
            if len(widened.batch_size) != batch_dims:
                shapes = {k: list(t.shape) for k, t in self.batch.items(True, True)}
                raise ValueError(f"tensors do not share their first {batch_dims} dims: {shapes}")
            batch = widened.reshape(-1)
        non_tensor = {k: v.reshape(-1, *v.shape[batch_dims:]) for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, non_tensor)

    # -------------------------------------------------------------------- padding

    def is_padding_enabled(self) -> bool:
        """True when this DataProto was built with ``auto_padding=True`` or
        ``DataProtoConfig.auto_padding`` is on. Mirrors verl's ``is_padding_enabled``."""
        return (
            bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding
        )

    def padding(self, padding_size: int, padding_candidate: str = "") -> DataProto:
        """Append ``padding_size`` copies of one row to this DataProto, in place, and return ``self``.

        Mirrors verl's ``DataProto.padding``: the caller's DataProto grows (``[1, 2, 3]``
        padded by 2 becomes ``[1, 2, 3, 3, 3]``); the repeated row is the last one, or the
        first with ``padding_candidate="first"`` (``[1, 2, 3, 1, 1]``). verl returns ``None``;
        daskwg also returns ``self``. ``meta_info`` is kept. To pad without touching the
        caller's batch use [`pad_dataproto_to_divisor`][daskwg.pad_dataproto_to_divisor], which pads a copy.

        Args:
            padding_size: rows to append, ``>= 0``.
            padding_candidate: ``""`` or ``"last"`` repeat the last row, ``"first"`` the first
                (verl takes any other string as ``"last"``; daskwg refuses it).

        Returns:
            ``self``, now ``N + padding_size`` rows long.

        Raises:
            ValueError: negative ``padding_size``, an unknown ``padding_candidate``, or
                padding an empty DataProto (there is no row to repeat).
        """
        if padding_size < 0:
            raise ValueError(f"padding_size must be >= 0, got {padding_size}")
        if padding_candidate not in ("", "first", "last"):
            raise ValueError(f"padding_candidate must be '', 'first' or 'last', got {padding_candidate!r}")
        n = len(self)
        if padding_size == 0:
            return self
        if n == 0:
            raise ValueError("cannot pad a DataProto with no rows: there is no row to repeat")
        row = 0 if padding_candidate == "first" else n - 1
        index = np.concatenate([np.arange(n, dtype=np.int64), np.full(padding_size, row, dtype=np.int64)])
        padded = self.select_idxs(index)
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch
        return self

    # ---------------------------------------------------------------- iteration

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Iterate over mini-batches for ``epochs`` epochs. Mirrors verl's ``make_iterator``.

        Built on ``torch.utils.data.DataLoader`` like verl, with ``dataloader_kwargs`` passed
        through (``shuffle=True`` to shuffle); ``seed`` seeds its generator so two iterators
        with the same seed yield the same mini-batches. verl stacks rows one by one and needs
        tensors; daskwg gathers each mini-batch with one [`select_idxs`][daskwg.DataProto.select_idxs] and
        also works when ``batch`` is None.

        Yields:
            DataProto of ``mini_batch_size`` rows with a copy of ``meta_info``;
            ``N * epochs // mini_batch_size`` of them.

        Raises:
            ValueError: ``N`` is not divisible by ``mini_batch_size``.
            TypeError: ``dataloader_kwargs`` is not a dict.
        """
        n = len(self)
        if mini_batch_size < 1 or n % mini_batch_size:
            raise ValueError(
                f"{n} rows cannot be cut into mini-batches of {mini_batch_size}; "
                "choose a mini_batch_size that divides the batch"
            )
        if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
            raise TypeError(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
        kwargs = dict(dataloader_kwargs or {})
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader = torch.utils.data.DataLoader(
            dataset=_RowIndices(n),
            batch_size=mini_batch_size,
            collate_fn=functools.partial(_collate_rows, self),
            generator=generator,
            **kwargs,
        )

        def epochs_of_batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                yield from loader

        return epochs_of_batches()

    # ----------------------------------------------------------- device and disk

    def to(self, device: str | torch.device) -> DataProto:
        """Move ``batch`` to ``device`` in place and return ``self`` (verl's ``DataProto.to``)."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, filepath: str | os.PathLike[str]) -> None:
        """Pickle this DataProto to ``filepath``. Mirrors verl's ``save_to_disk``."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike[str]) -> DataProto:
        """Load a DataProto written by [`save_to_disk`][daskwg.DataProto.save_to_disk]. Mirrors verl's
        ``load_from_disk``.

        Only load files you trust: this unpickles.

        Raises:
            TypeError: the file holds something other than a DataProto.
        """
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{filepath} holds a {type(data).__name__}, not a DataProto")
        return data

    def print_size(self, prefix: str = "") -> None:
        """Print the bytes held by the tensors and the numpy arrays, in GiB (verl's ``print_size``)."""
        tensor_bytes = 0
        if self.batch is not None:
            tensor_bytes = sum(
                t.element_size() * t.numel()
                for _, t in self.batch.items(include_nested=True, leaves_only=True)
                if isinstance(t, torch.Tensor)
            )
        array_bytes = sum(a.nbytes for a in self.non_tensor_batch.values())
        message = (
            f"Size of tensordict: {tensor_bytes / 1024**3} GB, "
            f"size of non_tensor_batch: {array_bytes / 1024**3} GB"
        )
        print(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """A multi-line text listing every field with its shape, dtype and device, and the type
        of every ``meta_info`` value (verl's ``get_data_info``)."""
        lines = ["batch"]
        if self.batch is not None:
            for key, t in self.batch.items(include_nested=True, leaves_only=True):
                name = ".".join(key) if isinstance(key, tuple) else key
                if isinstance(t, torch.Tensor):
                    lines.append(f"  {name}: {tuple(t.shape)} ({t.dtype}) {t.device}")
                else:
                    lines.append(f"  {name}: {type(t).__name__}")
        lines.append("non_tensor_batch")
        lines += [f"  {k}: ndarray{v.shape} ({v.dtype})" for k, v in self.non_tensor_batch.items()]
        lines.append("meta_info")
        lines += [f"  {k}: {_type_info(v)}" for k, v in self.meta_info.items()]
        return "\n".join(lines)

    # ------------------------------------------------------------ TensorDict form

    def to_tensordict(self) -> TensorDict:
        """This DataProto as one ``TensorDict`` of batch size ``[N]`` (verl's ``to_tensordict``).

        Tensors stay tensors; each non-tensor field becomes a ``NonTensorStack`` of its ``N``
        values (lists, dicts, nested lists of dicts: any value); each ``meta_info`` entry
        becomes a ``NonTensorData``. [`from_tensordict`][daskwg.DataProto.from_tensordict] turns it back.

        Returns:
            ``TensorDict`` with ``batch_size == [N]``; ``td["labels"]`` reads a non-tensor
            field back as a list, ``td["name"]`` a meta value.

        Raises:
            ValueError: a key is used by more than one of the three parts.
        """
        from tensordict import NonTensorData, NonTensorStack

        source: dict[str, Any] = self.batch.to_dict() if self.batch is not None else {}
        for part, keys in (("non_tensor_batch", self.non_tensor_batch), ("meta_info", self.meta_info)):
            shared = sorted(set(source) & set(keys))
            if shared:
                raise ValueError(
                    f"to_tensordict: keys {shared} are in {part} and in an earlier part; a TensorDict "
                    "holds each key once, rename one of them first"
                )
            if part == "non_tensor_batch":
                for key, values in keys.items():
                    source[key] = NonTensorStack.from_list([NonTensorData(v) for v in values])
            else:
                for key, value in keys.items():
                    source[key] = NonTensorData(value)
        device = self.batch.device if self.batch is not None else None
        return TensorDict(source, batch_size=[len(self)], device=device)

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: TensorDictBase,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
    ) -> DataProto:
        """Build a DataProto from a ``TensorDict`` (verl's ``from_tensordict``).

        Tensors (and nested TensorDicts) go to ``batch``; ``NonTensorStack`` entries (one value
        per row) to ``non_tensor_batch`` as 1-D object arrays; ``NonTensorData`` entries (one
        value for the whole batch) to ``meta_info``. The inverse of
        [`to_tensordict`][daskwg.DataProto.to_tensordict].

        Args:
            tensor_dict: a TensorDict whose first batch dim is ``N``.
            meta_info: extra batch-wide metadata (copied shallowly).
            num_batch_dims: must be 1, as in [`from_dict`][daskwg.DataProto.from_dict].

        Returns:
            DataProto with ``N`` rows (``batch`` is None when there are no tensors).

        Raises:
            TypeError: ``tensor_dict`` is not a TensorDict.
            BatchDimsError: ``num_batch_dims != 1`` (a ``ValueError`` and an ``AssertionError``).
            ValueError: the TensorDict has no batch dimension.
        """
        from tensordict import NonTensorData, NonTensorStack

        if not isinstance(tensor_dict, TensorDictBase):
            raise TypeError(f"from_tensordict takes a TensorDict, got {type(tensor_dict).__name__}")
        if num_batch_dims != 1:
            raise BatchDimsError(
                f"DataProto has exactly one batch dimension, got num_batch_dims={num_batch_dims}"
            )
        if tensor_dict.batch_dims < 1:
            raise ValueError(
                "from_tensordict needs a TensorDict with a batch dimension (batch_size=[N]), got "
                f"batch_size={list(tensor_dict.batch_size)}"
            )
        meta = dict(meta_info or {})
        tensors: dict[str, Any] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key in tensor_dict.keys():
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                non_tensors[key] = _object_array(value.tolist())
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            else:
                tensors[key] = value
        batch = None
        if tensors:
            batch = TensorDict(tensors, batch_size=tensor_dict.batch_size[:1], device=tensor_dict.device)
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        """Pickle state in which every tensor travels as its own bytes (``daskwg.wire.codec``).

        verl serialises the TensorDict with ``torch.save`` into one bytes object (one extra
        copy each way) unless an environment variable asks for numpy. daskwg hands pickle
        each tensor's bytes as a buffer, so pickle protocol 5 with a ``buffer_callback``
        (what Dask uses) sends it out of band without copying; any dtype works since the
        bytes are reinterpreted, not converted; a view carries only its own elements;
        sparse tensors travel as their index and value tensors. CUDA tensors are copied to
        CPU; on load they go back to their device when this process has it, else they stay
        on CPU. Nested/jagged tensors and TensorDict subclasses keep their own pickling.
        """
        batch = None if self.batch is None else codec.tensordict_state(self.batch)
        return {
            "version": _STATE_VERSION,
            "batch": batch,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("this DataProto was pickled by an incompatible daskwg version; re-create it")
        self.batch = None if state["batch"] is None else codec.tensordict_from_state(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


class _RowIndices(torch.utils.data.Dataset):
    """Row numbers ``0..n-1`` as a dataset, so the DataLoader only samples and batches indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _collate_rows(data: DataProto, rows: list[int]) -> DataProto:
    return data.select_idxs(np.asarray(rows, dtype=np.int64))


# ------------------------------------------------------------------- padding API


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its length is a multiple of ``size_divisor``, cycling through its rows.

    Mirrors verl's ``pad_dataproto_to_divisor``: 3 rows padded to a divisor of 7 become
    ``r0, r1, r2, r0, r1, r2, r0`` with ``pad_size == 4``. ``data`` is never modified; when no
    padding is needed it is returned as is.

    Args:
        data: DataProto of ``N`` rows.
        size_divisor: the multiple to reach, ``>= 1``.

    Returns:
        ``(padded, pad_size)``: ``padded`` has ``N + pad_size`` rows, ``0 <= pad_size < size_divisor``.

    Raises:
        TypeError: ``data`` is not a DataProto.
        ValueError: ``size_divisor < 1``.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"pad_dataproto_to_divisor takes a DataProto, got {type(data).__name__}")
    if not isinstance(size_divisor, (int, np.integer)) or size_divisor < 1:
        raise ValueError(f"size_divisor must be an int >= 1, got {size_divisor!r}")
    n = len(data)
    if n == 0:
        logger.warning("pad_dataproto_to_divisor: the DataProto has no rows; nothing to pad")
        return data, 0
    pad_size = -n % size_divisor
    if pad_size == 0:
        return data, 0
    index = np.arange(n + pad_size, dtype=np.int64) % n
    return data.select_idxs(index), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (``data[:N - pad_size]``). Mirrors verl's ``unpad_dataproto``.

    Returns ``data`` itself when ``pad_size == 0``; never modifies it.

    Raises:
        ValueError: ``pad_size`` is negative or larger than ``len(data)``.
    """
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size must be in 0..{len(data)}, got {pad_size}")
    if pad_size == 0:
        return data
    return data.slice(0, len(data) - pad_size)


def pad_rows(value: DataProto | TensorDictBase, size_divisor: int) -> tuple[Any, int]:
    """``value`` padded to a multiple of ``size_divisor`` rows, cycling through its rows:
    [`pad_dataproto_to_divisor`][daskwg.pad_dataproto_to_divisor] for a DataProto, the same rule for a
    TensorDict.

    What group calls pad with (``DP_COMPUTE_PROTO`` dispatch, through ``daskwg.futures.padding``,
    which holds the rule); [`unpad_rows`][daskwg.protocol.unpad_rows] takes the padding off again, on
    the blocking and the future path alike.

    Returns:
        ``(padded, pad_size)``; ``value`` itself when no padding is needed.

    Raises:
        TypeError: ``value`` is neither a DataProto nor a TensorDict.
    """
    if isinstance(value, DataProto):
        return pad_dataproto_to_divisor(value, size_divisor)
    if not isinstance(value, TensorDictBase):
        raise TypeError(f"pad_rows takes a DataProto or a TensorDict, got {type(value).__name__}")
    n = int(value.batch_size[0]) if value.batch_dims else 0
    pad_size = -n % size_divisor if n else 0
    if pad_size == 0:
        return value, 0
    index = torch.arange(pad_size) % n
    return torch.cat([value, value[index]], dim=0), pad_size


def unpad_rows(value: Any, pad_size: int) -> Any:
    """``value`` without its last ``pad_size`` rows (what [`pad_rows`][daskwg.protocol.pad_rows] added).

    A DataProto goes through [`unpad_dataproto`][daskwg.unpad_dataproto], a TensorDict is sliced, an object
    with an ``unpad`` method (a ``DataProtoFuture``) drops them when it is materialised,
    and any other batch (verl's ``DataProto``) is sliced with its own ``[:n]``.
    """
    if not pad_size:
        return value
    if isinstance(value, DataProto):
        return unpad_dataproto(value, pad_size)
    if isinstance(value, TensorDictBase):
        return value[: int(value.batch_size[0]) - pad_size]
    if hasattr(value, "unpad"):
        return value.unpad(pad_size)
    return value[: len(value) - pad_size]


def _type_info(value: Any) -> str:
    """A short type description of a meta_info value (``list[int|str]``, ``dict[str: float]``)."""
    if isinstance(value, list):
        kinds = sorted({_type_info(v) for v in value[:3]})
        return f"list[{'|'.join(kinds) if kinds else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, item = next(iter(value.items()))
        return f"dict[{_type_info(key)}: {_type_info(item)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


# ------------------------------------------------- verl's module-level helpers


def union_tensor_dict(tensor_dict1: TensorDictBase, tensor_dict2: TensorDictBase) -> TensorDictBase:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` in place and return ``tensor_dict1``.

    Mirrors ``verl.protocol.union_tensor_dict``. A key present in both must hold equal
    tensors (NaN equals NaN here; verl uses ``Tensor.equal``). Nothing is changed when a
    check fails.

    Raises:
        ConflictError: the batch sizes differ or a shared key holds different tensors (an
            ``AssertionError`` too, what verl raises).
    """
    _check_union_tensors(tensor_dict1, tensor_dict2, "key")
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2[key]
    return tensor_dict1


def union_numpy_dict(
    tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Merge ``tensor_dict2`` into ``tensor_dict1`` in place and return ``tensor_dict1``.

    Mirrors ``verl.protocol.union_numpy_dict``: a key present in both must hold arrays of
    the same dtype, shape and values, compared deeply inside object arrays, NaN equal to NaN,
    self-referencing arrays allowed. Nothing is changed when a check fails.

    Raises:
        TypeError: a shared key does not hold a numpy array on both sides.
        ConflictError: a shared key holds different arrays (an ``AssertionError`` too).
    """
    _check_union_arrays(tensor_dict1, tensor_dict2, "key")
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{"a": 1, "b": 2}, {"a": 3, "b": 4}]`` -> ``{"a": [1, 3], "b": [2, 4]}`` (verl's helper).

    The keys are those of the first dict; ``[]`` gives ``{}``.

    Raises:
        KeyError: a later dict has a key the first one lacks (verl asserts).
    """
    if not list_of_dict:
        return {}
    output: dict[str, list[Any]] = {key: [] for key in list_of_dict[0]}
    for i, entry in enumerate(list_of_dict):
        for key, value in entry.items():
            if key not in output:
                raise KeyError(f"dict {i} has key {key!r}, which dict 0 lacks (keys {sorted(output)})")
            output[key].append(value)
    return output


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group rows: ``[N, ...]`` -> ``[new_batch_size, N // new_batch_size, ...]``.

    ``verl.protocol.fold_batch_dim``; see [`DataProto.fold_batch_dim`][daskwg.DataProto.fold_batch_dim]. verl
    also replaces the arrays in ``data.non_tensor_batch`` with the folded ones; daskwg leaves
    ``data`` as it was.

    Raises:
        ValueError: ``N`` is not divisible by ``new_batch_size``.
    """
    return data.fold_batch_dim(new_batch_size)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Flatten the first ``batch_dims`` dims into the rows; the inverse of
    [`fold_batch_dim`][daskwg.protocol.fold_batch_dim].

    ``verl.protocol.unfold_batch_dim``; see [`DataProto.unfold_batch_dim`][daskwg.DataProto.unfold_batch_dim].
    """
    return data.unfold_batch_dim(batch_dims)


def collate_fn(x: Sequence[DataProtoItem]) -> DataProto:
    """Stack rows (``data[i]`` items) into a DataProto (``verl.protocol.collate_fn``).

    Tensors are stacked along a new dim 0; non-tensor values become 1-D object arrays (one
    element per row, even when the values are equal-length lists); ``meta_info`` is empty,
    as in verl.

    Raises:
        ValueError: ``x`` is empty.
        KeyError: the items do not all have the same non-tensor keys.
    """
    items = list(x)
    if not items:
        raise ValueError("collate_fn needs at least one DataProtoItem")
    batch = None
    if items[0].batch is not None:
        batch = torch.stack([item.batch for item in items]).contiguous()
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in items])
    return DataProto(batch=batch, non_tensor_batch={k: _object_array(v) for k, v in columns.items()})


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, torch.Size, np.ndarray]:
    """``(dtype name, shape, flat uint8 numpy array)`` of a tensor (verl's helper).

    The array shares the tensor's memory when the tensor is contiguous and on CPU.
    """
    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = t.flatten().contiguous().view(torch.uint8).numpy()
    return str(t.dtype).removeprefix("torch."), obj.shape, data


def deserialize_single_tensor(arr: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    """The inverse of [`serialize_single_tensor`][daskwg.protocol.serialize_single_tensor] (a writable copy
    of the bytes).

    Raises:
        ValueError: the dtype name is not a torch dtype.
    """
    dtype_name, shape, data = arr
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{dtype_name!r} is not a torch dtype")
    raw = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDictBase) -> tuple[tuple[int, ...], str | None, dict[str, Any]]:
    """``(batch_size, device, {key: encoded tensor})`` of a flat TensorDict (verl's helper).

    Any number of batch dims. A nested (jagged) tensor is encoded as ``(layout name,
    [encoded component, ...])``, every other tensor with
    [`serialize_single_tensor`][daskwg.protocol.serialize_single_tensor].
    """
    items: dict[str, Any] = {}
    for key, value in batch.items():
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            items[key] = (layout, [serialize_single_tensor(t) for t in value.unbind()])
        else:
            items[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(arr: tuple[Sequence[int], str | None, dict[str, Any]]) -> TensorDict:
    """The inverse of [`serialize_tensordict`][daskwg.protocol.serialize_tensordict].

    Raises:
        ValueError: an entry is neither a 3-tuple (tensor) nor a 2-tuple (nested tensor).
    """
    batch_size, device, items = arr
    source: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 3:
            source[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            source[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(p) for p in parts], layout=getattr(torch, layout)
            )
        else:
            raise ValueError(
                f"entry {key!r} has {len(value)} fields; expected 3 (tensor) or 2 (nested tensor)"
            )
    return TensorDict(source, batch_size=tuple(batch_size), device=device)


def all_gather_data_proto(data: DataProto, process_group: Any = None) -> DataProto:
    """All-gather ``data`` in place across a ``torch.distributed`` group (verl's helper).

    Every rank of ``process_group`` calls it with its own DataProto; afterwards each holds
    the rows of all ranks in rank order (2 ranks holding ``[r, r]`` both end with
    ``[0, 0, 1, 1]``). Tensors travel with ``torch.distributed.all_gather`` (moved to the
    current CUDA device for NCCL groups, kept on CPU otherwise, and back afterwards);
    non-tensor fields with ``all_gather_object``. Ranks may hold different numbers of rows
    (verl needs equal ones); ``meta_info`` is left alone.

    Args:
        data: DataProto of ``N_r`` rows on rank ``r``.
        process_group: the group, ``None`` for the default one.

    Returns:
        ``data`` itself, now ``sum(N_r)`` rows long.

    Raises:
        ConcatError: ranks disagree on the keys or on a field's shape after dim 0 (raised on
            every rank, before any tensor is sent).
    """
    import torch.distributed as dist

    n = dist.get_world_size(group=process_group)
    fields = {}
    if data.batch is not None:
        fields = {key: (tuple(t.shape), t.dtype) for key, t in data.batch.items()}
    layouts: list[Any] = [None] * n
    dist.all_gather_object(layouts, (len(data), fields, data.non_tensor_batch), group=process_group)
    keys = [sorted(f) for _, f, _ in layouts]
    if any(k != keys[0] for k in keys):
        raise ConcatError("all_gather_data_proto: ranks hold different batch keys", dict(enumerate(keys)))
    for key in keys[0]:
        _check_trailing_shapes(f"batch key {key!r}", [f[key][0] for _, f, _ in layouts])
        dtypes = [f[key][1] for _, f, _ in layouts]
        if len(set(dtypes)) > 1:
            raise ConcatError(
                f"all_gather_data_proto: batch key {key!r} has different dtypes", dict(enumerate(dtypes))
            )
    non_tensor_keys = [sorted(nt) for _, _, nt in layouts]
    if any(k != non_tensor_keys[0] for k in non_tensor_keys):
        raise ConcatError(
            "all_gather_data_proto: ranks hold different non_tensor_batch keys",
            dict(enumerate(non_tensor_keys)),
        )
    gathered_batch = None
    if data.batch is not None:
        backend = dist.get_backend(process_group)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in str(backend)
            else torch.device("cpu")
        )
        rows = [length for length, _, _ in layouts]
        most = max(rows)
        out = {}
        for key, t in data.batch.items():
            local = t.to(device)
            if local.shape[0] < most:
                filler = local.new_zeros((most - local.shape[0], *local.shape[1:]))
                local = torch.cat([local, filler], dim=0)
            buffers = [torch.empty_like(local) for _ in range(n)]
            dist.all_gather(buffers, local.contiguous(), group=process_group)
            out[key] = torch.cat([b[:r] for b, r in zip(buffers, rows)], dim=0).to(t.device)
        gathered_batch = TensorDict(out, batch_size=[sum(rows)], device=data.batch.device)
    for key in non_tensor_keys[0]:
        _check_trailing_shapes(f"non_tensor_batch key {key!r}", [nt[key].shape for _, _, nt in layouts])
    data.non_tensor_batch = {
        key: np.concatenate([nt[key] for _, _, nt in layouts], axis=0) for key in non_tensor_keys[0]
    }
    data.batch = gathered_batch
    return data
