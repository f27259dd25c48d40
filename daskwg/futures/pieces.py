"""How a batch is cut into one piece per rank: as ``DataProto.chunk`` cuts it
(:func:`chunk_bounds`), or padded first as ``DP_COMPUTE_PROTO`` pads a batch in the
driver (:func:`piece_rows` of a padded piece), so that a ``DataProtoFuture`` of 2 rows
feeds 3 ranks exactly as the same 2 rows in the driver do.

A piece is ``(index, chunks)`` (unpadded) or ``(index, chunks, mode[, length[, check]])``.
``mode`` ``None`` is unpadded too; :data:`PAD` or :data:`STRIP` pads to a multiple of
``chunks`` rows, rows repeated from the start, as :func:`daskwg.protocol.pad_rows` does: with
:data:`PAD` the driver takes the padding off the collected output (it padded its own batches
by as many rows); with :data:`STRIP` each consuming rank takes its own padding rows off its
output (:func:`trailing_padding`), since the driver never learns the length. ``length``: the
rows the batch must have (those of the driver's batches cut beside it in the same call), or
``None``. ``check``: ``(label, known)`` when the call has several batch arguments and the
driver did not know the length of this one: ``label`` names the argument (``"positional
argument 1"``) and ``known`` is ``((label, rows), ...)`` of the arguments whose lengths it
knew; the consuming rank compares the lengths of all such arguments before it fetches a row
(:func:`check_lengths`).

A future cut again (a micro-batch of a piece, ``fut.chunk(4)[i]`` handed to a group of 2)
holds its pieces in order, each cutting the rows the one before left.
"""

from __future__ import annotations

import numpy as np

from ..errors import DispatchError

__all__ = ["PAD", "STRIP", "chunk_bounds", "check_lengths", "piece_rows", "rows_after", "trailing_padding"]

PAD = "pad"
STRIP = "strip"


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


def _size(rows: int, chunks: int) -> int:
    """Rows of every padded piece: ``rows`` padded to a multiple of ``chunks``, cut evenly."""
    return -(-rows // chunks)


def piece_rows(rows: int, piece: tuple) -> np.ndarray:
    """The row numbers of ``piece`` of a batch of ``rows`` rows, padding rows included
    (a padded piece's last numbers wrap around to the first rows).

    Raises:
        ValueError: an unpadded piece of fewer rows than pieces, a padded one of a batch
            with no rows, or of a batch whose rows are not the ``length`` it was cut for.
    """
    index, chunks = piece[0], piece[1]
    if len(piece) > 3 and piece[3] is not None and piece[3] != rows:
        label = (
            f"{piece[4][0]} (a DataProtoFuture)" if len(piece) > 4 and piece[4] else "this DataProtoFuture"
        )
        raise DispatchError(
            f"{label} has {rows} rows, but the DataProto/TensorDict arguments beside it in the same "
            f"call have {piece[3]}: every batch argument of one call must have the same length (as for "
            "batches in the driver); select or pad them to one length first"
        )
    if not _padded(piece):
        return np.arange(*chunk_bounds(rows, index, chunks))
    if rows == 0:
        raise ValueError(f"the batch has 0 rows; there is nothing to split over {chunks} ranks")
    size = _size(rows, chunks)
    return np.arange(index * size, (index + 1) * size) % rows


def rows_after(rows: int, pieces: tuple) -> int:
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


def _padded(piece: tuple) -> bool:
    return len(piece) > 2 and piece[2] is not None


def trailing_padding(rows: int, piece: tuple) -> int:
    """How many padding rows end ``piece`` of a batch of ``rows`` rows (0 unpadded)."""
    if not _padded(piece) or rows == 0:
        return 0
    size = _size(rows, piece[1])
    return min(size, max(0, (piece[0] + 1) * size - rows))
