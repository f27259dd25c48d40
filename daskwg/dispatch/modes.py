"""The dispatch and collect functions: how a group call's arguments are split over the
ranks and the per-rank results merged back (verl's ``dispatch_*`` / ``collect_*``).

A call on a group runs three steps, mirroring verl's ``verl.single_controller.base.decorator``:

1. **dispatch** (driver): ``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)``
   turns the call's arguments into per-rank arguments: every returned positional and
   keyword value is a list with one entry per rank (length ``worker_group.world_size``).
   The ``DP_COMPUTE_PROTO`` family also returns the padding count under
   :data:`PADDING_SIZE_KEY` in ``kwargs`` (an ``int``, not a per-rank list), as verl's does:
   the group takes it out before sending and strips that many rows from the collected
   output (``daskwg.futures.padding``).
2. **execute**: the group runs the method on every rank (``Execute.ALL``) or on rank 0
   only (``Execute.RANK_ZERO``).
3. **collect** (driver): ``collect_fn(worker_group, outputs) -> Any`` merges the per-rank
   outputs (``outputs[r]`` is rank ``r``'s result).

Dispatch and collect functions may rely only on ``worker_group.world_size``,
``worker_group._dispatch_info`` / ``_collect_info`` (dicts used as caches) and
``worker_group._query_dispatch_info(mesh_name) -> list[int]`` /
``_query_collect_info(mesh_name) -> list[bool]``.

Padding has one rule, in ``daskwg.futures.padding`` (how many rows, how the count travels,
where the rows come off); the functions here call it.

The batch-splitting and concatenating functions take verl's ``DataProto`` too: they work on
daskwg's sharing its tensors (``daskwg.foreign``) and hand back verl's class.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from distributed import Future
from tensordict import TensorDict, TensorDictBase

from .. import foreign
from ..errors import ConcatError, DispatchError
from ..futures import padding
from ..futures.future import DataProtoFuture
from ..futures.padding import PADDING_SIZE_KEY
from ..futures.pieces import check_lengths
from ..futures.plan import LengthCheck
from ..protocol import DataProto, concat_small_columns, concat_tensordicts
from ..wire import codec

__all__ = [
    "PADDING_SIZE_KEY",
    "RankOutputs",
    "check_per_rank",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_nd_compute_dataproto",
    "collect_rank_zero",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "dispatch_dp_compute_metric",
    "dispatch_nd_compute_dataproto",
    "dispatch_one_to_all",
    "make_nd_compute_dataproto_dispatch_fn",
    "split_or_broadcast",
]


def _labelled(args: tuple[Any, ...], kwargs: Mapping[str, Any], start: int = 0) -> Iterator[tuple[str, Any]]:
    """``(label, value)`` for every argument, labels as error messages show them.

    ``start`` is the position of ``args[0]`` in the user's call (1 when the dispatch
    function already took the first argument off).
    """
    for i, value in enumerate(args, start=start):
        yield f"positional argument {i}", value
    for key, value in kwargs.items():
        yield f"argument {key!r}", value


def check_per_rank(
    mode: str, world_size: int, args: tuple[Any, ...], kwargs: Mapping[str, Any], hint: str = ""
) -> None:
    """Check that every argument holds one entry per rank (a list or tuple of length
    ``world_size``): the input of ``ALL_TO_ALL``/``DP_COMPUTE``, and what every dispatch
    function must return.

    Args:
        mode: who expects it, for the message (``"ALL_TO_ALL"``, ``"the dispatch function of g.m"``).
        hint: what to do instead, appended to the message of an argument that is no list.

    Raises:
        DispatchError: naming the argument, its type or length, and ``world_size``.
    """
    for label, value in _labelled(args, kwargs):
        if not isinstance(value, (list, tuple)):
            raise DispatchError(
                f"{mode} expects every argument to hold one entry per rank (a list or tuple of length "
                f"world_size={world_size}); {label} has type {type(value).__name__}{hint}"
            )
        if len(value) != world_size:
            raise DispatchError(
                f"{mode} expects one entry per rank: {label} has length {len(value)}, the group has "
                f"world_size={world_size}"
            )


_ONE_TO_ALL_HINT = (
    ". Pass a list of {n} values, or register the method with Dispatch.ONE_TO_ALL to send the same value to "
    "every rank"
)


def _check_batches(mode: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], start: int = 0) -> None:
    for label, value in _labelled(args, kwargs, start):
        if not isinstance(value, (DataProto, TensorDict, DataProtoFuture)):
            raise DispatchError(
                f"{mode} splits DataProto, DataProtoFuture or TensorDict arguments over the ranks; "
                f"{label} has type {type(value).__name__}. Wrap it in a DataProto: "
                f'DataProto.from_dict({{"x": t}}) for a tensor t with one row per sample, or '
                f'DataProto.from_dict(meta_info={{"x": value}}) for one value for the whole batch; '
                f"or register the method with another dispatch mode (ONE_TO_ALL sends it to every rank)"
            )
        if isinstance(value, TensorDictBase) and value.batch_dims == 0:
            raise DispatchError(
                f"{mode} splits batches along their first batch dimension; {label} is a TensorDict "
                f"with batch_size=[] (no batch dimension). Build it with batch_size=[N] (N rows), "
                f"or call td.auto_batch_size_(batch_dims=1)"
            )


def _num_rows(value: Any) -> int | None:
    """Rows of a DataProto or TensorDict; ``None`` for a DataProtoFuture (not known here)."""
    if isinstance(value, DataProto):
        return len(value)
    if isinstance(value, TensorDict):
        return int(value.batch_size[0]) if value.batch_dims else 0
    return None


class _Lengths:
    """The lengths of one call's batch arguments, as far as the driver knows them.

    A DataProto's or TensorDict's rows are known; a ``DataProtoFuture``'s once its producing
    calls replied (:meth:`DataProtoFuture.known_rows`). Known lengths that differ are refused
    here (:func:`daskwg.futures.pieces.check_lengths`); where a future's is not known yet and
    the call has other batch arguments, its pieces carry a ``check`` and every consuming rank
    compares the lengths before it fetches a row, naming the arguments (not the producer).

    Attributes:
        known: ``((label, rows), ...)`` of the arguments whose rows are known.
        batch: rows of the DataProto/TensorDict arguments (``None``: there are none).
        unknown: whether some future's rows are not known.
    """

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], start: int = 0) -> None:
        entries = [(label, value) for label, value in _labelled(args, kwargs, start)]
        self.count = len(entries)
        known, batch, self.unknown = [], None, False
        for label, value in entries:
            rows = _num_rows(value)
            if rows is not None:
                batch = rows if batch is None else batch
            elif isinstance(value, DataProtoFuture):
                rows = value.known_rows()
                label = f"{label} (a DataProtoFuture)"
            if rows is None:
                self.unknown = True
            else:
                known.append((label, rows))
        self.known = tuple(known)
        self.batch = batch
        try:
            check_lengths(list(self.known))
        except DispatchError as exc:
            self.error = exc
        else:
            self.error = None

    def refuse(self, mode: str) -> None:
        """Raise the :class:`DispatchError` of known lengths that differ, naming ``mode``."""
        if self.error is not None:
            raise DispatchError(f"{mode}: {self.error}") from None

    @property
    def length(self) -> int | None:
        """The rows every batch argument must have, where one is known."""
        return self.known[0][1] if self.known else None

    def check(self, label: str) -> LengthCheck | None:
        """The ``check`` for the pieces of the future argument ``label`` (``None``: the driver
        knows every length, or it is the call's only batch argument)."""
        if self.count < 2 or not self.unknown:
            return None
        return LengthCheck(f"{label} (a DataProtoFuture)", self.known)


def _even_parts(value: DataProtoFuture, chunks: int) -> bool:
    """Whether ``value``'s parts, handed over one per rank, are the pieces ``chunk(chunks)``
    cuts: the driver knows they all hold the same rows (another batch argument beside it is
    then paired row by row)."""
    if len(value.futures) != chunks or value.pad_size:
        return False
    rows = [getattr(f, "batch_rows", lambda: None)() for f in value.futures]
    return None not in rows and len(set(rows)) == 1


def _split_tensordict(td: Any, chunks: int) -> list[Any]:
    """``chunks`` pieces along dim 0, sizes differing by at most one, each with its own storage.

    Cloning matters: a view would pickle its whole parent storage and would alias the
    caller's tensors.
    """
    rows = _num_rows(td) or 0
    base, extra = divmod(rows, chunks)
    sizes = [base + 1] * extra + [base] * (chunks - extra)
    return [piece.clone() for piece in td.split(sizes, dim=0)]


def _split_batch(label: str, value: Any, chunks: int, lengths: _Lengths | None = None) -> list[Any]:
    """Split one DataProto / TensorDict / DataProtoFuture into exactly ``chunks`` pieces
    (a future's checked by the ranks against ``lengths`` where the driver does not know its rows)."""
    rows = _num_rows(value)
    if rows is not None and rows < chunks:
        raise DispatchError(f"{label} has {rows} rows, fewer than the {chunks} pieces it must be split into")
    try:
        if isinstance(value, TensorDict):
            pieces = _split_tensordict(value, chunks)
        elif isinstance(value, DataProtoFuture) and lengths is not None and lengths.count > 1:
            pieces = value.padded_chunk(
                chunks,
                None,
                keep_parts=_even_parts(value, chunks),
                length=lengths.length,
                check=lengths.check(label),
            )
        else:
            pieces = value.chunk(chunks)
    except (TypeError, ValueError) as exc:
        raise DispatchError(f"cannot split {label} into {chunks} pieces: {exc}") from exc
    pieces = list(pieces)
    if len(pieces) != chunks:
        raise DispatchError(f"{label} was split into {len(pieces)} pieces instead of {chunks}")
    return pieces


class RankOutputs(list):
    """The per-rank results of one group call, handed to its collect function.

    The group gives up its references to them, so the built-in collect functions may
    drop each part as soon as it has been merged (see :func:`_concat_releasing`).

    Attributes:
        method: the name of the method whose outputs these are (``None`` if unknown), so
            that a collect error can say which call it was collecting.
        ranks: the rank of each output (``outputs[i]`` came from rank ``ranks[i]``).
    """

    def __init__(self, outputs: Any = (), method: str | None = None, ranks: list[int] | None = None):
        super().__init__(outputs)
        self.method = method
        self.ranks = list(range(len(self))) if ranks is None else list(ranks)


#: Bytes of a collected column from which it is copied part by part, each part freed once
#: copied; smaller ones are one ``torch.cat``.
_RELEASE_FROM = 1 << 20


def _concat_releasing(parts: list[Any]) -> Any:
    """``DataProto.concat`` of per-rank outputs that frees each part once it is copied.

    ``torch.cat`` needs every part and the result in memory together: 2x the batch on
    top of whatever the caller holds. Copying part by part into the result and dropping
    each part right after (``parts`` is emptied) keeps one part and the result instead.
    The tensors' keys, dtypes and trailing shapes are compared here, one pass over the
    columns; parts that disagree take ``DataProto.concat`` itself, which raises its own
    errors. ``meta_info`` merging, validation and the non-tensor rows come from
    ``DataProto.concat`` run on stand-ins without tensors. (Stand-ins whose tensors were on
    the ``meta`` device cost a Python ``torch.cat`` meta kernel per column: 512 keys,
    2 ranks: ~100 ms of driver CPU per call, 13x the driver's own chunk + concat.) The
    columns are written into
    :func:`daskwg.wire.codec.owned_empty`: an RL loop collects batches of the same sizes every
    step, so columns of :data:`daskwg.wire.buffers.SMALLEST` (1 MiB) or more land in the warm
    pages an earlier step's result gave back (a 64 MiB DP round trip on 4 ranks 92 -> 75 ms
    here); smaller ones are ``torch.empty``'s own. Parts that are not flat TensorDicts of
    plain CPU tensors take the ordinary path.
    """

    def plain(part: Any) -> bool:
        td = part.batch
        return (
            type(td) is TensorDict
            and td.device in (None, torch.device("cpu"))
            and td.batch_dims == 1
            and td.names[0] is None
        )

    if len(parts) < 2 or not all(p.batch is not None and plain(p) for p in parts):
        return DataProto.concat(list(parts))
    small = concat_small_columns(parts)
    if small is not None:
        parts.clear()
        return small
    columns = [p.batch._tensordict for p in parts]
    first = columns[0]
    shapes = {}
    for key, t in first.items():
        trailing, dtype, rows = t.shape[1:], t.dtype, 0
        for cols in columns:
            other = cols.get(key)
            if (
                type(other) is not torch.Tensor
                or not other.is_cpu
                or other.layout != torch.strided
                or other.dtype != dtype
                or other.shape[1:] != trailing
            ):
                # Not plain CPU tensors (the ordinary path), or parts that disagree:
                # DataProto.concat raises, or promotes dtypes as torch.cat does.
                return DataProto.concat(list(parts))
            rows += other.shape[0]
        shapes[key] = ((rows, *trailing), dtype)
    if any(len(cols) != len(first) for cols in columns):
        return DataProto.concat(list(parts))  # raises: the parts differ in keys
    first = t = other = None  # no reference to a part beyond ``columns``
    shells = [type(p)(batch=None, non_tensor_batch=p.non_tensor_batch, meta_info=p.meta_info) for p in parts]
    merged = DataProto.concat(shells)
    del shells
    rows = sum(p.batch.batch_size[0] for p in parts)
    out = {}
    for key, (shape, dtype) in shapes.items():
        # A small column: one torch.cat of it (a copy into the result, slicing and
        # copying part by part costs a few Python-level tensor calls a part); the parts
        # wait for the large columns anyway.
        if math.prod(shape) * dtype.itemsize < _RELEASE_FROM:
            out[key] = torch.cat([cols[key] for cols in columns])
    large = [key for key in shapes if key not in out]
    # Columns of buffers.SMALLEST bytes or more go into pooled blocks (an RL loop drops the
    # last step's batch of the same sizes, so the copy lands in warm pages); owned_empty
    # leaves smaller ones to torch's allocator, which keeps small blocks warm itself.
    for key in large:
        out[key] = codec.owned_empty(*shapes[key])
    columns = None
    device = parts[0].batch.device
    start = 0
    for i in range(len(parts)):
        part, parts[i] = parts[i], None
        n = part.batch.batch_size[0]
        cols = part.batch._tensordict
        for k in large:
            out[k][start : start + n].copy_(cols[k])
        start += n
        part = cols = None  # the part (and its receive buffer) is freed here
    out = {key: out[key] for key in shapes}  # the parts' key order
    batch = TensorDict(out, batch_size=[rows], device=device)
    return type(merged)(batch=batch, non_tensor_batch=merged.non_tensor_batch, meta_info=merged.meta_info)


def _concat_outputs(mode: str, outputs: list[Any], keep: list[bool] | None = None) -> Any:
    """Concatenate per-rank DataProto / TensorDict outputs, or wrap Dask futures of them.

    ``keep`` selects the outputs to concatenate (all by default). A failed concatenation
    raises :class:`ConcatError` naming the method and the ranks when ``outputs`` is the
    group's :class:`RankOutputs`. verl DataProto outputs are concatenated as daskwg ones
    (replaced in ``outputs``, which the group gave up) and the result is verl's again.
    """
    method = getattr(outputs, "method", None)
    ranks = getattr(outputs, "ranks", None) or list(range(len(outputs)))
    if keep is not None:
        ranks = [r for r, k in zip(ranks, keep) if k]
        outputs = RankOutputs([o for o, k in zip(outputs, keep) if k], method=method, ranks=ranks)
    verl_cls = foreign.nativize(outputs)
    if not outputs:
        raise ValueError(f"{mode} has no outputs to collect")
    for kind, concat in (
        (DataProto, DataProto.concat),
        (TensorDictBase, concat_tensordicts),
        (Future, functools.partial(_concat_futures, method=method, ranks=ranks)),
    ):
        if isinstance(outputs[0], kind):
            if not all(isinstance(out, kind) for out in outputs):
                break
            try:
                if kind is DataProto and isinstance(outputs, RankOutputs):
                    return foreign.from_native(_concat_releasing(outputs), verl_cls)
                return foreign.from_native(concat(list(outputs)), verl_cls)
            except ConcatError as exc:
                raise exc.in_call(method or mode, ranks) from None
    kinds = ", ".join(f"rank output {i}: {type(out).__name__}" for i, out in enumerate(outputs))
    raise TypeError(
        f"{mode} concatenates outputs that are all DataProto, all TensorDict or all Dask futures; got {kinds}"
    )


def _concat_futures(futures: list[Any], method: str | None = None, ranks: list[int] | None = None) -> Any:
    return DataProtoFuture(futures=list(futures), method=method, ranks=ranks)


def dispatch_one_to_all(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, list[Any]]]:
    """Every rank gets every argument as given (verl's ``dispatch_one_to_all``)."""
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {key: [value] * n for key, value in kwargs.items()}


def dispatch_all_to_all(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, list[Any]]]:
    """Arguments already hold one entry per rank (verl's ``dispatch_all_to_all``).

    Unlike verl, which passes anything through and lets ``execute_all`` guess whether to
    split, the lengths are checked here.

    Raises:
        DispatchError: an argument is not a list/tuple of length ``world_size``.
    """
    n = worker_group.world_size
    check_per_rank("ALL_TO_ALL", n, args, kwargs, _ONE_TO_ALL_HINT.format(n=n))
    return tuple(list(arg) for arg in args), {key: list(value) for key, value in kwargs.items()}


def split_or_broadcast(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """A dispatch function with verl's ``execute_all`` rule (what verl's ``ALL_TO_ALL``
    amounts to): arguments that are all lists of ``world_size`` entries are split one per
    rank, any others go to every rank as given. ``execute_all_*`` and ``daskwg.verl``'s
    groups use it."""
    n = worker_group.world_size
    if all(isinstance(v, list) and len(v) == n for v in (*args, *kwargs.values())):
        return dispatch_all_to_all(worker_group, *args, **kwargs)
    return dispatch_one_to_all(worker_group, *args, **kwargs)


def collect_all_to_all(worker_group: Any, outputs: list[Any]) -> list[Any]:
    """The per-rank outputs as a plain list (verl's ``collect_all_to_all``).

    A plain ``list``, not the group's ``RankOutputs``: ``client.gather`` only looks
    inside plain lists for the futures of a ``blocking=False`` call.
    """
    return list(outputs)


def collect_rank_zero(worker_group: Any, outputs: list[Any]) -> Any:
    """Rank 0's output (verl defines ``Dispatch.RANK_ZERO`` but never implemented it)."""
    return outputs[0]


def dispatch_dp_compute(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, list[Any]]]:
    """Data-parallel lists: rank ``r`` gets entry ``r`` of every argument (verl's ``dispatch_dp_compute``).

    Raises:
        DispatchError: an argument is not a list/tuple of length ``world_size`` (the message
            names the argument, its length and ``world_size``).
    """
    n = worker_group.world_size
    check_per_rank("DP_COMPUTE", n, args, kwargs, _ONE_TO_ALL_HINT.format(n=n))
    return tuple(list(arg) for arg in args), {key: list(value) for key, value in kwargs.items()}


def collect_dp_compute(worker_group: Any, outputs: list[Any]) -> list[Any]:
    """The list of per-rank outputs (verl's ``collect_dp_compute``)."""
    return list(outputs)


def dispatch_dp_compute_data_proto(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, Any]]:
    """Pad and split batch arguments over the ranks (verl's ``dispatch_dp_compute_data_proto``).

    Every argument must be a ``DataProto``, ``TensorDict`` or ``DataProtoFuture``, all of one
    length ``L`` (verl asserts as much), futures included: those whose producers replied are
    checked here, the others by the consuming ranks before they fetch a row (every rank raises
    a ``RankError`` holding the ``DispatchError`` that names the arguments and their rows). The
    DataProto and TensorDict arguments are padded
    to ``L + pad`` rows (a multiple of ``world_size``, rows repeated from the start) and split
    into ``world_size`` equal pieces. DataProtoFutures are cut the same way on the consuming
    ranks (:meth:`DataProtoFuture.padded_chunk`), so 2 rows feed 3 ranks on both paths: with
    DataProto or TensorDict arguments beside them, padded by as many rows, which the driver
    takes off; alone (their length is not known in the driver), each rank takes its padding
    rows off its own output. A future whose parts are already one per rank is handed over
    part by part. ``kwargs[PADDING_SIZE_KEY] = pad`` (:func:`daskwg.futures.padding.announce`).

    Unlike verl, padding is always on: verl pads only when ``DataProtoConfig.auto_padding``
    (or the DataProto's own flag) is set and otherwise requires ``L % world_size == 0``. The
    caller's DataProtos are never modified (verl pads them in place).

    Raises:
        DispatchError: an argument of another type (message names it and its type),
            arguments of different lengths (each named with its rows), or a batch with no rows.
    """
    mode = "DP_COMPUTE_PROTO"
    args, kwargs, as_given = foreign.native_arguments(args, kwargs)
    _check_batches(mode, args, kwargs)
    n = worker_group.world_size
    lengths = _Lengths(args, kwargs)
    lengths.refuse(mode)
    if lengths.length == 0:
        raise DispatchError(f"{mode} got batches with 0 rows; there is nothing to split over {n} ranks")
    length = lengths.batch
    pad_size = padding.rows_to_add(length, n)

    def pad_and_split(label: str, value: Any) -> list[Any]:
        if _num_rows(value) is not None:
            value = padding.pad(value, n)
        elif isinstance(value, DataProtoFuture):
            alone = lengths.count == 1 or _even_parts(value, n)
            return value.padded_chunk(
                n,
                strip=length is None,
                keep_parts=length is None and alone,
                length=lengths.length if length is None else length,
                check=lengths.check(label),
            )
        return _split_batch(label, value, n)

    split_args = tuple(pad_and_split(f"positional argument {i}", arg) for i, arg in enumerate(args))
    split_kwargs: dict[str, Any] = {
        key: pad_and_split(f"argument {key!r}", value) for key, value in kwargs.items()
    }
    return as_given(split_args, padding.announce(split_kwargs, pad_size))


def dispatch_dp_compute_metric(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, Any]]:
    """Pad and split like ``DP_COMPUTE_PROTO``, without asking the group to unpad.

    The outputs of ``DP_COMPUTE_METRIC`` are one value per rank, not rows, so there is
    nothing to strip. verl reuses ``dispatch_dp_compute_data_proto`` here and then slices
    ``pad_size`` entries off the per-rank list, dropping whole ranks' metrics.

    Raises:
        DispatchError: as :func:`dispatch_dp_compute_data_proto`.
    """
    split_args, split_kwargs = dispatch_dp_compute_data_proto(worker_group, *args, **kwargs)
    return split_args, padding.take(split_kwargs)[0]


def dispatch_dp_compute_data_proto_with_func(
    worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, list[Any]]]:
    """Send ``args[0]`` (a callable) to every rank and split the rest without padding.

    Mirrors verl's ``dispatch_dp_compute_data_proto_with_func``; verl requires a plain
    function and lengths divisible by ``world_size``, here any callable is accepted and
    pieces may differ in size by one row.

    Raises:
        DispatchError: no first argument, or it is not callable; another argument is not a
            DataProto/TensorDict/DataProtoFuture, has fewer rows than ``world_size``, or has
            other rows than another (a future's checked on the ranks where not known here).
    """
    mode = "DP_COMPUTE_PROTO_WITH_FUNC"
    if not args or not callable(args[0]):
        got = type(args[0]).__name__ if args else "nothing"
        raise DispatchError(f"{mode} expects a callable as first positional argument, got {got}")
    args, kwargs, as_given = foreign.native_arguments(args, kwargs)
    func, rest = args[0], args[1:]
    _check_batches(mode, rest, kwargs, start=1)
    n = worker_group.world_size
    lengths = _Lengths(rest, kwargs, start=1)
    lengths.refuse(mode)
    split_args = tuple(
        _split_batch(f"positional argument {i}", arg, n, lengths) for i, arg in enumerate(rest, start=1)
    )
    split_kwargs = {
        key: _split_batch(f"argument {key!r}", value, n, lengths) for key, value in kwargs.items()
    }
    return as_given(([func] * n, *split_args), split_kwargs)


def collect_dp_compute_data_proto(worker_group: Any, outputs: list[Any]) -> Any:
    """Concatenate per-rank outputs (verl's ``collect_dp_compute_data_proto``).

    DataProtos with ``DataProto.concat``, TensorDicts with ``torch.cat`` along dim 0, Dask
    ``distributed.Future`` objects (``blocking=False``) into one ``DataProtoFuture``.

    Raises:
        TypeError: the outputs are not all of one of those kinds.
        ConcatError: ranks returned a field with different shapes after dim 0 (the method,
            the field and each rank's shape are named; verl lets ``torch.cat`` raise a bare
            ``RuntimeError``).
        MetaInfoConflictError: ranks returned different values for a non-metric ``meta_info``
            key (the method, the key and each rank's value are named; also an
            ``AssertionError``, what verl raises).
    """
    return _concat_outputs("DP_COMPUTE_PROTO", outputs)


def _lookup_mesh(mesh_name: str, worker_group: Any, collect: bool) -> list:
    """The per-rank dp ranks (``collect=False``) or collect flags (``collect=True``) of
    ``mesh_name``, asked of the ranks once and cached on the group (verl's
    ``_query_dispatch_info`` / ``_query_collect_info`` and their caches).

    Raises:
        DispatchError: an answer per rank missing, dp ranks that do not cover
            ``0..dp_size-1``, or no rank marked ``is_collect``.
    """
    cache = worker_group._collect_info if collect else worker_group._dispatch_info
    cached = cache.get(mesh_name)
    if cached is not None:
        return cached
    n = worker_group.world_size
    if collect:
        values = [bool(flag) for flag in worker_group._query_collect_info(mesh_name)]
        what = "collect flags"
    else:
        values = [int(dp_rank) for dp_rank in worker_group._query_dispatch_info(mesh_name)]
        what = "dp ranks"
    if len(values) != n:
        raise DispatchError(f"mesh {mesh_name!r}: got {what} for {len(values)} ranks, the group has {n}")
    if collect and not any(values):
        raise DispatchError(
            f"mesh {mesh_name!r}: no rank is marked is_collect=True, nothing would be returned"
        )
    if not collect and (not values or min(values) < 0 or set(values) != set(range(max(values) + 1))):
        raise DispatchError(
            f"mesh {mesh_name!r}: dp ranks per rank {values} must cover 0..dp_size-1 without gaps"
        )
    cache[mesh_name] = values
    return values


def dispatch_nd_compute_dataproto(
    mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any
) -> tuple[tuple[list[Any], ...], dict[str, list[Any]]]:
    """Split batches into ``dp_size`` pieces and give each rank the piece of its dp rank.

    Mirrors verl's ``dispatch_lazy_compute_data_proto``: on first use, asks the ranks for
    their dp rank in ``mesh_name`` (``worker_group._query_dispatch_info``) and caches the
    answer in ``worker_group._dispatch_info[mesh_name]``. No padding (as verl).

    Raises:
        DispatchError: a non-batch argument, a batch with fewer rows than ``dp_size``, batches
            of different lengths (futures' checked on the ranks where not known here), or dp
            ranks that do not cover ``0..dp_size-1``.
    """
    mode = f"mesh dispatch {mesh_name!r}"
    args, kwargs, as_given = foreign.native_arguments(args, kwargs)
    _check_batches(mode, args, kwargs)
    lengths = _Lengths(args, kwargs)
    lengths.refuse(mode)
    mapping = _lookup_mesh(mesh_name, worker_group, collect=False)
    dp_size = max(mapping) + 1

    def per_rank(label: str, value: Any) -> list[Any]:
        pieces = _split_batch(label, value, dp_size, lengths)
        return [pieces[dp_rank] for dp_rank in mapping]

    split_args = tuple(per_rank(f"positional argument {i}", arg) for i, arg in enumerate(args))
    split_kwargs = {key: per_rank(f"argument {key!r}", value) for key, value in kwargs.items()}
    return as_given(split_args, split_kwargs)


def collect_nd_compute_dataproto(mesh_name: str, worker_group: Any, outputs: list[Any]) -> Any:
    """Concatenate, in rank order, the outputs of the ranks marked ``is_collect`` in ``mesh_name``.

    Mirrors verl's ``collect_lazy_compute_data_proto``; the flags are queried once with
    ``worker_group._query_collect_info`` and cached in ``worker_group._collect_info``.

    Raises:
        DispatchError: no rank collects (also a ``ValueError``).
        ValueError: ``outputs`` does not have ``world_size`` entries.
        TypeError: the collected outputs are not all DataProto / TensorDict / Dask futures.
    """
    mask = _lookup_mesh(mesh_name, worker_group, collect=True)
    if len(outputs) != len(mask):
        raise ValueError(f"mesh {mesh_name!r}: expected {len(mask)} outputs, got {len(outputs)}")
    return _concat_outputs(f"mesh collect {mesh_name!r}", outputs, keep=mask)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Callable[..., Any]]:
    """A dispatch mode for a device mesh registered on the workers (verl's function of that name).

    Use it as ``@register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))`` on
    a Worker that calls ``self._register_dispatch_collect_info("train", dp_rank, is_collect)``
    in ``__init__``. The functions are ``functools.partial`` objects, so they pickle.

    Returns:
        ``{"dispatch_fn": ..., "collect_fn": ...}``.
    """
    if not isinstance(mesh_name, str):
        raise TypeError(f"mesh_name must be a str, got {type(mesh_name).__name__}")
    return {
        "dispatch_fn": functools.partial(dispatch_nd_compute_dataproto, mesh_name),
        "collect_fn": functools.partial(collect_nd_compute_dataproto, mesh_name),
    }
