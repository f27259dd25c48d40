"""The ``DP_COMPUTE_PROTO`` padding rule (``daskwg.futures.padding``): how many rows are
added, how the count leaves a dispatch function's ``kwargs`` (verl's contract) to travel as
a typed field, and where the rows come off (the driver's collected output, or a rank's own
output for a future it was given alone). No cluster: the group is a stand-in."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict import TensorDict

from daskwg.dispatch.calling import Cut, cut
from daskwg.dispatch.modes import PADDING_SIZE_KEY, dispatch_dp_compute_data_proto
from daskwg.futures import padding
from daskwg.protocol import DataProto

pytestmark = pytest.mark.timeout(60)


def _rows(n: int) -> DataProto:
    return DataProto.from_dict({"a": torch.arange(n)})


def _group(world_size: int):
    return types.SimpleNamespace(world_size=world_size, _name="g", _dispatch_info={}, _collect_info={})


@pytest.mark.parametrize(
    ("length", "ranks", "added"), [(6, 4, 2), (8, 4, 0), (1, 4, 3), (None, 4, 0), (0, 3, 0)]
)
def test_rows_to_add_makes_the_length_a_multiple_of_the_ranks(length, ranks, added):
    assert padding.rows_to_add(length, ranks) == added


def test_the_dispatch_key_is_the_one_the_padding_module_reads():
    assert PADDING_SIZE_KEY is padding.PADDING_SIZE_KEY
    kwargs, count = padding.take(padding.announce({"x": [1, 2]}, 3))
    assert (kwargs, count) == ({"x": [1, 2]}, 3)


def test_cutting_a_call_carries_the_padding_as_a_field_and_never_to_a_rank():
    fns = {"dispatch_fn": dispatch_dp_compute_data_proto}
    result = cut(_group(4), "m", fns, (_rows(6),), {}, [0, 1, 2, 3])
    assert isinstance(result, Cut) and result.padding == 2
    assert all(kwargs == {} for _, kwargs in result.payloads)
    assert [args[0].batch["a"].tolist() for args, _ in result.payloads][-1] == [0, 1]


def test_the_driver_unpads_the_collected_output():
    assert padding.unpad(_rows(8), 2).batch["a"].tolist() == list(range(6))


def test_a_rank_strips_its_padding_rows_off_a_batch_output():
    td = TensorDict({"a": torch.arange(3)}, batch_size=[3])
    assert padding.strip(_rows(3), 2).batch["a"].tolist() == [0]
    assert padding.strip(td, 1)["a"].tolist() == [0, 1]


@pytest.mark.parametrize("output", [{"loss": 1.0}, 7, None])
def test_a_rank_leaves_an_output_that_is_not_a_batch_as_it_is(output):
    assert padding.strip(output, 2) is output


def test_a_rank_leaves_a_batch_shorter_than_its_padding_as_it_is():
    short = _rows(1)
    assert padding.strip(short, 2) is short
