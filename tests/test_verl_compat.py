"""verl code on daskwg unchanged: issue 16's "What fails today", one test per item, same values.

The workers (``verl_workers.py``) use verl's own ``Worker``, ``register``, ``Dispatch``,
``Execute`` and ``DataProto`` (verl 0.9.1 installed with ``--no-deps``, real ray).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import verl
from dask.sizeof import sizeof
from distributed.client import FutureCancelledError
from verl.single_controller.base.decorator import Dispatch as VerlDispatch
from verl_workers import (
    DaskwgRegistersWithVerlModes,
    RemoteVerlScaler,
    VerlPair,
    VerlScaler,
    add_one,
    double_rows,
)

import daskwg
from daskwg import ClassWithInitArgs, DataProtoFuture, WorkerGroup
from daskwg.dispatch.register import get_registered_method
from daskwg.foreign import to_native
from daskwg.serialization import pickling as serialization
from daskwg.verl import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    merge_resource_pool,
    split_resource_pool,
)


def batch(rows: int) -> verl.DataProto:
    return verl.DataProto.from_dict({"x": torch.arange(float(rows))})


@pytest.fixture
def scaler2(client4):
    with WorkerGroup(client4, ClassWithInitArgs(VerlScaler, factor=10.0), world_size=2) as wg:
        yield wg


# ------------------------------------------------ 1. verl's registration is read


def test_verl_registered_methods_and_verl_pre_registered_methods_are_bound(scaler2):
    assert scaler2.method_names == [
        "_query_collect_info",
        "_query_dispatch_info",
        "add_rank_zero",
        "available_addr_port",
        "env",
        "execute_func_rank_zero",
        "execute_with_func_generator",
        "fail",
        "ray_node_ip",
        "rows_seen",
        "scale",
        "scale_later",
        "scale_on_mesh",
        "sleep",
        "type_seen",
        "whoami",
    ]


def test_verl_worker_init_finds_its_rank_variables(scaler2):
    assert scaler2.whoami() == [(0, 2), (1, 2)]


def test_verl_dp_compute_proto_method_scales_a_verl_batch(scaler2):
    out = scaler2.scale(batch(4))
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0, 20.0, 30.0]))


def test_a_verl_batch_made_from_a_padded_future_comes_back_without_the_padding_rows(scaler2):
    # The consuming rank unpads what verl's worker code returns (verl's own DataProto), as
    # it does daskwg's: 3 rows on 2 ranks travel as 4, one of them a copy of row 0.
    for rows in (3, 5):
        out = scaler2.type_seen(scaler2.scale_later(batch(rows)))
        assert len(out) == rows


def test_verl_query_dispatch_info_is_bound(scaler2):
    assert scaler2._query_dispatch_info("train") == [0, 1]


def test_verl_execute_func_rank_zero_gives_rank_zero_the_arguments_as_given(scaler2):
    torch.testing.assert_close(
        scaler2.execute_func_rank_zero(add_one, torch.ones(2, 2)), torch.ones(2, 2) + 1
    )


def test_verl_execute_with_func_generator_splits_the_batch(scaler2):
    out = scaler2.execute_with_func_generator(double_rows, batch(4))
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_verl_all_to_all_rank_zero_method_takes_scalars(scaler2):
    assert scaler2.add_rank_zero(x=1, y=2) == 13


# ------------------------------------------------ 2. daskwg.register takes verl's members


def test_daskwg_register_maps_verl_members_by_name():
    info = get_registered_method(DaskwgRegistersWithVerlModes.rank_plus)
    assert info.dispatch_mode is daskwg.Dispatch.ONE_TO_ALL
    assert info.execute_mode is daskwg.Execute.ALL


def test_daskwg_method_registered_with_verl_member_runs_on_every_rank(client4):
    with WorkerGroup(client4, DaskwgRegistersWithVerlModes, world_size=2) as wg:
        assert wg.rank_plus(10) == [10, 11]


def test_verl_member_without_daskwg_counterpart_is_refused():
    with pytest.raises(ValueError, match="DIRECT_ROLLOUT_METHOD"):
        daskwg.register(dispatch_mode=VerlDispatch.DIRECT_ROLLOUT_METHOD)


# ------------------------------------------------ 3. @ray.remote classes are unwrapped


def test_class_with_init_args_unwraps_a_ray_remote_class():
    cia = ClassWithInitArgs(RemoteVerlScaler, factor=2.0)
    assert cia.cls is RemoteVerlScaler.__ray_actor_class__
    assert cia.kwargs == {"factor": 2.0}


def test_group_of_a_ray_remote_class_runs_it(client4):
    with WorkerGroup(client4, ClassWithInitArgs(RemoteVerlScaler, factor=2.0), world_size=2) as wg:
        assert wg.whoami() == [(0, 2), (1, 2)]


# ------------------------------------------------ 4. verl's DataProto travels as itself


def test_verl_batch_is_padded_split_and_returned_as_verl_dataproto(scaler2):
    out = scaler2.scale(batch(5))
    assert type(out) is verl.DataProto
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0, 20.0, 30.0, 40.0]))


def test_ranks_receive_verl_dataproto_pieces(scaler2):
    out = scaler2.type_seen(batch(3))
    assert list(out.non_tensor_batch["type"]) == ["verl.protocol.DataProto"] * 3


def test_future_of_verl_parts_gets_a_verl_dataproto(scaler2):
    future = scaler2.scale_later(batch(5))
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert type(out) is verl.DataProto
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0, 20.0, 30.0, 40.0]))


def test_future_of_verl_parts_reaches_the_next_call_as_verl_dataproto(scaler2):
    out = scaler2.type_seen(scaler2.scale_later(batch(4)))
    assert list(out.non_tensor_batch["type"]) == ["verl.protocol.DataProto"] * 4


def test_verl_mesh_dispatch_splits_a_verl_batch_by_dp_rank(scaler2):
    out = scaler2.scale_on_mesh(batch(4))
    assert type(out) is verl.DataProto
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0, 20.0, 30.0]))


def test_verl_metric_dispatch_gives_each_rank_a_verl_piece(scaler2):
    assert scaler2.rows_seen(batch(4)) == [("verl.protocol", 2), ("verl.protocol", 2)]


def test_verl_dataproto_pickles_its_tensors_out_of_band_without_copying_them():
    data = batch(1024)
    packed = serialization.dumps(data)
    assert np.frombuffer(packed.buffers[0], dtype=np.uint8).ctypes.data == data.batch["x"].data_ptr()
    loaded = serialization.loads(packed)
    assert type(loaded) is verl.DataProto
    assert torch.equal(loaded.batch["x"], data.batch["x"])


def test_dask_sizeof_counts_the_tensor_bytes_of_a_verl_dataproto():
    assert sizeof(batch(1024)) >= 1024 * 4


def test_daskwg_imports_neither_verl_nor_ray():
    code = "import sys, daskwg, daskwg.verl; print(sorted(m for m in ('verl', 'ray') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_conversion_to_daskwg_dataproto_shares_the_tensors():
    data = batch(3)
    assert to_native(data).batch is data.batch
    assert to_native(data).meta_info is data.meta_info


# ------------------------------------------------ 5. the environment verl's workers expect


def test_verl_rank_variables_are_set_as_verl_sets_them(scaler2):
    assert scaler2.env("WG_PREFIX") == [scaler2.name, scaler2.name]
    assert scaler2.env("WG_BACKEND") == ["ray", "ray"]
    assert scaler2.env("RAY_LOCAL_WORLD_SIZE") == ["2", "2"]
    assert scaler2.env("RAY_LOCAL_RANK") == ["0", "1"]


def test_verl_get_available_master_addr_port_gives_node_address_and_a_free_port(scaler2):
    node_ips = scaler2.ray_node_ip()
    for (addr, port), node_ip in zip(scaler2.available_addr_port(), node_ips):
        assert addr == node_ip
        with socket.socket() as sock:
            sock.bind(("", int(port)))  # free on the rank's host (the same machine here)


# ------------------------------------------------ 6. verl's own tests: the three gaps


def test_from_detached_reattaches_by_worker_names_to_a_group_not_built_detached(client4):
    cia = RayClassWithInitArgs(cls=VerlPair, x=2)
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), cia, name_prefix="worker_group_basic")
    try:
        again = RayWorkerGroup.from_detached(worker_names=wg.worker_names, ray_cls_with_init=cia)
        assert again.worker_names == wg.worker_names
        assert again.add_rank_zero(x=1, y=2) == 5
    finally:
        wg.shutdown()


def test_ray_worker_group_all_to_all_splits_lists_and_broadcasts_scalars(client4):
    wg = RayWorkerGroup(RayResourcePool([4]), RayClassWithInitArgs(cls=VerlPair, x=2))
    try:
        assert wg.add(x=[1, 2, 3, 4], y=[5, 6, 7, 8]) == [8, 10, 12, 14]
        assert wg.add(x=1, y=2) == [5, 5, 5, 5]
    finally:
        wg.shutdown()


def test_native_group_all_to_all_keeps_refusing_scalars(client4):
    with WorkerGroup(client4, ClassWithInitArgs(VerlPair, x=2), world_size=2) as wg:
        with pytest.raises(daskwg.DispatchError):
            wg.add(x=1, y=2)


def test_second_set_dispatch_collect_for_a_mesh_raises_assertion_error(monkeypatch):
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "12345",
    }.items():
        monkeypatch.setenv(key, value)
    actor = daskwg.Worker()
    actor._register_dispatch_collect_info(mesh_name="actor", dp_rank=1, is_collect=False)
    fused = daskwg.Worker()
    fused.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())
    with pytest.raises(AssertionError):
        fused.set_dispatch_collect(mesh_name="actor", **actor.get_dispatch_collect())


def test_ray_local_world_size_is_the_ranks_on_the_host(client4):
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(cls=VerlScaler, factor=1.0))
    try:
        assert wg.env("RAY_LOCAL_WORLD_SIZE") == ["4", "4", "4", "4"]
        assert wg.env("WG_PREFIX") == [wg.name_prefix] * 4
    finally:
        wg.shutdown()


# ------------------------------------------------ the verl-shaped module


def test_ray_resource_pools_hold_disjoint_workers(client4):
    first, second = RayResourcePool([2]), RayResourcePool([2])
    assert set(first.pool.workers).isdisjoint(second.pool.workers)
    with pytest.raises(daskwg.WorldSizeError, match="held by other live pools"):
        RayResourcePool([1]).pool  # noqa: B018


def test_split_resource_pool_cuts_consecutive_workers(client4):
    whole = RayResourcePool([4])
    one, three = split_resource_pool(whole, [1, 3])
    assert (one.world_size, three.world_size) == (1, 3)
    assert one.pool.workers + three.pool.workers == whole.pool.workers


def test_merge_resource_pool_holds_the_workers_of_both(client4):
    rm, ref = RayResourcePool([2], name_prefix="rm"), RayResourcePool([2], name_prefix="ref")
    merged = merge_resource_pool(rm, ref)
    assert merged.world_size == 4
    assert sorted(merged.pool.workers) == sorted(rm.pool.workers + ref.pool.workers)


def test_ray_worker_group_of_worker_names_reattaches_to_the_live_group(client4):
    wg = RayWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(cls=VerlPair, x=2), name_prefix="names")
    try:
        again = RayWorkerGroup(resource_pool=None, worker_names=wg.worker_names)
        assert again.workers == wg.workers
        assert again.add(x=[1, 2], y=[3, 4]) == [6, 8]
    finally:
        wg.shutdown()


def test_from_detached_of_unknown_worker_names_is_refused(client4):
    with pytest.raises(ValueError, match="no live group named 'nopeVerlPair'"):
        RayWorkerGroup.from_detached(worker_names=["nopeVerlPair_0:0"])


def test_role_groups_of_a_ray_worker_group_keep_verls_all_to_all(client4):
    colocated = create_colocated_worker_cls({"pair": RayClassWithInitArgs(cls=VerlPair, x=2)})
    wg = RayWorkerGroup(RayResourcePool([2]), colocated)
    try:
        pair = wg.spawn(["pair"])["pair"]
        assert pair.add(x=1, y=2) == [5, 5]
        assert pair.add(x=[1, 2], y=[3, 4]) == [6, 8]
    finally:
        wg.shutdown()


def test_ray_worker_group_future_is_also_verl_dataproto_future(client4):
    wg = RayWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(cls=VerlScaler, factor=3.0))
    try:
        future = wg.scale_later(batch(3))
        assert isinstance(future, verl.protocol.DataProtoFuture)
        assert isinstance(future, DataProtoFuture)
        assert torch.equal(future.get().batch["y"], torch.tensor([0.0, 3.0, 6.0]))
    finally:
        wg.shutdown()


# ------------------------------------------------ daskwg.get


def test_get_resolves_a_list_of_futures_in_order(scaler2):
    assert daskwg.get(scaler2.execute_all_async("whoami")) == [(0, 2), (1, 2)]


def test_get_keeps_the_nesting(scaler2):
    first, second = scaler2.execute_all_async("whoami")
    assert daskwg.get([[first], (second,)]) == [[(0, 2)], ((1, 2),)]


def test_get_materialises_a_dataproto_future(scaler2):
    out = daskwg.get(scaler2.scale_later(batch(2)))
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0]))


def test_get_raises_rank_error_for_a_rank_that_raised(scaler2):
    with pytest.raises(daskwg.RankError, match="rank 1 fails on purpose") as info:
        daskwg.get(scaler2.execute_all_async("fail", 1))
    assert info.value.rank == 1


def test_get_refuses_what_is_not_a_future():
    with pytest.raises(TypeError, match="got int"):
        daskwg.get([5])


def test_get_raises_call_timeout_error_when_the_active_deadline_passes(scaler2):
    refs = scaler2.execute_all_async("sleep", 2.0)
    with daskwg.deadline(0.3), pytest.raises(daskwg.CallTimeoutError) as info:
        daskwg.get(refs)
    assert info.value.ranks == {0: "running", 1: "running"}


def test_get_bounds_a_future_no_group_made_by_the_active_deadline(client4):
    future = client4.submit(time.sleep, 1.5, pure=False)
    with daskwg.deadline(0.2), pytest.raises(daskwg.CallTimeoutError, match="daskwg.get passed its deadline"):
        daskwg.get([future])


def test_get_of_a_cancelled_future_raises_a_daskwg_error(client4):
    future = client4.submit(time.sleep, 1.0, pure=False)
    future.cancel()
    with pytest.raises(daskwg.WorkerGroupError, match="was cancelled") as info:
        daskwg.get(future)
    assert not isinstance(info.value, FutureCancelledError)


def test_get_of_a_cancelled_group_call_raises_a_daskwg_error(scaler2):
    refs = scaler2.execute_all_async("sleep", 0.5)
    refs[1].cancel()
    with pytest.raises(daskwg.WorkerGroupError, match="cancelled") as info:
        daskwg.get(refs)
    assert not isinstance(info.value, FutureCancelledError)
