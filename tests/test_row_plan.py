"""A ``DataProtoFuture``'s row plan (``daskwg.futures.plan``) and its one interpreter
(``daskwg.futures.interpreter``): the plan a future builds is typed nodes that survive the
trip to a rank, and the interpreter reads exactly the rows of a piece (a piece of a piece
too), as ``DataProto.chunk`` and ``DP_COMPUTE_PROTO``'s padding cut them in the driver.

No cluster: the parts are values, ``gather`` hands them over as they are, and the fetch a
rank would send to other workers is recorded here.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from daskwg.errors import DispatchError
from daskwg.futures import padding
from daskwg.futures.future import DataProtoFuture
from daskwg.futures.interpreter import argument_rows, evaluate, length_check, padding_of
from daskwg.futures.plan import LengthCheck, Local, Parts, Piece, Plan, Rename, Repeat, Select, Union
from daskwg.protocol import DataProto

pytestmark = pytest.mark.timeout(60)

#: Rows of each part of the futures below (10 rows in all, uneven parts).
PARTS = (4, 3, 3)


def _batch(start: int, rows: int) -> DataProto:
    values = torch.arange(start, start + rows)
    return DataProto.from_dict({"a": values, "b": values * 10})


def _parts() -> list[DataProto]:
    starts = [sum(PARTS[:i]) for i in range(len(PARTS))]
    return [_batch(s, n) for s, n in zip(starts, PARTS)]


def _future() -> DataProtoFuture:
    """A future of 10 rows (``a``: 0..9) whose parts are the values themselves."""
    return DataProtoFuture(futures=_parts(), gather=list)


def _whole() -> DataProto:
    return DataProto.concat(_parts())


def _a(value: DataProto) -> list[int]:
    return value.batch["a"].tolist()


class _Fetch:
    """A rank's fetch over the parts: rows ``[start, stop)`` of one part, recorded."""

    def __init__(self, parts: list[DataProto]) -> None:
        self.parts = parts
        self.asked: list[tuple[int, int, int]] = []

    def __call__(self, part: int, start: int, stop: int, columns) -> DataProto:
        self.asked.append((part, start, stop))
        return self.parts[part][start:stop]


def _on_rank(future: DataProtoFuture) -> tuple[DataProto, list[tuple[int, int, int]]]:
    """What a consuming rank builds from ``future``'s plan, and the row ranges it fetched."""
    plan, parts = future.plan()  # the parts are the values themselves here
    fetch = _Fetch(parts)
    return evaluate(plan, [len(p) for p in parts], [{} for _ in parts], fetch), fetch.asked


def test_a_futures_plan_is_typed_nodes_naming_its_parts_ops_and_pieces():
    future = _future().select(["a"]).repeat(2, interleave=False).chunk(3)[1]
    plan, parts = future.plan()
    assert plan == Plan(Parts((0, 1, 2)), (Select(("a",)), Repeat(2, False)), (Piece(1, 3),))
    assert len(parts) == 3


def test_a_union_with_a_future_numbers_the_other_futures_parts_after_its_own():
    other = DataProtoFuture(futures=_parts()[:2], gather=list).rename("a", "c")
    plan, parts = _future().union(other).plan()
    assert plan.ops == (Union(Plan(Parts((3, 4)), (Rename(("a",), ("c",)),))),)
    assert len(parts) == 5


def test_a_union_with_a_driver_batch_holds_it_as_a_local_base():
    local = _whole()
    (union,) = _future().union(local).plan()[0].ops
    assert isinstance(union.other.base, Local) and union.other.base.data is local


def test_a_plan_survives_pickling_as_it_does_inside_a_call():
    piece = _future().select(["a"], None).rename("a", "x").padded_chunk(4, strip=True)[3]
    plan = piece.chunk(1)[0].plan()[0]
    assert pickle.loads(pickle.dumps(plan)) == plan


@pytest.mark.parametrize("index", range(4))
def test_a_piece_fetches_only_its_own_rows_as_dataproto_chunk_cuts_them(index):
    value, asked = _on_rank(_future().chunk(4)[index])  # 3, 3, 2 and 2 rows
    assert _a(value) == _a(_whole().chunk(4)[index])
    fetched = sum(stop - start for _, start, stop in asked)
    assert fetched == len(_whole().chunk(4)[index])


def test_a_piece_spanning_two_parts_fetches_the_tail_of_one_and_the_head_of_the_next():
    _, asked = _on_rank(_future().chunk(2)[1])  # rows 5..9: the last 2 of part 1, all of part 2
    assert asked == [(1, 1, 3), (2, 0, 3)]
    _, asked = _on_rank(_future().chunk(2)[0])  # rows 0..4: all of part 0, the first row of part 1
    assert asked == [(0, 0, 4), (1, 0, 1)]


@pytest.mark.parametrize(("outer", "inner"), [(0, 0), (0, 1), (1, 0), (1, 1), (3, 1)])
def test_a_piece_of_a_piece_is_the_chunk_of_the_chunk(outer, inner):
    nested = _future().chunk(4)[outer].chunk(2)[inner]
    expected = _a(_whole().chunk(4)[outer].chunk(2)[inner])
    assert [len(nested.rows), _a(nested.get())] == [2, expected]
    assert _a(_on_rank(nested)[0]) == expected


def test_a_piece_of_a_repeated_future_reads_the_source_rows_it_repeats():
    piece = _future().repeat(2).chunk(4)[1]  # rows 5..9 of 0,0,1,1,...,9,9
    value, asked = _on_rank(piece)
    assert _a(value) == [2, 3, 3, 4, 4]
    assert asked == [(0, 2, 4), (1, 0, 1)]


def test_select_rename_and_union_evaluate_as_the_eager_dataproto_methods():
    other = DataProtoFuture(futures=_parts(), gather=list).select(["b"]).rename("b", "c")
    future = _future().select(["a"]).union(other).chunk(2)[1]
    expected = _whole().select(["a"]).union(_whole().select(["b"]).rename("b", "c")).chunk(2)[1]
    for value in (future.get(), _on_rank(future)[0]):
        assert sorted(value.batch.keys()) == ["a", "c"]
        assert value.batch["c"].tolist() == expected.batch["c"].tolist()
        assert _a(value) == _a(expected)


@pytest.mark.parametrize(("chunks", "index", "rows", "trailing"), [(4, 3, [9, 0, 1], 2), (5, 4, [8, 9], 0)])
def test_a_padded_piece_wraps_round_to_the_first_rows_as_dp_compute_proto_pads(chunks, index, rows, trailing):
    # 10 rows over 4 ranks: padded to 12 as pad_dataproto_to_divisor pads the driver's batches.
    pieces = _future().padded_chunk(chunks, strip=True, keep_parts=False)
    padded = padding.pad(_whole(), chunks)
    size = len(padded) // chunks
    assert _a(_on_rank(pieces[index])[0]) == rows
    assert _a(pieces[index].get()) == _a(padded)[index * size : (index + 1) * size]
    assert padding_of(pieces[index].plan()[0], list(PARTS)) == trailing


def test_a_piece_the_driver_unpads_leaves_its_rows_to_the_driver():
    piece = _future().padded_chunk(4, strip=False, keep_parts=False)[3]
    assert padding_of(piece.plan()[0], list(PARTS)) == 0


def test_argument_rows_counts_the_batch_before_the_last_piece_cut_it():
    plan = _future().repeat(3).chunk(2)[1].chunk(5)[0].plan()[0]
    assert argument_rows(plan, list(PARTS)) == 15
    assert argument_rows(plan, list(PARTS), whole=True) == 3


def test_a_piece_cut_for_another_length_is_refused_with_the_argument_named():
    check = LengthCheck("argument 'x' (a DataProtoFuture)", (("argument 'y'", 8),))
    (piece,) = _future().padded_chunk(1, strip=None, keep_parts=False, length=8, check=check)
    assert length_check(piece.plan()[0]) == check
    with pytest.raises(DispatchError, match="argument 'x' \\(a DataProtoFuture\\) has 10 rows"):
        piece.get()
