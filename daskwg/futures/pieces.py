"""How a batch is cut into one piece per rank: as ``DataProto.chunk`` cuts it
(:func:`chunk_bounds`), or padded first as ``DP_COMPUTE_PROTO`` pads a batch in the
driver (``daskwg.futures.padding``), so that a ``DataProtoFuture`` of 2 rows feeds 3 ranks
exactly as the same 2 rows in the driver do.

A piece is a :class:`daskwg.futures.plan.Piece`. Its ``length``, where set, is the rows the
batch must have (those of the driver's batches cut beside it in the same call); its
``check``, where set, makes the consuming rank compare the lengths of all the call's batch
arguments before it fetches a row (:func:`check_lengths`).

A future cut again (a micro-batch of a piece, ``fut.chunk(4)[i]`` handed to a group of 2)
holds its pieces in order, each cutting the rows the one before left (:func:`rows_after`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..errors import DispatchError
from . import padding
from .plan import Piece

__all__ = ["chunk_bounds", "check_lengths", "piece_rows", "rows_after", "trailing_padding"]


def chunk_bounds(rows: int, index: int, chunks: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of piece ``index`` when ``rows`` rows are cut into
    ``chunks`` pieces as :meth:`DataProto.chunk` cuts them (the first ``rows % chunks``
    pieces one row longer).

    Raises:
        ValueError: fewer rows than pieces.
    """
    if rows < chunks:
        raise ValueError(
            f"cannot split {rows} rows into {chunks} non-empty chunks; the consuming group has more ranks "
            "than the batch has rows"
        )
    base, extra = divmod(rows, chunks)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def piece_rows(rows: int, piece: Piece) -> np.ndarray:
    """The row numbers of ``piece`` of a batch of ``rows`` rows, padding rows included
    (a padded piece's last numbers wrap around to the first rows).

    Raises:
        DispatchError: the batch's rows are not the ``length`` the piece was cut for.
        ValueError: an unpadded piece of fewer rows than pieces, or a padded one of a batch
            with no rows.
    """
    if piece.length is not None and piece.length != rows:
        label = f"{piece.check.label}" if piece.check is not None else "this DataProtoFuture"
        raise DispatchError(
            f"{label} has {rows} rows, but the DataProto/TensorDict arguments beside it in the same "
            f"call have {piece.length}: every batch argument of one call must have the same length (as for "
            "batches in the driver); select or pad them to one length first"
        )
    if piece.padding is None:
        return np.arange(*chunk_bounds(rows, piece.index, piece.chunks))
    return padding.padded_rows(rows, piece.index, piece.chunks)


def rows_after(rows: int, pieces: Iterable[Piece]) -> int:
    """Rows left of a batch of ``rows`` rows once ``pieces`` cut it, one after the other
    (a padded piece's padding rows included).

    Raises:
        ValueError: a piece cannot be cut, as :func:`piece_rows`.
    """
    for piece in pieces:
        rows = len(piece_rows(rows, piece))
    return rows


def check_lengths(arguments: list[tuple[str, int]]) -> None:
    """Refuse one call's batch arguments of different lengths, as ``DP_COMPUTE_PROTO`` refuses
    DataProtos of different lengths in the driver.

    Args:
        arguments: ``(label, rows)`` of every batch argument whose length is known.

    Raises:
        DispatchError: two lengths differ; it names every argument and its rows.
    """
    if len({rows for _, rows in arguments}) > 1:
        shown = ", ".join(f"{label}: {rows}" for label, rows in arguments)
        raise DispatchError(
            "every DataProto, TensorDict and DataProtoFuture argument of one call must have the same length "
            f"(paired row by row over the ranks, as verl's dispatch requires); got {shown}. Select or pad "
            "them to one length first"
        )


def trailing_padding(rows: int, piece: Piece) -> int:
    """How many padding rows end ``piece`` of a batch of ``rows`` rows (0 unpadded)."""
    if piece.padding is None:
        return 0
    return padding.trailing(rows, piece.index, piece.chunks)
