"""Fault injection on real worker processes: lost workers, failing ranks, paused
workers, bad results, bad input. Detection times are printed (``pytest -s``); they
are measurements, never assertions."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from conftest import CLICluster, free_port, process_cluster, wait_for_workers
from dask.config import set as dask_config
from distributed import Client, Nanny, Scheduler, SpecCluster
from fault_workers import FaultWorker
from workers import AddWorker

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    DispatchError,
    GroupBrokenError,
    RankError,
    ResourcePool,
    WorkerGroup,
    WorkerLostError,
    WorldSizeError,
)
from daskwg.plugin.ports import EPHEMERAL_RANGE, port_range, reserve_port

TESTS_DIR = os.path.dirname(__file__)


def _kill_later(pid: int, delay: float, record: dict) -> threading.Thread:
    def kill():
        time.sleep(delay)
        record["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _hosted_groups(client: Client) -> dict[str, list]:
    def info(dask_worker):
        return dask_worker.plugins["daskwg"].hosted_ranks() if "daskwg" in dask_worker.plugins else []

    return client.run(info)


# ---- 1. worker loss -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_worker_killed_during_a_blocking_call_raises_worker_lost(fresh_cluster4):
    _, client = fresh_cluster4
    addresses = sorted(client.scheduler_info()["workers"])
    wg = WorkerGroup(client, FaultWorker, workers=addresses[:2])
    other = WorkerGroup(client, AddWorker, workers=addresses[2:])
    killed = {}
    _kill_later(wg.pid()[1], 1.0, killed)
    with pytest.raises(WorkerLostError) as info:
        wg.sleep(60)
    print(f"\n[detect] blocking call, SIGKILL -> WorkerLostError: {time.monotonic() - killed['t']:.3f} s")
    assert info.value.rank == 1
    assert info.value.address == wg.workers[1]
    assert wg.workers[1] in str(info.value)
    assert "its process was killed by signal 9 (SIGKILL)" in str(info.value), str(info.value)
    assert "wg.restart()" in str(info.value)  # the way back, as well as a new group
    assert wg.is_broken
    # Every later call raises the group's error afresh: its traceback does not grow with
    # each call (a retrying loop would keep every earlier call's frames alive).
    depths = []
    for _ in range(4):
        with pytest.raises(WorkerLostError, match="rank 1") as later:
            wg.pid()
        assert later.value is not info.value
        depths.append(len(traceback.extract_tb(later.value.__traceback__)))
    assert len(set(depths)) == 1, depths
    assert other.foo(x=1, y=2) == [5, 5]
    wg.shutdown()


@pytest.mark.timeout(90)
def test_worker_killed_during_a_non_blocking_call_raises_worker_lost():
    with process_cluster(2) as cluster, Client(cluster) as client:
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        pids = wg.pid()
        futures = wg.sleep_async(60)
        killed = {}
        _kill_later(pids[1], 1.0, killed)
        with pytest.raises(WorkerLostError) as info:
            wg._gather(futures, "sleep_async")
        print(
            f"\n[detect] non-blocking call (gather), SIGKILL -> WorkerLostError: {time.monotonic() - killed['t']:.3f} s"
        )
        assert (info.value.rank, info.value.address) == (1, wg.workers[1])
        assert "killed by signal 9 (SIGKILL)" in str(info.value), str(info.value)
        # A plain Dask future of the lost rank does not wait forever either, and raises
        # daskwg's error, not Dask's FutureCancelledError.
        with pytest.raises(WorkerLostError, match="killed by signal 9"):
            futures[1].result(timeout=30)
        with pytest.raises(WorkerLostError):
            wg.sleep_async(0)


@pytest.mark.timeout(120)
def test_after_a_lost_worker_only_busy_ranks_are_named_and_a_refused_rebuild_says_to_wait(caplog):
    with process_cluster(2) as cluster, Client(cluster) as client:
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        survivor = wg.workers[0]
        _kill_later(wg.pid()[1], 1.0, {})
        with pytest.raises(WorkerLostError):
            wg.sleep(4)  # rank 0 sleeps on for about 3 s
        caplog.clear()
        with caplog.at_level("WARNING", logger="daskwg"):
            for _ in range(2):
                with pytest.raises(
                    GroupBrokenError, match="still stuck in 'sleep' of the broken group"
                ) as info:
                    WorkerGroup(client, FaultWorker, workers=[survivor])
        assert "Wait for that call to end and retry" in str(info.value)
        assert [r.message for r in caplog.records if r.name.startswith("daskwg")] == []  # refused, not logged
        t0 = time.monotonic()
        while True:
            try:
                fresh = WorkerGroup(client, FaultWorker, workers=[survivor])
                break
            except GroupBrokenError:
                assert time.monotonic() - t0 < 30
                time.sleep(0.2)
        print(
            f"\n[stuck] a rebuild on the survivor of a lost worker succeeded {time.monotonic() - t0:.2f} s later"
        )
        fresh.shutdown()
        caplog.clear()
        with caplog.at_level("WARNING", logger="daskwg"):
            wg.shutdown()  # rank 0 is idle now: nothing to say about it
        assert [r.message for r in caplog.records if r.name.startswith("daskwg")] == []


@pytest.mark.timeout(90)
def test_data_proto_future_of_a_lost_worker_raises_worker_lost():
    with process_cluster(2) as cluster, Client(cluster) as client:
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        pids = wg.pid()
        wg.sleep_async(60)
        future = wg.echo_proto_async(DataProto.from_dict({"a": torch.arange(4)}))
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="rank 0"):
            future.get()


@pytest.mark.timeout(90)
def test_a_finished_result_of_a_lost_worker_fails_its_consumer_naming_the_producer_before_sending():
    # Found by a new-user trial: the consuming call went out, was cancelled by Dask (its
    # input's key was lost) and said only "the call of 'echo_proto' on rank 0 was cancelled".
    with process_cluster(4) as cluster, Client(cluster) as client:
        producers_pool, consumers_pool = ResourcePool(client, world_size=4).split([2, 2])
        producers = WorkerGroup(client, FaultWorker, workers=producers_pool, name="producers")
        consumers = WorkerGroup(client, FaultWorker, workers=consumers_pool, name="consumers")
        future = producers.echo_proto_async(DataProto.from_dict({"a": torch.arange(8)}))
        future.get()  # finished: kept on the producers' workers
        os.kill(producers.pid()[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not producers.is_broken and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(
            WorkerLostError, match=r"rank 1 .*producers\.echo_proto_async \(rank 1\) kept its result"
        ):
            consumers.echo_proto(future)
        assert consumers.echo(5) == [5, 5]  # nothing of it was sent: the consumers go on
        assert consumers.echo_proto(DataProto.from_dict({"a": torch.arange(4)})).batch["a"].tolist() == [
            0,
            1,
            2,
            3,
        ]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("read", ["consume-at-once", "consume-once-known", "get-at-once", "get-once-known"])
def test_a_result_whose_producer_was_killed_names_the_producers_group_and_the_signal(read):
    with process_cluster(4) as cluster, Client(cluster) as client:
        producers_pool, consumers_pool = ResourcePool(client, world_size=4).split([2, 2])
        producers = WorkerGroup(client, FaultWorker, workers=producers_pool, name="producers")
        consumers = WorkerGroup(client, FaultWorker, workers=consumers_pool, name="consumers")
        future = producers.echo_proto_async(DataProto.from_dict({"a": torch.arange(8)}))
        producers.echo(0)  # calls run in order: the result is made and kept on its worker
        os.kill(producers.pid()[1], signal.SIGKILL)
        if read.endswith("once-known"):
            deadline = time.monotonic() + 60
            while not producers.is_broken and time.monotonic() < deadline:
                time.sleep(0.05)
        with pytest.raises(WorkerLostError) as info:
            if read.startswith("consume"):
                consumers.echo_proto(future)
            else:
                future.get()
        message = str(info.value)
        assert info.value.group == "producers", message
        assert "rank 1 of group 'producers'" in message and "group 'producers' is broken" in message, message
        assert "killed by signal 9 (SIGKILL)" in message, message
        if read.startswith("consume"):
            assert consumers.echo(5) == [5, 5]  # the consuming group is not broken


def _fixed_port_cluster(n: int) -> SpecCluster:
    # Fixed worker ports: a restarted worker comes back at the same address.
    workers = {
        f"w{i}": {
            "cls": Nanny,
            "options": {"nthreads": 1, "worker_port": free_port(), "dashboard_address": ":0"},
        }
        for i in range(n)
    }
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}})


@pytest.mark.timeout(90)
def test_idle_group_learns_of_a_killed_worker_and_never_reuses_its_restart():
    with _fixed_port_cluster(2) as cluster, Client(cluster) as client:
        wait_for_workers(client, 2)
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        old_pid = wg.pid()[1]
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        while not wg.is_broken:
            time.sleep(0.01)
        print(f"\n[detect] idle group, SIGKILL -> is_broken: {time.monotonic() - t0:.3f} s")
        deadline = time.monotonic() + 60
        while wg.workers[1] not in client.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wg.workers[1] in client.scheduler_info()["workers"], "the Nanny did not restart the worker"
        print(f"[detect] worker restarted at the same address after {time.monotonic() - t0:.3f} s")
        with pytest.raises(WorkerLostError) as info:
            wg.pid()
        assert (info.value.rank, info.value.address) == (1, wg.workers[1])
        # The restarted process (same name, same address) serves a new group at once.
        with WorkerGroup(client, FaultWorker, world_size=2) as fresh:
            new_pids = fresh.pid()
        assert new_pids[1] != old_pid


# ---- 2. a rank fails during a collective ----------------------------------------------


@pytest.mark.timeout(120)
def test_rank_failing_in_a_collective_raises_rank_error_and_breaks_the_group():
    with process_cluster(3) as cluster, Client(cluster) as client:
        wg = WorkerGroup(client, FaultWorker, world_size=3)
        assert wg.init_process_group() == [True] * 3
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            wg.all_reduce_or_fail(failing_rank=1)
        print(f"\n[detect] rank failure in all-reduce -> RankError: {time.monotonic() - t0:.3f} s")
        assert info.value.rank == 1 and info.value.method == "all_reduce_or_fail"
        t0 = time.monotonic()
        assert wg.is_broken
        print(f"[detect] -> group marked broken: {time.monotonic() - t0:.3f} s (daskwg.rank-failure-grace)")
        with pytest.raises(GroupBrokenError, match="rank 1 failed in 'all_reduce_or_fail'"):
            wg.pid()
        # A new group on the same workers is refused with the reason instead of hanging
        # behind the stuck ranks. (Asked before the shutdown: shutting down destroys the
        # failed rank's process group, which can end its peers' all-reduce at once.)
        with pytest.raises(GroupBrokenError, match="still stuck in 'all_reduce_or_fail'"):
            WorkerGroup(client, FaultWorker, world_size=3)
        t0 = time.monotonic()
        wg.shutdown()  # does not wait for the stuck ranks
        assert time.monotonic() - t0 < 30
        # The recovery the error names: restarting the workers frees them.
        client.restart()
        with WorkerGroup(client, FaultWorker, world_size=3) as fresh:
            assert len(set(fresh.pid())) == 3


@pytest.mark.timeout(120)
def test_a_collective_timeout_frees_stuck_ranks_for_a_new_group():
    with process_cluster(2) as cluster, Client(cluster) as client:
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        wg.init_process_group(timeout_s=5)
        with pytest.raises(RankError):
            wg.all_reduce_or_fail(failing_rank=0)
        assert wg.is_broken
        wg.shutdown()
        deadline = time.monotonic() + 60
        while True:
            try:
                fresh = WorkerGroup(client, FaultWorker, world_size=2)
                break
            except GroupBrokenError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        with fresh:
            assert len(fresh.pid()) == 2


# ---- 3. ordering ------------------------------------------------------------------------


def test_calls_from_several_groups_and_threads_run_in_one_order_on_every_worker(client4):
    groups = [WorkerGroup(client4, FaultWorker, world_size=4) for _ in range(2)]
    try:
        start = threading.Barrier(3)

        def issue(tag: str):
            start.wait()
            for i in range(25):
                groups[i % 2].record(tag, i)

        threads = [threading.Thread(target=issue, args=(f"t{n}",)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        logs = groups[0].process_log()
        mine = [[entry for entry in log if entry[0] in ("t0", "t1", "t2")] for log in logs]
        assert len(mine[0]) == 75
        assert all(log == mine[0] for log in mine)
        for tag in ("t0", "t1", "t2"):
            assert [i for t, i in mine[0] if t == tag] == list(range(25))
    finally:
        for g in groups:
            g.shutdown()
        client4.run(lambda: __import__("fault_workers").PROCESS_LOG.clear())


# ---- 4. setup failures ------------------------------------------------------------------


def test_init_that_raises_names_the_worker_and_leaves_nothing_behind(client4):
    before = _hosted_groups(client4)
    with pytest.raises(RankError, match="__init__ fails on rank 2") as info:
        WorkerGroup(client4, ClassWithInitArgs(FaultWorker, fail_rank=2), world_size=4, name="half-built")
    assert info.value.rank == 2
    assert info.value.address in client4.scheduler_info()["workers"]
    assert info.value.method == "__init__"
    assert _hosted_groups(client4) == before
    with WorkerGroup(client4, FaultWorker, world_size=4, name="half-built") as again:
        assert len(again.pid()) == 4


@pytest.mark.timeout(90)
def test_inconsistent_visible_devices_fail_group_creation_naming_the_worker():
    envs = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}]
    workers = {
        f"w{i}": {"cls": Nanny, "options": {"nthreads": 1, "env": env, "dashboard_address": ":0"}}
        for i, env in enumerate(envs)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        wait_for_workers(client, 2)
        with pytest.raises(
            RankError, match="HIP_VISIBLE_DEVICES='0' and CUDA_VISIBLE_DEVICES='1' disagree"
        ) as info:
            WorkerGroup(client, FaultWorker, world_size=2)
        assert info.value.rank == 1
        assert info.value.address in str(info.value)
        assert _hosted_groups(client) == {a: [] for a in client.scheduler_info()["workers"]}


# ---- 5. rendezvous ----------------------------------------------------------------------


def test_an_explicit_master_port_in_use_is_a_clear_error(client4):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"MASTER_PORT {port} is already in use"):
            WorkerGroup(client4, FaultWorker, world_size=2, master_port=port)


def test_two_groups_cannot_share_an_explicit_master_port(client4):
    port = free_port()
    with WorkerGroup(client4, FaultWorker, world_size=2, master_port=port) as first:
        assert first.master_addr_port[1] == port
        with pytest.raises(OSError, match=f"MASTER_PORT {port} is already used by another worker group"):
            WorkerGroup(client4, FaultWorker, world_size=2, master_port=port)


def test_free_master_ports_are_drawn_below_the_kernels_ephemeral_range(client4):
    # Seen in CI: a MASTER_PORT the kernel picked (port 0) was taken by some connection's own
    # end before rank 0's init_process_group bound it (EADDRINUSE). Ports below the
    # ephemeral range are never handed out by the kernel.
    with open(EPHEMERAL_RANGE) as f:
        ephemeral = int(f.read().split()[0])
    first, last = port_range()
    assert last < ephemeral
    for _ in range(3):
        with WorkerGroup(client4, FaultWorker, world_size=2) as wg:
            assert first <= wg.master_addr_port[1] <= last


def test_master_port_range_bounds_the_ports_reserved_and_says_when_it_is_full():
    reserved: set[int] = set()
    first = free_port()
    with dask_config({"daskwg.master-port-range": f"{first}:{first}"}):
        assert reserve_port("tcp://127.0.0.1:1", reserved, None) == first
        with pytest.raises(OSError, match=f"could not find a free port .* {first}:{first}"):
            reserve_port("tcp://127.0.0.1:1", reserved, None)
    for bad in ("29500", "29600:29500", "a:b", "0:10"):
        with dask_config({"daskwg.master-port-range": bad}), pytest.raises(ValueError, match="first:last"):
            port_range()


def test_an_explicit_master_port_held_on_any_address_is_refused_before_rank_zero_binds(client4):
    # TCPStore listens on every address; a port held only on another one still fails there.
    if not socket.has_ipv6:
        pytest.skip("no IPv6 sockets on this machine")
    with socket.socket(socket.AF_INET6) as busy:
        busy.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            busy.bind(("::1", 0))
        except OSError:
            pytest.skip("this machine has no IPv6 loopback")
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"MASTER_PORT {port} is already in use"):
            WorkerGroup(client4, FaultWorker, world_size=2, master_port=port)


# ---- 7. results that cannot be serialised -----------------------------------------------


def test_an_unserialisable_result_names_the_method_and_type_on_both_paths(client4):
    with WorkerGroup(client4, FaultWorker, world_size=2) as wg:
        with pytest.raises(RankError, match=r"lock on rank \d returned a _thread.lock"):
            wg.lock()
        with pytest.raises(RankError, match=r"lock_async on rank \d returned a _thread.lock"):
            wg._gather(wg.lock_async(), "lock_async")
        with pytest.raises(RankError, match="proto_with_lock on rank .* cannot be serialised"):
            wg.proto_with_lock()
        assert wg.echo(7) == [7, 7]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool])
def test_tensors_of_every_dtype_round_trip_exactly(client4, dtype):
    with WorkerGroup(client4, FaultWorker, world_size=1) as wg:
        t = (torch.arange(24).reshape(4, 6) % 3).to(dtype)
        for value in (t, t[:, ::2], t.T, t[:0]):
            (out,) = wg.echo(value)
            assert out.dtype == dtype and out.shape == value.shape and torch.equal(out, value)
        data = DataProto.from_dict(
            {"x": t}, non_tensors={"o": np.array([{"k": 1}, "s", None, [2]], dtype=object)}
        )
        for out in (wg.echo_proto(data), wg.echo_proto_async(data).get()):
            assert torch.equal(out.batch["x"], t)
            assert list(out.non_tensor_batch["o"]) == [{"k": 1}, "s", None, [2]]


@pytest.mark.timeout(180)
def test_a_one_gib_batch_round_trips_exactly():
    # A cluster of its own: a worker over its memory limit is restarted by its Nanny.
    with (
        process_cluster(1, memory_limit="8GiB") as cluster,
        Client(cluster) as client,
        WorkerGroup(client, FaultWorker, world_size=1) as wg,
    ):
        (out,) = wg.ones(1 << 30)
        assert out.dtype == torch.uint8 and out.numel() == 1 << 30
        out[::4096] = 7
        assert wg.total(out) == [(1 << 30) + 6 * ((1 << 30) // 4096)]
        del out


# ---- 9. paused workers ------------------------------------------------------------------


def _pause(dask_worker):
    from distributed.core import Status

    dask_worker.memory_manager.memory_pause_fraction = False  # keep the monitor from resuming it
    dask_worker.status = Status.paused


def _resume(dask_worker):
    from distributed.core import Status

    dask_worker.status = Status.running


@pytest.mark.timeout(90)
def test_a_call_waiting_on_a_paused_worker_warns_naming_it(caplog):
    with (
        process_cluster(2) as cluster,
        Client(cluster) as client,
        dask_config({"daskwg.paused-warning": 0.5}),
    ):
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        # A future no group call made goes as a Dask task, which a paused worker never starts.
        zero = client.scatter(0, broadcast=True)
        client.run(_pause, workers=[wg.workers[1]])
        time.sleep(0.5)
        # Handlers still run while paused: the direct path, blocking or not, is unaffected.
        assert wg.echo(1) == [1, 1]
        assert wg._gather(wg.sleep_async(0), "sleep_async") == [0, 1]
        futures = wg.sleep_async(zero)
        timer = threading.Timer(3, client.run, args=(_resume,), kwargs={"workers": [wg.workers[1]]})
        timer.start()
        with caplog.at_level(logging.WARNING, logger="daskwg.groups.group"):
            assert wg._gather(futures, "sleep_async") == [0, 1]
        timer.join()
        assert any("paused" in r.message and wg.workers[1] in r.message for r in caplog.records)


# ---- 11. bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"client": "tcp://x:1"}, TypeError, "client must be a distributed.Client"),
        ({"cls": 3}, TypeError, "needs a class"),
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": -1}, ValueError, "world_size must be a positive int"),
        ({"world_size": "4"}, ValueError, "world_size must be a positive int"),
        ({"world_size": 9}, WorldSizeError, "asked for 9 ranks, the cluster has 4 workers"),
        ({"workers": ["tcp://127.0.0.1:1"]}, ValueError, "unknown worker"),
        ({"worker_env": {"A": 1}}, TypeError, "worker_env must map str to str"),
    ],
)
def test_wrong_arguments_are_rejected_with_clear_messages(client4, kwargs, error, message):
    args = {"client": client4, "cls": FaultWorker, **kwargs}
    with pytest.raises(error, match=message):
        WorkerGroup(args.pop("client"), args.pop("cls"), **args)


def test_a_duplicate_group_name_is_rejected(client4):
    with WorkerGroup(client4, FaultWorker, world_size=1, name="dup"):
        with pytest.raises(ValueError, match="'dup' already exists"):
            WorkerGroup(client4, FaultWorker, world_size=1, name="dup")


def test_a_data_proto_future_survives_a_later_dispatch_error(client4):
    with WorkerGroup(client4, FaultWorker, world_size=2) as wg:
        future = wg.echo_proto_async(DataProto.from_dict({"a": torch.arange(4)}))
        with pytest.raises(DispatchError):
            wg.echo_proto([1, 2, 3])
        assert isinstance(future, DataProtoFuture)
        assert future.get().batch["a"].tolist() == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_a_class_the_workers_cannot_import_fails_clearly_and_leaves_the_workers_usable(tmp_path, monkeypatch):
    # The module exists only on the driver's path, as a class defined in a notebook
    # helper file would; the CLI workers started without it.
    (tmp_path / "driver_only_mod.py").write_text(
        "import daskwg\n"
        "class DriverOnly(daskwg.Worker):\n"
        "    @daskwg.register(dispatch_mode=daskwg.Dispatch.ONE_TO_ALL)\n"
        "    def echo(self, x):\n"
        "        return x\n"
    )
    cluster = CLICluster(2)
    try:
        with Client(cluster.address, timeout=60) as client:
            wait_for_workers(client, 2)
            monkeypatch.syspath_prepend(str(tmp_path))
            from driver_only_mod import DriverOnly

            with pytest.raises(RankError, match="driver_only_mod") as info:
                WorkerGroup(client, DriverOnly, world_size=2)
            assert "install its module" in str(info.value)
            with WorkerGroup(client, FaultWorker, world_size=2) as wg:
                assert wg.echo(3) == [3, 3]
    finally:
        cluster.close()


def test_calls_and_shutdown_after_the_client_closed_raise_instead_of_waiting(fresh_cluster4):
    cluster, _ = fresh_cluster4
    client = Client(cluster)
    wg = WorkerGroup(client, FaultWorker, world_size=2)
    assert wg.echo(1) == [1, 1]
    client.close()
    with pytest.raises(GroupBrokenError, match="is closed"):
        wg.echo(2)
    wg.shutdown()


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:g} s")
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_client_that_reconnected_builds_new_groups_and_its_old_groups_raise_group_broken(client4):
    old = WorkerGroup(client4, AddWorker, world_size=2)
    assert old.foo(x=1, y=2) == [5, 5]
    comm = client4.scheduler_comm
    # As a broken link does: the scheduler drops the client (releasing its ranks), and
    # the client reconnects under the same id.
    comm.comm.abort()
    _until(
        lambda: client4.scheduler_comm not in (comm, None) and client4.status == "running", 30, "reconnected"
    )
    _until(
        lambda: not any(r[0] == old.name for ranks in _hosted_groups(client4).values() for r in ranks),
        30,
        "the old group's ranks released",
    )
    with pytest.raises(GroupBrokenError, match="re-established"):
        old.foo(x=1, y=2)
    with WorkerGroup(client4, AddWorker, world_size=2) as new:
        assert new.foo(x=1, y=2) == [5, 5]
        # The task path too: both number their calls in the new session.
        out = new.add_rank_async(DataProto.from_dict({"a": torch.zeros(4)})).get()
        assert out.batch["a"].tolist() == [0, 0, 1, 1]
    old.shutdown()


@pytest.mark.timeout(90)
def test_a_worker_whose_event_loop_is_blocked_past_the_heartbeat_timeout_is_not_taken_as_lost(client4):
    # Its host's kernel still acknowledges the heartbeat's keepalive probes: busy, not cut off.
    with dask_config({"daskwg.heartbeat-timeout": 1, "daskwg.heartbeat-interval": 1}):
        wg = WorkerGroup(client4, AddWorker, world_size=1)
    assert wg.foo(x=1, y=2) == [5]
    # client.run calls a plain function on the worker's event loop, which it blocks.
    blocker = threading.Thread(
        target=client4.run, args=(time.sleep, 5.0), kwargs={"workers": wg.workers}, daemon=True
    )
    blocker.start()
    time.sleep(1.0)
    assert wg.foo(x=2, y=2) == [6]  # answered once the loop is free again
    blocker.join(30)
    time.sleep(2.0)
    assert not wg.is_broken
    assert wg.foo(x=3, y=2) == [7]
    wg.shutdown()
