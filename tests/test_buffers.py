"""Receive buffers kept for the next value of their size (``daskwg.wire.buffers``), in this
process: what may be reused, and when."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import psutil
import pytest
import torch
from dask.config import set as dask_config

from daskwg import DataProto
from daskwg.dispatch import modes as dispatch
from daskwg.serialization import pickling as serialization
from daskwg.wire import buffers, codec

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def pool():
    with dask_config({"daskwg.buffer-pool": "64 MiB"}):
        gc.collect()
        # What earlier tests (of any file) left pooled, under another limit, is not this test's.
        buffers.clear_pool()
        yield
    gc.collect()


def _received(value):
    """``value`` as a receiver gets it: its bytes copied into receive buffers, unpickled."""
    packed = serialization.dumps(value)
    into = [buffers.receive_buffer(memoryview(b).nbytes) for b in packed.buffers]
    for target, source in zip(into, packed.buffers):
        memoryview(target).cast("B")[:] = memoryview(source).cast("B")
    return pickle.loads(packed.header, buffers=into)


def test_a_buffer_in_use_by_a_tensor_built_on_it_is_never_handed_out_again():
    # Seen while building this: numpy's views (and memoryviews of them) refer to the array
    # that owns the memory, so a wrapper of the block died while tensors still used it, and
    # the next receive was handed the same memory.
    before = buffers.pooled_bytes()
    weights = _received({"a": torch.full((MiB,), 1.0), "b": torch.full((2 * MiB,), 2.0)})
    gc.collect()
    assert buffers.pooled_bytes() == before  # in use: nothing came back
    fresh = buffers.receive_buffer(4 * MiB)
    fresh[:] = 7
    assert bool((weights["a"] == 1.0).all()) and bool((weights["b"] == 2.0).all())
    del weights, fresh
    gc.collect()
    assert buffers.pooled_bytes() == before + 16 * MiB  # 4 + 8 MiB, and the 4 MiB `fresh`
    again = _received({"a": torch.full((MiB,), 3.0), "b": torch.full((2 * MiB,), 4.0)})
    assert buffers.pooled_bytes() == before + 4 * MiB  # the 4 and 8 MiB blocks were taken again
    assert bool((again["a"] == 3.0).all()) and bool((again["b"] == 4.0).all())


def test_the_pool_keeps_at_most_its_limit_and_small_or_oversized_buffers_are_plain():
    with dask_config({"daskwg.buffer-pool": "16 MiB"}):
        held = [buffers.receive_buffer(8 * MiB) for _ in range(3)]
        del held
        gc.collect()
        assert buffers.pooled_bytes() <= 16 * MiB
        small = buffers.receive_buffer(MiB // 2)
        big = buffers.receive_buffer(32 * MiB)
        assert small.base is None and big.base is None  # numpy's own memory, not pooled
    with dask_config({"daskwg.buffer-pool": 0}):
        assert buffers.receive_buffer(8 * MiB).base is None
    with dask_config({"daskwg.buffer-pool": "auto"}):
        # No Dask worker in this process (the driver): a sixteenth of the memory, at most 1 GiB.
        assert buffers.pool_limit() == min(psutil.virtual_memory().total // 16, 1 << 30)
    with pytest.raises(ValueError, match="cannot have -1 bytes"):
        buffers.receive_buffer(-1)


def test_a_received_buffer_is_writable_and_its_own():
    first = buffers.receive_buffer(2 * MiB)
    second = buffers.receive_buffer(2 * MiB)
    first[:] = 1
    second[:] = 2
    assert first.flags.writeable and int(first.sum()) == 2 * MiB
    assert not np.shares_memory(first, second)


def test_a_collected_batch_is_written_into_a_pooled_block_that_the_next_step_reuses():
    # A DP_COMPUTE_PROTO collect of a 64 MiB batch took 92 ms on 4 ranks while its copy went
    # into fresh torch pages, 75 ms into a block an earlier step's result gave back.
    def collected(value: float) -> DataProto:
        parts = [
            DataProto.from_dict(tensors={"x": torch.full((rows, 1024), value), "i": torch.arange(rows)})
            for rows in (96, 160, 0, 256)  # uneven, one rank without rows
        ]
        return dispatch._concat_releasing(parts)

    first = collected(1.0)
    x = first.batch["x"]
    assert x.shape == (512, 1024) and bool((x == 1.0).all()) and first.batch["i"].tolist()[95:97] == [95, 0]
    assert codec.received(x) and x.is_contiguous()  # the process's own: handed on without a copy
    address, held = x.data_ptr(), buffers.pooled_bytes()
    del first, x
    gc.collect()
    assert buffers.pooled_bytes() == held + 2 * MiB  # the 2 MiB column came back; `i` is small
    second = collected(2.0)
    assert second.batch["x"].data_ptr() == address and bool((second.batch["x"] == 2.0).all())
    assert buffers.pooled_bytes() == held
