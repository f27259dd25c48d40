"""The one interpreter of a ``DataProtoFuture``'s row plan (``daskwg.futures.plan``): the
driver runs it over the parts' values (``DataProtoFuture.get()``, Dask's compute) and every
consuming rank over only the rows of its piece, fetched from the workers holding them
(``daskwg.plugin.rows``). Both sides import it from here; neither calls into the other.

:func:`evaluate` maps the rows the plan's pieces leave back through its operations
(:class:`~daskwg.futures.plan.Repeat` renumbers rows, :class:`~daskwg.futures.plan.Select`
and :class:`~daskwg.futures.plan.Rename` narrow the columns fetched) to row ranges of the
numbered parts, asks its ``fetch`` for exactly those, and applies the operations to what
came back, as verl's eager ``DataProto`` methods would. :func:`argument_rows`,
:func:`padding_of` and :func:`length_check` answer what a rank needs before it fetches a
row: how long the batch argument is, how many padding rows end its piece
(``daskwg.futures.padding``), and which lengths it must compare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from .. import foreign
from ..protocol import DataProto, concat_small_columns, concat_tensordicts
from .padding import STRIP
from .pieces import piece_rows, rows_after, trailing_padding
from .plan import LengthCheck, Local, Parts, Plan, Rename, Repeat, Select, Union

__all__ = [
    "argument_rows",
    "concat_parts",
    "evaluate",
    "evaluate_values",
    "length",
    "length_check",
    "padding_of",
    "rows_of",
    "select_columns",
]

#: ``(batch_keys, non_tensor_batch_keys)`` to fetch, each a set or ``None`` (all); ``None``: all.
Columns = tuple[set | None, set | None] | None


def concat_parts(parts: list) -> Any:
    """Concatenate per-rank outputs: ``DataProto.concat`` or ``torch.cat`` of TensorDicts.

    A single part is returned as it is (no copy); verl DataProto parts concatenate as
    daskwg's and give verl's class back.

    Raises:
        TypeError: parts that are neither all DataProtos nor all TensorDicts.
        ConcatError: parts that cannot be concatenated (as ``DataProto.concat``).
    """
    if len(parts) == 1:
        return parts[0]
    parts = list(parts)
    verl_cls = foreign.nativize(parts)
    if all(isinstance(p, DataProto) for p in parts):
        joined = concat_small_columns(parts)  # a wide batch's many small columns, by runs
        return foreign.from_native(joined if joined is not None else DataProto.concat(parts), verl_cls)
    if all(isinstance(p, TensorDictBase) for p in parts):
        return concat_tensordicts(list(parts))
    kinds = sorted({type(p).__name__ for p in parts})
    raise TypeError(f"a DataProtoFuture must resolve to DataProto or TensorDict parts, got {kinds}")


def rows_of(value: Any) -> int:
    """Rows of a DataProto or TensorDict (0 for a TensorDict without a batch dimension).

    Raises:
        TypeError: ``value`` is neither (a part of a ``DataProtoFuture`` that is not a batch).
    """
    if isinstance(value, DataProto):
        return len(value)
    if not isinstance(value, TensorDictBase):
        raise TypeError(
            f"the parts of a DataProtoFuture must be DataProto or TensorDict, got {type(value).__name__}: "
            "pass per-rank futures of other values (state dict shards, say) as a list, which each "
            "rank receives as the list of their values"
        )
    return int(value.batch_size[0]) if value.batch_dims else 0


def select_columns(value: Any, columns: Columns) -> Any:
    """``value`` with only the wanted columns (those it has), ``meta_info`` kept.

    Args:
        columns: ``None`` (all) or ``(batch_keys, non_tensor_batch_keys)``, each a set or ``None``.
    """
    if columns is None or not isinstance(value, DataProto):
        return value
    batch_keys, non_tensor_keys = columns
    batch = value.batch
    if batch is not None and batch_keys is not None:
        batch = batch.select(*[k for k in batch.keys() if k in batch_keys])
    non_tensor = value.non_tensor_batch
    if non_tensor_keys is not None:
        non_tensor = {k: v for k, v in non_tensor.items() if k in non_tensor_keys}
    return type(value)(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=dict(value.meta_info))


def evaluate_values(plan: Plan, values: list) -> Any:
    """Evaluate ``plan`` over the parts' values themselves (the driver, or a rank that got
    them whole); over verl DataProto parts, as daskwg's, giving verl's class back.

    Raises:
        KeyError, ValueError: as the eager ``DataProto`` operations of the plan.
    """
    values = list(values)
    verl_cls = foreign.nativize(values)
    lengths = [rows_of(v) for v in values]
    metas = [getattr(v, "meta_info", None) for v in values]

    def fetch(part: int, start: int, stop: int, columns: Columns) -> Any:
        return select_columns(values[part][start:stop], columns)

    return foreign.from_native(evaluate(plan, lengths, metas, fetch), verl_cls)


def length(plan: Plan, lengths: list[int]) -> int:
    """Rows of ``plan``'s value before its pieces cut it.

    Args:
        lengths: rows of every part (padding included), by part number.

    Raises:
        ValueError: a union of values of different lengths.
    """
    return _length(plan.base, plan.ops, lengths)


def _length(base: Parts | Local, ops: tuple, lengths: list[int]) -> int:
    if isinstance(base, Local):
        n = len(base.data)
    else:
        n = sum(lengths[p] for p in base.numbers) - base.pad_size
    for op in ops:
        if isinstance(op, Repeat):
            n *= op.times
        elif isinstance(op, Union):
            m = length(op.other, lengths)
            if m != n:
                raise ValueError(f"cannot union DataProtos of {n} and {m} rows")
    return n


def evaluate(plan: Plan, lengths: list[int], metas: list, fetch: Callable[..., Any]) -> Any:
    """The rows of ``plan`` (from :meth:`daskwg.DataProtoFuture.plan`).

    Args:
        lengths: rows of every part (padding included), by part number.
        metas: ``meta_info`` of every part (``None`` for TensorDict parts).
        fetch: ``(part, start, stop, columns) -> rows [start, stop) of that part``,
            ``columns`` being ``None`` (all) or ``(batch_keys, non_tensor_batch_keys)``
            (each a set, or ``None`` for all), ``meta_info`` left out; runs of rows over
            several parts go through its ``many([(part, start, stop, columns), ...])``
            where it has one (those rows concatenated, fetched all at once).

    Returns:
        the DataProto (or TensorDict) the plan stands for: all its rows, or the piece its
        last piece cuts (as ``DataProto.chunk`` would cut it, or padded as
        ``DP_COMPUTE_PROTO`` pads).

    Raises:
        DispatchError: the batch is not the length a piece was cut for.
        KeyError, ValueError: as the eager ``DataProto`` operations of the plan.
    """
    idx = np.arange(length(plan, lengths))
    for piece in plan.pieces:
        idx = idx[piece_rows(len(idx), piece)]
    # A padded piece wraps around to the first rows: fetched one contiguous run at a time.
    runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1) if len(idx) else [idx]
    pieces = [_eval(plan.base, plan.ops, run, None, lengths, metas, fetch) for run in runs]
    return pieces[0] if len(pieces) == 1 else concat_parts(pieces)


def _eval(base: Parts | Local, ops: tuple, idx: np.ndarray, columns: Columns, lengths, metas, fetch) -> Any:
    """Rows ``idx`` of ``base`` after ``ops``, only ``columns``: the last op applied to
    what the ops before it give for the rows and columns it needs."""
    if not ops:
        return _eval_base(base, idx, columns, lengths, metas, fetch)
    *head, op = ops
    head = tuple(head)
    if isinstance(op, Select):
        narrowed = _narrow(columns, op.batch_keys, op.non_tensor_batch_keys)
        value = _eval(base, head, idx, narrowed, lengths, metas, fetch)
        batch_keys = op.batch_keys
        if batch_keys is not None and columns is not None and columns[0] is not None:
            # An outer select dropped some of these: only the wanted ones must exist.
            batch_keys = [k for k in batch_keys if k in columns[0]]
        return value.select(
            _listed(batch_keys), _listed(op.non_tensor_batch_keys), _listed(op.meta_info_keys)
        )
    if isinstance(op, Rename):
        renamed = dict(zip(op.new_keys, op.old_keys))
        wanted = None
        if columns is not None:
            wanted = tuple(None if keys is None else {renamed.get(k, k) for k in keys} for keys in columns)
        value = _eval(base, head, idx, wanted, lengths, metas, fetch)
        present = set(value.batch.keys()) if value.batch is not None else set()
        present |= set(value.non_tensor_batch)
        pairs = [(o, w) for o, w in zip(op.old_keys, op.new_keys) if columns is None or o in present]
        if pairs:
            value = value.rename([o for o, _ in pairs], [w for _, w in pairs])
        return value
    if isinstance(op, Repeat):
        inner = _length(base, head, lengths)
        source = idx // op.times if op.interleave else idx % inner
        return _eval(base, head, source, columns, lengths, metas, fetch)
    if isinstance(op, Union):
        left = _eval(base, head, idx, columns, lengths, metas, fetch)
        right = _eval(op.other.base, op.other.ops, idx, columns, lengths, metas, fetch)
        return left.union(right)
    raise ValueError(f"unknown DataProtoFuture operation {type(op).__name__}")


def _listed(keys: tuple | list | None) -> list | None:
    return None if keys is None else list(keys)


def _narrow(columns: Columns, batch_keys: tuple | None, non_tensor_keys: tuple | None) -> tuple:
    old_b, old_n = columns if columns is not None else (None, None)
    b = old_b if batch_keys is None else set(batch_keys) if old_b is None else old_b & set(batch_keys)
    n = (
        old_n
        if non_tensor_keys is None
        else set(non_tensor_keys)
        if old_n is None
        else old_n & set(non_tensor_keys)
    )
    return b, n


def _eval_base(base: Parts | Local, idx: np.ndarray, columns: Columns, lengths, metas, fetch) -> Any:
    if isinstance(base, Local):
        data = select_columns(base.data, columns)
        return data.select_idxs(idx) if isinstance(data, DataProto) else data[torch.from_numpy(idx)]
    numbers = base.numbers
    lo, hi = (int(idx.min()), int(idx.max()) + 1) if len(idx) else (0, 0)
    wanted, offset = [], 0  # (part, start, stop, columns) of every part the rows touch
    for part in numbers:
        start, stop = max(lo, offset), min(hi, offset + lengths[part])
        if start < stop or (not wanted and part == numbers[-1]):
            wanted.append((part, start - offset, max(start, stop) - offset, columns))
        offset += lengths[part]
    if len(wanted) > 1 and hasattr(fetch, "many"):
        value = fetch.many(wanted)
    else:
        value = concat_parts([fetch(*request) for request in wanted])
    if isinstance(value, DataProto):
        value.meta_info = _merged_meta([metas[p] for p in numbers if metas[p] is not None])
    if len(idx) and not (idx[0] == lo and idx[-1] == hi - 1 and len(idx) == hi - lo):
        local = idx - lo
        value = value.select_idxs(local) if isinstance(value, DataProto) else value[torch.from_numpy(local)]
    return value


def padding_of(plan: Plan, lengths: list[int]) -> int:
    """How many padding rows end the :data:`~daskwg.futures.padding.STRIP` piece ``plan``
    stands for (0 for any other): the rows the consuming rank takes off its output.

    Raises:
        ValueError: as :func:`argument_rows`.
    """
    if not plan.pieces or plan.pieces[-1].padding != STRIP:
        return 0
    return trailing_padding(argument_rows(plan, lengths), plan.pieces[-1])


def length_check(plan: Plan) -> LengthCheck | None:
    """What the consuming rank must compare this argument's length with before it fetches a
    row (the last piece's ``check``), or ``None``."""
    return plan.pieces[-1].check if plan.pieces else None


def argument_rows(plan: Plan, lengths: list[int], whole: bool = False) -> int:
    """Rows of the batch a call was given as ``plan``: the future's value before the piece the
    call's dispatch cut for one rank (``whole``: after every piece, the value ``plan`` stands for).

    Args:
        lengths: rows of every part (padding included), by part number.

    Raises:
        ValueError: a union of different lengths, or a piece that cannot be cut.
    """
    pieces = plan.pieces if whole else plan.pieces[:-1]
    return rows_after(length(plan, lengths), pieces)


def _merged_meta(metas: list[dict]) -> dict:
    """``meta_info`` as ``DataProto.concat`` of all parts would merge it."""
    return (
        dict(metas[0])
        if len(metas) == 1
        else DataProto.concat([DataProto(meta_info=dict(m)) for m in metas]).meta_info
    )
