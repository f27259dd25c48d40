"""Specification of ``daskwg.dispatch.register``: modes, ``@register`` and the dispatch/collect functions.

These are unit tests of pure functions, run in this process against small stand-ins for
a worker group; the same functions on a real Dask cluster are tested with the group.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import pickle
import subprocess
import sys
import textwrap

import distributed
import pytest
import torch
from tensordict import TensorDict

from daskwg.dispatch.modes import PADDING_SIZE_KEY, make_nd_compute_dataproto_dispatch_fn
from daskwg.dispatch.register import (
    Dispatch,
    Execute,
    RegisteredMethod,
    get_predefined_dispatch_fn,
    get_registered_method,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from daskwg.errors import DispatchError
from daskwg.futures.future import DataProtoFuture
from daskwg.protocol import DataProto
from daskwg.worker import Worker


class FakeGroup:
    """The part of a worker group that dispatch and collect functions may use."""

    def __init__(self, world_size, dp_ranks=None, collect=None):
        self.world_size = world_size
        self._dispatch_info = {}
        self._collect_info = {}
        self._dp_ranks = dp_ranks or {}
        self._collect = collect or {}
        self.queries = []

    def _query_dispatch_info(self, mesh_name):
        self.queries.append(("dispatch", mesh_name))
        return self._dp_ranks[mesh_name]

    def _query_collect_info(self, mesh_name):
        self.queries.append(("collect", mesh_name))
        return self._collect[mesh_name]


class InProcessGroup:
    """dispatch -> every rank -> collect in this process, with one Worker instance per rank.

    Per-rank arguments make a pickle round trip, as they do when sent to a Dask worker, so
    ranks never share objects.
    """

    def __init__(self, worker_cls, world_size, monkeypatch):
        self.world_size = world_size
        self._dispatch_info = {}
        self._collect_info = {}
        self.ranks = []
        for rank in range(world_size):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world_size))
            self.ranks.append(worker_cls())

    def call(self, method_name, *args, **kwargs):
        registered = get_registered_method(getattr(type(self.ranks[0]), method_name))
        fns = get_predefined_dispatch_fn(registered.dispatch_mode)
        rank_args, rank_kwargs = fns["dispatch_fn"](self, *args, **kwargs)
        rank_kwargs.pop(PADDING_SIZE_KEY, None)
        outputs = []
        for rank, worker in enumerate(self.ranks):
            sent = pickle.loads(
                pickle.dumps(([a[rank] for a in rank_args], {k: v[rank] for k, v in rank_kwargs.items()}))
            )
            outputs.append(getattr(worker, method_name)(*sent[0], **sent[1]))
        return fns["collect_fn"](self, outputs)

    def _query_dispatch_info(self, mesh_name):
        return self.call("_query_dispatch_info", mesh_name)

    def _query_collect_info(self, mesh_name):
        return self.call("_query_collect_info", mesh_name)


def rows(*values):
    return DataProto.from_dict({"a": torch.tensor(values)})


def column(data):
    return data.batch["a"].tolist()


def dispatch(mode, group, *args, **kwargs):
    return get_predefined_dispatch_fn(mode)["dispatch_fn"](group, *args, **kwargs)


def collect(mode, group, outputs):
    return get_predefined_dispatch_fn(mode)["collect_fn"](group, outputs)


# --------------------------------------------------------------------------- modes


def test_dispatch_has_verls_predefined_members():
    assert Dispatch.names()[:7] == [
        "RANK_ZERO",
        "ONE_TO_ALL",
        "ALL_TO_ALL",
        "DP_COMPUTE",
        "DP_COMPUTE_PROTO",
        "DP_COMPUTE_PROTO_WITH_FUNC",
        "DP_COMPUTE_METRIC",
    ]


def test_execute_has_all_and_rank_zero():
    assert list(Execute) == [Execute.ALL, Execute.RANK_ZERO]


def test_member_is_found_by_name():
    assert Dispatch["DP_COMPUTE"] is Dispatch.DP_COMPUTE
    assert Dispatch.from_name("dp_compute") is Dispatch.DP_COMPUTE
    assert "DP_COMPUTE" in Dispatch
    assert Dispatch.DP_COMPUTE in Dispatch


def test_members_of_different_enums_are_different():
    assert Dispatch.RANK_ZERO != Execute.RANK_ZERO


def test_member_unpickles_to_the_same_object():
    restored = pickle.loads(pickle.dumps(Dispatch.DP_COMPUTE_PROTO))
    assert restored is Dispatch.DP_COMPUTE_PROTO
    assert {Dispatch.DP_COMPUTE_PROTO: "proto"}[restored] == "proto"


def test_member_repr_names_enum_and_member():
    assert repr(Dispatch.ONE_TO_ALL) == "Dispatch.ONE_TO_ALL"
    assert repr(Execute.RANK_ZERO) == "Execute.RANK_ZERO"


def test_dispatch_register_adds_a_member():
    member = Dispatch.register("test_register_adds")
    assert Dispatch.TEST_REGISTER_ADDS is member
    assert member.name == "TEST_REGISTER_ADDS"
    assert member in Dispatch


def test_dispatch_register_rejects_an_existing_name():
    with pytest.raises(ValueError, match="ONE_TO_ALL already exists"):
        Dispatch.register("one_to_all")


def test_member_added_at_run_time_unpickles_in_a_fresh_process():
    payload = pickle.dumps(Dispatch.register("TEST_CROSSES_PROCESSES"))
    script = textwrap.dedent(
        """
        import pickle, sys
        from daskwg.dispatch.register import Dispatch
        member = pickle.loads(sys.stdin.buffer.read())
        print(member is Dispatch.TEST_CROSSES_PROCESSES, repr(member))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], input=payload, capture_output=True, check=True, timeout=60
    )
    assert out.stdout.decode().split() == ["True", "Dispatch.TEST_CROSSES_PROCESSES"]


# --------------------------------------------------------------------------- @register


def test_register_defaults_match_verl():
    @register()
    def method(self):
        return 1

    assert get_registered_method(method) == RegisteredMethod(
        dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.ALL, blocking=True, materialize_futures=True
    )


def test_register_records_its_arguments_in_one_readable_attribute():
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO, blocking=False)
    def method(self, data):
        return data

    assert method._daskwg_registered == RegisteredMethod(
        dispatch_mode=Dispatch.DP_COMPUTE_PROTO,
        execute_mode=Execute.RANK_ZERO,
        blocking=False,
        materialize_futures=True,
    )
    assert not hasattr(method, "attrs_3141562937")


def test_registered_method_info_is_frozen():
    @register()
    def method(self):
        return 1

    with pytest.raises(AttributeError):
        get_registered_method(method).blocking = False


def test_plain_function_is_not_registered():
    def method(self):
        return 1

    assert get_registered_method(method) is None


def test_registered_method_is_found_through_a_bound_method():
    class Holder:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def ping(self):
            return "pong"

    assert get_registered_method(Holder().ping).dispatch_mode is Dispatch.ONE_TO_ALL


def test_registered_method_still_runs_in_process():
    class Holder:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def add(self, x, y=1):
            """Add y."""
            return x + y

    assert Holder().add(2, y=3) == 5
    assert Holder.add.__name__ == "add"
    assert Holder.add.__doc__ == "Add y."


def test_registered_async_method_stays_a_coroutine_function():
    class Holder:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        async def add(self, x):
            await asyncio.sleep(0)
            return x + 1

    assert inspect.iscoroutinefunction(Holder.add)
    assert asyncio.run(Holder().add(1)) == 2


def test_registered_method_pickles_by_reference():
    restored = pickle.loads(pickle.dumps(Worker.execute_func_rank_zero))
    assert restored is Worker.execute_func_rank_zero


def test_register_rejects_a_string_dispatch_mode():
    with pytest.raises(TypeError, match="dispatch_mode must be a Dispatch member or a dict"):
        register(dispatch_mode="DP_COMPUTE")


def test_register_without_parentheses_is_a_type_error():
    with pytest.raises(TypeError, match=r"write @register\(\)"):

        @register
        def method(self):
            return 1


def test_dict_dispatch_mode_needs_both_functions():
    with pytest.raises(ValueError, match="missing \\['collect_fn'\\]"):
        register(dispatch_mode={"dispatch_fn": print})


def test_dict_dispatch_mode_functions_must_be_callable():
    with pytest.raises(TypeError, match="collect_fn must be callable, got int"):
        register(dispatch_mode={"dispatch_fn": print, "collect_fn": 3})


def test_register_rejects_a_non_execute_mode():
    with pytest.raises(TypeError, match="execute_mode must be an Execute member, got Dispatch"):
        register(execute_mode=Dispatch.RANK_ZERO)


def test_register_rejects_a_non_bool_blocking():
    with pytest.raises(TypeError, match="blocking must be a bool, got str"):
        register(blocking="no")


def test_registering_a_function_twice_is_an_error():
    @register()
    def method(self):
        return 1

    with pytest.raises(ValueError, match="already registered"):
        register(dispatch_mode=Dispatch.ONE_TO_ALL)(method)


def future_of(data):
    """A DataProtoFuture whose parts are already known (no cluster needed)."""
    return DataProtoFuture(futures=["part-0"], gather=lambda futures: [data])


def test_in_process_call_materializes_data_proto_futures():
    class Holder:
        @register()
        def total(self, data, *, other):
            return column(data) + column(other)

    assert Holder().total(future_of(rows(1, 2)), other=future_of(rows(3))) == [1, 2, 3]


def test_in_process_async_call_materializes_data_proto_futures():
    class Holder:
        @register()
        async def total(self, data):
            return column(data)

    assert asyncio.run(Holder().total(future_of(rows(4, 5)))) == [4, 5]


def test_in_process_call_keeps_futures_when_materialize_futures_is_false():
    class Holder:
        @register(materialize_futures=False)
        def passthrough(self, data):
            return data

    future = future_of(rows(1))
    assert Holder().passthrough(future) is future


def test_in_process_call_does_not_mutate_the_callers_kwargs():
    class Holder:
        @register()
        def total(self, data):
            return column(data)

    future = future_of(rows(7))
    kwargs = {"data": future}
    Holder().total(**kwargs)
    assert kwargs == {"data": future}


# --------------------------------------------------------------------------- simple modes


def test_one_to_all_gives_every_rank_every_argument():
    args, kwargs = dispatch(Dispatch.ONE_TO_ALL, FakeGroup(3), "x", n=1)
    assert args == (["x", "x", "x"],)
    assert kwargs == {"n": [1, 1, 1]}


def test_one_to_all_collects_the_list_of_outputs():
    assert collect(Dispatch.ONE_TO_ALL, FakeGroup(3), [0, 1, 2]) == [0, 1, 2]


def test_rank_zero_gives_every_rank_every_argument():
    args, kwargs = dispatch(Dispatch.RANK_ZERO, FakeGroup(2), "x", n=1)
    assert args == (["x", "x"],)
    assert kwargs == {"n": [1, 1]}


def test_rank_zero_collects_rank_zeros_output():
    assert collect(Dispatch.RANK_ZERO, FakeGroup(3), ["r0", "r1", "r2"]) == "r0"


def test_all_to_all_gives_rank_r_entry_r():
    args, kwargs = dispatch(Dispatch.ALL_TO_ALL, FakeGroup(2), ("a", "b"), n=[1, 2])
    assert args == (["a", "b"],)
    assert kwargs == {"n": [1, 2]}


def test_all_to_all_rejects_an_argument_that_is_not_per_rank():
    with pytest.raises(DispatchError, match="positional argument 0 has type int.*Dispatch.ONE_TO_ALL"):
        dispatch(Dispatch.ALL_TO_ALL, FakeGroup(2), 5)


def test_all_to_all_rejects_a_list_of_the_wrong_length():
    with pytest.raises(DispatchError, match="argument 'n' has length 3, the group has world_size=2"):
        dispatch(Dispatch.ALL_TO_ALL, FakeGroup(2), n=[1, 2, 3])


def test_dp_compute_gives_rank_r_entry_r():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE, FakeGroup(3), [10, 11, 12], seed=(0, 1, 2))
    assert args == ([10, 11, 12],)
    assert kwargs == {"seed": [0, 1, 2]}


def test_dp_compute_error_names_the_argument_its_length_and_world_size():
    with pytest.raises(DispatchError, match="DP_COMPUTE.*argument 'seed' has length 2.*world_size=4"):
        dispatch(Dispatch.DP_COMPUTE, FakeGroup(4), [0, 1, 2, 3], seed=[0, 1])


def test_dp_compute_collects_the_list_of_outputs():
    assert collect(Dispatch.DP_COMPUTE, FakeGroup(2), ("r0", "r1")) == ["r0", "r1"]


# --------------------------------------------------------------------------- DP_COMPUTE_PROTO


def test_dp_compute_proto_splits_an_even_batch_without_padding():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), rows(0, 1, 2, 3))
    assert [column(piece) for piece in args[0]] == [[0, 1], [2, 3]]
    assert kwargs == {PADDING_SIZE_KEY: 0}


def test_dp_compute_proto_pads_an_uneven_batch_by_repeating_rows_from_the_start():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(4), rows(0, 1, 2, 3, 4, 5))
    assert [column(piece) for piece in args[0]] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert kwargs[PADDING_SIZE_KEY] == 2


def test_dp_compute_proto_pads_a_batch_smaller_than_world_size():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(4), rows(7))
    assert [column(piece) for piece in args[0]] == [[7], [7], [7], [7]]
    assert kwargs[PADDING_SIZE_KEY] == 3


def test_dp_compute_proto_splits_keyword_arguments_too():
    _, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), data=rows(0, 1, 2))
    assert [column(piece) for piece in kwargs["data"]] == [[0, 1], [2, 0]]
    assert kwargs[PADDING_SIZE_KEY] == 1


def test_dp_compute_proto_does_not_modify_the_callers_batch():
    data = rows(0, 1, 2)
    dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), data)
    assert column(data) == [0, 1, 2]


def test_dp_compute_proto_rejects_a_non_batch_argument():
    with pytest.raises(DispatchError, match="argument 'scale' has type float"):
        dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), rows(0, 1), scale=0.5)


def test_dp_compute_proto_rejects_batches_of_different_lengths():
    with pytest.raises(DispatchError, match="positional argument 0: 3, positional argument 1: 2"):
        dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), rows(0, 1, 2), rows(0, 1))


def test_dp_compute_proto_rejects_an_empty_batch():
    with pytest.raises(DispatchError, match="got batches with 0 rows"):
        dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), DataProto.from_dict({"a": torch.zeros(0)}))


def test_dp_compute_proto_pads_and_splits_a_tensordict():
    td = TensorDict({"a": torch.arange(3)}, batch_size=[3])
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), td)
    assert [piece["a"].tolist() for piece in args[0]] == [[0, 1], [2, 0]]
    assert kwargs[PADDING_SIZE_KEY] == 1


def test_dp_compute_proto_tensordict_pieces_do_not_share_the_callers_storage():
    td = TensorDict({"a": torch.arange(4)}, batch_size=[4])
    args, _ = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), td)
    args[0][1]["a"] += 100
    assert td["a"].tolist() == [0, 1, 2, 3]


def test_dp_compute_proto_chunks_a_data_proto_future_without_padding():
    future = DataProtoFuture(futures=["part-0", "part-1"])
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), future)
    assert [piece.futures for piece in args[0]] == [["part-0"], ["part-1"]]
    assert kwargs[PADDING_SIZE_KEY] == 0


def test_dp_compute_proto_collect_concatenates_data_protos_in_rank_order():
    out = collect(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), [rows(0, 1), rows(2, 3)])
    assert column(out) == [0, 1, 2, 3]


def test_dp_compute_proto_collect_concatenates_tensordicts():
    parts = [
        TensorDict({"a": torch.tensor([0])}, batch_size=[1]),
        TensorDict({"a": torch.tensor([1])}, batch_size=[1]),
    ]
    out = collect(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), parts)
    assert out["a"].tolist() == [0, 1]


class _UnboundFuture(distributed.Future):
    """A ``distributed.Future`` with no client behind it, for type-based dispatch only."""

    def __init__(self, key):
        self._key = key

    def __del__(self):
        pass

    def __repr__(self):
        return f"_UnboundFuture({self._key!r})"


def test_dp_compute_proto_collect_wraps_dask_futures_in_a_data_proto_future():
    outputs = [_UnboundFuture("r0"), _UnboundFuture("r1")]
    out = collect(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), outputs)
    assert isinstance(out, DataProtoFuture)
    assert list(out.futures) == outputs


def test_dp_compute_proto_collect_rejects_mixed_outputs():
    with pytest.raises(TypeError, match="rank output 0: DataProto, rank output 1: dict"):
        collect(Dispatch.DP_COMPUTE_PROTO, FakeGroup(2), [rows(0), {"a": 1}])


def test_dp_compute_proto_with_func_sends_the_function_to_every_rank():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, FakeGroup(2), len, rows(0, 1, 2, 3, 4))
    assert args[0] == [len, len]
    assert [column(piece) for piece in args[1]] == [[0, 1, 2], [3, 4]]
    assert kwargs == {}


def test_dp_compute_proto_with_func_needs_a_callable_first():
    with pytest.raises(DispatchError, match="callable as first positional argument, got DataProto"):
        dispatch(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, FakeGroup(2), rows(0, 1))


def test_dp_compute_metric_pads_and_splits_but_asks_for_no_unpadding():
    args, kwargs = dispatch(Dispatch.DP_COMPUTE_METRIC, FakeGroup(2), rows(0, 1, 2))
    assert [column(piece) for piece in args[0]] == [[0, 1], [2, 0]]
    assert kwargs == {}


def test_dp_compute_metric_collects_the_list_of_outputs():
    assert collect(Dispatch.DP_COMPUTE_METRIC, FakeGroup(2), [{"loss": 1.0}, {"loss": 2.0}]) == [
        {"loss": 1.0},
        {"loss": 2.0},
    ]


# --------------------------------------------------------------------------- device meshes


class MeshWorker(Worker):
    """verl's ``tests/single_controller/test_device_mesh_register.py`` actor, without torch.distributed.

    Eight ranks laid out row-major as ``init_device_mesh`` does: "infer" is dp=2 x tp=4,
    "train" is pp=2 x dp=2 x tp=2.
    """

    def __init__(self):
        super().__init__()
        rank = self.rank
        self.infer = {"dp": rank // 4, "tp": rank % 4}
        self.train = {"pp": rank // 4, "dp": rank // 2 % 2, "tp": rank % 2}
        self._register_dispatch_collect_info(
            "infer", dp_rank=self.infer["dp"], is_collect=self.infer["tp"] == 0
        )
        self._register_dispatch_collect_info(
            "train", dp_rank=self.train["dp"], is_collect=self.train["tp"] == 0 and self.train["pp"] == 1
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"))
    def generate(self, data):
        batch = data.batch if isinstance(data, DataProto) else data
        batch["a"] += (self.infer["tp"] + 1) * self.infer["dp"]
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def train_step(self, data):
        batch = data.batch if isinstance(data, DataProto) else data
        tp, dp, pp = self.train["tp"], self.train["dp"], self.train["pp"]
        batch["a"] += (tp + 1) * (dp + 2) * (pp + 3)
        return data


def as_kind(kind, values):
    data = rows(*values)
    return data if kind == "DataProto" else data.batch


def a_column(out):
    return (out.batch if isinstance(out, DataProto) else out)["a"].tolist()


@pytest.mark.parametrize("kind", ["DataProto", "TensorDict"])
def test_mesh_dispatch_dp2_tp4_collects_tp_rank_zero(kind, monkeypatch):
    group = InProcessGroup(MeshWorker, 8, monkeypatch)
    out = group.call("generate", as_kind(kind, [1, 2]))
    assert group._dispatch_info["infer"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert group._collect_info["infer"] == [True, False, False, False, True, False, False, False]
    assert a_column(out) == [1, 3]


@pytest.mark.parametrize("kind", ["DataProto", "TensorDict"])
def test_mesh_dispatch_pp2_dp2_tp2_collects_tp0_on_last_pp_stage(kind, monkeypatch):
    group = InProcessGroup(MeshWorker, 8, monkeypatch)
    out = group.call("train_step", as_kind(kind, [3, 4]))
    assert group._dispatch_info["train"] == [0, 0, 1, 1, 0, 0, 1, 1]
    # rank 4 (pp1 dp0 tp0): 3 + 1*2*4 = 11; rank 6 (pp1 dp1 tp0): 4 + 1*3*4 = 16
    assert a_column(out) == [11, 16]


def test_mesh_info_is_queried_once_and_cached_on_the_group():
    group = FakeGroup(4, dp_ranks={"m": [0, 0, 1, 1]}, collect={"m": [True, False, True, False]})
    mode = make_nd_compute_dataproto_dispatch_fn("m")
    for _ in range(2):
        mode["dispatch_fn"](group, rows(0, 1))
        mode["collect_fn"](group, [rows(0), rows(9), rows(1), rows(9)])
    assert group.queries == [("dispatch", "m"), ("collect", "m")]


def test_mesh_dispatch_gives_each_rank_the_piece_of_its_dp_rank():
    group = FakeGroup(4, dp_ranks={"m": [1, 0, 1, 0]})
    args, _ = make_nd_compute_dataproto_dispatch_fn("m")["dispatch_fn"](group, rows(5, 6, 7, 8))
    assert [column(piece) for piece in args[0]] == [[7, 8], [5, 6], [7, 8], [5, 6]]


def test_mesh_collect_keeps_collect_ranks_in_rank_order():
    group = FakeGroup(4, collect={"m": [False, True, False, True]})
    out = make_nd_compute_dataproto_dispatch_fn("m")["collect_fn"](
        group, [rows(0), rows(1), rows(2), rows(3)]
    )
    assert column(out) == [1, 3]


def test_mesh_dispatch_rejects_dp_ranks_with_a_gap():
    group = FakeGroup(2, dp_ranks={"m": [0, 2]})
    with pytest.raises(DispatchError, match=r"dp ranks per rank \[0, 2\] must cover 0..dp_size-1"):
        make_nd_compute_dataproto_dispatch_fn("m")["dispatch_fn"](group, rows(0, 1))


def test_mesh_dispatch_rejects_dp_ranks_for_the_wrong_number_of_ranks():
    group = FakeGroup(4, dp_ranks={"m": [0, 1]})
    with pytest.raises(DispatchError, match="got dp ranks for 2 ranks, the group has 4"):
        make_nd_compute_dataproto_dispatch_fn("m")["dispatch_fn"](group, rows(0, 1))


def test_mesh_dispatch_rejects_a_non_batch_argument():
    group = FakeGroup(2, dp_ranks={"m": [0, 1]})
    with pytest.raises(DispatchError, match="positional argument 0 has type list"):
        make_nd_compute_dataproto_dispatch_fn("m")["dispatch_fn"](group, [1, 2])
    assert group.queries == []


def test_mesh_collect_needs_at_least_one_collect_rank():
    group = FakeGroup(2, collect={"m": [False, False]})
    with pytest.raises(ValueError, match="no rank is marked is_collect=True"):
        make_nd_compute_dataproto_dispatch_fn("m")["collect_fn"](group, [rows(0), rows(1)])


def test_mesh_dispatch_functions_pickle():
    mode = pickle.loads(pickle.dumps(make_nd_compute_dataproto_dispatch_fn("train")))
    assert isinstance(mode["dispatch_fn"], functools.partial)
    assert mode["collect_fn"].args == ("train",)


# --------------------------------------------------------------------------- registry


def test_predefined_dispatch_fn_of_a_member_has_dispatch_and_collect():
    fns = get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)
    assert sorted(fns) == ["collect_fn", "dispatch_fn"]
    assert fns["dispatch_fn"](FakeGroup(2), 1) == (([1, 1],), {})


def test_predefined_dispatch_fn_of_a_dict_mode_is_the_dict_itself():
    mode = make_nd_compute_dataproto_dispatch_fn("m")
    assert get_predefined_dispatch_fn(mode) is mode


def test_predefined_dispatch_fn_rejects_other_types():
    with pytest.raises(TypeError, match="got str"):
        get_predefined_dispatch_fn("ONE_TO_ALL")


def test_predefined_dispatch_fn_of_a_member_without_functions_is_an_error():
    member = Dispatch.register("TEST_WITHOUT_FUNCTIONS")
    with pytest.raises(ValueError, match="no dispatch/collect functions are registered"):
        get_predefined_dispatch_fn(member)


def _dispatch_doubled(worker_group, value):
    return ([value * 2] * worker_group.world_size,), {}


def _collect_sum(worker_group, outputs):
    return sum(outputs)


def test_register_dispatch_mode_adds_a_usable_mode():
    mode = register_dispatch_mode("test_doubled", _dispatch_doubled, _collect_sum)
    assert mode is Dispatch.TEST_DOUBLED

    @register(dispatch_mode=Dispatch.TEST_DOUBLED)
    def method(self, value):
        return value

    fns = get_predefined_dispatch_fn(get_registered_method(method).dispatch_mode)
    assert fns["dispatch_fn"](FakeGroup(3), 5) == (([10, 10, 10],), {})
    assert fns["collect_fn"](FakeGroup(3), [1, 2, 3]) == 6


def test_register_dispatch_mode_rejects_an_existing_mode():
    with pytest.raises(ValueError, match="Dispatch.DP_COMPUTE already exists"):
        register_dispatch_mode("DP_COMPUTE", _dispatch_doubled, _collect_sum)


def test_update_dispatch_mode_replaces_the_functions():
    mode = register_dispatch_mode("test_updated", _dispatch_doubled, _collect_sum)
    update_dispatch_mode(mode, _dispatch_doubled, max)
    assert get_predefined_dispatch_fn(mode)["collect_fn"] is max


def test_update_dispatch_mode_needs_a_registered_mode():
    member = Dispatch.register("TEST_NOT_YET_REGISTERED")
    with pytest.raises(ValueError, match="is not registered; use register_dispatch_mode"):
        update_dispatch_mode(member, _dispatch_doubled, _collect_sum)
