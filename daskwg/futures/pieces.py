"""How a batch is cut into one piece per rank: as ``DataProto.chunk`` cuts it
(:func:`chunk_bounds`), or padded first as ``DP_COMPUTE_PROTO`` pads a batch in the
driver (:func:`piece_rows` of a padded piece), so that a ``DataProtoFuture`` of 2 rows
feeds 3 ranks exactly as the same 2 rows in the driver do.

A piece is ``(index, chunks)`` (unpadded) or ``(index, chunks, PAD | STRIP[, length])``
(padded to a multiple of ``chunks`` rows, rows repeated from the start, as
:func:`daskwg.protocol.pad_rows` does): with :data:`PAD` the driver takes the padding off
the collected output (it padded its own batches by as many rows); with :data:`STRIP` each
consuming rank takes its own padding rows off its output (:func:`trailing_padding`),
since the driver never learns the length. ``length``: the rows the batch must have (those
of the driver's batches cut beside it in the same call).
"""

from __future__ import annotations

import numpy as np

__all__ = ["PAD", "STRIP", "chunk_bounds", "piece_rows", "trailing_padding"]

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
    if len(piece) == 2:
        return np.arange(*chunk_bounds(rows, *piece))
    index, chunks = piece[0], piece[1]
    if rows == 0:
        raise ValueError(f"the batch has 0 rows; there is nothing to split over {chunks} ranks")
    if len(piece) > 3 and piece[3] != rows:
        raise ValueError(
            f"this DataProtoFuture has {rows} rows, but the DataProto/TensorDict arguments beside it in "
            f"the same DP_COMPUTE_PROTO call have {piece[3]}: every batch argument of one call must have "
            "the same length (as for batches in the driver); select or pad them to one length first"
        )
    size = _size(rows, chunks)
    return np.arange(index * size, (index + 1) * size) % rows


def trailing_padding(rows: int, piece: tuple) -> int:
    """How many padding rows end ``piece`` of a batch of ``rows`` rows (0 unpadded)."""
    if len(piece) < 3 or rows == 0:
        return 0
    size = _size(rows, piece[1])
    return min(size, max(0, (piece[0] + 1) * size - rows))
