"""``DataProtoFuture``: a batch that is still on the workers.

Mirrors verl's ``verl.protocol.DataProtoFuture`` (``collect_fn``, ``futures``,
``dispatch_fn``, ``concat``, ``chunk``, ``get``) with Dask futures in place of Ray
object refs. Handed to the next group call it is not materialised in the driver:
the per-rank Dask futures travel as task dependencies, Dask moves their data worker to
worker, and the receiving rank runs ``collect_fn`` / unpadding / ``dispatch_fn`` on
them (see :func:`materialize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from .errors import ConcatError

__all__ = ["DataProtoFuture", "concat_parts", "materialize"]


def concat_parts(parts: list) -> Any:
    """Concatenate per-rank outputs: ``DataProto.concat`` or ``torch.cat`` of TensorDicts.

    A single part is returned as it is (no copy).
    """
    if len(parts) == 1:
        return parts[0]
    from .protocol import DataProto, _concat_tensordicts

    if all(isinstance(p, DataProto) for p in parts):
        return DataProto.concat(list(parts))
    from tensordict import TensorDictBase

    if all(isinstance(p, TensorDictBase) for p in parts):
        return _concat_tensordicts(list(parts))
    kinds = sorted({type(p).__name__ for p in parts})
    raise TypeError(f"a DataProtoFuture must resolve to DataProto or TensorDict parts, got {kinds}")


def _take_chunk(data: Any, *, index: int, chunks: int) -> Any:
    from .protocol import DataProto

    if isinstance(data, DataProto):
        return data.chunk(chunks)[index]
    return data.chunk(chunks, dim=0)[index]


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
    if pad_size:
        from .protocol import DataProto, unpad_dataproto

        out = unpad_dataproto(out, pad_size) if isinstance(out, DataProto) else out[: len(out) - pad_size]
    if dispatch_fn is not None:
        out = dispatch_fn(out)
    return out


def _default_gather(futures: list) -> list:
    return futures[0].client.gather(list(futures))


@dataclass(frozen=True)
class DataProtoFuture:
    """A ``DataProto`` (or TensorDict) computed by a group and still held by its ranks.

    Attributes:
        futures: one ``distributed.Future`` per producing rank, in rank order.
        collect_fn: ``list of parts -> value``; default concatenates the parts.
        dispatch_fn: optional ``value -> piece`` applied after collection (the piece
            of a :meth:`chunk`).
        pad_size: rows of padding the producing call added, dropped after collection.
        method: the producing method's name, named by collect errors (``None``: unknown).
        ranks: the producing rank of each future (``None``: ``0..len(futures)-1``).

    Returned by non-blocking ``DP_COMPUTE_PROTO`` (and mesh) calls. ``get()``
    materialises it in the driver; passing it to another group's call moves the data
    worker to worker without passing through the driver.
    """

    futures: Sequence[Any]
    collect_fn: Callable[[list], Any] = concat_parts
    dispatch_fn: Callable[[Any], Any] | None = None
    pad_size: int = 0
    gather: Callable[[list], list] = _default_gather
    method: str | None = None
    ranks: Sequence[int] | None = None

    @staticmethod
    def concat(futures: Sequence[Any]) -> DataProtoFuture:
        """A future of the concatenation of ``futures`` (per-rank Dask futures), as verl's."""
        return DataProtoFuture(futures=list(futures))

    def unpad(self, pad_size: int) -> DataProtoFuture:
        """The same future with ``pad_size`` trailing padding rows dropped on collection."""
        if self.dispatch_fn is not None:
            raise ValueError("cannot unpad a DataProtoFuture that was already chunked")
        return replace(self, pad_size=self.pad_size + pad_size)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """Split into ``chunks`` futures, piece ``i`` being ``value.chunk(chunks)[i]``.

        When this future is the plain concatenation of exactly ``chunks`` parts (the
        output of a group with the same dp size), piece ``i`` is part ``i`` itself, so
        each receiving rank fetches only its own part.
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        if (
            len(self.futures) == chunks
            and self.collect_fn is concat_parts
            and self.dispatch_fn is None
            and not self.pad_size
        ):
            ranks = list(self.ranks) if self.ranks is not None else list(range(chunks))
            return [replace(self, futures=[f], ranks=[r]) for f, r in zip(self.futures, ranks)]
        return [
            replace(self, dispatch_fn=partial(_take_chunk, index=i, chunks=chunks)) for i in range(chunks)
        ]

    @property
    def transform(self) -> Callable[[list], Any]:
        """``values -> value``: what a receiving rank applies to the resolved parts."""
        return partial(
            materialize,
            self.collect_fn,
            self.pad_size,
            self.dispatch_fn,
            method=self.method,
            ranks=self.ranks,
        )

    def get(self) -> Any:
        """Materialise the value in the driver.

        Raises the producing call's error (``RankError``, ``WorkerLostError``) if it
        failed, and :class:`~daskwg.errors.ConcatError` naming the method, the field and
        each rank when the ranks' outputs cannot be concatenated.
        """
        return self.transform(self.gather(list(self.futures)))

    def done(self) -> bool:
        """Whether every producing rank has finished."""
        return all(f.done() for f in self.futures)
