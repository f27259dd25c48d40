"""Wide batches (hundreds of keys, mixed dtypes, non-tensor keys) on every call path:
blocking, ``blocking=False`` + ``get``, and a ``DataProtoFuture`` passed on to the next
call. Issue 46: such a batch's small columns travel in one buffer per TensorDict
(``daskwg.wire.codec.reduce_columns``) and are collected with one ``torch.cat`` a column.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from wide_workers import WideWorker

from daskwg import ClassWithInitArgs, DataProto, DataProtoFuture, ResourcePool, WorkerGroup
from daskwg.serialization import pickling as serialization
from daskwg.wire import codec

pytestmark = pytest.mark.timeout(180)

ROWS = 12
DTYPES = (torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float64, torch.uint8, torch.int32)


def wide(keys: int = 300, rows: int = ROWS, auto_padding: bool = False) -> DataProto:
    """``keys`` small columns of mixed dtypes and shapes, one large column, two non-tensor
    keys and meta_info."""
    g = torch.Generator().manual_seed(keys)
    tensors = {}
    for i in range(keys):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (rows,) if i % 3 else (rows, 1 + i % 5)
        values = torch.randint(0, 100, shape, generator=g)
        tensors[f"k{i:03d}"] = values.to(dtype) if dtype is not torch.bool else values % 2 == 0
    tensors["large"] = torch.arange(rows * 4096, dtype=torch.float32).reshape(rows, 4096)
    return DataProto.from_dict(
        tensors,
        non_tensors={"uid": [f"u{r}" for r in range(rows)], "score": np.arange(rows, dtype=np.float64)},
        meta_info={"step": 3},
        auto_padding=auto_padding,
    )


def assert_same(got: DataProto, want: DataProto) -> None:
    assert list(got.batch.keys()) == list(want.batch.keys())
    for key, value in want.batch.items():
        assert got.batch[key].dtype == value.dtype, key
        assert torch.equal(got.batch[key], value), key
    assert list(got.non_tensor_batch) == list(want.non_tensor_batch)
    for key, value in want.non_tensor_batch.items():
        np.testing.assert_array_equal(got.non_tensor_batch[key], value)
    assert got.meta_info == want.meta_info


@pytest.fixture(scope="module")
def group(cluster4):
    from distributed import Client

    with Client(cluster4) as client:
        with WorkerGroup(
            client, ClassWithInitArgs(WideWorker), workers=ResourcePool(client, world_size=3)
        ) as wg:
            yield wg


def test_wide_batch_comes_back_whole_from_a_blocking_call(group):
    batch = wide()
    assert_same(group.echo(batch), batch)


def test_wide_batch_comes_back_whole_from_a_non_blocking_call(group):
    batch = wide()
    future = group.echo_later(batch)
    assert isinstance(future, DataProtoFuture)
    assert_same(future.get(), batch)


def test_wide_batch_future_passed_on_reaches_the_next_call_whole(group):
    batch = wide()
    sums = group.checksums(group.echo_later(batch))
    want = torch.zeros(ROWS, dtype=torch.float64)
    for value in batch.batch.values():
        want += value.reshape(ROWS, -1).to(torch.float64).sum(dim=1)
    assert torch.equal(sums.batch["sum"], want)


def test_in_place_change_of_one_wide_column_leaves_its_neighbours(group):
    batch = wide()
    key = "k010"
    got = group.bump_one(batch)
    per_rank = ROWS // group.world_size
    want = (
        batch.batch[key]
        + torch.arange(group.world_size).repeat_interleave(per_rank).to(batch.batch[key].dtype)
        + 1
    )
    assert torch.equal(got.batch[key], want)
    for other in ("k009", "k011", "k017", "large"):
        assert torch.equal(got.batch[other], batch.batch[other]), other


def test_wide_batch_with_padding_comes_back_without_the_padding_rows(group):
    batch = wide(rows=10, auto_padding=True)
    got = group.echo(batch)
    assert len(got) == 10
    assert torch.equal(got.batch["k005"], batch.batch["k005"])
    np.testing.assert_array_equal(got.non_tensor_batch["uid"], batch.non_tensor_batch["uid"])


def test_small_columns_of_a_wide_tensordict_travel_in_one_buffer():
    td = TensorDict({f"k{i}": torch.full((8,), float(i)) for i in range(512)}, batch_size=[8])
    packed = serialization.dumps(td)
    assert len(packed.buffers) == 1
    back = serialization.loads(packed)
    assert list(back.keys()) == list(td.keys())
    assert all(torch.equal(back[k], td[k]) for k in td.keys())


def test_packed_columns_of_mixed_dtypes_arrive_aligned_and_apart():
    batch = wide(keys=64)
    back = serialization.loads(serialization.dumps(batch.batch))
    for key, value in back.items():
        assert value.data_ptr() % value.element_size() == 0, key
        assert torch.equal(value, batch.batch[key]), key
    back["k001"] += 1
    assert torch.equal(back["k000"], batch.batch["k000"])
    assert torch.equal(back["k002"], batch.batch["k002"])


def test_a_packed_column_is_a_copy_the_sender_may_change():
    td = TensorDict({f"k{i}": torch.zeros(4) for i in range(8)}, batch_size=[4])
    packed = serialization.dumps(td)
    td["k3"] += 5
    assert torch.equal(serialization.loads(packed)["k3"], torch.zeros(4))


def test_columns_above_the_small_size_travel_on_their_own():
    big = codec.SMALL_COLUMN // 4 + 1
    td = TensorDict(
        {**{f"k{i}": torch.zeros(2) for i in range(8)}, "big": torch.ones(2, big)}, batch_size=[2]
    )
    packed = serialization.dumps(td)
    assert len(packed.buffers) == 2
    back = serialization.loads(packed)
    assert list(back.keys()) == list(td.keys())
    assert torch.equal(back["big"], td["big"])


def _part_info_cases() -> list:
    """Batches whose part info the snapshot fast path reads: wide with a large column,
    with non-tensor keys, a TensorDict part, a column with gradients, a transposed column,
    a nested TensorDict and a named batch dimension (the last four have no columns)."""
    small = {f"k{i}": torch.ones(4, 2) for i in range(6)}
    named = TensorDict(dict(small), batch_size=[4])
    named.names = ["b"]
    return [
        DataProto(batch=wide(keys=64).batch, meta_info={"step": 3}),
        wide(keys=64),
        TensorDict(dict(small), batch_size=[4]),
        DataProto(batch=TensorDict({**small, "g": torch.ones(4, 2, requires_grad=True)}, batch_size=[4])),
        DataProto(batch=TensorDict({**small, "t": torch.ones(2, 4).t()}, batch_size=[4])),
        DataProto(batch=TensorDict({**small, "n": TensorDict(dict(small), batch_size=[4])}, batch_size=[4])),
        DataProto(batch=named),
    ]


@pytest.mark.parametrize("case", range(len(_part_info_cases())))
def test_part_info_of_a_wide_snapshot_is_read_without_rebuilding_its_columns(case, monkeypatch):
    # A non-blocking call's reply carries its result's PartInfo: read from the kept
    # snapshot, it used to rebuild every packed column (a tensor a key) to name them.
    from daskwg.plugin import rows

    value = _part_info_cases()[case]
    packed = serialization.dumps(value)
    want = rows.part_info_of(serialization.loads(packed), "key", "tcp://w")
    rebuilt = []
    real = codec.rebuild_columns
    monkeypatch.setattr(codec, "rebuild_columns", lambda *args: rebuilt.append(1) or real(*args))
    assert rows.part_info_of(packed, "key", "tcp://w") == want
    assert not rebuilt


def test_small_columns_are_collected_as_dataproto_concat_would():
    from daskwg.protocol import concat_small_columns

    parts = wide(keys=64).chunk(3)
    got = concat_small_columns(list(parts))
    assert got is not None
    assert_same(got, DataProto.concat(list(parts)))
    for key, value in got.batch.items():
        # Each column a tensor of its own: saving or keeping one holds only its bytes.
        assert value.is_contiguous(), key
        assert value.untyped_storage().nbytes() == value.nbytes, key
    got.batch["k001"] += 1
    assert torch.equal(got.batch["k004"], DataProto.concat(list(parts)).batch["k004"])


def test_small_columns_with_gradients_or_another_dtype_on_one_rank_collect_as_dataproto_concat():
    from daskwg.protocol import concat_small_columns

    parts = list(wide(keys=16).chunk(2))
    parts[1].batch["k007"] = parts[1].batch["k007"].to(torch.float64)  # promoted, as torch.cat does
    for part in parts:
        part.batch["k000"] = part.batch["k000"].float().requires_grad_()
    got = concat_small_columns(parts)
    want = DataProto.concat(parts)
    assert got.batch["k007"].dtype == want.batch["k007"].dtype == torch.float64
    assert torch.equal(got.batch["k007"], want.batch["k007"])
    assert got.batch["k000"].requires_grad and got.batch["k000"].grad_fn is not None
    with torch.no_grad():
        got.batch["k000"].mul_(2)  # an ordinary tensor, not a view of a multi-output op


@pytest.mark.parametrize("change", ["missing", "trailing", "large"])
def test_parts_that_disagree_are_left_to_dataproto_concat(change):
    from daskwg.protocol import concat_small_columns

    parts = list(wide(keys=16).chunk(2))
    second = parts[1].batch
    if change == "missing":
        del second["k003"]
        second["extra"] = torch.zeros(second.batch_size[0])
    elif change == "trailing":
        second["k000"] = torch.zeros(second.batch_size[0], 7)
    else:
        second["huge"] = parts[0].batch["huge"] = torch.zeros(second.batch_size[0], 1 << 18)
    assert concat_small_columns(parts) is None
