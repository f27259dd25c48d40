"""Two jobs on one cluster: two driver scripts (two clients), each with its own groups.

Group names are scoped as Dask scopes a client's futures: each client may build a
non-detached group named ``"actor"``, while a detached group's name holds on the whole
cluster. Calls on a worker run one at a time whichever driver sent them, so one job's call
may wait behind the other's: its deadline report, its warnings and ``wg.status()`` then
name the call that holds the worker, its group and its driver, and say when that driver
left (a SIGKILLed driver runs here as a subprocess).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import busy_factor, process_cluster
from distributed import Client
from two_jobs_workers import JobWorker

import daskwg
from daskwg import CallTimeoutError, ClassWithInitArgs, WorkerGroup
from daskwg.wire.records import ROOT

TESTS_DIR = os.path.dirname(__file__)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster2():
    """Two worker processes shared by the module: every test ends the calls it holds."""
    with process_cluster(2) as cluster:
        yield cluster


@pytest.fixture
def files(tmp_path):
    """``(log, until)``: the file the ranks note their calls in, and the one whose creation
    ends a ``hold``."""
    return str(tmp_path / "log"), str(tmp_path / "until")


def _lines(log: str) -> list[str]:
    with open(log) as f:
        return f.read().split()


def _release(until: str) -> None:
    open(until, "w").close()


def _worker_status(client: Client, address: str) -> list[dict]:
    async def ask():
        return await client.rpc(address).daskwg_status()

    return client.sync(ask)


def _wait_for(client: Client, address: str, seen, what: str, timeout: float = 60) -> None:
    """Poll ``address``'s status records until one satisfies ``seen``."""
    deadline = time.monotonic() + timeout * busy_factor()
    while True:
        records = _worker_status(client, address)
        if any(seen(r) for r in records):
            return
        assert time.monotonic() < deadline, f"{what} not seen on {address}: {records}"
        time.sleep(0.05)


def _holds(record: dict) -> bool:
    return record["state"] == "running" and record["method"] == "hold"


def _call(wg: WorkerGroup, log: str, line: str, blocking: bool) -> list:
    """``note`` on every rank of ``wg``, blocking or through a non-blocking call's future."""
    return wg.note(log, line) if blocking else daskwg.get(wg.note_later(log, line))


# ---- names -----------------------------------------------------------------------------


def test_two_clients_each_build_a_non_detached_group_of_the_same_name(cluster2):
    with Client(cluster2) as first, Client(cluster2) as second:
        with (
            WorkerGroup(first, ClassWithInitArgs(JobWorker, x=1), world_size=2, name="actor") as one,
            WorkerGroup(second, ClassWithInitArgs(JobWorker, x=2), world_size=2, name="actor") as two,
        ):
            assert one.name == two.name == "actor"
            assert one.value() == [1, 1]
            assert two.value() == [2, 2]


def test_a_second_live_group_of_the_same_name_in_one_client_is_refused(cluster2):
    with Client(cluster2) as client, WorkerGroup(client, JobWorker, world_size=1, name="actor"):
        with pytest.raises(ValueError, match="'actor' already exists \\(built by this client\\)"):
            WorkerGroup(client, JobWorker, world_size=1, name="actor")


def test_shutting_down_one_clients_group_leaves_the_other_clients_group_of_that_name(cluster2):
    with Client(cluster2) as first, Client(cluster2) as second:
        with WorkerGroup(first, ClassWithInitArgs(JobWorker, x=1), world_size=1, name="actor") as one:
            WorkerGroup(second, JobWorker, world_size=1, name="actor").shutdown()
            assert one.value() == [1]
            with pytest.raises(ValueError, match="built by this client"):
                WorkerGroup(first, JobWorker, world_size=1, name="actor")


def test_a_detached_name_holds_for_the_non_detached_groups_of_every_client(cluster2):
    with Client(cluster2) as first, Client(cluster2) as second:
        wg = WorkerGroup(first, JobWorker, world_size=1, name="shared", detached=True)
        try:
            with pytest.raises(ValueError, match="'shared' already exists \\(a detached group"):
                WorkerGroup(second, JobWorker, world_size=1, name="shared")
        finally:
            wg.shutdown()


def test_a_detached_group_may_not_take_a_name_a_connected_client_uses(cluster2):
    with Client(cluster2) as first, Client(cluster2) as second:
        with WorkerGroup(first, JobWorker, world_size=1, name="actor"):
            with pytest.raises(ValueError, match=f"'actor' already exists \\(built by client {first.id}"):
                WorkerGroup(second, JobWorker, world_size=1, name="actor", detached=True)


def test_a_detached_group_is_attached_by_name_from_another_client(cluster2):
    with Client(cluster2) as first, Client(cluster2) as second:
        wg = WorkerGroup(first, ClassWithInitArgs(JobWorker, x=7), world_size=1, name="kept", detached=True)
        try:
            assert WorkerGroup.attach(second, "kept").value() == [7]
        finally:
            wg.shutdown()


def test_the_records_of_a_departed_clients_groups_are_dropped(cluster2):
    with Client(cluster2) as observer:
        with Client(cluster2) as leaving:
            wg = WorkerGroup(leaving, JobWorker, world_size=1, name="actor")
            owner = leaving.id
            assert any(r and r["owner"] == owner for r in observer.get_metadata([ROOT]).values())
        deadline = time.monotonic() + 30 * busy_factor()
        while any(r and r["owner"] == owner for r in observer.get_metadata([ROOT]).values()):
            assert time.monotonic() < deadline, observer.get_metadata([ROOT])
            time.sleep(0.05)
        del wg


# ---- a call behind another driver's call -----------------------------------------------


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_a_deadline_report_names_the_other_drivers_call_that_holds_the_worker(cluster2, files, blocking):
    log, until = files
    with Client(cluster2) as a, Client(cluster2) as b:
        with WorkerGroup(b, JobWorker, world_size=1, name="actor") as job_b:
            address = job_b.workers[0]
            with WorkerGroup(a, JobWorker, workers=[address], name="actor") as job_a:
                held = job_b.hold(log, until)
                try:
                    _wait_for(a, address, _holds, "B's hold")
                    with pytest.raises(CallTimeoutError) as info:
                        with daskwg.deadline(1):
                            _call(job_a, log, "a", blocking)
                finally:
                    _release(until)
                assert daskwg.get(held) == ["held"]
    assert info.value.ranks == {0: "queued"}
    assert f"rank 0 queued behind 'hold' of group 'actor' of another driver, client {b.id} (running" in str(
        info.value
    )


def test_status_of_a_queued_rank_names_the_other_drivers_call_it_waits_behind(cluster2, files):
    log, until = files
    with Client(cluster2) as a, Client(cluster2) as b:
        with WorkerGroup(b, JobWorker, world_size=1, name="actor") as job_b:
            address = job_b.workers[0]
            with WorkerGroup(a, JobWorker, workers=[address], name="actor") as job_a:
                held = job_b.hold(log, until)
                try:
                    _wait_for(a, address, _holds, "B's hold")
                    queued = job_a.note_later(log, "a")
                    _wait_for(
                        a,
                        address,
                        lambda r: r["state"] == "queued" and r["method"] == "note_later",
                        "A's call",
                    )
                    (status,) = job_a.status()
                finally:
                    _release(until)
                assert daskwg.get(queued) == ["a"]
                assert daskwg.get(held) == ["held"]
    assert status["state"] == "queued"
    assert status["behind"].startswith(f"'hold' of group 'actor' of another driver, client {b.id} (running")


def test_the_still_busy_warning_names_the_other_drivers_call_that_holds_the_worker(cluster2, files, caplog):
    log, until = files
    with Client(cluster2) as a, Client(cluster2) as b:
        with WorkerGroup(b, JobWorker, world_size=1, name="actor") as job_b:
            address = job_b.workers[0]
            with WorkerGroup(a, JobWorker, workers=[address], name="actor") as job_a:
                held = job_b.hold(log, until)
                try:
                    _wait_for(a, address, _holds, "B's hold")
                    with pytest.raises(CallTimeoutError):
                        with daskwg.deadline(1):
                            job_a.note(log, "abandoned")
                    with caplog.at_level("WARNING", logger="daskwg"):
                        later = job_a.note_later(log, "later")
                finally:
                    _release(until)
                assert daskwg.get(later) == ["later"]
                assert daskwg.get(held) == ["held"]
    (warning,) = [r.getMessage() for r in caplog.records if "waits on" in r.getMessage()]
    assert f"the worker runs 'hold' of group 'actor' of another driver, client {b.id} (running" in warning
    assert "this driver's call of 'note' of group 'actor', abandoned by a deadline" in warning


# ---- a driver that left mid-call --------------------------------------------------------

_DRIVER = textwrap.dedent(
    """
    import sys, time
    from distributed import Client
    from daskwg import WorkerGroup
    from two_jobs_workers import JobWorker

    address, worker, log, until = sys.argv[1:]
    client = Client(address, timeout=30)
    wg = WorkerGroup(client, JobWorker, workers=[worker], name="actor")
    futures = [wg.hold(log, until), wg.note_later(log, "b1"), wg.note_later(log, "b2")]
    print("sent", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def departed(cluster2, files):
    """``(client, job_a, log, until)``: job A's group on a worker where job B, a driver
    SIGKILLed after sending a ``hold`` and two calls behind it, left that ``hold`` running."""
    log, until = files
    with Client(cluster2) as client, WorkerGroup(client, JobWorker, world_size=1, name="actor") as job_a:
        address = job_a.workers[0]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
        driver = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, cluster2.scheduler_address, address, log, until],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            try:
                line = driver.stdout.readline().strip()
                assert line == "sent", driver.stderr.read() if driver.poll() is not None else line
                _wait_for(client, address, _holds, "B's hold")
            finally:
                os.kill(driver.pid, signal.SIGKILL)
                driver.wait(timeout=30)
                driver.stdout.close()
                driver.stderr.close()
            _wait_for(client, address, lambda r: _holds(r) and r.get("departed"), "B's departure")
            yield client, job_a, log, until
        finally:
            _release(until)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_a_deadline_report_says_the_worker_runs_a_call_of_a_driver_that_left(departed, blocking):
    client, job_a, log, until = departed
    with pytest.raises(CallTimeoutError) as info:
        with daskwg.deadline(1):
            _call(job_a, log, "a", blocking)
    message = str(info.value)
    assert "rank 0 queued behind 'hold' of group 'actor' of a driver that left, client Client-" in message
    assert "a running sync method cannot be interrupted" in message


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_after_a_driver_left_a_call_waits_only_for_that_drivers_running_call(departed, blocking):
    client, job_a, log, until = departed
    out: list = []
    caller = threading.Thread(target=lambda: out.append(_call(job_a, log, "a", blocking)), daemon=True)
    caller.start()
    address = job_a.workers[0]
    _wait_for(
        client, address, lambda r: r["state"] == "queued" and r["method"].startswith("note"), "A's call"
    )
    _release(until)
    caller.join(timeout=60 * busy_factor())
    assert out == [["a"]]
    # The departed driver's calls queued behind its hold never ran.
    assert _lines(log) == ["hold", "a"]
