"""Specification of daskwg.protocol: DataProto and its padding helpers.

Expected values of verl's tests/test_protocol_on_cpu.py are kept where they apply, adjusted
to daskwg's deliberate fixes (exact chunk counts, typed errors). The verbatim port of that
file is tests/test_verl_protocol.py.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from daskwg.errors import ConcatError, MetaInfoConflictError
from daskwg.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)


def abc_data() -> DataProto:
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"]},
        meta_info={"info": "test_info"},
    )


def rows(n: int) -> DataProto:
    """n rows whose tensor and non-tensor fields both name the row: obs=i, tag='r{i}'."""
    return DataProto.from_dict(
        tensors={"obs": torch.arange(n)}, non_tensors={"tag": [f"r{i}" for i in range(n)]}
    )


def tags(data: DataProto) -> list[str]:
    return data.non_tensor_batch["tag"].tolist()


# ----------------------------------------------------------------------- building


def test_from_dict_takes_batch_size_from_dim0():
    data = DataProto.from_dict(tensors={"obs": torch.randn(100, 10), "act": torch.randn(100, 10, 3)})
    assert data.batch.batch_size == torch.Size([100])
    assert len(data) == 100


@pytest.mark.parametrize("num_batch_dims", [2, 3])
def test_from_dict_rejects_more_than_one_batch_dim(num_batch_dims):
    with pytest.raises(ValueError, match="num_batch_dims"):
        DataProto.from_dict(
            tensors={"obs": torch.randn(100, 10), "act": torch.randn(100, 10, 3)},
            num_batch_dims=num_batch_dims,
        )


def test_from_dict_rejects_tensors_of_different_lengths_naming_both():
    with pytest.raises(ValueError, match="'obs' has 4 rows, 'act' has 3"):
        DataProto.from_dict(tensors={"obs": torch.zeros(4), "act": torch.zeros(3)})


def test_from_dict_rejects_non_tensor_of_wrong_length():
    with pytest.raises(ValueError, match=r"non_tensor_batch\['labels'\] has 2 rows, expected 3"):
        DataProto.from_dict(tensors={"obs": torch.zeros(3)}, non_tensors={"labels": ["a", "b"]})


def test_from_dict_rejects_a_tensor_given_as_non_tensor():
    with pytest.raises(TypeError, match="pass tensors in `tensors`"):
        DataProto.from_dict(non_tensors={"x": torch.zeros(3)})


def test_from_dict_does_not_modify_its_arguments():
    non_tensors = {"labels": ["a", "b"]}
    meta_info = {"k": 1}
    DataProto.from_dict(
        tensors={"obs": torch.zeros(2)}, non_tensors=non_tensors, meta_info=meta_info, auto_padding=True
    )
    assert non_tensors == {"labels": ["a", "b"]}
    assert meta_info == {"k": 1}


def test_lists_become_object_arrays():
    data = abc_data()
    assert data.non_tensor_batch["labels"].dtype == object
    assert data.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]


def test_equal_length_lists_stay_one_dimensional_object_arrays():
    data = DataProto.from_dict(non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]]})
    pairs = data.non_tensor_batch["pairs"]
    assert pairs.shape == (3,)
    assert pairs.dtype == object
    assert pairs[1] == [3, 4]


def test_equal_length_lists_stay_one_dimensional_through_every_operation():
    data = DataProto.from_dict(
        tensors={"obs": torch.arange(3)}, non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]]}
    )
    results = {
        "concat": DataProto.concat([data, data]),
        "index": data[[2, 0]],
        "mask": data[np.array([True, False, True])],
        "slice": data[1:],
        "repeat": data.repeat(2),
        "tile": data.repeat(2, interleave=False),
        "padding": data.padding(4),
        "chunk": data.chunk(2)[0],
    }
    for name, result in results.items():
        pairs = result.non_tensor_batch["pairs"]
        assert pairs.ndim == 1, name
        assert pairs.shape == (len(result),), name
        assert pairs.dtype == object, name
    assert results["padding"].non_tensor_batch["pairs"].tolist() == [[1, 2], [3, 4]] + [[5, 6]] * 5


def test_from_single_dict_routes_tensors_and_arrays():
    data = DataProto.from_single_dict(
        {"obs": torch.zeros(2, 3), "labels": np.array(["a", "b"], dtype=object)}
    )
    assert list(data.batch.keys()) == ["obs"]
    assert list(data.non_tensor_batch) == ["labels"]


def test_from_single_dict_rejects_lists():
    with pytest.raises(TypeError, match="from_single_dict takes torch.Tensor or np.ndarray"):
        DataProto.from_single_dict({"labels": ["a", "b"]})


def test_from_single_dict_returns_the_subclass_it_is_called_on():
    class CustomProto(DataProto):
        pass

    assert type(CustomProto.from_single_dict({"x": torch.tensor([0])})) is CustomProto


def test_constructor_rejects_lists_in_non_tensor_batch():
    with pytest.raises(TypeError, match="from_dict converts lists"):
        DataProto(batch=None, non_tensor_batch={"labels": ["a", "b"]})


def test_constructor_rejects_a_two_dimensional_batch():
    with pytest.raises(ValueError, match="exactly one batch dim"):
        DataProto(batch=TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))


# ------------------------------------------------------------------------ length


def test_len_counts_tensor_rows():
    assert len(abc_data()) == 3


def test_len_uses_non_tensors_when_there_are_no_tensors():
    labels = np.array(["a", "b", "c"], dtype=object)
    assert (
        len(DataProto(batch=None, non_tensor_batch={"labels": labels}, meta_info={"info": "test_info"})) == 3
    )


@pytest.mark.parametrize("non_tensor_batch", [{}, None])
def test_len_of_empty_dataproto_is_zero(non_tensor_batch):
    assert len(DataProto(batch=None, non_tensor_batch=non_tensor_batch, meta_info={"info": "test_info"})) == 0


def test_repr_lists_fields_not_values():
    text = repr(abc_data())
    assert (
        text == "DataProto(len=3, batch={obs: int64[3, 2] cpu}, non_tensor_batch={labels: object[3]}, "
        "meta_info_keys=['info'])"
    )


# ---------------------------------------------------------------------- indexing


def test_int_index_returns_a_row_item():
    item = abc_data()[1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["obs"].tolist() == [3, 4]
    assert item.non_tensor_batch == {"labels": "b"}
    assert item.meta_info == {"info": "test_info"}


def test_negative_int_index_counts_from_the_end():
    assert abc_data()[-1].non_tensor_batch == {"labels": "c"}


def test_int_index_out_of_range_raises_index_error():
    with pytest.raises(IndexError, match="row 3 is out of range for a DataProto of 3 rows"):
        abc_data()[3]


def test_index_of_unsupported_type_raises_type_error():
    with pytest.raises(TypeError, match="cannot be indexed with str"):
        abc_data()["obs"]


def test_slice_index_returns_dataproto():
    data = rows(10)[2:8:2]
    assert isinstance(data, DataProto)
    assert data.batch["obs"].tolist() == [2, 4, 6]
    assert tags(data) == ["r2", "r4", "r6"]


def test_slice_with_negative_step_raises():
    with pytest.raises(ValueError, match="step must be positive"):
        rows(4)[::-1]


@pytest.mark.parametrize(
    "index,expected",
    [
        ([3, 0, 3], [3, 0, 3]),
        (np.array([3, 0, 3]), [3, 0, 3]),
        (torch.tensor([3, 0, 3]), [3, 0, 3]),
        ([-1, 0], [3, 0]),
        ([False, True, False, True], [1, 3]),
        (np.array([False, True, False, True]), [1, 3]),
        (torch.tensor([False, True, False, True]), [1, 3]),
    ],
    ids=["int-list", "int-numpy", "int-torch", "negative-int", "bool-list", "bool-numpy", "bool-torch"],
)
def test_select_idxs_accepts_int_and_bool_indices(index, expected):
    data = rows(4).select_idxs(index)
    assert data.batch["obs"].tolist() == expected
    assert tags(data) == [f"r{i}" for i in expected]
    assert data.batch.batch_size == torch.Size([len(expected)])


def test_select_idxs_with_empty_list_gives_zero_rows():
    data = rows(4).select_idxs([])
    assert len(data) == 0
    assert data.non_tensor_batch["tag"].shape == (0,)


def test_select_idxs_rejects_mask_of_wrong_length():
    with pytest.raises(IndexError, match="boolean mask has 3 entries but the DataProto has 4 rows"):
        rows(4).select_idxs([True, False, True])


def test_select_idxs_rejects_out_of_range_index():
    with pytest.raises(IndexError, match="out of range"):
        rows(4).select_idxs([0, 4])


def test_select_idxs_rejects_float_indices():
    with pytest.raises(TypeError, match="integers or booleans"):
        rows(4).select_idxs(np.array([0.0, 1.0]))


def test_indexing_matches_torch_and_numpy_indexing():
    rng = np.random.default_rng(0)
    obs = torch.randn(100, 10)
    labels = rng.choice(["abc", "cde"], size=100).tolist()
    labels_np = np.array(labels)
    data = DataProto.from_dict(tensors={"obs": obs}, non_tensors={"labels": labels})
    for index in (
        rng.integers(0, 100, size=10),
        torch.from_numpy(rng.integers(0, 100, size=10)),
        rng.integers(0, 100, size=10).tolist(),
        rng.integers(0, 2, size=100).astype(bool),
        torch.from_numpy(rng.integers(0, 2, size=100).astype(bool)),
        [bool(b) for b in rng.integers(0, 2, size=100)],
    ):
        np_index = index.numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        result = data[index]
        assert result.batch.keys() == data.batch.keys()
        assert np.array_equal(result.batch["obs"].numpy(), obs.numpy()[np_index])
        assert np.array_equal(result.non_tensor_batch["labels"], labels_np[np_index])


@pytest.mark.parametrize(
    "index",
    [
        np.array([True, False, True, False]),
        np.array([0, 2]),
        [True, False, True, False],
        [0, 2],
        torch.tensor([True, False, True, False]),
        torch.tensor([0, 2]),
    ],
)
def test_selected_batch_size_is_a_torch_size_of_ints(index):
    selected = rows(4)[index]
    assert isinstance(selected.batch.batch_size, torch.Size)
    assert all(isinstance(d, int) for d in selected.batch.batch_size)


# ---------------------------------------------------------------- select, pop, ...


def test_select_keeps_only_the_named_keys():
    data = DataProto.from_dict(
        tensors={"a": torch.zeros(2), "b": torch.ones(2)},
        non_tensors={"x": [1, 2], "y": [3, 4]},
        meta_info={"m": 1, "n": 2},
    )
    selected = data.select(batch_keys=["b"], non_tensor_batch_keys=["y"], meta_info_keys=["n"])
    assert list(selected.batch.keys()) == ["b"]
    assert list(selected.non_tensor_batch) == ["y"]
    assert selected.meta_info == {"n": 2}
    assert set(data.batch.keys()) == {"a", "b"}


def test_select_missing_batch_key_raises_key_error():
    with pytest.raises(KeyError):
        abc_data().select(batch_keys=["nope"])


def test_select_with_deepcopy_does_not_share_tensors_or_values():
    data = DataProto.from_dict(
        tensors={"a": torch.zeros(2)}, non_tensors={"x": [[1], [2]]}, meta_info={"m": [1]}
    )
    copied = data.select(deepcopy=True)
    copied.batch["a"][0] = 5
    copied.non_tensor_batch["x"][0].append(9)
    copied.meta_info["m"].append(2)
    assert data.batch["a"].tolist() == [0, 0]
    assert data.non_tensor_batch["x"][0] == [1]
    assert data.meta_info == {"m": [1]}


def test_pop_moves_keys_out():
    data = DataProto.from_dict(
        {"obs": torch.randn(100, 10), "act": torch.randn(100, 3)}, meta_info={"2": 2, "1": 1}
    )
    popped = data.pop(batch_keys=["obs"], meta_info_keys=["2"])
    assert popped.batch.keys() == {"obs"}
    assert popped.meta_info.keys() == {"2"}
    assert data.batch.keys() == {"act"}
    assert data.meta_info.keys() == {"1"}


def test_pop_of_missing_key_raises_and_removes_nothing():
    data = abc_data()
    with pytest.raises(KeyError, match="cannot pop \\['nope'\\] from non_tensor_batch"):
        data.pop(batch_keys=["obs"], non_tensor_batch_keys=["nope"])
    assert list(data.batch.keys()) == ["obs"]


def test_dataproto_without_tensors_supports_select_and_pop():
    data = DataProto.from_dict(non_tensors={"labels": ["a", "b", "c"]}, meta_info={"info": "test_info"})
    assert data.batch is None
    assert data.select(non_tensor_batch_keys=["labels"]).non_tensor_batch["labels"].tolist() == [
        "a",
        "b",
        "c",
    ]
    assert data.pop(non_tensor_batch_keys=["labels"]).non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert data.non_tensor_batch == {}


def test_rename_renames_batch_and_non_tensor_keys_in_place():
    data = abc_data()
    assert data.rename(["obs", "labels"], ["observation", "names"]) is data
    assert list(data.batch.keys()) == ["observation"]
    assert list(data.non_tensor_batch) == ["names"]


def test_rename_rejects_lists_of_different_lengths():
    with pytest.raises(ValueError, match="old_keys has 1 keys but new_keys has 2"):
        abc_data().rename("obs", ["a", "b"])


def test_union_adds_the_other_keys():
    obs = torch.randn(4, 2)
    left = DataProto.from_dict({"obs": obs, "act": torch.zeros(4)}, {"x": [1, 2, 3, 4]}, {"m": 1})
    right = DataProto.from_dict({"obs": obs.clone(), "rew": torch.ones(4)}, {"y": [5, 6, 7, 8]}, {"n": 2})
    merged = left.union(right)
    assert merged is left
    assert set(merged.batch.keys()) == {"obs", "act", "rew"}
    assert set(merged.non_tensor_batch) == {"x", "y"}
    assert merged.meta_info == {"m": 1, "n": 2}


def test_union_with_a_different_tensor_under_the_same_key_raises_and_changes_nothing():
    left = DataProto.from_dict({"obs": torch.zeros(4)})
    right = DataProto.from_dict({"obs": torch.ones(4), "rew": torch.ones(4)})
    with pytest.raises(ValueError, match="batch key 'obs' differs"):
        left.union(right)
    assert list(left.batch.keys()) == ["obs"]


def test_union_treats_nan_as_equal_in_non_tensors():
    values = np.array([float("nan")] * 3 + ["nan"], dtype=object)
    left = DataProto.from_dict(non_tensors={"b": values, "a": np.array([1.0, np.nan, 3.0, 4.0])})
    right = DataProto.from_dict(non_tensors={"b": values.copy(), "a": np.array([1.0, np.nan, 3.0, 4.0])})
    left.union(right)


@pytest.mark.parametrize(
    "other",
    [np.array([1.0, 2.0, 3.0]), np.array([np.nan, 1.0, 3.0])],
    ids=["different-value", "nan-moved"],
)
def test_union_with_different_non_tensor_values_raises(other):
    left = DataProto.from_dict(non_tensors={"data": np.array([1.0, np.nan, 3.0])})
    with pytest.raises(ValueError, match="non_tensor_batch key 'data' differs"):
        left.union(DataProto.from_dict(non_tensors={"data": other}))


def test_union_compares_nested_object_arrays_deeply():
    same = np.array([[np.array([1, 2]), "text"], [np.array([3.0, 4.0]), None]], dtype=object)
    diff = np.array([[np.array([1, 2]), "text"], [np.array([3.0, 4.0]), "other"]], dtype=object)
    DataProto(non_tensor_batch={"data": same}).union(DataProto(non_tensor_batch={"data": same.copy()}))
    with pytest.raises(ValueError, match="'data' differs"):
        DataProto(non_tensor_batch={"data": same}).union(DataProto(non_tensor_batch={"data": diff}))


def test_union_with_conflicting_meta_info_raises():
    with pytest.raises(ValueError, match="meta_info key 'lr' differs"):
        DataProto(meta_info={"lr": 1}).union(DataProto(meta_info={"lr": 2}))


def test_union_of_different_lengths_raises():
    with pytest.raises(ValueError, match="3 and 2 rows"):
        rows(3).union(DataProto.from_dict(non_tensors={"x": [1, 2]}))


def test_reorder_permutes_rows_in_place():
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4, 5, 6])},
        non_tensors={"labels": ["a", "b", "c", "d", "e", "f"]},
        meta_info={"name": "abdce"},
    )
    data.reorder(torch.tensor([3, 4, 2, 0, 1, 5]))
    assert data.batch["obs"].tolist() == [4, 5, 3, 1, 2, 6]
    assert data.non_tensor_batch["labels"].tolist() == ["d", "e", "c", "a", "b", "f"]
    assert data.meta_info == {"name": "abdce"}


# ------------------------------------------------------------------ chunk, split


def test_chunk_returns_exactly_k_pieces_for_uneven_batches():
    pieces = rows(124).chunk(15)
    assert len(pieces) == 15
    assert [len(p) for p in pieces] == [9] * 4 + [8] * 11
    assert sum(len(p) for p in pieces) == 124


def test_chunk_cuts_tensors_and_non_tensors_at_the_same_rows():
    for piece in rows(124).chunk(15):
        assert tags(piece) == [f"r{i}" for i in piece.batch["obs"].tolist()]
    assert tags(DataProto.concat(rows(124).chunk(15))) == tags(rows(124))


def test_chunk_of_divisible_batch_gives_equal_pieces():
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4, 5, 6])},
        non_tensors={"labels": ["a", "b", "c", "d", "e", "f"]},
        meta_info={"name": "abdce"},
    )
    first, second = data.chunk(2)
    assert first.batch["obs"].tolist() == [1, 2, 3]
    assert first.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert second.batch["obs"].tolist() == [4, 5, 6]
    assert second.non_tensor_batch["labels"].tolist() == ["d", "e", "f"]
    assert first.meta_info == second.meta_info == {"name": "abdce"}
    joined = DataProto.concat([first, second])
    assert joined.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert joined.non_tensor_batch["labels"].tolist() == ["a", "b", "c", "d", "e", "f"]
    assert joined.meta_info == {"name": "abdce"}


def test_chunk_of_six_rows_into_five_gives_one_piece_of_two():
    assert [tags(p) for p in rows(6).chunk(5)] == [["r0", "r1"], ["r2"], ["r3"], ["r4"], ["r5"]]


def test_chunk_with_more_pieces_than_rows_raises_and_says_to_pad():
    with pytest.raises(ValueError, match="cannot split 3 rows into 4 non-empty chunks; pad first"):
        rows(3).chunk(4)


def test_chunk_rejects_zero_pieces():
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        rows(3).chunk(0)


def test_chunk_pieces_have_independent_meta_info():
    first, second = abc_data().select_idxs([0, 1]).chunk(2)
    first.meta_info["extra"] = 1
    assert "extra" not in second.meta_info


def test_chunk_works_without_tensors():
    data = DataProto.from_dict(non_tensors={"tag": ["a", "b", "c", "d", "e"]})
    pieces = data.chunk(2)
    assert [p.non_tensor_batch["tag"].tolist() for p in pieces] == [["a", "b", "c"], ["d", "e"]]
    assert all(p.batch is None for p in pieces)


def test_split_gives_pieces_of_the_given_size_and_a_short_last_one():
    assert [tags(p) for p in rows(5).split(2)] == [["r0", "r1"], ["r2", "r3"], ["r4"]]


# ------------------------------------------------------------------------ concat


def test_concat_joins_rows_in_order():
    joined = DataProto.concat([rows(2), rows(3)])
    assert joined.batch["obs"].tolist() == [0, 1, 0, 1, 2]
    assert tags(joined) == ["r0", "r1", "r0", "r1", "r2"]


def test_concat_works_without_tensors():
    joined = DataProto.concat(
        [DataProto.from_dict(non_tensors={"x": [1]}), DataProto.from_dict(non_tensors={"x": [2]})]
    )
    assert joined.batch is None
    assert len(joined) == 2
    assert joined.non_tensor_batch["x"].tolist() == [1, 2]


def test_concat_merges_metrics_lists_from_every_part():
    parts = [
        DataProto.from_dict(
            tensors={"obs": torch.tensor([1, 2])},
            meta_info={"metrics": [{"loss": 0.5, "accuracy": 0.9}], "config_flag": True},
        ),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([3, 4])},
            meta_info={"metrics": [{"loss": 0.6, "accuracy": 0.85}], "config_flag": True},
        ),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([5, 6])},
            meta_info={"metrics": [{"loss": 0.55, "accuracy": 0.88}], "config_flag": True},
        ),
    ]
    joined = DataProto.concat(parts)
    assert joined.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert joined.meta_info["metrics"] == {"loss": [0.5, 0.6, 0.55], "accuracy": [0.9, 0.85, 0.88]}
    assert joined.meta_info["config_flag"] is True


def test_concat_merges_metric_dicts_scalars_and_lists():
    parts = [
        DataProto.from_dict(tensors={"obs": torch.tensor([1])}, meta_info={"metrics": {"loss": 0.5}}),
        DataProto.from_dict(tensors={"obs": torch.tensor([2])}, meta_info={"metrics": {"loss": [0.6, 0.7]}}),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([3])}, meta_info={"metrics": {"loss": 0.8, "acc": 1.0}}
        ),
    ]
    assert DataProto.concat(parts).meta_info["metrics"] == {"loss": [0.5, 0.6, 0.7, 0.8], "acc": [1.0]}


def test_concat_keeps_metrics_when_the_first_part_has_none():
    parts = [
        DataProto.from_dict(tensors={"obs": torch.tensor([1, 2])}, meta_info={"config_flag": True}),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([3, 4])}, meta_info={"metrics": {"loss": 0.6}, "config_flag": True}
        ),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([5, 6])}, meta_info={"metrics": {"loss": 0.55}, "config_flag": True}
        ),
    ]
    joined = DataProto.concat(parts)
    assert joined.meta_info["metrics"] == {"loss": [0.6, 0.55]}
    assert joined.meta_info["config_flag"] is True


def test_concat_with_metrics_in_only_one_part():
    parts = [
        DataProto.from_dict(
            tensors={"obs": torch.tensor([1, 2])}, meta_info={"metrics": [{"loss": 0.5}], "flag": True}
        ),
        DataProto.from_dict(tensors={"obs": torch.tensor([3, 4])}, meta_info={"flag": True}),
    ]
    joined = DataProto.concat(parts)
    assert joined.meta_info == {"metrics": {"loss": [0.5]}, "flag": True}


def test_concat_keeps_equal_scalar_meta_info():
    parts = [DataProto.from_dict(tensors={"obs": torch.tensor([1])}, meta_info={"single_value": 42})] * 2
    assert DataProto.concat(parts).meta_info == {"single_value": 42}


def test_concat_merges_meta_keys_that_only_some_parts_have():
    parts = [
        DataProto.from_dict(tensors={"obs": torch.tensor([1])}, meta_info={"config": "A", "shared_key": "X"}),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([2])}, meta_info={"extra_key": "B", "shared_key": "X"}
        ),
        DataProto.from_dict(
            tensors={"obs": torch.tensor([3])}, meta_info={"another_key": "C", "shared_key": "X"}
        ),
    ]
    assert DataProto.concat(parts).meta_info == {
        "config": "A",
        "shared_key": "X",
        "extra_key": "B",
        "another_key": "C",
    }


def test_concat_with_conflicting_meta_key_raises_naming_the_key():
    parts = [
        DataProto.from_dict(tensors={"obs": torch.tensor([1, 2])}, meta_info={"config": "A"}),
        DataProto.from_dict(tensors={"obs": torch.tensor([3, 4])}, meta_info={"config": "B"}),
    ]
    with pytest.raises(MetaInfoConflictError, match="Conflicting values for meta_info key 'config'") as info:
        DataProto.concat(parts)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    assert "part 0: 'A', part 1: 'B'" in str(info.value)


def test_concat_of_tensors_of_different_widths_names_the_key_and_each_part():
    parts = [
        DataProto.from_dict(tensors={"responses": torch.zeros(2, 3)}),
        DataProto.from_dict(tensors={"responses": torch.zeros(2, 5)}),
    ]
    with pytest.raises(ConcatError, match=r"'responses'.*part 0: \[2, 3\], part 1: \[2, 5\]"):
        DataProto.concat(parts)


def test_concat_of_numeric_non_tensors_of_different_widths_names_the_key_and_each_part():
    parts = [
        DataProto.from_dict(non_tensors={"scores": np.zeros((2, 3))}),
        DataProto.from_dict(non_tensors={"scores": np.zeros((1, 4))}),
    ]
    with pytest.raises(ConcatError, match=r"'scores'.*part 0: \[2, 3\], part 1: \[1, 4\]"):
        DataProto.concat(parts)


def test_concat_of_nothing_raises():
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_concat_with_different_non_tensor_keys_raises():
    with pytest.raises(ValueError, match="part 1 has non-tensor keys"):
        DataProto.concat(
            [DataProto.from_dict(non_tensors={"x": [1]}), DataProto.from_dict(non_tensors={"y": [1]})]
        )


def test_concat_of_parts_with_and_without_tensors_raises():
    with pytest.raises(ValueError, match="have no tensors while others do"):
        DataProto.concat([rows(1), DataProto.from_dict(non_tensors={"tag": ["r9"]})])


# ------------------------------------------------------------------------ repeat


def test_repeat_interleaved_repeats_each_row_in_place():
    repeated = abc_data().repeat(repeat_times=2, interleave=True)
    assert repeated.batch["obs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert repeated.non_tensor_batch["labels"].tolist() == ["a", "a", "b", "b", "c", "c"]
    assert repeated.meta_info == {"info": "test_info"}


def test_repeat_not_interleaved_repeats_the_whole_batch():
    repeated = abc_data().repeat(repeat_times=2, interleave=False)
    assert repeated.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]]
    assert repeated.non_tensor_batch["labels"].tolist() == ["a", "b", "c", "a", "b", "c"]
    assert repeated.meta_info == {"info": "test_info"}


@pytest.mark.parametrize(
    "times",
    [[3, 1, 2], (3, 1, 2), np.array([3, 1, 2]), torch.tensor([3, 1, 2])],
    ids=["list", "tuple", "numpy", "torch"],
)
def test_sample_level_repeat_repeats_each_row_its_own_number_of_times(times):
    repeated = abc_data().sample_level_repeat(times)
    assert repeated.batch["obs"].tolist() == [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    assert repeated.non_tensor_batch["labels"].tolist() == ["a", "a", "a", "b", "c", "c"]
    assert repeated.meta_info == {"info": "test_info"}


def test_sample_level_repeat_with_wrong_length_raises():
    with pytest.raises(ValueError, match="one entry per row"):
        abc_data().sample_level_repeat([1, 2])


def test_unfold_column_chunks_moves_column_pieces_into_rows():
    data = DataProto.from_dict(
        tensors={
            "obs1": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]),
            "obs2": torch.tensor([[1, 2], [5, 6], [9, 10]]),
        },
        non_tensors={"labels": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]},
        meta_info={"name": "abc"},
    )
    result = data.unfold_column_chunks(2, split_keys=["obs1", "labels"])
    assert result.batch["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert result.batch["obs2"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]]
    assert result.non_tensor_batch["labels"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    assert result.non_tensor_batch["labels"].shape == (6, 1)
    assert (result.non_tensor_batch["labels"] == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]).all()
    assert result.meta_info == {"name": "abc"}


def test_unfold_column_chunks_cuts_lists_of_different_lengths_element_by_element():
    data = DataProto.from_dict(non_tensors={"turns": [[1, 2, 3, 4], [5, 6]]})
    result = data.unfold_column_chunks(2, split_keys=["turns"])
    assert result.non_tensor_batch["turns"].shape == (4,)
    assert result.non_tensor_batch["turns"].tolist() == [[1, 2], [3, 4], [5], [6]]


def test_unfold_column_chunks_splits_a_two_dimensional_array_like_verl():
    labels = np.array([["a1", "a2"], ["b1", "b2"], ["c1", "c2"]])
    result = DataProto(non_tensor_batch={"labels": labels}).unfold_column_chunks(2, split_keys=["labels"])
    assert result.non_tensor_batch["labels"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]


def test_unfold_column_chunks_keeps_trailing_dims():
    obs1 = torch.tensor(
        [
            [[1, 1], [2, 2], [3, 3], [4, 4]],
            [[5, 5], [6, 6], [7, 7], [8, 8]],
            [[9, 9], [10, 10], [11, 11], [12, 12]],
        ]
    )
    data = DataProto.from_dict(tensors={"obs1": obs1})
    result = data.unfold_column_chunks(2, split_keys=["obs1"])
    assert result.batch["obs1"].tolist() == [
        [[1, 1], [2, 2]],
        [[3, 3], [4, 4]],
        [[5, 5], [6, 6]],
        [[7, 7], [8, 8]],
        [[9, 9], [10, 10]],
        [[11, 11], [12, 12]],
    ]


def test_unfold_column_chunks_repeats_keys_not_split():
    data = DataProto.from_dict(
        tensors={"obs1": torch.arange(12).reshape(3, 4)}, non_tensors={"labels": ["a", "b", "c"]}
    )
    result = data.unfold_column_chunks(2, split_keys=["obs1"])
    assert result.non_tensor_batch["labels"].tolist() == ["a", "a", "b", "b", "c", "c"]


# ----------------------------------------------------------------------- padding


def test_pad_to_divisor_two_appends_the_first_row():
    padded, pad_size = pad_dataproto_to_divisor(abc_data(), size_divisor=2)
    assert pad_size == 1
    assert padded.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [1, 2]]
    assert padded.non_tensor_batch["labels"].tolist() == ["a", "b", "c", "a"]
    assert padded.meta_info == {"info": "test_info"}


def test_pad_to_a_divisor_already_met_changes_nothing():
    data = abc_data()
    padded, pad_size = pad_dataproto_to_divisor(data, size_divisor=3)
    assert pad_size == 0
    assert padded.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert unpad_dataproto(padded, pad_size) is padded


def test_pad_three_rows_to_divisor_seven_cycles_through_the_rows():
    padded, pad_size = pad_dataproto_to_divisor(rows(3), size_divisor=7)
    assert pad_size == 4
    assert tags(padded) == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]
    assert padded.batch["obs"].tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_pad_does_not_modify_its_input():
    data = rows(3)
    pad_dataproto_to_divisor(data, size_divisor=7)
    assert len(data) == 3
    assert tags(data) == ["r0", "r1", "r2"]


def test_unpad_removes_the_padding():
    data = abc_data()
    padded, pad_size = pad_dataproto_to_divisor(data, size_divisor=7)
    unpadded = unpad_dataproto(padded, pad_size=pad_size)
    assert unpadded.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert unpadded.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert unpadded.meta_info == {"info": "test_info"}
    assert len(padded) == 7


def test_unpad_more_rows_than_there_are_raises():
    with pytest.raises(ValueError, match="pad_size must be in 0..3, got 4"):
        unpad_dataproto(rows(3), 4)


def test_padding_pads_the_caller_in_place_with_the_last_row():
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3])})
    data.padding(2)
    assert data.batch["a"].tolist() == [1, 2, 3, 3, 3]


def test_padding_candidate_first_pads_the_caller_with_the_first_row():
    data = DataProto.from_dict({"a": torch.tensor([1, 2, 3])})
    data.padding(2, padding_candidate="first")
    assert data.batch["a"].tolist() == [1, 2, 3, 1, 1]


def test_padding_returns_the_padded_dataproto_itself_with_its_meta_info():
    data = rows(2)
    data.meta_info["step"] = 7
    assert data.padding(3) is data
    assert tags(data) == ["r0", "r1", "r1", "r1", "r1"]
    assert data.meta_info["step"] == 7


def test_padding_by_more_than_the_batch_repeats_the_last_row():
    assert tags(rows(2).padding(5)) == ["r0", "r1", "r1", "r1", "r1", "r1", "r1"]


def test_padding_by_zero_leaves_the_dataproto_as_it_was():
    data = rows(2)
    assert data.padding(0) is data
    assert tags(data) == ["r0", "r1"]


@pytest.mark.parametrize(
    "candidate,expected",
    [
        ("", ["r0", "r1", "r2", "r2", "r2"]),
        ("first", ["r0", "r1", "r2", "r0", "r0"]),
        ("last", ["r0", "r1", "r2", "r2", "r2"]),
    ],
)
def test_padding_candidate_repeats_the_first_or_last_row(candidate, expected):
    assert tags(rows(3).padding(2, padding_candidate=candidate)) == expected


def test_padding_rejects_an_unknown_candidate():
    with pytest.raises(ValueError, match="padding_candidate must be"):
        rows(3).padding(1, padding_candidate="middle")


def test_padding_an_empty_dataproto_raises():
    with pytest.raises(ValueError, match="no rows"):
        rows(0).padding(1)


def test_auto_padding_flag_from_dict_enables_padding():
    assert DataProto.from_dict(tensors={"obs": torch.zeros(2)}, auto_padding=True).is_padding_enabled()
    assert not DataProto.from_dict(tensors={"obs": torch.zeros(2)}).is_padding_enabled()


def test_dataproto_config_auto_padding_reads_env_and_attribute(monkeypatch):
    monkeypatch.delenv("DASKWG_AUTO_PADDING", raising=False)
    monkeypatch.setattr(type(DataProtoConfig), "_config", {})
    assert DataProtoConfig.auto_padding is False
    DataProtoConfig.auto_padding = True
    assert DataProtoConfig.auto_padding is True
    assert rows(2).is_padding_enabled()
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("DASKWG_AUTO_PADDING", "1")
    assert DataProtoConfig.auto_padding is True


def test_dataproto_config_auto_padding_rejects_non_bool(monkeypatch):
    monkeypatch.setattr(type(DataProtoConfig), "_config", {})
    with pytest.raises(TypeError, match="takes a bool"):
        DataProtoConfig.auto_padding = 1


# ----------------------------------------------------------------- fold, iterate


def test_fold_groups_rows_and_unfold_restores_them():
    data = abc_data().repeat(repeat_times=2, interleave=True)
    folded = data.fold_batch_dim(new_batch_size=3)
    assert folded.batch["obs"].tolist() == [[[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]]]
    assert folded.non_tensor_batch["labels"].tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]
    assert len(folded) == 3
    folded.reorder(indices=torch.tensor([1, 2, 0]))
    unfolded = folded.unfold_batch_dim(batch_dims=2)
    assert unfolded.batch["obs"].tolist() == [[3, 4], [3, 4], [5, 6], [5, 6], [1, 2], [1, 2]]
    assert unfolded.non_tensor_batch["labels"].tolist() == ["b", "b", "c", "c", "a", "a"]
    assert unfolded.meta_info == {"info": "test_info"}
    assert folded.batch.batch_size == torch.Size([3])


def test_fold_with_indivisible_size_raises():
    with pytest.raises(ValueError, match="cannot fold 3 rows into 2 groups"):
        rows(3).fold_batch_dim(2)


def make_iter_data() -> DataProto:
    labels = [["abc", "cde"][i % 3 == 0] for i in range(100)]
    return DataProto.from_dict(
        tensors={"obs": torch.randn(100, 10)}, non_tensors={"labels": labels}, meta_info={"m": 1}
    )


def test_make_iterator_with_same_seed_is_reproducible():
    data = make_iter_data()
    kwargs = {"shuffle": True}
    first = list(data.make_iterator(mini_batch_size=10, epochs=2, seed=1, dataloader_kwargs=kwargs))
    second = list(data.make_iterator(mini_batch_size=10, epochs=2, seed=1, dataloader_kwargs=kwargs))
    assert len(first) == len(second) == 20
    for a, b in zip(first, second):
        assert isinstance(a, DataProto)
        assert torch.equal(a.batch["obs"], b.batch["obs"])
        assert a.non_tensor_batch["labels"].tolist() == b.non_tensor_batch["labels"].tolist()
        assert a.meta_info == {"m": 1}


def test_make_iterator_with_different_seeds_shuffles_differently():
    data = rows(100)
    first = next(data.make_iterator(10, 1, seed=1, dataloader_kwargs={"shuffle": True}))
    second = next(data.make_iterator(10, 1, seed=2, dataloader_kwargs={"shuffle": True}))
    assert tags(first) != tags(second)


def test_make_iterator_without_shuffle_keeps_row_order_and_alignment():
    batches = list(rows(6).make_iterator(mini_batch_size=2, epochs=1))
    assert [tags(b) for b in batches] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert [b.batch["obs"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]


def test_make_iterator_works_without_tensors():
    data = DataProto.from_dict(non_tensors={"x": [1, 2, 3, 4]})
    assert [b.non_tensor_batch["x"].tolist() for b in data.make_iterator(2, 1)] == [[1, 2], [3, 4]]


def test_make_iterator_with_indivisible_mini_batch_raises():
    with pytest.raises(ValueError, match="100 rows cannot be cut into mini-batches of 7"):
        rows(100).make_iterator(mini_batch_size=7, epochs=1)


# ----------------------------------------------------------------- device, disk


def test_to_moves_the_batch_and_returns_self():
    data = abc_data()
    assert data.to("cpu") is data
    assert data.batch.device == torch.device("cpu")


def test_save_and_load_round_trip(tmp_path):
    data = abc_data()
    path = tmp_path / "data.pkl"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.equal(loaded.batch["obs"], data.batch["obs"])
    assert loaded.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert loaded.meta_info == {"info": "test_info"}


def test_load_from_disk_rejects_other_objects(tmp_path):
    path = tmp_path / "other.pkl"
    path.write_bytes(pickle.dumps({"not": "a DataProto"}))
    with pytest.raises(TypeError, match="not a DataProto"):
        DataProto.load_from_disk(path)


def test_print_size_reports_gigabytes(capsys):
    DataProto.from_dict(tensors={"x": torch.zeros(2, dtype=torch.uint8)}).print_size(prefix="step 1")
    assert capsys.readouterr().out.startswith("step 1, Size of tensordict: ")


# ------------------------------------------------------------- zero-copy pickle


def pickle5(obj: object) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return body, buffers


def test_pickle5_ships_tensors_as_out_of_band_buffers():
    data = DataProto.from_dict(
        tensors={
            "a": torch.randn(512, 256),
            "b": torch.randn(512, 64).bfloat16(),
            "m": torch.ones(512, dtype=torch.bool),
        },
        non_tensors={"uid": [f"u{i}" for i in range(512)]},
    )
    tensor_bytes = sum(t.numel() * t.element_size() for t in data.batch.values())
    body, buffers = pickle5(data)
    assert sum(memoryview(b).nbytes for b in buffers) == tensor_bytes
    assert len(body) < 10_000


def test_pickle5_round_trip_shares_memory_with_the_buffers():
    data = DataProto.from_dict(tensors={"a": torch.randn(64, 8)})
    body, buffers = pickle5(data)
    loaded = pickle.loads(body, buffers=buffers)
    assert loaded.batch["a"].data_ptr() == data.batch["a"].data_ptr()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 3).bfloat16(),
        torch.randn(4, 3).half(),
        torch.randint(-128, 127, (4, 3), dtype=torch.int8),
        torch.tensor([True, False, True, True]),
        torch.randn(4, 2).to(torch.float8_e4m3fn),
        torch.randn(4, 2, dtype=torch.complex64),
        torch.randn(4, 5, dtype=torch.float64),
        torch.arange(4, dtype=torch.int64),
    ],
    ids=["bf16", "fp16", "int8", "bool", "fp8", "complex64", "fp64", "int64"],
)
def test_pickle5_round_trip_is_exact_for_every_dtype(tensor):
    data = DataProto.from_dict(tensors={"x": tensor})
    body, buffers = pickle5(data)
    loaded = pickle.loads(body, buffers=buffers)
    assert loaded.batch["x"].dtype == tensor.dtype
    assert loaded.batch["x"].shape == tensor.shape
    assert torch.equal(loaded.batch["x"].view(torch.uint8), tensor.view(torch.uint8))


def test_pickle_round_trip_of_non_contiguous_tensor():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    data = DataProto.from_dict(tensors={"t": base.t()[:4], "strided": base[:, ::2]})
    assert not data.batch["strided"].is_contiguous()
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert torch.equal(loaded.batch["t"], base.t()[:4])
    assert torch.equal(loaded.batch["strided"], base[:, ::2])


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_pickle_round_trip_of_zero_size_tensor(shape):
    data = DataProto.from_dict(tensors={"x": torch.zeros(shape, dtype=torch.bfloat16)})
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert loaded.batch["x"].shape == shape
    assert loaded.batch["x"].dtype == torch.bfloat16
    assert len(loaded) == shape[0]


def test_pickle_keeps_batch_size_and_device_of_the_tensordict():
    data = DataProto(batch=TensorDict({"x": torch.zeros(3, 2)}, batch_size=[3], device="cpu"))
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert loaded.batch.batch_size == torch.Size([3])
    assert loaded.batch.device == torch.device("cpu")


def test_pickle_of_tensordict_without_keys_keeps_its_batch_size():
    loaded = pickle.loads(pickle.dumps(DataProto(batch=TensorDict({}, batch_size=[10]))))
    assert len(loaded.batch.keys()) == 0
    assert loaded.batch.batch_size == torch.Size([10])


def test_pickle_of_nested_tensordict():
    inner = TensorDict({"y": torch.arange(6).reshape(3, 2)}, batch_size=[3, 2])
    data = DataProto(batch=TensorDict({"x": torch.zeros(3), "inner": inner}, batch_size=[3]))
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert loaded.batch["inner"].batch_size == torch.Size([3, 2])
    assert torch.equal(loaded.batch["inner", "y"], inner["y"])


def test_pickle_of_jagged_tensor_falls_back_to_torch_pickling():
    jagged = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    data = DataProto(batch=TensorDict({"j": jagged, "x": torch.zeros(2)}, batch_size=[2]))
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert loaded.batch["j"].is_nested
    assert [t.tolist() for t in loaded.batch["j"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]


def test_pickle_of_dataproto_without_tensors():
    data = DataProto.from_dict(non_tensors={"x": [[1, 2], [3, 4]]}, meta_info={"m": 1})
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert loaded.batch is None
    assert loaded.non_tensor_batch["x"].tolist() == [[1, 2], [3, 4]]
    assert loaded.meta_info == {"m": 1}


def test_shallow_copy_of_dataproto_shares_its_tensors():
    """``copy.copy`` passes ``__getstate__``'s state to ``__setstate__`` without pickling it."""
    data = DataProto.from_dict(tensors={"x": torch.arange(3)}, meta_info={"m": 1})
    copied = copy.copy(data)
    assert copied.batch["x"] is data.batch["x"]
    assert copied.meta_info == {"m": 1}


def test_pickle_of_read_only_buffers_gives_writable_tensors():
    data = DataProto.from_dict(tensors={"x": torch.arange(4, dtype=torch.float32)})
    body, buffers = pickle5(data)
    loaded = pickle.loads(body, buffers=[bytes(b) for b in buffers])
    loaded.batch["x"][0] = 9.0
    assert loaded.batch["x"].tolist() == [9.0, 1.0, 2.0, 3.0]
    assert data.batch["x"][0] == 0.0


def test_dask_serialize_round_trip_sends_tensors_as_frames():
    from distributed.protocol import deserialize, serialize

    data = DataProto.from_dict(
        tensors={"a": torch.randn(256, 128).bfloat16()},
        non_tensors={"uid": ["u"] * 256},
        meta_info={"step": 3},
    )
    header, frames = serialize(data)
    assert sum(memoryview(f).nbytes for f in frames) < 256 * 128 * 2 + 10_000
    assert max(memoryview(f).nbytes for f in frames) == 256 * 128 * 2
    loaded = deserialize(header, frames)
    assert torch.equal(loaded.batch["a"], data.batch["a"])
    assert loaded.non_tensor_batch["uid"].tolist() == ["u"] * 256
    assert loaded.meta_info == {"step": 3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pickle_of_cuda_tensors_goes_through_host_memory_and_back():
    data = DataProto(batch=TensorDict({"x": torch.arange(4, device="cuda")}, batch_size=[4], device="cuda:0"))
    body, buffers = pickle5(data)
    assert sum(memoryview(b).nbytes for b in buffers) == 4 * 8
    loaded = pickle.loads(body, buffers=buffers)
    assert loaded.batch.device == torch.device("cuda:0")
    assert loaded.batch["x"].tolist() == [0, 1, 2, 3]


def test_a_large_concat_writes_one_block_per_column_with_torch_cats_values():
    # Collecting a batch writes each large column into memory numpy allocates (huge pages)
    # and counts it as the process's own: the same values, dtypes, shapes and batch size
    # as torch.cat, and handed on without a copy.
    from daskwg import serialization
    from daskwg.protocol import _LARGE_CAT, concat_tensordicts

    rows = _LARGE_CAT // (8 * 64) + 1  # x: float64 [rows, 64] crosses the threshold per part
    parts = [
        TensorDict(
            {
                "x": torch.randn(rows + i, 64, dtype=torch.float64),
                "mask": torch.rand(rows + i, 3) > 0.5,
                "ids": torch.arange(rows + i),
            },
            batch_size=[rows + i],
        )
        for i in range(3)
    ]
    got, want = concat_tensordicts(parts), torch.cat(parts, 0)
    assert got.batch_size == want.batch_size
    for key in want.keys():
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert serialization.private(got)
    # Anything else goes to torch.cat: nested TensorDicts, tensors with autograd.
    nested = [
        TensorDict({"a": TensorDict({"x": p["x"]}, batch_size=p.batch_size)}, batch_size=p.batch_size)
        for p in parts
    ]
    assert torch.equal(concat_tensordicts(nested)["a", "x"], want["x"])
    grads = [TensorDict({"x": p["x"].clone().requires_grad_()}, batch_size=p.batch_size) for p in parts]
    assert concat_tensordicts(grads)["x"].requires_grad
