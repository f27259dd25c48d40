"""verl 0.9.1's ``tests/test_protocol_on_cpu.py`` run against daskwg.

One test per verl test, same name, same inputs and expected values; ``verl.DataProto`` and
``verl.protocol`` map to ``daskwg.DataProto`` and ``daskwg.protocol``. Where daskwg departs
on purpose, the test says so in its docstring ("Deviation: ...") and asserts daskwg's
behaviour instead; docs/porting.md lists the same deviations.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from daskwg import DataProto
from daskwg.protocol import (
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def three_rows(meta_info=None) -> DataProto:
    """obs [[1, 2], [3, 4], [5, 6]], labels a, b, c: the batch most of verl's tests start from."""
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"]},
        meta_info={"info": "test_info"} if meta_info is None else meta_info,
    )


def six_rows() -> DataProto:
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4, 5, 6])},
        non_tensors={"labels": ["a", "b", "c", "d", "e", "f"]},
        meta_info={"name": "abdce"},
    )


def obs_rows(*rows_per_part: list[int], **meta_per_part: list) -> list[DataProto]:
    """One DataProto per part with ``obs`` = the given rows and ``meta_info`` taken from the
    keyword lists (entry ``i`` for part ``i``; ``None`` leaves the key out)."""
    parts = []
    for i, obs in enumerate(rows_per_part):
        meta = {key: values[i] for key, values in meta_per_part.items() if values[i] is not None}
        parts.append(DataProto.from_dict(tensors={"obs": torch.tensor(obs)}, meta_info=meta))
    return parts


# ------------------------------------------------------------------------ union helpers


def test_union_tensor_dict():
    obs = torch.randn(100, 10)
    first = TensorDict({"obs": obs, "act": torch.randn(100, 3)}, batch_size=[100])
    same_obs = TensorDict(
        {"obs": obs, "next_obs": torch.randn(100, 10), "rew": torch.randn(100)}, batch_size=[100]
    )
    copied_obs = TensorDict(
        {"obs": obs.clone(), "next_obs": torch.randn(100, 10), "rew": torch.randn(100)}, batch_size=[100]
    )
    union_tensor_dict(first, same_obs)
    with pytest.raises(AssertionError):
        union_tensor_dict(first, copied_obs)


def test_union_numpy_dict():
    """The message starts as verl's, naming the key, so code matching verl's message keeps working."""
    cube = np.arange(8).reshape((2, 2, 2))
    union_numpy_dict({"a": cube}, {"a": cube})
    mixed = [1, "hello", np.array([2, 3])]
    union_numpy_dict({"a": np.array(mixed, dtype=object)}, {"a": np.array(mixed, dtype=object)})

    floats = np.random.random(100)
    nans = np.array([float("nan")] * 99 + ["nan"], dtype=object)
    left = {"a": floats, "b": nans}
    union_numpy_dict(left, {"a": floats.copy(), "b": nans.copy()})
    with pytest.raises(AssertionError):
        union_numpy_dict(left, {"a": np.random.random(100)})

    ints = np.arange(24, dtype=np.int32).reshape((2, 3, 4))
    union_numpy_dict({"nd_array": ints}, {"nd_array": ints.copy()})
    with pytest.raises(
        AssertionError, match="^`nd_array` in tensor_dict1 and tensor_dict2 are not the same object"
    ):
        union_numpy_dict({"nd_array": ints}, {"nd_array": ints + 1})

    sub1, sub2 = np.array([1, 2]), np.array([3.0, 4.0])
    grid = np.array([[sub1, "text"], [sub2, None]], dtype=object)
    union_numpy_dict({"data": grid}, {"data": grid.copy()})
    with pytest.raises(AssertionError):
        union_numpy_dict({"data": grid}, {"data": np.array([[sub1, "text"], [sub2, "other"]], dtype=object)})

    deep = np.array([[[[sub1]]], [[[sub2]]]], dtype=object)
    union_numpy_dict({"data": deep}, {"data": deep.copy()})
    with pytest.raises(AssertionError):
        union_numpy_dict(
            {"data": deep}, {"data": np.array([[[[sub1]]], [[[np.array([9, 9])]]]], dtype=object)}
        )

    with_nan = {"data": np.array([1.0, np.nan, 3.0])}
    union_numpy_dict(with_nan, {"data": np.array([1.0, np.nan, 3.0])})
    for other in (np.array([1.0, 2.0, 3.0]), np.array([np.nan, 1.0, 3.0])):
        with pytest.raises(AssertionError):
            union_numpy_dict(with_nan, {"data": other})

    def self_holding() -> np.ndarray:
        arr = np.array([None], dtype=object)
        arr[0] = arr
        return arr

    loop = self_holding()
    union_numpy_dict({"data": loop}, {"data": self_holding()})
    with pytest.raises(AssertionError):
        union_numpy_dict({"data": loop}, {"data": np.array([None], dtype=object)})


# ---------------------------------------------------------------------- building


def test_tensor_dict_constructor():
    """``num_batch_dims`` other than 1 raises an error that is both verl's ``AssertionError``
    and a ``ValueError`` (daskwg has one batch dimension only)."""
    obs, act = torch.randn(100, 10), torch.randn(100, 10, 3)
    assert DataProto.from_dict(tensors={"obs": obs, "act": act}).batch.batch_size == torch.Size([100])
    for dims in (2, 3):
        with pytest.raises(AssertionError):
            DataProto.from_dict(tensors={"obs": obs, "act": act}, num_batch_dims=dims)
        with pytest.raises(ValueError):
            DataProto.from_dict(tensors={"obs": obs, "act": act}, num_batch_dims=dims)


def test_tensor_dict_make_iterator():
    dataset = DataProto.from_dict(
        tensors={"obs": torch.randn(100, 10)},
        non_tensors={"labels": [random.choice(["abc", "cde"]) for _ in range(100)]},
    )
    first = list(dataset.make_iterator(mini_batch_size=10, epochs=2, seed=1))
    second = list(dataset.make_iterator(mini_batch_size=10, epochs=2, seed=1))
    assert len(first) == len(second) == 20
    for a, b in zip(first, second, strict=True):
        assert isinstance(a, DataProto) and isinstance(b, DataProto)
        assert torch.all(torch.eq(a.batch["obs"], b.batch["obs"]))
        assert np.all(np.equal(a.non_tensor_batch["labels"], b.non_tensor_batch["labels"]))


def test_reorder():
    data = six_rows()
    data.reorder(torch.tensor([3, 4, 2, 0, 1, 5]))
    assert torch.all(torch.eq(data.batch["obs"], torch.tensor([4, 5, 3, 1, 2, 6])))
    assert np.all(data.non_tensor_batch["labels"] == np.array(["d", "e", "c", "a", "b", "f"]))
    assert data.meta_info == {"name": "abdce"}


# ---------------------------------------------------------------- chunk and concat


def test_chunk_concat():
    """Deviation: ``chunk(5)`` of 6 rows returns 5 pieces of 2, 1, 1, 1, 1 rows (a documented
    fix); verl asserts that the rows divide evenly."""
    data = six_rows()
    assert [len(piece) for piece in data.chunk(5)] == [2, 1, 1, 1, 1]

    halves = data.chunk(2)
    assert len(halves) == 2
    for half, obs, labels in zip(
        halves, ([1, 2, 3], [4, 5, 6]), (["a", "b", "c"], ["d", "e", "f"]), strict=True
    ):
        assert torch.all(torch.eq(half.batch["obs"], torch.tensor(obs)))
        assert np.all(half.non_tensor_batch["labels"] == np.array(labels))
        assert half.meta_info == {"name": "abdce"}

    joined = DataProto.concat(halves)
    assert torch.all(torch.eq(joined.batch["obs"], data.batch["obs"]))
    assert np.all(joined.non_tensor_batch["labels"] == data.non_tensor_batch["labels"])
    assert joined.meta_info == data.meta_info


def test_concat_metrics_from_multiple_workers():
    parts = obs_rows(
        [1, 2],
        [3, 4],
        [5, 6],
        metrics=[
            [{"loss": 0.5, "accuracy": 0.9}],
            [{"loss": 0.6, "accuracy": 0.85}],
            [{"loss": 0.55, "accuracy": 0.88}],
        ],
        config_flag=[True, True, True],
    )
    joined = DataProto.concat(parts)
    assert torch.all(torch.eq(joined.batch["obs"], torch.tensor([1, 2, 3, 4, 5, 6])))
    assert joined.meta_info["metrics"] == {"loss": [0.5, 0.6, 0.55], "accuracy": [0.9, 0.85, 0.88]}
    assert joined.meta_info["config_flag"] is True


def test_concat_with_empty_and_non_list_meta_info():
    joined = DataProto.concat(obs_rows([1, 2], [3, 4], metrics=[[{"loss": 0.5}], None], flag=[True, True]))
    assert joined.meta_info["metrics"] == {"loss": [0.5]}
    assert joined.meta_info["flag"] is True
    assert DataProto.concat(obs_rows([1, 2], [3, 4], single_value=[42, 42])).meta_info["single_value"] == 42


def test_concat_first_worker_missing_metrics():
    parts = obs_rows(
        [1, 2], [3, 4], [5, 6], metrics=[None, {"loss": 0.6}, {"loss": 0.55}], config_flag=[True, True, True]
    )
    joined = DataProto.concat(parts)
    assert joined.meta_info["metrics"] == {"loss": [0.6, 0.55]}
    assert joined.meta_info["config_flag"] is True


def test_concat_non_list_metrics():
    parts = obs_rows(
        [1, 2], [3, 4], metrics=[{"loss": 0.5, "accuracy": 0.9}, {"loss": 0.6, "accuracy": 0.85}]
    )
    assert DataProto.concat(parts).meta_info["metrics"] == {"loss": [0.5, 0.6], "accuracy": [0.9, 0.85]}


def test_concat_merge_different_non_metric_keys():
    parts = obs_rows(
        [1, 2],
        [3, 4],
        [5, 6],
        config=["A", None, None],
        extra_key=[None, "B", None],
        another_key=[None, None, "C"],
        shared_key=["X", "X", "X"],
    )
    meta = DataProto.concat(parts).meta_info
    assert (meta["config"], meta["extra_key"], meta["another_key"], meta["shared_key"]) == (
        "A",
        "B",
        "C",
        "X",
    )


def test_concat_conflicting_non_metric_keys():
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat(obs_rows([1, 2], [3, 4], config=["A", "B"]))


# ------------------------------------------------------------ keys, rows, padding


def test_pop():
    dataset = DataProto.from_dict(
        {"obs": torch.randn(100, 10), "act": torch.randn(100, 3)}, meta_info={"2": 2, "1": 1}
    )
    popped = dataset.pop(batch_keys=["obs"], meta_info_keys=["2"])
    assert popped.batch.keys() == {"obs"}
    assert popped.meta_info.keys() == {"2"}
    assert dataset.batch.keys() == {"act"}
    assert dataset.meta_info.keys() == {"1"}


@pytest.mark.parametrize(
    "interleave,obs,labels",
    [
        (True, [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]], ["a", "a", "b", "b", "c", "c"]),
        (False, [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]], ["a", "b", "c", "a", "b", "c"]),
    ],
)
def test_repeat(interleave, obs, labels):
    repeated = three_rows().repeat(repeat_times=2, interleave=interleave)
    assert torch.all(torch.eq(repeated.batch["obs"], torch.tensor(obs)))
    assert (repeated.non_tensor_batch["labels"] == labels).all()
    assert repeated.meta_info == {"info": "test_info"}


@pytest.mark.parametrize(
    "divisor,pad,obs,labels",
    [
        (2, 1, [[1, 2], [3, 4], [5, 6], [1, 2]], ["a", "b", "c", "a"]),
        (3, 0, [[1, 2], [3, 4], [5, 6]], ["a", "b", "c"]),
        (7, 4, [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6], [1, 2]], ["a", "b", "c", "a", "b", "c", "a"]),
    ],
)
def test_dataproto_pad_unpad(divisor, pad, obs, labels):
    data = three_rows()
    padded, pad_size = pad_dataproto_to_divisor(data, size_divisor=divisor)
    assert pad_size == pad
    assert torch.all(torch.eq(padded.batch["obs"], torch.tensor(obs)))
    assert (padded.non_tensor_batch["labels"] == labels).all()
    assert padded.meta_info == {"info": "test_info"}
    unpadded = unpad_dataproto(padded, pad_size=pad_size)
    assert torch.all(torch.eq(unpadded.batch["obs"], torch.tensor([[1, 2], [3, 4], [5, 6]])))
    assert (unpadded.non_tensor_batch["labels"] == ["a", "b", "c"]).all()
    assert unpadded.meta_info == {"info": "test_info"}


def test_dataproto_fold_unfold():
    folded = fold_batch_dim(three_rows().repeat(repeat_times=2, interleave=True), new_batch_size=3)
    torch.testing.assert_close(
        folded.batch["obs"], torch.tensor([[[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]]])
    )
    assert (folded.non_tensor_batch["labels"] == [["a", "a"], ["b", "b"], ["c", "c"]]).all()
    folded.reorder(indices=torch.tensor([1, 2, 0]))
    unfolded = unfold_batch_dim(folded, batch_dims=2)
    torch.testing.assert_close(
        unfolded.batch["obs"], torch.tensor([[3, 4], [3, 4], [5, 6], [5, 6], [1, 2], [1, 2]])
    )
    assert (unfolded.non_tensor_batch["labels"] == ["b", "b", "c", "c", "a", "a"]).all()
    assert unfolded.meta_info == {"info": "test_info"}


def test_torch_save_data_proto(tmp_path):
    """Deviation: the file goes to pytest's tmp_path instead of the working directory."""
    data = three_rows()
    path = tmp_path / "test_data.pt"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.all(torch.eq(loaded.batch["obs"], data.batch["obs"]))
    assert (loaded.non_tensor_batch["labels"] == data.non_tensor_batch["labels"]).all()
    assert loaded.meta_info == data.meta_info


def test_len():
    labels = np.array(["a", "b", "c"], dtype=object)
    meta = {"info": "test_info"}
    assert (
        len(
            DataProto.from_dict(
                tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
                non_tensors={"labels": labels},
                meta_info=meta,
            )
        )
        == 3
    )
    assert len(DataProto(batch=None, non_tensor_batch={"labels": labels}, meta_info=meta)) == 3
    assert len(DataProto(batch=None, non_tensor_batch={}, meta_info=meta)) == 0
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info=meta)) == 0


def _random_indices(kind: str, n: int, count: int):
    return {
        "np_int": lambda: np.random.randint(0, n, size=(count,)),
        "torch_int": lambda: torch.randint(0, n, size=(count,)),
        "list_int": lambda: [np.random.randint(0, n) for _ in range(count)],
        "np_bool": lambda: np.random.randint(0, 2, size=(n,), dtype=bool),
        "torch_bool": lambda: torch.randint(0, 2, size=(n,), dtype=torch.bool),
        "list_bool": lambda: [np.random.randint(0, 2, dtype=bool) for _ in range(n)],
    }[kind]()


@pytest.mark.parametrize("kind", ["np_int", "torch_int", "list_int", "np_bool", "torch_bool", "list_bool"])
def test_dataproto_index(kind):
    obs = torch.randn(100, 10)
    labels = [random.choice(["abc", "cde"]) for _ in range(100)]
    data = DataProto.from_dict(tensors={"obs": obs}, non_tensors={"labels": labels})
    idx = _random_indices(kind, 100, 10)
    as_numpy = idx.numpy() if isinstance(idx, torch.Tensor) else idx
    expected_rows = int(np.sum(as_numpy)) if kind.endswith("bool") else 10
    result = data[idx]
    assert result.batch.keys() == data.batch.keys()
    assert result.non_tensor_batch.keys() == data.non_tensor_batch.keys()
    assert result.batch["obs"].shape[0] == expected_rows
    assert result.non_tensor_batch["labels"].shape[0] == expected_rows
    assert np.array_equal(result.batch["obs"].cpu().numpy(), obs[idx].cpu().numpy())
    assert np.array_equal(result.non_tensor_batch["labels"], np.array(labels)[as_numpy])


def test_old_vs_new_from_single_dict():
    class CustomProto(DataProto):
        pass

    class OriginProto(DataProto):
        @classmethod
        def from_single_dict(cls, data, meta_info=None, auto_padding=False):
            tensors = {k: v for k, v in data.items() if torch.is_tensor(v)}
            others = {k: v for k, v in data.items() if not torch.is_tensor(v)}
            return DataProto.from_dict(
                tensors=tensors, non_tensors=others, meta_info=meta_info, auto_padding=auto_padding
            )

    sample = {"x": torch.tensor([0])}
    assert type(OriginProto.from_single_dict(sample)) is DataProto
    assert type(CustomProto.from_single_dict(sample)) is CustomProto


def test_dataproto_no_batch():
    data = DataProto.from_dict(non_tensors={"labels": ["a", "b", "c"]}, meta_info={"info": "test_info"})
    assert (data.select(non_tensor_batch_keys=["labels"]).non_tensor_batch["labels"] == ["a", "b", "c"]).all()
    assert (data.pop(non_tensor_batch_keys=["labels"]).non_tensor_batch["labels"] == ["a", "b", "c"]).all()
    assert data.non_tensor_batch == {}


@pytest.mark.parametrize(
    "times,obs,labels",
    [
        ([3, 1, 2], [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]], ["a", "a", "a", "b", "c", "c"]),
        (
            torch.tensor([1, 2, 3]),
            [[1, 2], [3, 4], [3, 4], [5, 6], [5, 6], [5, 6]],
            ["a", "b", "b", "c", "c", "c"],
        ),
    ],
)
def test_sample_level_repeat(times, obs, labels):
    repeated = three_rows().sample_level_repeat(repeat_times=times)
    assert torch.all(torch.eq(repeated.batch["obs"], torch.tensor(obs)))
    assert (repeated.non_tensor_batch["labels"] == labels).all()
    assert repeated.meta_info == {"info": "test_info"}


OBS1_FLAT = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
OBS1_PAIRS = [
    [[1, 1], [2, 2], [3, 3], [4, 4]],
    [[5, 5], [6, 6], [7, 7], [8, 8]],
    [[9, 9], [10, 10], [11, 11], [12, 12]],
]


@pytest.mark.parametrize(
    "obs1,obs2,labels,split_keys,expect_obs1,expect_obs2,expect_labels",
    [
        (
            OBS1_FLAT,
            [[1, 2], [5, 6], [9, 10]],
            ["a", "b", "c"],
            ["obs1"],
            [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]],
            [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]],
            ["a", "a", "b", "b", "c", "c"],
        ),
        (
            OBS1_FLAT,
            [[1, 2], [5, 6], [9, 10]],
            [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]],
            ["obs1", "labels"],
            [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]],
            [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]],
            [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]],
        ),
        (
            OBS1_PAIRS,
            [[[1, 1], [2, 2]], [[5, 5], [6, 6]], [[9, 9], [10, 10]]],
            ["a", "b", "c"],
            ["obs1"],
            [
                [[1, 1], [2, 2]],
                [[3, 3], [4, 4]],
                [[5, 5], [6, 6]],
                [[7, 7], [8, 8]],
                [[9, 9], [10, 10]],
                [[11, 11], [12, 12]],
            ],
            [
                [[1, 1], [2, 2]],
                [[1, 1], [2, 2]],
                [[5, 5], [6, 6]],
                [[5, 5], [6, 6]],
                [[9, 9], [10, 10]],
                [[9, 9], [10, 10]],
            ],
            ["a", "a", "b", "b", "c", "c"],
        ),
    ],
)
def test_dataproto_unfold_column_chunks(
    obs1, obs2, labels, split_keys, expect_obs1, expect_obs2, expect_labels
):
    data = DataProto.from_dict(
        tensors={"obs1": torch.tensor(obs1), "obs2": torch.tensor(obs2)},
        non_tensors={"labels": labels},
        meta_info={"name": "abc"},
    )
    ret = data.unfold_column_chunks(2, split_keys=split_keys)
    assert torch.all(torch.eq(ret.batch["obs1"], torch.tensor(expect_obs1)))
    assert torch.all(torch.eq(ret.batch["obs2"], torch.tensor(expect_obs2)))
    assert (ret.non_tensor_batch["labels"] == expect_labels).all()
    assert ret.meta_info == {"name": "abc"}


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
def test_dataproto_chunk_after_index(index):
    data = DataProto.from_dict(
        tensors={"obs": torch.randn(4, 4)},
        non_tensors={"labels": [f"label_{i}" for i in range(4)]},
        meta_info={"name": "abc"},
    )
    selected = data[index]
    assert isinstance(selected.batch.batch_size, torch.Size)
    assert all(isinstance(d, int) for d in selected.batch.batch_size)


# ------------------------------------------------------------------ TensorDict form


def test_to_tensordict():
    data = six_rows()
    output = data.to_tensordict()
    assert torch.all(torch.eq(output["obs"], torch.tensor([1, 2, 3, 4, 5, 6]))).item()
    assert output["labels"] == ["a", "b", "c", "d", "e", "f"]
    assert output["name"] == "abdce"


def test_from_tensordict():
    """Deviation: the input is built with tensordict's own ``NonTensorStack``/``NonTensorData``
    (what verl's ``tensordict_utils.get_tensordict`` builds), as daskwg has no such helper."""
    labels = ["a", "b", "c", "d", "e", "f"]
    td = TensorDict(
        {
            "obs": torch.tensor([1, 2, 3, 4, 5, 6]),
            "labels": NonTensorStack.from_list([NonTensorData(v) for v in labels]),
            "name": NonTensorData("abdce"),
        },
        batch_size=[6],
    )
    data = DataProto.from_tensordict(td)
    assert data.non_tensor_batch["labels"].tolist() == labels
    assert torch.all(torch.eq(data.batch["obs"], torch.tensor([1, 2, 3, 4, 5, 6]))).item()
    assert data.meta_info["name"] == "abdce"


def test_to_tensordict_with_nested_lists():
    turn_scores = [[], [0.5, 0.8], [0.9]]
    out = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3])}, non_tensors={"turn_scores": turn_scores}
    ).to_tensordict()
    assert torch.all(torch.eq(out["obs"], torch.tensor([1, 2, 3]))).item()
    assert len(out["turn_scores"]) == 3
    assert [list(v) for v in out["turn_scores"]] == [[], [0.5, 0.8], [0.9]]


def test_to_tensordict_with_nested_dicts():
    info = [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}]
    out = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3])}, non_tensors={"reward_extra_info": info}
    ).to_tensordict()
    assert torch.all(torch.eq(out["obs"], torch.tensor([1, 2, 3]))).item()
    assert len(out["reward_extra_info"]) == 3
    assert [dict(v) for v in out["reward_extra_info"]] == info


def test_to_tensordict_with_complex_nested_structures():
    raw_prompt = [
        [{"content": "Question 1", "role": "user"}],
        [{"content": "Question 2", "role": "user"}, {"content": "Answer 2", "role": "assistant"}],
        [{"content": "Question 3", "role": "user"}],
    ]
    out = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3])}, non_tensors={"raw_prompt": raw_prompt}
    ).to_tensordict()
    assert torch.all(torch.eq(out["obs"], torch.tensor([1, 2, 3]))).item()
    assert len(out["raw_prompt"]) == 3
    assert len(out["raw_prompt"][0]) == 1
    assert dict(out["raw_prompt"][0][0]) == {"content": "Question 1", "role": "user"}


def test_to_tensordict_and_back_with_nested_data():
    labels = ["a", "b", "c", "d"]
    turn_scores = [[], [0.5], [0.8, 0.9], [0.7]]
    info = [
        {"acc": 1.0, "loss": 0.1},
        {"acc": 0.5, "loss": 0.3},
        {"acc": 1.0, "loss": 0.05},
        {"acc": 0.0, "loss": 0.9},
    ]
    raw_prompt = [
        [{"content": "Q1", "role": "user"}],
        [{"content": "Q2", "role": "user"}],
        [{"content": "Q3", "role": "user"}, {"content": "A3", "role": "assistant"}],
        [{"content": "Q4", "role": "user"}],
    ]
    original = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4])},
        non_tensors={
            "labels": labels,
            "turn_scores": turn_scores,
            "reward_extra_info": info,
            "raw_prompt": raw_prompt,
        },
        meta_info={"experiment": "test_nested"},
    )
    back = DataProto.from_tensordict(original.to_tensordict())
    assert torch.all(torch.eq(back.batch["obs"], torch.tensor([1, 2, 3, 4]))).item()
    assert back.non_tensor_batch["labels"].tolist() == labels
    assert [list(v) for v in back.non_tensor_batch["turn_scores"]] == turn_scores
    assert list(back.non_tensor_batch["reward_extra_info"]) == info
    assert [list(v) for v in back.non_tensor_batch["raw_prompt"]] == raw_prompt
    assert back.meta_info["experiment"] == "test_nested"


def test_to_tensordict_agent_loop_scenario():
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    responses = torch.tensor([[7, 8], [9, 10]])
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses},
        non_tensors={
            "data_source": ["lighteval/MATH", "lighteval/MATH"],
            "uid": ["uuid-1", "uuid-2"],
            "num_turns": np.array([2, 4], dtype=np.int32),
            "acc": np.array([1.0, 0.0]),
            "turn_scores": [[], [0.5, 0.8]],
            "reward_extra_info": [{"acc": 1.0}, {"acc": 0.0}],
            "raw_prompt": [
                [{"content": "Compute 4 @ 2", "role": "user"}],
                [{"content": "Compute 8 @ 7", "role": "user"}],
            ],
            "tool_rewards": [[0.0], []],
        },
        meta_info={"global_steps": 42},
    )
    out = data.to_tensordict()
    assert torch.all(torch.eq(out["prompts"], prompts)).item()
    assert torch.all(torch.eq(out["responses"], responses)).item()
    assert len(out["turn_scores"]) == 2
    assert (list(out["turn_scores"][0]), list(out["turn_scores"][1])) == ([], [0.5, 0.8])
    assert len(out["reward_extra_info"]) == 2
    assert dict(out["reward_extra_info"][0]) == {"acc": 1.0}
    assert len(out["raw_prompt"]) == 2
    assert dict(out["raw_prompt"][0][0]) == {"content": "Compute 4 @ 2", "role": "user"}
    assert len(out["tool_rewards"]) == 2
    assert (list(out["tool_rewards"][0]), list(out["tool_rewards"][1])) == ([0.0], [])

    back = DataProto.from_tensordict(out)
    assert len(back) == 2
    assert back.meta_info["global_steps"] == 42
    assert torch.all(torch.eq(back.batch["prompts"], prompts)).item()


# --------------------------------------------------------------- serialization


def assert_same_tensordict(original: TensorDict, rebuilt: TensorDict) -> None:
    assert original.batch_size == rebuilt.batch_size
    assert set(original.keys()) == set(rebuilt.keys())
    for key in original.keys():
        a, b = original[key], rebuilt[key]
        if a.is_nested:
            assert b.is_nested and a.layout == b.layout
            pairs = list(zip(a.unbind(), b.unbind(), strict=True))
        else:
            pairs = [(a, b)]
        for x, y in pairs:
            assert x.shape == y.shape and x.dtype == y.dtype
            assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8))


def test_serialize_deserialize_single_tensor():
    original = torch.randn(3, 4, 5)
    rebuilt = deserialize_single_tensor(serialize_single_tensor(original))
    assert torch.allclose(original, rebuilt)
    assert original.shape == rebuilt.shape and original.dtype == rebuilt.dtype


def test_serialize_deserialize_tensordict_regular_tensors():
    """A TensorDict with two batch dims (5, 3) round-trips, as in verl."""
    td = TensorDict(
        {"tensor1": torch.randn(5, 3, 4), "tensor2": torch.randint(0, 10, (5, 3, 2))}, batch_size=(5, 3)
    )
    assert_same_tensordict(td, deserialize_tensordict(serialize_tensordict(td)))


def test_serialize_deserialize_tensordict_nested_tensors():
    nested = torch.nested.as_nested_tensor([torch.randn(2, 3), torch.randn(3, 4), torch.randn(1, 5)])
    td = TensorDict({"nested": nested, "regular": torch.randn(3, 4, 5)}, batch_size=(3,))
    assert_same_tensordict(td, deserialize_tensordict(serialize_tensordict(td)))


def test_serialize_deserialize_tensordict_mixed_types():
    fields = {
        "float": torch.randn(2, 3).float(),
        "double": torch.randn(2, 3).double(),
        "int": torch.randint(0, 10, (2, 3)).int(),
        "long": torch.randint(0, 10, (2, 3)).long(),
        "bool": torch.tensor([[True, False], [False, True]]),
        "bfloat16": torch.randn(2, 3).bfloat16(),
        "fp8": torch.randn(2, 3).to(torch.float8_e5m2),
        "nested": torch.nested.as_nested_tensor([torch.randn(2, 3), torch.randn(3, 4)]),
    }
    td = TensorDict(fields, batch_size=(2,))
    assert_same_tensordict(td, deserialize_tensordict(serialize_tensordict(td)))


def test_serialize_deserialize_tensordict_with_device():
    td = TensorDict(
        {"tensor1": torch.randn(2, 3, 4), "tensor2": torch.randint(0, 10, (2, 3, 2))},
        batch_size=(2, 3),
        device="cpu",
    )
    rebuilt = deserialize_tensordict(serialize_tensordict(td))
    assert str(td.device) == str(rebuilt.device)
    assert_same_tensordict(td, rebuilt)


def test_serialize_dataproto_with_empty_tensordict():
    data = DataProto(batch=TensorDict({}, batch_size=[10]))
    rebuilt = pickle.loads(pickle.dumps(data))
    assert len(rebuilt.batch.keys()) == 0
    assert rebuilt.batch.batch_size == torch.Size([10])


def test_numpy_dataproto_serialization_skips_tensordict_consolidation(monkeypatch):
    """Deviation: daskwg always pickles tensors as numpy byte views, so no
    ``VERL_DATAPROTO_SERIALIZATION_METHOD`` is set; it never consolidates either."""

    def fail(*args, **kwargs):
        pytest.fail("TensorDict.consolidate() must not be called when a DataProto is pickled")

    monkeypatch.setattr(TensorDict, "consolidate", fail)
    data = DataProto.from_dict(
        tensors={"obs": torch.arange(12).reshape(3, 4)},
        non_tensors={"labels": np.array(["a", "b", "c"], dtype=object)},
        meta_info={"step": 1},
    )
    restored = DataProto()
    restored.__setstate__(data.__getstate__())
    torch.testing.assert_close(restored.batch["obs"], data.batch["obs"])
    assert restored.non_tensor_batch["labels"].tolist() == ["a", "b", "c"]
    assert restored.meta_info == {"step": 1}
