"""A rank is a long-lived actor: its own event loop, child processes, the memory it holds,
its own process group (issue 8), on real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import dask.config
import pytest
import torch
from actor_workers import ActorWorker, ProcessGroupWorker, SignalWorker, StateWorker
from conftest import CLICluster, process_cluster, wait_for_workers
from distributed import Client
from fault_workers import FaultWorker

import daskwg
from daskwg import (
    ClassWithInitArgs,
    DataProto,
    RankError,
    ResourcePool,
    WorkerGroup,
    WorkerLostError,
    WorkerPausedError,
    create_colocated_worker_cls,
)

# Every test here starts or shares worker processes that import torch: on a loaded
# machine the first test of a cluster pays for that.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster3():
    """Three workers from ``daskwg.local_cluster()``, as a new user builds them."""
    with daskwg.local_cluster(n_workers=3, dashboard_address=":0", worker_dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture
def client3(cluster3):
    with Client(cluster3) as client:
        yield client


@pytest.fixture
def actors(client3):
    with WorkerGroup(client3, ActorWorker, world_size=2) as wg:
        yield wg


def _rank_loop_threads(client: Client) -> list[str]:
    def names():
        return [t.name for t in threading.enumerate() if t.name.startswith("daskwg-rank-")]

    return sorted(n for ns in client.run(names).values() for n in ns)


# ---- 1. an event loop in sync methods ----------------------------------------------------


def test_sync_methods_have_the_same_current_event_loop_on_every_call(actors):
    first = actors.loop_id()
    assert actors.loop_id() == first
    assert actors.run_asyncio() == [7, 7]  # asyncio.run() unsets the thread's loop when it ends
    assert actors.loop_id() == first


# ---- 2. background tasks keep running between calls ---------------------------------------


def _echo(port: int, message: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(5)
        sock.sendall(message)
        return sock.recv(100)


def _wait_for_ticks(group: WorkerGroup, at_least: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        ticks = group.get_ticks()
        if min(ticks) >= at_least or time.monotonic() > deadline:
            return ticks
        time.sleep(0.2)


def test_servers_and_tasks_started_by_an_async_method_keep_serving_between_calls(actors):
    ports = actors.start()
    time.sleep(1)  # no call in flight meanwhile
    assert [_echo(port, b"ping") for port in ports] == [b"ping", b"ping"]
    assert min(_wait_for_ticks(actors, 50)) >= 50


def test_async_methods_of_a_rank_run_on_one_loop_that_is_not_the_sync_methods_loop(actors):
    first = actors.running_loop_id()
    assert actors.running_loop_id() == first
    assert first != actors.loop_id()
    assert len(set(first)) == 2  # one loop per rank


def test_an_async_call_is_finished_when_its_coroutine_returns(actors):
    actors.append_later(1, 0.3)
    futures = actors.append_later_async(2, 0.3)
    actors.append_later(3, 0.0)
    assert [f.result(timeout=30) for f in futures] == [None, None]
    assert actors.get_log() == [[1, 2, 3], [1, 2, 3]]


def _running_stacks(dask_worker) -> list[str]:
    return [r["stack"] for r in dask_worker.handlers["daskwg_status"]() if r["state"] == "running"]


def test_the_status_of_a_running_async_call_shows_where_its_coroutine_is(actors, client3):
    futures = actors.append_later_async(4, 5.0)
    deadline = time.monotonic() + 30
    stacks: list[str] = []
    # Until the rank's loop has started the coroutine, only the host thread's wait shows.
    while not any("in append_later_async" in s for s in stacks) and time.monotonic() < deadline:
        stacks = client3.run(_running_stacks, workers=[actors.workers[0]])[actors.workers[0]]
    assert len(stacks) == 1 and "in append_later_async" in stacks[0]
    client3.gather(futures)


def test_a_shut_down_rank_stops_its_event_loop_thread(client3):
    wg = WorkerGroup(client3, ActorWorker, world_size=2, name="loop-owner")
    wg.start()
    assert len([n for n in _rank_loop_threads(client3) if "loop-owner" in n]) == 2
    wg.shutdown()
    assert [n for n in _rank_loop_threads(client3) if "loop-owner" in n] == []


# ---- 3. child processes ------------------------------------------------------------------


def test_ranks_on_local_cluster_workers_start_child_processes(actors):
    assert actors.dataloader_sum() == [28, 28]
    assert actors.child_exit_code() == [0, 0]


def test_daemonic_cli_workers_say_how_to_allow_child_processes():
    cluster = CLICluster(2)
    try:
        with Client(cluster.address, timeout=60) as client:
            wait_for_workers(client, 2)
            with WorkerGroup(client, ActorWorker, world_size=2) as wg:
                with pytest.raises(RankError) as info:
                    wg.dataloader_sum()
                message = str(info.value)
                assert "daemonic processes are not allowed to have children" in message
                assert "distributed.worker.daemon: False" in message
                assert "DASK_DISTRIBUTED__WORKER__DAEMON=False" in message
    finally:
        cluster.close()


def test_cli_workers_started_as_the_error_says_start_child_processes(monkeypatch):
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__DAEMON", "False")
    cluster = CLICluster(2)
    try:
        with Client(cluster.address, timeout=60) as client:
            wait_for_workers(client, 2)
            with WorkerGroup(client, ActorWorker, world_size=2) as wg:
                assert wg.dataloader_sum() == [28, 28]
                assert wg.child_exit_code() == [0, 0]
    finally:
        cluster.close()


# ---- 5. one torch.distributed default group per process ---------------------------------


@pytest.fixture
def pool3(client3):
    pool = ResourcePool(client3, world_size=3)
    yield pool
    # Whatever a test left initialised would refuse the next groups on these workers.
    client3.run(_destroy_process_group)


def _destroy_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_on_another_groups_process_group_is_refused_until_that_one_is_destroyed(client3, pool3):
    sub = pool3.split([1, 2])[1]
    with (
        WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="A") as a,
        WorkerGroup(client3, ProcessGroupWorker, workers=sub, name="B") as b,
    ):
        assert a.init_process_group() == [[0, 3], [1, 3], [2, 3]]
        with pytest.raises(RankError) as info:
            b.init_process_group()
        # Both ranks of B are refused; whichever answered first is raised.
        rank, message = info.value.rank, str(info.value)
        assert rank in (0, 1) and info.value.address == sub.workers[rank]
        assert f"rank {rank} of group 'B' (world size 2)" in message
        assert f"rank {rank + 1} of group 'A' (world size 3)" in message
        assert f"puts this process at rank {rank + 1} of 3" in message
        assert "destroy_process_group() in group 'A'" in message
        a.destroy_process_group()
        assert b.init_process_group() == [[0, 2], [1, 2]]
        assert b.all_reduce_ones() == [[2.0], [2.0]]
        b.destroy_process_group()


def test_groups_with_the_same_layout_share_the_process_group(client3, pool3):
    with (
        WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="first") as first,
        WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="second") as second,
    ):
        assert first.init_process_group() == [[0, 3], [1, 3], [2, 3]]
        assert second.all_reduce_ones() == [[3.0], [3.0], [3.0]]
        first.destroy_process_group()


def test_colocated_roles_share_one_process_group(client3, pool3):
    cls = create_colocated_worker_cls({"actor": ProcessGroupWorker, "critic": ProcessGroupWorker})
    with WorkerGroup(client3, cls, workers=pool3) as wg:
        roles = wg.spawn(["actor", "critic"])
        assert roles["actor"].init_process_group() == [[0, 3], [1, 3], [2, 3]]
        assert roles["critic"].init_process_group() == [[0, 3], [1, 3], [2, 3]]
        assert roles["critic"].all_reduce_ones() == [[3.0], [3.0], [3.0]]
        roles["actor"].destroy_process_group()


def _process_group_layouts(client: Client, workers) -> list:
    def layout():
        import torch.distributed as dist

        return [dist.get_rank(), dist.get_world_size()] if dist.is_initialized() else None

    return list(client.run(layout, workers=list(workers)).values())


def test_shutting_a_group_down_destroys_the_process_group_its_ranks_started(client3, pool3):
    # As a Ray actor's process takes its process group with it: a group rebuilt on
    # some of the same workers (after a lost peer, say) starts its own.
    sub = pool3.split([1, 2])[1]
    with WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="A") as a:
        assert a.init_process_group() == [[0, 3], [1, 3], [2, 3]]
    assert _process_group_layouts(client3, pool3.workers) == [None, None, None]
    with WorkerGroup(client3, ProcessGroupWorker, workers=sub, name="B") as b:
        assert b.init_process_group() == [[0, 2], [1, 2]]
        assert b.all_reduce_ones() == [[2.0], [2.0]]


def test_a_group_with_the_same_layout_keeps_the_process_group_when_its_starter_shuts_down(client3, pool3):
    first = WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="first")
    with WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="second") as second:
        assert first.init_process_group() == [[0, 3], [1, 3], [2, 3]]
        first.shutdown()
        assert second.all_reduce_ones() == [[3.0], [3.0], [3.0]]
    assert _process_group_layouts(client3, pool3.workers) == [None, None, None]


def test_a_driver_that_leaves_takes_the_process_group_of_its_groups_with_it(cluster3, client3, pool3):
    with Client(cluster3) as other:
        wg = WorkerGroup(other, ProcessGroupWorker, workers=pool3.workers, name="left-behind")
        assert wg.init_process_group() == [[0, 3], [1, 3], [2, 3]]
    deadline = time.monotonic() + 30
    while _process_group_layouts(client3, pool3.workers) != [None, None, None]:
        assert time.monotonic() < deadline, _process_group_layouts(client3, pool3.workers)
        time.sleep(0.2)


def test_a_group_built_with_the_check_off_may_share_a_mismatched_process_group(client3, pool3):
    sub = pool3.split([1, 2])[1]
    with WorkerGroup(client3, ProcessGroupWorker, workers=pool3, name="holder") as holder:
        holder.init_process_group()
        with dask.config.set({"daskwg.check-process-group": False}):
            other = WorkerGroup(client3, ProcessGroupWorker, workers=sub)
        with other:
            assert other.echo(5) == [5, 5]
        holder.destroy_process_group()


# ---- 6. signals --------------------------------------------------------------------------


def test_a_constructor_installing_signal_handlers_fails_saying_what_to_do(client3):
    with pytest.raises(RankError) as info:
        WorkerGroup(client3, SignalWorker, world_size=2)
    message = str(info.value)
    assert "daskwg-host thread" in message
    assert "daskwg.skip-signal-handlers" in message


def test_skip_signal_handlers_lets_such_a_constructor_start_in_a_rank(client3):
    with dask.config.set({"daskwg.skip-signal-handlers": True}):
        wg = WorkerGroup(client3, SignalWorker, world_size=2)
    with wg:
        assert wg.previous_is_kept() == [True, True]
        # Only SIGTERM/SIGINT are skipped: another signal still fails clearly.
        with pytest.raises(RankError, match="signal only works in main thread"):
            wg.install_sigusr1()


# ---- 7. driving groups from async code ----------------------------------------------------


def test_async_code_calls_a_group_through_a_thread_while_its_loop_keeps_running(actors, tmp_path):
    flag = tmp_path / "set-by-the-driver-loop"

    async def main() -> list[bool]:
        # The rank waits for a file that only the driver's event loop creates while the
        # call is in flight: the call returns True only if that loop kept running.
        call = asyncio.ensure_future(asyncio.to_thread(actors.wait_for_file, str(flag), 30.0))
        await asyncio.sleep(0.5)
        flag.touch()
        return await call

    assert asyncio.run(main()) == [True, True]


def test_an_asynchronous_client_is_refused_saying_what_to_do_instead(cluster3):
    async def main() -> None:
        async with Client(cluster3.scheduler_address, asynchronous=True) as client:
            WorkerGroup(client, ActorWorker, world_size=2)

    with pytest.raises(TypeError) as info:
        asyncio.run(main())
    assert "synchronous Client" in str(info.value)
    assert "asyncio.to_thread" in str(info.value)


@pytest.mark.timeout(180)
def test_a_local_cluster_keeps_the_nanny_of_a_killed_worker_however_long_its_restart_takes():
    # Dask would close the Nanny of a worker not back within this (15 s by default, which a
    # loaded machine's restart of a torch worker can exceed): the cluster a worker short.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "0.5s"}),
        daskwg.local_cluster(n_workers=2, dashboard_address=":0", worker_dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        wait_for_workers(client, 2)
        wg = WorkerGroup(client, FaultWorker, world_size=2)
        pid = wg.pid()[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            wg.pid()
        time.sleep(2.0)  # well past the 0.5 s; the Nanny's new process is still starting
        wait_for_workers(client, 2, timeout=60)
        assert len(cluster.workers) == 2
        wg.restart()
        assert pid not in wg.pid()
        wg.shutdown()


# ---- 4. memory the rank holds ------------------------------------------------------------


def test_rank_state_does_not_stop_its_own_calls_on_local_cluster_workers():
    # About 1.75 GiB of the 2 GiB limit with torch loaded: above Dask's default pause
    # threshold (80%), below the nanny's terminate threshold (95%).
    with (
        daskwg.local_cluster(n_workers=2, memory_limit="2GiB", dashboard_address=":0") as cluster,
        Client(cluster) as client,
        WorkerGroup(client, ClassWithInitArgs(StateWorker, mib=1450), world_size=2) as wg,
    ):
        assert wg.state_mib() == [1450, 1450]
        time.sleep(1)  # the workers' memory monitors have seen the state meanwhile
        assert [w["status"] for w in client.scheduler_info(n_workers=-1)["workers"].values()] == [
            "running",
            "running",
        ]
        futures = wg.state_mib_async()
        assert client.gather(futures) == [1450, 1450]


def _wait_for_status(client: Client, status: str, n: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        statuses = [w["status"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
        if statuses.count(status) >= n or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)


def test_a_task_path_call_on_a_worker_paused_by_rank_state_fails_within_the_bound_naming_the_figures():
    memory = {
        "distributed.worker.memory.pause": 0.5,
        "distributed.worker.memory.target": False,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.terminate": False,
        "daskwg.paused-timeout": 3.0,
    }
    with (
        dask.config.set(memory),
        process_cluster(2, memory_limit="1GiB") as cluster,
        Client(cluster) as client,
    ):
        # A future no group call made, on every worker while they still accept data.
        (scattered,) = client.scatter([[0, 0, 0, 0]], broadcast=True)
        wg = WorkerGroup(client, ClassWithInitArgs(StateWorker, mib=480), world_size=2)
        assert _wait_for_status(client, "paused", 2) == ["paused", "paused"]
        assert wg.state_mib() == [480, 480]  # blocking calls reach paused workers
        # So do non-blocking ones: they travel on the same call streams, not as Dask tasks.
        assert (
            wg.add_one_async(DataProto.from_dict({"x": torch.zeros(4)})).get().batch["y"].tolist() == [1] * 4
        )
        assert client.gather(wg.state_mib_async()) == [480, 480]
        # A call taking a future no group call made is a Dask task: it cannot start there.
        future = wg.numel_async(scattered)
        with pytest.raises(WorkerPausedError) as info:
            daskwg.get(future)
        error = info.value
        assert error.rank in (0, 1) and error.address == wg.workers[error.rank]
        assert error.method == "numel_async"
        assert error.memory_limit == 2**30 and error.pause_fraction == 0.5
        assert error.memory > 2**29
        for part in (
            "paused for",
            "memory_limit 1.00 GiB",
            "distributed.worker.memory.pause = 0.5",
            "512.00 MiB",
        ):
            assert part in str(error)
        # Its plain Dask futures end too, with the same error.
        with pytest.raises(WorkerPausedError, match="did not start there"):
            client.gather(wg.numel_async(scattered))
        assert wg.state_mib() == [480, 480]  # the cancelled calls gave up their places
        wg.shutdown()


def test_a_worker_its_nanny_restarts_for_memory_gives_worker_lost_saying_so():
    with (
        daskwg.local_cluster(n_workers=1, memory_limit="1GiB", dashboard_address=":0") as cluster,
        Client(cluster) as client,
        WorkerGroup(client, ClassWithInitArgs(StateWorker, mib=1), world_size=1) as wg,
    ):
        with pytest.raises(WorkerLostError) as info:
            wg.grow(1100)
        message = str(info.value)
        assert "nanny restarted it for memory" in message
        assert "distributed.worker.memory.terminate" in message
        assert "memory_limit 1.00 GiB" in message


def _release_while_the_host_thread_dequeues(dask_worker, calls: int) -> list[str]:
    """Queue ``calls`` calls of a group this worker does not host (each fails at once on
    the host thread, which takes it off the queue), and answer ``daskwg_release`` on the
    event loop meanwhile, as a departing driver's release does. Returns the errors."""
    from daskwg.wire.messages import Call

    host = dask_worker.plugins["daskwg"]
    release = dask_worker.handlers["daskwg_release"]
    session = f"race-{time.monotonic_ns()}"
    results = [
        host.enqueue(Call(session, seq, "ghost", "ghost", 0, "nap", session), ((), {}))
        for seq in range(calls)
    ]
    errors = []
    deadline = time.monotonic() + 60
    while not results[-1].done() and time.monotonic() < deadline:
        try:
            release(client="a-driver-that-left")
        except RuntimeError as exc:  # "dictionary changed size during iteration"
            errors.append(str(exc))
    return errors


def test_releasing_a_departed_drivers_ranks_while_calls_leave_the_queue_never_fails(actors, client3):
    address = actors.workers[0]
    errors = client3.run(_release_while_the_host_thread_dequeues, calls=30_000, workers=[address])[address]
    assert errors == []
