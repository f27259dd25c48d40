"""A ``DataProtoFuture``'s row plan as typed nodes: what its value is made of, with no
Dask future in it (its parts are numbered), so that it travels to the consuming ranks
inside a call (a :class:`daskwg.wire.messages.LazyArg`'s ``spec``) and the driver and every
rank run the same interpreter on it (``daskwg.futures.interpreter``).

A :class:`Plan` is a base (:class:`Parts`: the concatenation of numbered parts, minus
trailing padding rows; or :class:`Local`: a DataProto the driver holds), the lazy
operations applied to it in order (:class:`Select`, :class:`Rename`, :class:`Repeat`,
:class:`Union`, as verl's ``DataProto`` methods of those names) and the pieces it was cut
to, in order (:class:`Piece`: piece ``index`` of ``chunks`` as ``DataProto.chunk`` cuts it,
or padded as ``DP_COMPUTE_PROTO`` pads a batch, ``daskwg.futures.padding``). A piece cut
again (``fut.chunk(4)[1].chunk(2)[0]``) holds both pieces, each cutting the rows the one
before left.

The nodes are frozen dataclasses: a future and its plan are values, and every node
pickles by reference to this module (a change here is a change of the wire format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .padding import PieceMode

__all__ = [
    "Base",
    "LengthCheck",
    "Local",
    "Op",
    "Parts",
    "Piece",
    "Plan",
    "Rename",
    "Repeat",
    "Select",
    "Union",
]


@dataclass(frozen=True)
class Parts:
    """The parts ``numbers`` (indices into the plan's parts) concatenated in order, their
    last ``pad_size`` rows dropped (the padding the producing call added)."""

    numbers: tuple[int, ...]
    pad_size: int = 0


@dataclass(frozen=True)
class Local:
    """A DataProto (or TensorDict) the driver holds, united with a future (``fut.union(dp)``)."""

    data: Any


Base = Parts | Local


@dataclass(frozen=True)
class Select:
    """``DataProto.select(batch_keys, non_tensor_batch_keys, meta_info_keys)`` (``None``
    keeps that part whole)."""

    batch_keys: tuple[str, ...] | None = None
    non_tensor_batch_keys: tuple[str, ...] | None = None
    meta_info_keys: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Rename:
    """``DataProto.rename(old_keys, new_keys)``, key by key."""

    old_keys: tuple[str, ...]
    new_keys: tuple[str, ...]


@dataclass(frozen=True)
class Repeat:
    """``DataProto.repeat(times, interleave)``: every row ``times`` times (``a, a, b, b``
    interleaved, ``a, b, a, b`` not)."""

    times: int
    interleave: bool = True


@dataclass(frozen=True)
class Union:
    """``DataProto.union(other)``, row by row. ``other``: a :class:`Plan` in a plan; in a
    ``DataProtoFuture``'s own ``ops``, the ``DataProtoFuture`` or ``DataProto`` given to
    ``union`` (its plan is made when the future's is)."""

    other: Any


Op = Select | Rename | Repeat | Union


@dataclass(frozen=True)
class LengthCheck:
    """The lengths a consuming rank compares before it fetches a row, where the driver did
    not know this batch argument's: ``label`` names the argument (``"positional argument 1
    (a DataProtoFuture)"``), ``known`` is ``((label, rows), ...)`` of the call's batch
    arguments whose lengths the driver knew."""

    label: str
    known: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Piece:
    """Piece ``index`` of ``chunks``, as ``DataProto.chunk`` cuts (``padding`` ``None``)
    or padded first (:data:`~daskwg.futures.padding.PAD` or
    :data:`~daskwg.futures.padding.STRIP`: every piece ``ceil(rows / chunks)`` rows, the
    last ones wrapping round to the first rows).

    Attributes:
        length: the rows the batch must have (those of the driver's batches cut beside it
            in the same call), or ``None``.
        check: what the consuming rank compares this argument's length with, or ``None``.
    """

    index: int
    chunks: int
    padding: PieceMode | None = None
    length: int | None = None
    check: LengthCheck | None = None


@dataclass(frozen=True)
class Plan:
    """A ``DataProtoFuture`` as plain data: ``base``, then ``ops`` in order, then ``pieces``
    in order (``()``: the whole value)."""

    base: Base
    ops: tuple[Op, ...] = ()
    pieces: tuple[Piece, ...] = ()
