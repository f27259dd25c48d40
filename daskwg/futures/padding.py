"""Padding for ``DP_COMPUTE_PROTO``: the one rule for how many rows are added, how the
count travels and where the rows come off, for blocking calls, ``DataProtoFuture``
arguments and step plans alike.

verl's ``dispatch_dp_compute_data_proto`` pads a batch of ``L`` rows to a multiple of the
group's ``world_size`` by repeating rows from the start (``pad_dataproto_to_divisor``),
returns the count under a key of the per-rank ``kwargs`` and its ``func_generator`` pops
that key and unpads the collected output. daskwg keeps that contract at the edge, where
dispatch functions (the built-in ones and users' own) return ``(args, kwargs)``:
:data:`PADDING_SIZE_KEY` is written by :func:`announce` and read once, by :func:`take`,
as the group cuts a call. From there the count travels as a typed field
(:class:`daskwg.dispatch.calling.Cut`'s ``padding``) to :func:`unpad`, which takes it off
the collected output (a value or a ``DataProtoFuture``).

A ``DataProtoFuture`` is cut on the consuming ranks: its padded pieces
(:class:`daskwg.futures.plan.Piece` with ``padding`` :data:`PAD` or :data:`STRIP`) read
rows :func:`padded_rows` numbers, so 2 rows feed 3 ranks exactly as a batch in the driver
does. With :data:`PAD`, the driver padded its own batches beside the future by as many rows
and takes them off the collected output; with :data:`STRIP` (the future alone: the driver
never learns its length) each rank takes its own :func:`trailing` padding rows off its
output (:func:`strip`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from tensordict import TensorDictBase

from .. import foreign
from ..protocol import DataProto, pad_rows, unpad_rows

__all__ = [
    "PAD",
    "PADDING_SIZE_KEY",
    "STRIP",
    "PieceMode",
    "announce",
    "pad",
    "padded_rows",
    "rows_to_add",
    "strip",
    "take",
    "trailing",
    "unpad",
]

PADDING_SIZE_KEY = "_daskwg_padding_size"
"""Key under which a dispatch function returns the number of padding rows it added (an
``int`` in ``kwargs``, not a per-rank list), as verl's ``_padding_size_key``."""

PAD = "pad"
"""A padded piece whose padding the driver takes off the collected output."""
STRIP = "strip"
"""A padded piece whose padding the consuming rank takes off its own output."""

PieceMode = Literal["pad", "strip"]


def rows_to_add(length: int | None, ranks: int) -> int:
    """Rows of padding that make ``length`` rows a multiple of ``ranks`` (0 when
    ``length`` is unknown, ``None``, or 0)."""
    return (-length) % ranks if length else 0


def pad(value: Any, ranks: int) -> Any:
    """``value`` (a DataProto or TensorDict) padded to a multiple of ``ranks`` rows, rows
    repeated from the start (:func:`daskwg.protocol.pad_rows`); ``value`` itself when none
    are needed.

    Raises:
        TypeError: ``value`` is neither a DataProto nor a TensorDict.
    """
    return pad_rows(value, ranks)[0]


def announce(kwargs: dict[str, Any], count: int) -> dict[str, Any]:
    """``kwargs`` of a dispatch function's return with the padding ``count`` under
    :data:`PADDING_SIZE_KEY` (verl's contract for what a dispatch function returns)."""
    kwargs[PADDING_SIZE_KEY] = count
    return kwargs


def take(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """``(kwargs without the padding key, the padding count)`` of a dispatch function's
    return: the one place :data:`PADDING_SIZE_KEY` is read (0 when it is absent)."""
    kwargs = dict(kwargs)
    return kwargs, int(kwargs.pop(PADDING_SIZE_KEY, 0) or 0)


def unpad(value: Any, count: int) -> Any:
    """The collected output ``value`` without its last ``count`` rows
    (:func:`daskwg.protocol.unpad_rows`; a ``DataProtoFuture`` drops them when materialised).

    Raises:
        ValueError: ``value`` has fewer than ``count`` rows.
    """
    return unpad_rows(value, count)


def strip(output: Any, count: int) -> Any:
    """A rank's ``output`` without its last ``count`` rows, the padding of a :data:`STRIP`
    piece it was given: a DataProto (daskwg's or verl's) or TensorDict with at least that
    many rows; anything else (a metric, a shorter batch) is returned as it is."""
    if not count:
        return output
    if isinstance(output, TensorDictBase):
        rows = int(output.batch_size[0]) if output.batch_dims else 0
    elif isinstance(output, DataProto) or foreign.is_verl_dataproto(output):
        rows = len(output)
    else:
        return output
    return unpad_rows(output, count) if rows >= count else output


def _size(rows: int, chunks: int) -> int:
    """Rows of every padded piece: ``rows`` padded to a multiple of ``chunks``, cut evenly."""
    return -(-rows // chunks)


def padded_rows(rows: int, index: int, chunks: int) -> np.ndarray:
    """Row numbers of padded piece ``index`` of ``chunks`` of a batch of ``rows`` rows: the
    last pieces' numbers wrap around to the first rows, as :func:`pad` repeats them.

    Raises:
        ValueError: a batch with no rows (there is no row to repeat).
    """
    if rows == 0:
        raise ValueError(f"the batch has 0 rows; there is nothing to split over {chunks} ranks")
    size = _size(rows, chunks)
    return np.arange(index * size, (index + 1) * size) % rows


def trailing(rows: int, index: int, chunks: int) -> int:
    """How many padding rows end padded piece ``index`` of ``chunks`` of ``rows`` rows."""
    if rows == 0:
        return 0
    size = _size(rows, chunks)
    return min(size, max(0, (index + 1) * size - rows))
