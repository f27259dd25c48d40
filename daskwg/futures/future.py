"""``DataProtoFuture``: a batch that is still on the workers, and its lazy algebra.

Mirrors verl's ``verl.protocol.DataProtoFuture`` (``collect_fn``, ``futures``,
``dispatch_fn``, ``concat``, ``chunk``, ``get``) with Dask futures in place of Ray
object refs, plus the driver-side algebra verl trainers apply to batches
(``union``, ``select``, ``repeat``, ``rename``), done lazily: each returns a new
``DataProtoFuture`` and moves no bytes.

A future is a *plan* (:meth:`DataProtoFuture.plan`, typed nodes of
``daskwg.futures.plan``): the parts (per-rank Dask futures of DataProto or TensorDict
rows, concatenated in rank order, minus ``pad_size`` trailing padding rows), the
operations to apply, and optionally the pieces it stands for (``chunk``). Handed to
a group call, each consuming rank evaluates the plan for its own rows only: it maps
its row range back through the operations to the rows of the parts it needs and
fetches just those rows from the workers holding them (``daskwg.plugin.rows``).
:meth:`DataProtoFuture.get` evaluates the same plan in the driver, with the same
interpreter (``daskwg.futures.interpreter``).
A future is also a Dask collection of its parts (``daskwg.futures.collection``).

The interpreter's names (``evaluate``, ``argument_rows``, ``padding_of``, ``concat_parts``,
``rows_of``, ``select_columns``) and ``chunk_bounds`` are re-exported here, where they were
named before the interpreter became a module of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from distributed import Future

from ..errors import ConcatError
from ..protocol import DataProto
from . import padding
from .collection import DaskCollection, cancel_futures, gather_parts
from .interpreter import (
    argument_rows,
    concat_parts,
    evaluate,
    evaluate_values,
    padding_of,
    rows_of,
    select_columns,
)
from .pieces import chunk_bounds
from .plan import LengthCheck, Local, Op, Parts, Piece, Plan, Rename, Repeat, Select, Union

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
    out = padding.unpad(out, pad_size)
    if dispatch_fn is not None:
        out = dispatch_fn(out)
    return out


def _as_key_tuple(keys: Any, name: str) -> tuple[str, ...] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        return (keys,)
    if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
        return tuple(keys)
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
        ops: lazy operations (``daskwg.futures.plan``'s ``Union``/``Select``/``Repeat``/
            ``Rename``) applied, in order, after collection and unpadding.
        rows: the pieces this future was cut to, in order (``None``: not cut), each a
            ``daskwg.futures.plan.Piece``: piece ``index`` of ``chunks`` of
            [`chunk`][daskwg.DataProtoFuture.chunk], or a padded one of
            [`padded_chunk`][daskwg.DataProtoFuture.padded_chunk]; a piece cut again holds both.

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
    ops: tuple[Op, ...] = ()
    rows: tuple[Piece, ...] | None = None

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

    def _derive(self, op: Op) -> DataProtoFuture:
        if self.rows is not None or self.dispatch_fn is not None:
            verb = type(op).__name__.lower()
            raise ValueError(
                f"cannot {verb} a piece of a chunked DataProtoFuture; apply {verb} before chunk()"
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
        return self._derive(Union(other))

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
            Select(
                _as_key_tuple(batch_keys, "batch_keys"),
                _as_key_tuple(non_tensor_batch_keys, "non_tensor_batch_keys"),
                _as_key_tuple(meta_info_keys, "meta_info_keys"),
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
        return self._derive(Repeat(int(repeat_times), bool(interleave)))

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProtoFuture:
        """Lazy ``DataProto.rename`` (a new future; this one is unchanged).

        Raises:
            TypeError: keys that are not a str or a list of str.
            ValueError: the two lists differ in length.
        """
        old, new = _as_key_tuple(old_keys, "old_keys"), _as_key_tuple(new_keys, "new_keys")
        if old is None or new is None:
            raise TypeError("rename needs old_keys and new_keys")
        if len(old) != len(new):
            raise ValueError(f"old_keys has {len(old)} keys but new_keys has {len(new)}")
        return self._derive(Rename(old, new))

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
        return [replace(self, rows=(*(self.rows or ()), Piece(i, chunks))) for i in range(chunks)]

    def padded_chunk(
        self,
        chunks: int,
        strip: bool | None,
        keep_parts: bool = True,
        length: int | None = None,
        check: LengthCheck | None = None,
    ) -> list[DataProtoFuture]:
        """[`chunk`][daskwg.DataProtoFuture.chunk] padded as ``DP_COMPUTE_PROTO`` pads a batch (2 rows
        feed 3 ranks; ``daskwg.futures.padding``).

        Args:
            chunks: pieces, one per consuming rank.
            strip: ``True``: each rank unpads its own output (``STRIP``), ``False``: the driver
                does (``PAD``), ``None``: no padding.
            keep_parts: parts one per piece are the pieces.
            length: rows the driver's batches beside it have (the ranks check), or ``None``.
            check: what the ranks compare this argument's rows with, or ``None``.

        Returns:
            ``chunks`` futures, piece ``i`` of this one each.

        Raises:
            ValueError: a custom ``dispatch_fn`` was applied.
        """
        if self.dispatch_fn is not None:
            raise ValueError(
                "cannot chunk a DataProtoFuture with a custom dispatch_fn; chunk the one before it"
            )
        pieces = self._cut(chunks)
        if pieces[0].rows is None:
            if keep_parts and check is None:
                return pieces
            pieces = [replace(self, rows=(*(self.rows or ()), Piece(i, chunks))) for i in range(chunks)]
        mode = None if strip is None else padding.STRIP if strip else padding.PAD
        if mode is None and length is None and check is None:
            return pieces
        return [
            replace(p, rows=(*p.rows[:-1], replace(p.rows[-1], padding=mode, length=length, check=check)))
            for p in pieces
        ]

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
            op.other.row_addressable
            for op in self.ops
            if isinstance(op, Union) and isinstance(op.other, DataProtoFuture)
        )

    def plan(self) -> tuple[Plan, list]:
        """``(plan, parts)``: this future as typed nodes (``daskwg.futures.plan``), parts
        numbered in ``parts`` (its Dask futures and those of every future it was united
        with, in order). A :class:`~daskwg.futures.plan.Union` holds the other's plan
        (a :class:`~daskwg.futures.plan.Local` one for a DataProto)."""
        parts: list = []
        return self._plan(parts), parts

    def _plan(self, parts: list) -> Plan:
        base = Parts(tuple(range(len(parts), len(parts) + len(self.futures))), self.pad_size)
        parts.extend(self.futures)
        ops = []
        for op in self.ops:
            if isinstance(op, Union):
                other = op.other
                ops.append(
                    Union(other._plan(parts) if isinstance(other, DataProtoFuture) else Plan(Local(other)))
                )
            else:
                ops.append(op)
        return Plan(base, tuple(ops), self.rows or ())

    @property
    def transform(self) -> Callable[[list], Any]:
        """``values -> value``: what a receiving rank applies to the resolved parts."""
        if self.ops or self.rows is not None:
            return partial(evaluate_values, self.plan()[0])
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
        return partial(evaluate_values, plan), parts

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
