"""Every dispatch mode, blocking and not, on a real 8-process cluster (verl's worked
mesh examples need 8 ranks)."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import process_cluster
from distributed import Client, Future
from roles import SWAPPABLE, ModeWorker
from tensordict import TensorDict

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    DispatchError,
    WorkerGroup,
    update_dispatch_mode,
)
from daskwg.dispatch.modes import (
    RankOutputs,
    collect_all_to_all,
    collect_dp_compute_data_proto,
    collect_rank_zero,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_data_proto_with_func,
    dispatch_dp_compute_metric,
    dispatch_nd_compute_dataproto,
    dispatch_one_to_all,
)
from daskwg.wire import codec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def wg():
    with process_cluster(8) as cluster, Client(cluster) as client:
        with WorkerGroup(client, ClassWithInitArgs(ModeWorker, offset=2), world_size=8) as group:
            yield group


def _values(futures):
    return [f.result(timeout=60) for f in futures]


def _rows(n: int) -> DataProto:
    return DataProto.from_dict({"a": torch.zeros(n)})


# ---------------------------------------------------------------- list modes


def test_one_to_all_non_blocking_returns_one_future_per_rank(wg):
    futures = wg.one_to_all_nb(1, y=2)
    assert len(futures) == 8 and all(isinstance(f, Future) for f in futures)
    assert _values(futures) == [5] * 8


class _Counted(int):
    """An int that counts how often the driver pickles it (each rank gets a plain int)."""

    pickled = 0

    def __reduce__(self):
        type(self).pickled += 1
        return (int, (int(self),))


@pytest.mark.parametrize("method", ["one_to_all", "one_to_all_nb"])
def test_one_to_all_arguments_are_pickled_once_for_all_ranks(wg, method):
    _Counted.pickled = 0
    got = getattr(wg, method)(_Counted(1), y=_Counted(2))
    assert (got if method == "one_to_all" else _values(got)) == [5] * 8
    assert _Counted.pickled == 2  # x and y once each, not once per rank
    # Different objects per rank are pickled per rank.
    assert _values(wg.all_to_all_nb([_Counted(r) for r in range(8)], y=[10] * 8)) == [
        12 + r for r in range(8)
    ]
    assert _Counted.pickled == 2 + 8


def test_all_to_all_non_blocking_gives_rank_r_entry_r(wg):
    assert _values(wg.all_to_all_nb(list(range(8)), y=[10] * 8)) == [12 + r for r in range(8)]


def test_rank_zero_dispatch_returns_rank_zeros_output(wg):
    assert wg.rank_zero(1) == 3


def test_rank_zero_dispatch_non_blocking_returns_one_future(wg):
    future = wg.rank_zero_nb(1)
    assert isinstance(future, Future)
    assert future.result(timeout=60) == 3


def test_execute_rank_zero_non_blocking_returns_one_future(wg):
    future = wg.execute_rank_zero_nb(5)
    assert isinstance(future, Future)
    assert future.result(timeout=60) == 7


def test_dp_compute_blocking_and_not(wg):
    assert wg.dp_compute(list(range(8))) == [2 + 2 * r for r in range(8)]
    assert _values(wg.dp_compute_nb(list(range(8)))) == [2 + 2 * r for r in range(8)]


# ---------------------------------------------------------------- DataProto modes


def test_non_blocking_padded_dp_call_returns_an_already_unpadded_future(wg):
    future = wg.dp_proto_nb(_rows(10))
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert len(out) == 10
    # 10 rows padded to 16 over 8 ranks: 2 rows per rank; the 6 padding rows are dropped.
    assert out.batch["a"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_non_blocking_padded_tensordict_call_returns_an_unpadded_future(wg):
    out = wg.dp_proto_td_nb(TensorDict({"a": torch.zeros(3)}, batch_size=[3])).get()
    assert isinstance(out, TensorDict)
    assert out["a"].tolist() == [0, 1, 2]


def test_data_proto_future_is_materialized_before_the_method_runs(wg):
    future = wg.dp_proto_nb(_rows(8))
    assert wg.kind_of_argument(future).batch["is_dataproto"].tolist() == [True] * 8


def _double_plus_rank(worker, data):
    return DataProto.from_dict({"a": data.batch["a"] * 2 + worker.rank})


def test_dp_compute_proto_with_func_ships_a_driver_function_to_every_rank(wg):
    data = DataProto.from_dict({"a": torch.arange(8.0)})
    expected = [2 * i + i for i in range(8)]
    assert wg.apply(_double_plus_rank, data).batch["a"].tolist() == expected
    assert wg.execute_with_func_generator(_double_plus_rank, data).batch["a"].tolist() == expected


def test_dp_compute_proto_with_func_non_blocking_returns_a_data_proto_future(wg):
    future = wg.apply_nb(_double_plus_rank, DataProto.from_dict({"a": torch.arange(8.0)}))
    assert isinstance(future, DataProtoFuture)
    assert future.get().batch["a"].tolist() == [3 * i for i in range(8)]


def test_dp_compute_metric_returns_one_metric_per_rank_including_padding_ranks(wg):
    metrics = wg.metric(DataProto.from_dict({"a": torch.ones(12)}))
    assert [m["rank"] for m in metrics] == list(range(8))
    assert [m["rows"] for m in metrics] == [2] * 8  # 12 rows padded to 16
    futures = wg.metric_nb(_rows(12))
    assert [m["rows"] for m in _values(futures)] == [2] * 8


def test_rank_sees_its_padded_share(wg):
    out = wg.rows_seen(DataProto.from_dict({"a": torch.arange(9.0)}))
    # 9 rows padded to 16: rows 9..15 repeat rows 0..6, every rank gets 2 rows
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert out.batch["rows"].tolist() == [2] * 9
    assert out.batch["a"].tolist() == list(range(9))


# ---------------------------------------------------------------- custom modes


def test_registered_custom_mode_dispatches_and_collects(wg):
    assert wg.two_to_all(x=[1, 2], y=[5, 6]) == [8, 10] * 4
    assert _values(wg.two_to_all_nb([1, 2], [5, 6])) == [8, 10] * 4


def test_dict_mode_dispatches_and_collects(wg):
    assert wg.dict_mode([1, 2], [5, 6]) == [8, 8, 8, 8]


def test_dict_mode_non_blocking_collects_the_futures(wg):
    futures = wg.dict_mode_nb([1, 2], [5, 6])
    assert len(futures) == 4 and all(isinstance(f, Future) for f in futures)
    assert _values(futures) == [8, 8, 8, 8]


def test_update_dispatch_mode_changes_the_collect_of_bound_methods(wg):
    assert wg.swappable(1) == [3 + r for r in range(8)]
    update_dispatch_mode(SWAPPABLE, dispatch_one_to_all, collect_rank_zero)
    try:
        assert wg.swappable(1) == 3
    finally:
        update_dispatch_mode(SWAPPABLE, dispatch_one_to_all, collect_all_to_all)


# ---------------------------------------------------------------- async def


def test_async_def_method_blocking(wg):
    assert wg.async_one_to_all(1) == [3 + r for r in range(8)]


def test_async_def_method_non_blocking_dp_proto(wg):
    future = wg.async_dp_proto_nb(DataProto.from_dict({"a": torch.arange(8.0)}))
    assert isinstance(future, DataProtoFuture)
    assert future.get().batch["a"].tolist() == [3 * i for i in range(8)]


def test_collected_columns_of_a_mib_or_more_go_to_pooled_blocks_and_smaller_ones_to_torch():
    # Two ranks' outputs of 4 rows, each with a 512 KiB column and a 64 KiB one (float32):
    # concatenated, the first is 1 MiB (a pooled receive block), the second 128 KiB
    # (torch's own memory).
    parts = [
        DataProto.from_dict({"large": torch.ones(4, 32 * 1024), "small": torch.ones(4, 4 * 1024)})
        for _ in range(2)
    ]
    out = collect_dp_compute_data_proto(None, RankOutputs(parts, method="generate"))
    assert out.batch["large"].nbytes == 1 << 20
    assert codec.received(out.batch["large"])
    assert not codec.received(out.batch["small"])
    assert out.batch["large"].sum().item() == 2 * 128 * 1024


# ---------------------------------------------------------------- meshes (verl's worked examples)


def test_mesh_dp2_tp4_collects_tp_rank_zero_data_proto(wg):
    out = wg.generate_data_proto(DataProto.from_single_dict({"a": torch.tensor([1, 2])}))
    assert wg._dispatch_info["infer"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert out.batch["a"].tolist() == [1, 3]


def test_mesh_dp2_tp4_collects_tp_rank_zero_tensordict(wg):
    out = wg.generate_tensordict(TensorDict({"a": torch.tensor([1, 2])}, batch_size=[2]))
    assert out["a"].tolist() == [1, 3]


def test_mesh_pp2_dp2_tp2_collects_tp0_of_the_last_stage_data_proto(wg):
    out = wg.train_data_proto(DataProto.from_single_dict({"a": torch.tensor([3, 4])}))
    assert wg._dispatch_info["train"] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert wg._collect_info["train"] == [False, False, False, False, True, False, True, False]
    assert out.batch["a"].tolist() == [11, 16]


def test_mesh_pp2_dp2_tp2_collects_tp0_of_the_last_stage_tensordict(wg):
    out = wg.train_tensordict(TensorDict({"a": torch.tensor([3, 4])}, batch_size=[2]))
    assert out["a"].tolist() == [11, 16]


def test_mesh_non_blocking_returns_a_data_proto_future(wg):
    future = wg.generate_data_proto_nb(DataProto.from_single_dict({"a": torch.tensor([1, 2])}))
    assert isinstance(future, DataProtoFuture)
    assert future.get().batch["a"].tolist() == [1, 3]
    td_future = wg.train_tensordict_nb(TensorDict({"a": torch.tensor([3, 4])}, batch_size=[2]))
    assert td_future.get()["a"].tolist() == [11, 16]


def test_mesh_future_feeds_the_next_mesh_call(wg):
    first = wg.generate_data_proto_nb(DataProto.from_single_dict({"a": torch.tensor([1, 2])}))
    # [1, 3] -> train mesh adds 8 to row 0 and 12 to row 1
    assert wg.train_data_proto(first).batch["a"].tolist() == [9, 15]


def test_a_method_that_changes_a_future_argument_in_place_leaves_the_future_unchanged(wg):
    first = wg.dp_proto_nb(_rows(8))
    wg.dp_proto_nb(first).get()  # adds the rank in place to the piece it received
    assert first.get().batch["a"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


# ------------------------------------------------- batches of different lengths (driver only)


class _Part:
    """A stand-in for a finished part of a ``DataProtoFuture``: the driver knows its rows."""

    def __init__(self, rows: int | None):
        self.rows = rows

    def batch_rows(self) -> int | None:
        return self.rows


def _future(*rows: int | None) -> DataProtoFuture:
    return DataProtoFuture(futures=[_Part(r) for r in rows])


def _group(world_size: int = 2):
    return types.SimpleNamespace(
        world_size=world_size, _dispatch_info={"m": [r % 2 for r in range(world_size)]}, _collect_info={}
    )


_MODES = {
    "DP_COMPUTE_PROTO": lambda g, *a, **k: dispatch_dp_compute_data_proto(g, *a, **k),
    "DP_COMPUTE_METRIC": lambda g, *a, **k: dispatch_dp_compute_metric(g, *a, **k),
    "DP_COMPUTE_PROTO_WITH_FUNC": lambda g, *a, **k: dispatch_dp_compute_data_proto_with_func(
        g, len, *a, **k
    ),
    "mesh": lambda g, *a, **k: dispatch_nd_compute_dataproto("m", g, *a, **k),
}


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ((_future(3, 3), _future(2, 2)), {}, "argument \\d \\(a DataProtoFuture\\): 4"),
        ((_future(3, 3),), {"other": _rows(4)}, "argument 'other': 4"),
        ((_rows(4),), {"other": _future(3, 3)}, "argument 'other' \\(a DataProtoFuture\\): 6"),
        ((_future(3, 3).chunk(2)[0], _rows(4)), {}, "\\(a DataProtoFuture\\): 3"),
        ((_future(4, 4).repeat(2), _future(8)), {}, ": 16"),
    ],
    ids=["future-future", "future-keyword-batch", "batch-keyword-future", "piece-batch", "repeated-future"],
)
def test_batches_whose_lengths_the_driver_knows_are_refused_in_every_mode_and_position(
    mode, args, kwargs, named
):
    with pytest.raises(DispatchError, match=named):
        _MODES[mode](_group(), *args, **kwargs)


@pytest.mark.parametrize("mode", list(_MODES))
def test_a_future_whose_length_is_not_known_is_checked_by_the_ranks_beside_other_batches(mode):
    split_args, _ = _MODES[mode](_group(), _future(3, None), _rows(4))
    pieces = split_args[-2]  # the future's pieces (WITH_FUNC's first argument is the function)
    check = pieces[0].rows[-1].check
    label, known = check.label, check.known
    assert label == f"positional argument {len(split_args) - 2} (a DataProtoFuture)"
    assert known == ((f"positional argument {len(split_args) - 1}", 4),)


def test_a_lone_future_of_one_part_per_rank_is_handed_over_part_by_part_unchecked():
    (pieces,), _ = dispatch_dp_compute_data_proto(_group(), _future(3, None))
    assert [p.rows for p in pieces] == [None, None]
