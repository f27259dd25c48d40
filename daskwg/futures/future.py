"""``DataProtoFuture``: a batch that is still on the workers, and its lazy algebra.

Mirrors verl's ``verl.protocol.DataProtoFuture`` (``collect_fn``, ``futures``,
``dispatch_fn``, ``concat``, ``chunk``, ``get``) with Dask futures in place of Ray
object refs, plus the driver-side algebra verl trainers apply to batches
(``union``, ``select``, ``repeat``, ``rename``), done lazily: each returns a new
``DataProtoFuture`` and moves no bytes.

A future is a *plan*: the parts (per-rank Dask futures of DataProto or TensorDict
rows, concatenated in rank order, minus ``pad_size`` trailing padding rows), the
operations to apply, and optionally the piece it stands for (``chunk``). Handed to
a group call, each consuming rank evaluates the plan for its own rows only: it maps
its row range back through the operations to the rows of the parts it needs and
fetches just those rows from the workers holding them (``daskwg.plugin.rows``).
:meth:`DataProtoFuture.get` evaluates the same plan in the driver.
A future is also a Dask collection of its parts (``daskwg.futures.collection``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from distributed import Future
from tensordict import TensorDictBase

from .. import foreign
from ..errors import ConcatError
from ..protocol import DataProto, concat_tensordicts, unpad_rows
from .collection import DaskCollection, cancel_futures, gather_parts
from .pieces import PAD, STRIP, chunk_bounds, piece_rows, rows_after, trailing_padding

__all__ = [
    "DataProtoFuture",
    "padding_of",
    "argument_rows",
    "concat_parts",
    "materialize",
    "evaluate",
    "chunk_bounds",
    "rows_of",
    "select_columns",
]


def concat_parts(parts: list) -> Any:
    """Concatenate per-rank outputs: ``DataProto.concat`` or ``torch.cat`` of TensorDicts.

    A single part is returned as it is (no copy); verl DataProto parts concatenate as
    daskwg's and give verl's class back.
    """
    if len(parts) == 1:
        return parts[0]
    parts = list(parts)
    verl_cls = foreign.nativize(parts)
    if all(isinstance(p, DataProto) for p in parts):
        return foreign.from_native(DataProto.concat(parts), verl_cls)
    if all(isinstance(p, TensorDictBase) for p in parts):
        return concat_tensordicts(list(parts))
    kinds = sorted({type(p).__name__ for p in parts})
    raise TypeError(f"a DataProtoFuture must resolve to DataProto or TensorDict parts, got {kinds}")


def _take_chunk(data: Any, *, index: int, chunks: int) -> Any:
    start, stop = chunk_bounds(rows_of(data), index, chunks)
    return data[start:stop]


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


def materialize(
    collect_fn: Callable[[list], Any],
    pad_size: int,
    dispatch_fn: Callable | None,
    values: list,
    *,
    method: str | None = None,
    ranks: Sequence[int] | None = None,
) -> Any:
    """Turn the resolved parts of a ``DataProtoFuture`` into its value.

    Runs ``collect_fn(values)``, drops the last ``pad_size`` rows, then applies
    ``dispatch_fn`` (the slice one receiving rank takes). Runs in the driver
    (``get()``) or on the receiving rank.

    Raises:
        ConcatError: the parts cannot be concatenated; it names ``method`` and the rank of
            each part (``ranks``) when they are known.
    """
    try:
        out = collect_fn(values)
    except ConcatError as exc:
        if method is None:
            raise
        raise exc.in_call(method, list(ranks) if ranks is not None else list(range(len(values)))) from None
    out = unpad_rows(out, pad_size)
    if dispatch_fn is not None:
        out = dispatch_fn(out)
    return out


def _as_key_list(keys: Any, name: str) -> list[str] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
        return list(keys)
    raise TypeError(f"{name} must be None, a str or a list of str, got {keys!r}")


@dataclass(frozen=True)
class DataProtoFuture(DaskCollection):
    """A ``DataProto`` (or TensorDict) computed by a group and still held by its ranks.

    Attributes:
        futures: one ``distributed.Future`` per producing rank, in rank order.
        collect_fn: ``list of parts -> value``; default concatenates the parts.
        dispatch_fn: optional ``value -> piece`` applied after collection.
        pad_size: rows of padding the producing call added, dropped after collection.
        method: the producing method's name, named by collect errors (``None``: unknown).
        ranks: the producing rank of each future (``None``: ``0..len(futures)-1``).
        ops: lazy operations (``union``/``select``/``repeat``/``rename``) applied, in
            order, after collection and unpadding.
        rows: the pieces this future was cut to, in order (``None``: not cut), each
            ``(index, chunks)``: piece ``index`` of [`chunk`][daskwg.DataProtoFuture.chunk], or
            ``(index, chunks, PAD | STRIP, ...)``: of [`padded_chunk`][daskwg.DataProtoFuture.padded_chunk]
            (``daskwg.futures.pieces``); a piece cut again holds both.

    Returned by non-blocking ``DP_COMPUTE_PROTO`` (and mesh) calls. ``get()``
    materialises it in the driver; passing it to another group's call moves the data
    worker to worker, each consuming rank fetching only the rows it gets.
    """

    futures: Sequence[Any]
    collect_fn: Callable[[list], Any] = concat_parts
    dispatch_fn: Callable[[Any], Any] | None = None
    pad_size: int = 0
    gather: Callable[[list], list] = gather_parts
    method: str | None = None
    ranks: Sequence[int] | None = None
    ops: tuple = ()
    rows: tuple | None = None

    @staticmethod
    def concat(futures: Sequence[Any]) -> DataProtoFuture:
        """A future of the concatenation of ``futures`` (per-rank Dask futures), as verl's.

        Raises:
            TypeError: an item is not a ``distributed.Future`` (a list of them, say: pass
                that list itself).
        """
        futures = list(futures)
        for i, future in enumerate(futures):
            if not isinstance(future, Future):
                hint = (
                    " (a list of futures: pass that list itself)" if isinstance(future, (list, tuple)) else ""
                )
                raise TypeError(
                    f"DataProtoFuture.concat takes per-rank futures, got a {type(future).__name__} at "
                    f"position {i}{hint}"
                )
        return DataProtoFuture(futures=futures)

    # ---- lazy algebra ----------------------------------------------------------------

    def _derive(self, op: tuple) -> DataProtoFuture:
        if self.rows is not None or self.dispatch_fn is not None:
            raise ValueError(
                f"cannot {op[0]} a piece of a chunked DataProtoFuture; apply {op[0]} before chunk()"
            )
        return replace(self, ops=(*self.ops, op))

    def union(self, other: DataProtoFuture | Any) -> DataProtoFuture:
        """Lazy ``DataProto.union``: the keys of both, row by row (verl's ``union``).

        Args:
            other: a ``DataProtoFuture`` or a ``DataProto`` with the same number of rows.

        Returns:
            a new ``DataProtoFuture``; nothing moves until it is consumed or ``get()``.

        Raises:
            TypeError: ``other`` is neither.
            ValueError: ``other`` is a piece of a chunked ``DataProtoFuture``. Differing row
                counts or keys holding different values raise it where the rows are
                materialised.
        """
        if isinstance(other, DataProtoFuture):
            if other.rows is not None or other.dispatch_fn is not None:
                raise ValueError("cannot union with a piece of a chunked DataProtoFuture")
        elif not isinstance(other, DataProto):
            raise TypeError(f"union takes a DataProtoFuture or a DataProto, got {type(other).__name__}")
        return self._derive(("union", other))

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProtoFuture:
        """Lazy ``DataProto.select``: keep these keys (``None`` keeps a part whole).

        Consuming ranks fetch only the selected columns. A missing batch key raises
        ``KeyError`` where the rows are materialised, as ``DataProto.select`` does.

        Raises:
            TypeError: keys that are not a str or a list of str.
        """
        return self._derive(
            (
                "select",
                _as_key_list(batch_keys, "batch_keys"),
                _as_key_list(non_tensor_batch_keys, "non_tensor_batch_keys"),
                _as_key_list(meta_info_keys, "meta_info_keys"),
            )
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProtoFuture:
        """Lazy ``DataProto.repeat``: every row ``repeat_times`` times (``a, a, b, b``
        with ``interleave=True``, ``a, b, a, b`` without).

        Raises:
            ValueError: ``repeat_times`` is not a positive int.
        """
        if (
            isinstance(repeat_times, bool)
            or not isinstance(repeat_times, (int, np.integer))
            or repeat_times < 1
        ):
            raise ValueError(f"repeat_times must be a positive int, got {repeat_times!r}")
        return self._derive(("repeat", int(repeat_times), bool(interleave)))

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProtoFuture:
        """Lazy ``DataProto.rename`` (a new future; this one is unchanged).

        Raises:
            TypeError: keys that are not a str or a list of str.
            ValueError: the two lists differ in length.
        """
        old, new = _as_key_list(old_keys, "old_keys"), _as_key_list(new_keys, "new_keys")
        if old is None or new is None:
            raise TypeError("rename needs old_keys and new_keys")
        if len(old) != len(new):
            raise ValueError(f"old_keys has {len(old)} keys but new_keys has {len(new)}")
        return self._derive(("rename", tuple(old), tuple(new)))

    def unpad(self, pad_size: int) -> DataProtoFuture:
        """The same future with ``pad_size`` trailing padding rows dropped on collection."""
        if self.dispatch_fn is not None or self.rows is not None or self.ops:
            raise ValueError("cannot unpad a DataProtoFuture that was already chunked or transformed")
        return replace(self, pad_size=self.pad_size + pad_size)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """Split into ``chunks`` futures, piece ``i`` being ``value.chunk(chunks)[i]``
        (``DataProto.chunk``: the first ``N % chunks`` pieces one row longer).

        Each piece is a future too: it can be chunked again, handed to a group of any size
        (``for mb in fut.chunk(4): wg.update_policy(mb)``) or ``get()``. When this future is
        the plain concatenation of exactly ``chunks`` parts (the output of a group with the
        same dp size), piece ``i`` is part ``i`` itself. Otherwise piece ``i`` is a row
        range, which a consuming rank fetches from the workers holding those rows.

        Raises:
            TypeError: ``chunks`` is not an int (as ``DataProto.chunk``).
            ValueError: ``chunks < 1``; or the driver knows this future's rows
                (``known_rows()``) and they are fewer than ``chunks`` (else that is raised
                where the piece is materialised, as ``DataProto.chunk`` raises it); or a
                custom ``dispatch_fn`` was applied.
        """
        if not isinstance(chunks, (int, np.integer)) or isinstance(chunks, bool):
            raise TypeError(f"chunks must be an int, got {type(chunks).__name__}")
        chunks = int(chunks)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if self.dispatch_fn is not None:
            raise ValueError(
                "cannot chunk a DataProtoFuture with a custom dispatch_fn; chunk the one before it"
            )
        rows = self.known_rows()
        if rows is not None and rows < chunks:
            raise ValueError(
                f"cannot split {rows} rows into {chunks} non-empty chunks; pad first with "
                f"pad_dataproto_to_divisor(fut.get(), {chunks}) and unpad the result"
            )
        return self._cut(chunks)

    def _cut(self, chunks: int) -> list[DataProtoFuture]:
        if (
            len(self.futures) == chunks
            and self.collect_fn is concat_parts
            and not self.pad_size
            and not self.ops
            and self.rows is None
        ):
            ranks = list(self.ranks) if self.ranks is not None else list(range(chunks))
            return [replace(self, futures=[f], ranks=[r]) for f, r in zip(self.futures, ranks)]
        return [replace(self, rows=(*(self.rows or ()), (i, chunks))) for i in range(chunks)]

    def padded_chunk(
        self,
        chunks: int,
        strip: bool | None,
        keep_parts: bool = True,
        length: int | None = None,
        check: tuple | None = None,
    ) -> list[DataProtoFuture]:
        """[`chunk`][daskwg.DataProtoFuture.chunk] padded as ``DP_COMPUTE_PROTO`` pads a batch (2 rows feed 3
        ranks). ``strip``: each rank unpads its own output, ``False``: the driver does, ``None``: no
        padding; ``keep_parts``: parts one per piece are the pieces; ``length``: rows the driver's
        batches beside it have (ranks check); ``check``: ``(label, known)``, the ranks compare this
        argument's rows with the call's other batch arguments' (``daskwg.futures.pieces``).

        Raises:
            ValueError: a custom ``dispatch_fn`` was applied."""
        if self.dispatch_fn is not None:
            raise ValueError(
                "cannot chunk a DataProtoFuture with a custom dispatch_fn; chunk the one before it"
            )
        pieces = self._cut(chunks)
        if pieces[0].rows is None:
            if keep_parts and check is None:
                return pieces
            pieces = [replace(self, rows=(*(self.rows or ()), (i, chunks))) for i in range(chunks)]
        mode = None if strip is None else STRIP if strip else PAD
        tail = (
            (mode, length, check) if check is not None else (mode, length) if length is not None else (mode,)
        )
        if tail == (None,):
            return pieces
        return [replace(p, rows=(*p.rows[:-1], (*p.rows[-1][:2], *tail))) for p in pieces]

    def known_rows(self) -> int | None:
        """Rows of this future's value, when the driver knows them: every part's producer
        finished and its reply said how many rows the part holds; ``None`` otherwise (or for
        a future with a custom ``collect_fn``/``dispatch_fn``)."""
        if not self.row_addressable:
            return None
        plan, parts = self.plan()
        lengths = []
        for part in parts:
            rows_of_part = getattr(part, "batch_rows", None)
            rows = rows_of_part() if callable(rows_of_part) else None
            if rows is None:
                return None
            lengths.append(rows)
        try:
            return argument_rows(plan, lengths, whole=True)
        except ValueError:
            return None  # a union of different lengths: raised where it is materialised

    # ---- evaluation ------------------------------------------------------------------

    @property
    def row_addressable(self) -> bool:
        """Whether consumers can fetch rows of it part by part (every part concatenated
        with ``concat_parts``, no custom ``dispatch_fn``), here and in every union."""
        if self.collect_fn is not concat_parts or self.dispatch_fn is not None:
            return False
        return all(
            op[1].row_addressable
            for op in self.ops
            if op[0] == "union" and isinstance(op[1], DataProtoFuture)
        )

    def plan(self) -> tuple[tuple, list]:
        """``(plan, parts)``: this future as plain data, parts numbered in ``parts``
        (its Dask futures and those of every future it was united with, in order).

        ``plan`` is ``(base, ops, rows)``; ``base`` is ``("parts", [part numbers],
        pad_size)`` or ``("local", DataProto)``; a ``union`` op holds the other plan.
        """
        parts: list = []
        return self._plan(parts), parts

    def _plan(self, parts: list) -> tuple:
        base = ("parts", list(range(len(parts), len(parts) + len(self.futures))), self.pad_size)
        parts.extend(self.futures)
        ops = []
        for op in self.ops:
            if op[0] == "union":
                other = op[1]
                other_plan = (
                    other._plan(parts) if isinstance(other, DataProtoFuture) else (("local", other), (), None)
                )
                ops.append(("union", other_plan))
            else:
                ops.append(op)
        return base, tuple(ops), self.rows

    @property
    def transform(self) -> Callable[[list], Any]:
        """``values -> value``: what a receiving rank applies to the resolved parts."""
        if self.ops or self.rows is not None:
            return partial(_evaluate_values, self.plan()[0])
        return partial(
            materialize,
            self.collect_fn,
            self.pad_size,
            self.dispatch_fn,
            method=self.method,
            ranks=self.ranks,
        )

    def _finish(self) -> tuple[Callable[[list], Any], list]:
        """``(parts' values -> value, the parts)`` (``get()``, Dask's compute); ``ValueError``
        for operations on a future whose parts are not simply concatenated."""
        if not (self.ops or self.rows is not None):
            return self.transform, list(self.futures)
        if not self.row_addressable:
            raise ValueError(
                "union/select/repeat/rename/chunk need a DataProtoFuture whose parts are concatenated "
                "(the default collect_fn) and no dispatch_fn"
            )
        plan, parts = self.plan()
        return partial(_evaluate_values, plan), parts

    def get(self) -> Any:
        """Materialise the value in the driver.

        Raises the producing call's error (``RankError``, ``WorkerLostError``, at once
        [`CallCancelledError`][daskwg.CallCancelledError]); [`ConcatError`][daskwg.ConcatError]
        naming the method, the field and each rank when the ranks' outputs cannot be
        concatenated; ``KeyError``/``ValueError`` as the eager ``DataProto`` operations would.
        """
        finish, parts = self._finish()
        return finish(self.gather(parts))

    def done(self) -> bool:
        """Whether every producing rank has finished."""
        return all(f.done() for f in self.futures)

    def cancel(self, reason: str | None = None, msg: str | None = None) -> None:
        """Cancel the calls that produce it (``client.cancel(fut)``, and ``ray.cancel`` of actor
        tasks): a queued call never runs, a running ``async def`` one gets ``CancelledError``
        at its next ``await``, a running plain one runs to its end and its result is dropped
        (see [cancelling calls](futures.md#cancelling-calls)); returns once every rank's worker
        answered. ``get()`` then raises [`CallCancelledError`][daskwg.CallCancelledError].
        """
        cancel_futures(self.plan()[1], reason=reason, msg=msg)


# ----------------------------------------------------------------------- plans


def _evaluate_values(plan: tuple, values: list) -> Any:
    """Evaluate ``plan`` over the parts' values themselves (driver, or a rank that got them);
    over verl DataProto parts, as daskwg's, giving verl's class back."""
    values = list(values)
    verl_cls = foreign.nativize(values)
    lengths = [rows_of(v) for v in values]
    metas = [getattr(v, "meta_info", None) for v in values]

    def fetch(part: int, start: int, stop: int, columns: Any) -> Any:
        return select_columns(values[part][start:stop], columns)

    return foreign.from_native(evaluate(plan, lengths, metas, fetch), verl_cls)


def _plan_length(plan: tuple, lengths: list[int]) -> int:
    base, ops, _ = plan
    if base[0] == "local":
        n = len(base[1])
    else:
        n = sum(lengths[p] for p in base[1]) - base[2]
    for op in ops:
        if op[0] == "repeat":
            n *= op[1]
        elif op[0] == "union":
            m = _plan_length(op[1], lengths)
            if m != n:
                raise ValueError(f"cannot union DataProtos of {n} and {m} rows")
    return n


def evaluate(plan: tuple, lengths: list[int], metas: list, fetch: Callable[[int, int, int, Any], Any]) -> Any:
    """The rows of ``plan`` (``(base, ops, rows)`` from :meth:`DataProtoFuture.plan`).

    Args:
        lengths: rows of every part (padding included), by part number.
        metas: ``meta_info`` of every part (``None`` for TensorDict parts).
        fetch: ``(part, start, stop, columns) -> rows [start, stop) of that part``,
            ``columns`` being ``None`` (all) or ``(batch_keys, non_tensor_batch_keys)``
            (each a set, or ``None`` for all), ``meta_info`` left out; runs of rows over
            several parts go through its ``many([(part, start, stop, columns), ...])``
            where it has one (those rows concatenated, fetched all at once).

    Returns:
        the DataProto (or TensorDict) the plan stands for: all its rows, or piece
        ``rows[0]`` of ``rows[1]`` as ``DataProto.chunk`` would cut it.
    """
    idx = np.arange(_plan_length(plan, lengths))
    for piece in plan[2] or ():
        idx = idx[piece_rows(len(idx), piece)]
    # A padded piece wraps around to the first rows: fetched one contiguous run at a time.
    runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1) if len(idx) else [idx]
    pieces = [_eval(plan[0], plan[1], run, None, lengths, metas, fetch) for run in runs]
    return pieces[0] if len(pieces) == 1 else concat_parts(pieces)


def _eval(base: tuple, ops: tuple, idx: np.ndarray, columns: Any, lengths, metas, fetch) -> Any:
    if not ops:
        return _eval_base(base, idx, columns, lengths, metas, fetch)
    *head, op = ops
    head = tuple(head)
    kind = op[0]
    if kind == "select":
        _, batch_keys, non_tensor_keys, meta_keys = op
        narrowed = _narrow(columns, batch_keys, non_tensor_keys)
        value = _eval(base, head, idx, narrowed, lengths, metas, fetch)
        if batch_keys is not None and columns is not None and columns[0] is not None:
            # An outer select dropped some of these: only the wanted ones must exist.
            batch_keys = [k for k in batch_keys if k in columns[0]]
        return value.select(batch_keys, non_tensor_keys, meta_keys)
    if kind == "rename":
        _, old, new = op
        renamed = dict(zip(new, old))
        wanted = None
        if columns is not None:
            wanted = tuple(None if keys is None else {renamed.get(k, k) for k in keys} for keys in columns)
        value = _eval(base, head, idx, wanted, lengths, metas, fetch)
        present = set(value.batch.keys()) if value.batch is not None else set()
        present |= set(value.non_tensor_batch)
        pairs = [(o, w) for o, w in zip(old, new) if columns is None or o in present]
        if pairs:
            value = value.rename([o for o, _ in pairs], [w for _, w in pairs])
        return value
    if kind == "repeat":
        _, times, interleave = op
        inner = _plan_length((base, head, None), lengths)
        source = idx // times if interleave else idx % inner
        return _eval(base, head, source, columns, lengths, metas, fetch)
    if kind == "union":
        left = _eval(base, head, idx, columns, lengths, metas, fetch)
        other_base, other_ops, _ = op[1]
        right = _eval(other_base, other_ops, idx, columns, lengths, metas, fetch)
        return left.union(right)
    raise ValueError(f"unknown DataProtoFuture operation {kind!r}")


def _narrow(columns: Any, batch_keys: list | None, non_tensor_keys: list | None) -> tuple:
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


def select_columns(value: Any, columns: Any) -> Any:
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


def _eval_base(base: tuple, idx: np.ndarray, columns: Any, lengths, metas, fetch) -> Any:
    if base[0] == "local":
        data = select_columns(base[1], columns)
        return data.select_idxs(idx) if isinstance(data, DataProto) else data[torch.from_numpy(idx)]
    _, part_numbers, _ = base
    lo, hi = (int(idx.min()), int(idx.max()) + 1) if len(idx) else (0, 0)
    wanted, offset = [], 0  # (part, start, stop, columns) of every part the rows touch
    for part in part_numbers:
        start, stop = max(lo, offset), min(hi, offset + lengths[part])
        if start < stop or (not wanted and part == part_numbers[-1]):
            wanted.append((part, start - offset, max(start, stop) - offset, columns))
        offset += lengths[part]
    if len(wanted) > 1 and hasattr(fetch, "many"):
        value = fetch.many(wanted)
    else:
        value = concat_parts([fetch(*request) for request in wanted])
    if isinstance(value, DataProto):
        value.meta_info = _merged_meta([metas[p] for p in part_numbers if metas[p] is not None])
    if len(idx) and not (idx[0] == lo and idx[-1] == hi - 1 and len(idx) == hi - lo):
        local = idx - lo
        value = value.select_idxs(local) if isinstance(value, DataProto) else value[torch.from_numpy(local)]
    return value


def padding_of(plan: tuple, lengths: list[int]) -> int:
    """How many padding rows end the ``STRIP`` piece ``plan`` stands for (0 for any other)."""
    pieces = plan[2]
    if not pieces or len(pieces[-1]) < 3 or pieces[-1][2] != STRIP:
        return 0
    return trailing_padding(argument_rows(plan, lengths), pieces[-1])


def argument_rows(plan: tuple, lengths: list[int], whole: bool = False) -> int:
    """Rows of the batch a call was given as ``plan``: the future's value before the piece the
    call's dispatch cut for one rank (``whole``: after every piece, the value ``plan`` stands for).

    Args:
        lengths: rows of every part (padding included), by part number.

    Raises:
        ValueError: a union of different lengths, or a piece that cannot be cut.
    """
    pieces = tuple(plan[2] or ())
    return rows_after(_plan_length(plan, lengths), pieces if whole else pieces[:-1])


def _merged_meta(metas: list[dict]) -> dict:
    """``meta_info`` as ``DataProto.concat`` of all parts would merge it."""
    return (
        dict(metas[0])
        if len(metas) == 1
        else DataProto.concat([DataProto(meta_info=dict(m)) for m in metas]).meta_info
    )
