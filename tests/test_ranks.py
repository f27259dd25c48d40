"""Rank assignment and device visibility, with GPUs simulated by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest
from conftest import gpu_spec_cluster, wait_for_workers
from distributed import Client
from workers import AddWorker

from daskwg import ResourcePool, WorkerGroup
from daskwg.groups.pool import WorkerSlot, rank_order


def _slot(name: str, device: str | None, host: str = "10.0.0.1") -> WorkerSlot:
    return WorkerSlot(address=f"tcp://{host}:{name}", host=host, name=name, device=device, server_id=name)


def test_numeric_device_ids_order_as_numbers():
    slots = [_slot("a", "10"), _slot("b", "2"), _slot("c", "0"), _slot("d", "1")]
    assert [s.device for s in rank_order(slots)] == ["0", "1", "2", "10"]


def test_hosts_order_before_devices_and_names_break_ties():
    slots = [_slot("w1", "0", host="10.0.0.2"), _slot("w3", None), _slot("w2", None), _slot("w0", "1")]
    assert [s.name for s in rank_order(slots)] == ["w0", "w2", "w3", "w1"]


def test_uuid_device_ids_pass_through_and_sort_after_numbers():
    slots = [_slot("a", "GPU-b3c1"), _slot("b", "MIG-0a"), _slot("c", "3")]
    assert [s.device for s in rank_order(slots)] == ["3", "GPU-b3c1", "MIG-0a"]


@pytest.fixture(scope="module")
def rotated_gpu_client():
    # dask-cuda rotates the list so each worker's first entry is its own GPU.
    devices = ["2,3,0,1", "0,1,2,3", "3,0,1,2", "1,2,3,0"]
    with gpu_spec_cluster(devices) as cluster, Client(cluster) as client:
        wait_for_workers(client, 4, timeout=60)
        yield client


def test_ranks_follow_the_gpu_each_worker_owns(rotated_gpu_client):
    with WorkerGroup(rotated_gpu_client, AddWorker, world_size=4) as wg:
        devices = wg.execute_all_sync("get_cuda_visible_devices")
    assert [d.split(",")[0] for d in devices] == ["0", "1", "2", "3"]


def test_visible_devices_are_never_rewritten(rotated_gpu_client):
    with WorkerGroup(rotated_gpu_client, AddWorker, world_size=4) as wg:
        devices = wg.execute_all_sync("get_cuda_visible_devices")
    assert sorted(devices) == ["0,1,2,3", "1,2,3,0", "2,3,0,1", "3,0,1,2"]


def test_pool_with_explicit_workers_keeps_the_rank_order(rotated_gpu_client):
    addresses = list(rotated_gpu_client.scheduler_info(n_workers=-1)["workers"])
    pool = ResourcePool(rotated_gpu_client, workers=list(reversed(addresses)))
    devices = [s.device for s in pool.slots]
    assert devices == ["0", "1", "2", "3"]


def test_local_ranks_count_ranks_on_the_same_host(rotated_gpu_client):
    with WorkerGroup(rotated_gpu_client, AddWorker, world_size=3) as wg:
        envs = wg.environment()
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
