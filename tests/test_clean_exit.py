"""A clean program exit prints nothing from daskwg or Dask at ERROR level, and no traceback.

Each test runs a driver script in a subprocess, as a user runs one, and reads its stderr
(the worker processes of ``daskwg.local_cluster()`` write theirs there too). The scripts
make the moment they are about deterministic where Dask leaves it to timing: a scheduler
handler that answers late stands for a busy scheduler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import busy_factor

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` as a script (``__main__``) with this checkout and ``tests/`` importable."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(body))
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240 * busy_factor(),
    )
    assert run.returncode == 0 and "done" in run.stdout, run.stderr
    return run


def error_lines(stderr: str) -> list[str]:
    """Lines logged at ERROR level or above (Dask's format and logging's default one), and
    tracebacks."""
    marks = (" - ERROR - ", " - CRITICAL - ", "ERROR:", "CRITICAL:", "Traceback (most recent call last)")
    return [line for line in stderr.splitlines() if any(mark in line for mark in marks)]


def test_a_result_registered_as_its_client_closes_is_not_reported_lost_at_cluster_close(tmp_path):
    """The driver registers a result the program held with the scheduler (``update_data``);
    the scheduler takes that in only after the client's close. Before, the scheduler kept
    the key for a client it re-created, and logged "caused the cluster to lose scattered
    data" for each worker as the cluster closed."""
    run = run_script(
        tmp_path,
        """
        import asyncio, time
        import torch
        from distributed import Client
        import daskwg.transport.owned as owned
        from daskwg import DataProto, WorkerGroup, local_cluster
        from workers import AddWorker

        owned.REGISTER_AFTER = 0.0  # results are registered as soon as they exist

        if __name__ == "__main__":
            with local_cluster(2, dashboard_address=":0") as cluster:
                handlers = cluster.scheduler.handlers
                update_data = handlers["update_data"]

                async def late_update_data(**kwargs):  # taken in after the client's close
                    await asyncio.sleep(2.0)
                    return update_data(**kwargs)

                handlers["update_data"] = late_update_data
                with Client(cluster) as client:
                    wg = WorkerGroup(client, AddWorker, world_size=2)
                    f = wg.add_rank_async(DataProto.from_dict({"a": torch.zeros(4)}))
                    f.get()
                    time.sleep(0.5)
                    del f
                time.sleep(3.0)
            print("done")
        """,
    )
    assert error_lines(run.stderr) == []


def test_a_future_dropped_as_the_cluster_closes_while_a_heartbeat_waits_prints_no_error(tmp_path):
    """The README's shape, a future dropped right before ``local_cluster`` closes, with the
    scheduler slow to answer heartbeats: each worker closes with a heartbeat waiting, which
    Dask's close aborts. Before, each worker logged "Failed to communicate with scheduler
    during heartbeat." with a ``CommClosedError`` traceback."""
    run = run_script(
        tmp_path,
        """
        import asyncio, time
        import torch
        from distributed import Client
        from daskwg import DataProto, WorkerGroup, local_cluster
        from workers import AddWorker

        if __name__ == "__main__":
            with local_cluster(2, dashboard_address=":0") as cluster, Client(cluster) as client:
                wg = WorkerGroup(client, AddWorker, world_size=2)
                handlers = cluster.scheduler.handlers
                heartbeat = handlers["heartbeat_worker"]

                async def slow_heartbeat(**kwargs):  # a busy scheduler
                    await asyncio.sleep(1.0)
                    return heartbeat(**kwargs)

                handlers["heartbeat_worker"] = slow_heartbeat
                f = wg.add_rank_async(DataProto.from_dict({"a": torch.zeros(4)}))
                f.get()
                time.sleep(1.5)  # the result is registered with the scheduler by now
                del f
            print("done")
        """,
    )
    assert error_lines(run.stderr) == []


def test_local_cluster_worker_processes_end_before_their_nannies_kill_them(tmp_path):
    """A worker process that hosted ranks ends once its close is done: before, the
    interpreter's teardown of a process that imported torch took seconds more on a busy
    machine, and each Nanny logged "Worker process still alive after 4.0 seconds, killing"
    (measured here at load 3-30 on 2 cores: in most runs). The script makes that teardown
    take 6 s in the worker processes (which import it again as they start)."""
    run = run_script(
        tmp_path,
        """
        import time
        import torch
        from distributed import Client
        from daskwg import DataProto, WorkerGroup, local_cluster
        from workers import AddWorker


        class SlowTeardown:
            def __del__(self):  # at the interpreter's teardown, as torch's takes on a busy machine
                time.sleep(6.0)


        if __name__ != "__main__":  # a worker process
            slow = SlowTeardown()

        if __name__ == "__main__":
            with local_cluster(2, dashboard_address=":0") as cluster, Client(cluster) as client:
                wg = WorkerGroup(client, AddWorker, world_size=2)
                assert wg.add_rank(DataProto.from_dict({"a": torch.zeros(4)})).batch["a"].tolist() == [0, 0, 1, 1]
            print("done")
        """,
    )
    assert [line for line in run.stderr.splitlines() if "still alive" in line] == []
    assert error_lines(run.stderr) == []


def test_a_call_still_running_as_the_cluster_closes_does_not_keep_its_worker_process(tmp_path):
    """A group left without ``shutdown()`` while its call runs (a thread cannot be
    interrupted): the interpreter joined the rank's host thread before any exit handler, so
    the process stayed until the Nanny killed it ("still alive after 4.0 seconds")."""
    run = run_script(
        tmp_path,
        """
        from distributed import Client
        from daskwg import WorkerGroup, local_cluster
        from hang_workers import HangWorker

        if __name__ == "__main__":
            with local_cluster(2, dashboard_address=":0") as cluster, Client(cluster) as client:
                wg = WorkerGroup(client, HangWorker, world_size=2)
                wg.sleep_async(30)
            print("done")
        """,
    )
    assert [line for line in run.stderr.splitlines() if "still alive" in line] == []
    assert error_lines(run.stderr) == []


def test_importing_verl_first_leaves_a_local_cluster_silent(tmp_path):
    """``import verl`` at the top of a driver script calls ``logging.basicConfig``; Dask then
    gives its ``distributed`` logger no handler of its own, and ``LocalCluster``'s
    ``silence_logs`` (which silences that handler) did nothing: the driver's scheduler and
    nannies and every worker process (which import the script again) wrote their INFO
    records, some 80 lines for two workers (``daskwg.cluster._silence_propagated_logs``,
    ``_daskwg_task._silence_propagated_logs``)."""
    pytest.importorskip("verl")
    run = run_script(
        tmp_path,
        """
        import verl  # noqa: F401  (first, as a verl script has it)
        from distributed import Client
        import daskwg

        if __name__ == "__main__":
            with daskwg.local_cluster(2, dashboard_address=":0") as cluster, Client(cluster) as client:
                client.wait_for_workers(2, timeout=120)
                assert sum(client.run(lambda: 1).values()) == 2
            print("done")
        """,
    )
    # Dask's Worker logs that it creates its preloads before it imports them: that line is
    # the one of each worker's start that daskwg's preload comes too late to hold back.
    info = [line for line in run.stderr.splitlines() if "INFO" in line and "Creating preload" not in line]
    assert info == []


def test_a_timeout_under_the_thread_method_names_its_test_before_the_thread_dump(tmp_path):
    """pytest-timeout's ``thread`` method writes its stack dump under a bare "Timeout" title
    and ends the process before any report: the suite's plugin (tests/timeout_report.py)
    writes the test's id first."""
    (tmp_path / "test_slow.py").write_text(
        "import time\ndef test_fast():\n    pass\ndef test_sleeps_past_its_timeout():\n    time.sleep(30)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "timeout_report"]
        + ["--timeout", "2", "--timeout-method", "thread"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    named = run.stdout.find("Timeout >2s in test_slow.py::test_sleeps_past_its_timeout")
    assert named != -1, run.stdout
    assert named < run.stdout.find("Stack of"), run.stdout
