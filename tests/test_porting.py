"""Porting fidelity (issue 13): verl code behaves the same on daskwg, and errors name the
method, the field and the ranks involved. One test per reported value."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from porting_workers import PortedWorker
from tensordict import TensorDict

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    DispatchError,
    RankError,
    WorkerGroup,
    WorkerGroupError,
)
from daskwg.errors import ConcatError, ConflictError, MetaInfoConflictError
from daskwg.protocol import (
    collate_fn,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)


@pytest.fixture(scope="module")
def ported_wg(cluster4):
    from distributed import Client

    with Client(cluster4) as client, WorkerGroup(client, ClassWithInitArgs(PortedWorker), world_size=2) as wg:
        yield wg


def four_rows() -> DataProto:
    return DataProto.from_dict({"a": torch.arange(4)})


# ---------------------------------------------------------------- 1: padding in place


def test_padding_pads_the_callers_dataproto_as_verl_does():
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3])})
    data.padding(2)
    assert data.batch["a"].tolist() == [1, 2, 3, 3, 3]


def test_padding_with_the_first_candidate_repeats_the_first_row():
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3])})
    data.padding(2, padding_candidate="first")
    assert data.batch["a"].tolist() == [1, 2, 3, 1, 1]


# ---------------------------------------------------------------- 2: per-rank meta_info


def test_per_rank_meta_info_names_the_method_and_the_ranks_that_disagree(ported_wg):
    with pytest.raises(MetaInfoConflictError) as info:
        ported_wg.tag_rank(four_rows())
    message = str(info.value)
    assert "collecting the outputs of 'tag_rank'" in message
    assert "Conflicting values for meta_info key 'gen_rank'" in message
    assert "rank 0: 0, rank 1: 1" in message
    assert info.value.method == "tag_rank"


def test_per_rank_meta_info_conflict_is_caught_by_verl_style_except_assertion_error(ported_wg):
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'gen_rank'"):
        ported_wg.tag_rank(four_rows())
    with pytest.raises(ValueError):
        ported_wg.tag_rank(four_rows())


def test_a_conflict_found_by_the_next_method_still_names_the_method_that_produced_it(ported_wg):
    future = ported_wg.tag_rank_async(four_rows())
    with pytest.raises(RankError) as info:
        ported_wg.count_rows(future)
    # The failure is blamed on the producing call, as the input of the consuming one.
    assert "tag_rank_async (ranks 0, 1)" in info.value.method
    assert "the input of 'count_rows'" in info.value.method
    assert isinstance(info.value.exception, AssertionError)
    message = str(info.value)
    # Built on the consuming rank, the parts are the producer's ranks in order.
    assert "'gen_rank'" in message and "part 0: 0, part 1: 1" in message


def test_per_rank_values_under_metrics_are_merged_not_refused(ported_wg):
    out = ported_wg.tag_metrics(four_rows())
    assert out.meta_info["metrics"] == {"gen_rank": [0, 1]}


# ---------------------------------------------------------------- 3: shapes at collect


def test_ranks_returning_different_widths_name_the_field_and_each_rank(ported_wg):
    with pytest.raises(ConcatError) as info:
        ported_wg.generate(four_rows())
    message = str(info.value)
    assert "collecting the outputs of 'generate'" in message
    assert "'responses'" in message
    assert "rank 0: [2, 3], rank 1: [2, 5]" in message


def test_shape_mismatch_is_named_by_data_proto_future_get(ported_wg):
    future = ported_wg.generate_async(four_rows())
    assert isinstance(future, DataProtoFuture)
    with pytest.raises(
        ConcatError, match=r"'generate_async'.*'responses'.*rank 0: \[2, 3\], rank 1: \[2, 5\]"
    ):
        future.get()


def test_numeric_non_tensor_fields_of_different_widths_name_the_field_and_each_rank(ported_wg):
    with pytest.raises(ConcatError, match=r"'score'.*'scores'.*rank 0: \[2, 3\], rank 1: \[2, 5\]"):
        ported_wg.score(four_rows())


def test_tensordict_outputs_of_different_widths_name_the_field_and_each_rank(ported_wg):
    data = TensorDict({"a": torch.arange(4)}, batch_size=[4])
    with pytest.raises(ConcatError, match=r"'generate_td'.*'responses'.*rank 0: \[2, 3\], rank 1: \[2, 5\]"):
        ported_wg.generate_td(data)


# ---------------------------------------------------------------- 6: dispatch messages


def test_with_func_dispatch_counts_the_function_as_argument_0(ported_wg):
    with pytest.raises(DispatchError, match="positional argument 1 has type list"):
        ported_wg.execute_with_func_generator(len, [1, 2])


def test_dispatch_error_suggests_building_a_data_proto_from_dict(ported_wg):
    with pytest.raises(DispatchError, match=r'DataProto\.from_dict\(\{"x": t\}\)'):
        ported_wg.generate(torch.zeros(4))


def test_a_tensordict_without_batch_dimension_is_reported_as_such(ported_wg):
    with pytest.raises(DispatchError, match=r"batch_size=\[\]") as info:
        ported_wg.generate_td(TensorDict({"a": torch.zeros(4)}, batch_size=[]))
    assert "0 rows" not in str(info.value)


# ---------------------------------------------------------------- 7: verl's helpers


def test_all_gather_data_proto_gives_every_rank_all_rows_in_rank_order(ported_wg):
    assert ported_wg.init_process_group() == [True, True]
    try:
        results = ported_wg.all_gather_rows()
    finally:
        ported_wg.destroy_process_group()
    assert results == [([0, 0, 1, 1], ["r0", "r0", "r1", "r1"])] * 2


def test_union_tensor_dict_adds_keys_in_place_and_returns_the_first():
    first = TensorDict({"a": torch.tensor([1, 2])}, batch_size=[2])
    second = TensorDict({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])}, batch_size=[2])
    assert union_tensor_dict(first, second) is first
    assert first["b"].tolist() == [3, 4]
    with pytest.raises(ConflictError, match="'a'"):
        union_tensor_dict(first, TensorDict({"a": torch.tensor([9, 9])}, batch_size=[2]))


def test_union_numpy_dict_adds_keys_in_place_and_returns_the_first():
    first = {"a": np.array([1, 2])}
    assert union_numpy_dict(first, {"b": np.array(["x", "y"], dtype=object)}) is first
    assert sorted(first) == ["a", "b"]


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}
    assert list_of_dict_to_dict_of_list([]) == {}
    with pytest.raises(KeyError, match="'c'"):
        list_of_dict_to_dict_of_list([{"a": 1}, {"c": 2}])


def test_collate_fn_stacks_items_back_into_a_dataproto():
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3])}, {"pair": [[1, 2], [3, 4], [5, 6]]})
    out = collate_fn([data[2], data[0]])
    assert out.batch["a"].tolist() == [3, 1]
    assert out.non_tensor_batch["pair"].tolist() == [[5, 6], [1, 2]]


def test_fold_and_unfold_batch_dim_leave_their_argument_as_it_was():
    data = DataProto.from_dict({"a": torch.arange(4)}, {"tag": ["r0", "r1", "r2", "r3"]})
    folded = fold_batch_dim(data, 2)
    assert folded.batch["a"].tolist() == [[0, 1], [2, 3]]
    assert data.non_tensor_batch["tag"].shape == (4,)
    unfolded = unfold_batch_dim(folded, 2)
    assert unfolded.non_tensor_batch["tag"].tolist() == ["r0", "r1", "r2", "r3"]
    assert folded.batch.batch_size == torch.Size([2])


# ---------------------------------------------------------------- 5: get_worker


def test_get_worker_in_a_rank_method_is_the_hosting_worker(ported_wg):
    assert ported_wg.hosting_worker() == ported_wg.workers
    assert ported_wg.hosting_worker_async() == ported_wg.workers


# ---------------------------------------------------------------- 4: what cannot be pickled


def dask_errors(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("distributed")
    ]


@pytest.mark.parametrize("blocking", [True, False])
def test_an_argument_that_cannot_be_pickled_is_refused_in_the_driver_naming_it(ported_wg, caplog, blocking):
    caplog.set_level(logging.ERROR)
    with pytest.raises(WorkerGroupError) as info:
        if blocking:
            ported_wg.ping(threading.Lock())
        else:
            ported_wg.execute_all_async("ping", lock=threading.Lock())
    assert not isinstance(info.value, RankError)
    message = str(info.value)
    assert "'ping'" in message
    assert ("positional argument 0" if blocking else "argument 'lock'") in message
    assert "lock" in message.lower()
    assert dask_errors(caplog) == []
    assert ported_wg.ping() == ["pong", "pong"]


def test_a_result_that_cannot_be_pickled_is_a_rank_error_naming_method_and_rank(ported_wg):
    with pytest.raises(RankError) as info:
        ported_wg.make_lock()
    assert info.value.method == "make_lock"
    assert info.value.rank in (0, 1)
    assert "make_lock" in str(info.value) and f"rank {info.value.rank}" in str(info.value)
    assert ported_wg.ping() == ["pong", "pong"]
