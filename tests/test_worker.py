"""Specification of ``daskwg.worker``: a Worker built in-process from environment variables."""

from __future__ import annotations

import os

import pytest

from daskwg.dispatch.register import Dispatch, Execute, get_registered_method
from daskwg.worker import DistGlobalInfo, DistRankInfo, Worker, _normalize_visible_devices

_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)


@pytest.fixture
def env():
    """``os.environ`` holding rank 1 of 4, restored afterwards (Worker may rewrite it)."""
    saved = {key: os.environ.get(key) for key in _KEYS}
    for key in _KEYS:
        os.environ.pop(key, None)
    os.environ.update(RANK="1", WORLD_SIZE="4", MASTER_ADDR="10.0.0.7", MASTER_PORT="29500")
    yield os.environ
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_worker(env, **values):
    env.update(values)
    return Worker()


# --------------------------------------------------------------------------- environment


def test_worker_reads_its_place_in_the_group_from_the_environment(env):
    worker = make_worker(env, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert (worker.rank, worker.world_size, worker.local_rank, worker.local_world_size) == (1, 4, 1, 2)


def test_local_rank_and_local_world_size_default_to_zero_and_one(env):
    worker = Worker()
    assert (worker.local_rank, worker.local_world_size) == (0, 1)


def test_master_addr_and_port_are_returned_as_strings(env):
    assert Worker().get_master_addr_port() == ("10.0.0.7", "29500")


def test_master_addr_and_port_are_none_when_unset(env):
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    assert Worker().get_master_addr_port() == (None, None)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE"])
def test_missing_rank_or_world_size_says_which_and_how_to_fix_it(env, missing):
    del env[missing]
    with pytest.raises(RuntimeError, match=f"{missing} is not set.*built by a WorkerGroup.*set {missing}"):
        Worker()


def test_non_integer_rank_is_a_value_error(env):
    with pytest.raises(ValueError, match="RANK must be an integer, got 'one'"):
        make_worker(env, RANK="one")


def test_rank_outside_the_world_is_a_value_error(env):
    with pytest.raises(ValueError, match=r"RANK=4 and WORLD_SIZE=4: RANK must be in \[0, WORLD_SIZE\)"):
        make_worker(env, RANK="4")


def test_env_keys_are_verls_with_cuda_visible_devices():
    assert Worker.env_keys() == [
        "WORLD_SIZE",
        "RANK",
        "LOCAL_WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
    ]


def test_subclass_that_skips_super_init_gets_a_clear_error():
    class Forgetful(Worker):
        def __init__(self):
            self.lr = 0.1

    with pytest.raises(AttributeError, match=r"Forgetful.__init__ must call super\(\).__init__\(\)"):
        _ = Forgetful().rank


def test_subclass_reaches_the_state_without_name_mangling(env):
    class Trainer(Worker):
        def describe(self):
            return self._rank, self._world_size, sorted(self._dispatch_dp_rank)

    trainer = Trainer()
    trainer._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    assert trainer.describe() == (1, 4, ["actor"])


# --------------------------------------------------------------------------- visible devices


def test_cuda_visible_devices_reads_not_set_when_unset(env):
    assert Worker().get_cuda_visible_devices() == "not set"


def test_cuda_visible_devices_are_passed_through_as_opaque_strings(env):
    mig = "MIG-4b7e2f1c-9d2a-5e6f-8a7b-1c2d3e4f5a6b,GPU-0f1e2d3c"
    assert make_worker(env, CUDA_VISIBLE_DEVICES=mig).get_cuda_visible_devices() == mig


def test_cuda_visible_devices_argument_sets_the_variable(env):
    worker = Worker(cuda_visible_devices="3")
    assert worker.get_cuda_visible_devices() == "3"
    assert env["CUDA_VISIBLE_DEVICES"] == "3"


def test_hip_visible_devices_becomes_cuda_visible_devices():
    environ = {"HIP_VISIBLE_DEVICES": "2,3"}
    _normalize_visible_devices(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_hip_equal_to_cuda_visible_devices_is_folded():
    environ = {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}
    _normalize_visible_devices(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "1"}


def test_hip_and_cuda_visible_devices_that_differ_are_named_in_the_error():
    environ = {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match="HIP_VISIBLE_DEVICES='0' and CUDA_VISIBLE_DEVICES='1' disagree"):
        _normalize_visible_devices(environ)
    assert environ == {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}


def test_rocr_visible_devices_alone_becomes_cuda_visible_devices():
    environ = {"ROCR_VISIBLE_DEVICES": "GPU-6a0b5c1d"}
    _normalize_visible_devices(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "GPU-6a0b5c1d"}


@pytest.mark.parametrize("other", ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"])
def test_rocr_with_cuda_or_hip_visible_devices_is_an_error(other):
    with pytest.raises(ValueError, match=f"ROCR_VISIBLE_DEVICES='0' is set together with {other}='1'"):
        _normalize_visible_devices({"ROCR_VISIBLE_DEVICES": "0", other: "1"})


def test_empty_visible_devices_count_as_unset_as_in_verl():
    environ = {"HIP_VISIBLE_DEVICES": "4", "CUDA_VISIBLE_DEVICES": ""}
    _normalize_visible_devices(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "4"}


def test_worker_applies_the_visible_device_rules_to_os_environ(env):
    worker = make_worker(env, HIP_VISIBLE_DEVICES="5")
    assert worker.get_cuda_visible_devices() == "5"
    assert "HIP_VISIBLE_DEVICES" not in env


def test_worker_raises_on_conflicting_visible_devices(env):
    with pytest.raises(ValueError, match="disagree"):
        make_worker(env, HIP_VISIBLE_DEVICES="0", CUDA_VISIBLE_DEVICES="1")


# --------------------------------------------------------------------------- device meshes


def test_registered_mesh_info_is_returned_by_the_queries(env):
    worker = Worker()
    worker._register_dispatch_collect_info("train", dp_rank=1, is_collect=False)
    assert worker._query_dispatch_info("train") == 1
    assert worker._query_collect_info("train") is False
    assert worker.query_collect_info("train") is False


def test_registering_a_mesh_twice_is_an_error(env):
    worker = Worker()
    worker._register_dispatch_collect_info("train", dp_rank=0, is_collect=True)
    with pytest.raises(ValueError, match="mesh 'train' is already registered on rank 1"):
        worker._register_dispatch_collect_info("train", dp_rank=1, is_collect=True)


def test_negative_dp_rank_is_an_error(env):
    with pytest.raises(ValueError, match="dp_rank must be >= 0, got -1"):
        Worker()._register_dispatch_collect_info("train", dp_rank=-1, is_collect=True)


def test_querying_an_unregistered_mesh_names_the_registered_ones(env):
    worker = Worker()
    worker._register_dispatch_collect_info("infer", dp_rank=0, is_collect=True)
    with pytest.raises(ValueError, match=r"mesh 'train' is not registered.*\['infer'\]"):
        worker._query_dispatch_info("train")


def test_get_dispatch_collect_returns_copies(env):
    worker = Worker()
    worker._register_dispatch_collect_info("actor", dp_rank=2, is_collect=True)
    info = worker.get_dispatch_collect()
    assert info == {"dispatch_dp_rank": {"actor": 2}, "collect_dp_rank": {"actor": True}}
    info["dispatch_dp_rank"]["actor"] = 9
    assert worker._query_dispatch_info("actor") == 2


def test_set_dispatch_collect_copies_another_workers_mesh_under_a_new_name(env):
    # verl's tests/single_controller/test_get_set_dispatch_collect_cpu.py
    ref, actor, fused = Worker(), Worker(), Worker()
    ref._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    fused.set_dispatch_collect("ref", **ref.get_dispatch_collect())
    fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    assert (fused._query_dispatch_info("ref"), fused._query_collect_info("ref")) == (0, True)
    assert (fused._query_dispatch_info("actor"), fused._query_collect_info("actor")) == (1, False)


def test_set_dispatch_collect_rejects_a_mesh_name_already_registered(env):
    actor, fused = Worker(), Worker()
    actor._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    with pytest.raises(ValueError, match="mesh 'actor' is already registered"):
        fused.set_dispatch_collect("actor", **actor.get_dispatch_collect())


def test_set_dispatch_collect_picks_the_named_mesh_among_several(env):
    source, fused = Worker(), Worker()
    source._register_dispatch_collect_info("infer", dp_rank=0, is_collect=True)
    source._register_dispatch_collect_info("train", dp_rank=3, is_collect=False)
    fused.set_dispatch_collect("train", **source.get_dispatch_collect())
    assert fused._query_dispatch_info("train") == 3


def test_set_dispatch_collect_rejects_several_meshes_none_named(env):
    source, fused = Worker(), Worker()
    source._register_dispatch_collect_info("infer", dp_rank=0, is_collect=True)
    source._register_dispatch_collect_info("train", dp_rank=3, is_collect=False)
    with pytest.raises(ValueError, match=r"one named 'ref', got meshes \['infer', 'train'\]"):
        fused.set_dispatch_collect("ref", **source.get_dispatch_collect())


# --------------------------------------------------------------------------- registered methods


def test_mesh_queries_are_registered_one_to_all():
    for method in (Worker._query_dispatch_info, Worker._query_collect_info):
        assert get_registered_method(method).dispatch_mode is Dispatch.ONE_TO_ALL


def test_execute_with_func_generator_is_registered_dp_compute_proto_with_func():
    info = get_registered_method(Worker.execute_with_func_generator)
    assert (info.dispatch_mode, info.execute_mode) == (Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Execute.ALL)


def test_execute_func_rank_zero_runs_on_rank_zero_only():
    info = get_registered_method(Worker.execute_func_rank_zero)
    assert (info.dispatch_mode, info.execute_mode) == (Dispatch.ONE_TO_ALL, Execute.RANK_ZERO)


def test_execute_with_func_generator_passes_the_worker_first(env):
    assert Worker().execute_with_func_generator(lambda worker, x: (worker.rank, x), "batch") == (1, "batch")


def test_execute_func_rank_zero_calls_the_function_with_the_arguments(env):
    assert Worker().execute_func_rank_zero(pow, 2, exp=5) == 32


# --------------------------------------------------------------------------- colocation and records


def test_fused_workers_are_found_by_name(env):
    fused, actor = Worker(), Worker()
    fused.fused_worker_dict["actor"] = actor
    assert fused.get_fused_worker_by_name("actor") is actor
    assert fused.get_fused_worker_by_name("critic") is None


def test_dist_info_records_hold_verls_fields():
    assert DistRankInfo(tp_rank=0, dp_rank=1, pp_rank=2, cp_rank=3).dp_rank == 1
    assert DistGlobalInfo(tp_size=2, dp_size=4, pp_size=1, cp_size=1).dp_size == 4
