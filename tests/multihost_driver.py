"""The driver side of the multi-host tests: a process in a host namespace that connects
one ``Client`` to the scheduler and runs named scenarios on request.

Run as ``python multihost_driver.py <scheduler address>`` (``MultiHost.start_driver``
does it in a host). Protocol (one JSON object per line; see ``multihost.Driver``): stdin
``{"run": name, "args": {...}, "id": n}`` starts scenario ``name`` as run ``n``,
``{"signal": name, "id": n, ...}`` answers that run's ``ctl.wait(name)``; stdout
``@@multihost {...}`` lines carry ``{"event": ...}`` while it runs, then ``{"result":
...}`` or ``{"error": ...}``, each with the run's ``id``. Runs are taken one at a time.

Scenarios return what they measured (JSON): the pytest process asserts on it. Errors a
scenario expects are part of its result, as ``{"type", "message", "seconds"}``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from distributed import Client, wait
from multihost_workers import BulkWorker, HostWorker

import daskwg
from daskwg import DataProto, WorkerGroup

MARK = "@@multihost "
SCENARIOS: dict[str, Callable[..., Any]] = {}
_print_lock = threading.Lock()


def emit(message: dict) -> None:
    with _print_lock:
        sys.stdout.write(MARK + json.dumps(message, default=str) + "\n")
        sys.stdout.flush()


def scenario(fn: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[fn.__name__] = fn
    return fn


class Control:
    """A scenario's line to the test: ``event`` tells it something, ``wait`` waits for a
    signal from it (bounded). Both belong to run ``run_id``."""

    def __init__(self, signals: queue.Queue, run_id: int):
        self._signals = signals
        self.run_id = run_id

    def event(self, name: str, **data: Any) -> None:
        emit({"event": name, **data, "id": self.run_id})

    def wait(self, name: str, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._signals.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise TimeoutError(f"no signal {name!r} from the test within {timeout:g} s") from None
            if message.get("signal") == name and message.get("id") == self.run_id:
                return message


def error_info(exc: BaseException, since: float) -> dict:
    """What a test asserts on for an expected error: class name, first line, seconds since ``since``."""
    return {
        "type": type(exc).__name__,
        "message": (str(exc).splitlines() or [""])[0][:400],
        "seconds": round(time.monotonic() - since, 3),
    }


def seed(rows: int, cols: int) -> DataProto:
    return DataProto.from_dict({"id": torch.arange(rows)}, meta_info={"cols": cols})


def rows_ok(out: DataProto, rows: int) -> bool:
    ids = out.batch["id"]
    return (
        len(ids) == rows
        and bool((ids == torch.arange(rows)).all())
        and bool((out.batch["x"] == ids.to(torch.float32)[:, None]).all())
    )


def measured(ctl: Control, step: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``step`` between the events ``ready`` and ``done``, once the test said ``go``
    (it reads the link counters in between); returns its value and seconds."""
    ctl.event("ready")
    ctl.wait("go", timeout=60)
    t0 = time.perf_counter()
    value = step()
    seconds = time.perf_counter() - t0
    ctl.event("done", seconds=round(seconds, 3))
    return value, seconds


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread; the dict gets ``value`` or ``error`` and ``t`` (monotonic)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the outcome is the measurement
            box["error"] = exc
        box["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def outcome(thread: threading.Thread, box: dict, t_down: float, until: float) -> dict:
    """Wait (until the monotonic time ``until``) for the call in ``thread``; what became of
    it: ``{"type": error class | "returned" | "pending", "message", "seconds"}`` (seconds
    after the link went down)."""
    thread.join(timeout=max(until - time.monotonic(), 0))
    if "error" in box:
        info = error_info(box["error"], t_down)
        info["seconds"] = round(box["t"] - t_down, 3)
        return info
    if "value" in box:
        return {"type": "returned", "message": "", "seconds": round(box["t"] - t_down, 3)}
    return {"type": "pending", "message": "", "seconds": round(time.monotonic() - t_down, 3)}


def wait_started(flag: str, ranks: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f"{flag}.r{r}.started") for r in range(ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the held call did not start on all {ranks} ranks within {timeout:g} s")
        time.sleep(0.05)


# ---------------------------------------------------------------- cluster


@scenario
def wait_for_workers(client: Client, ctl: Control, n: int, timeout_s: float = 120.0) -> list[str]:
    """Names of the cluster's workers once there are ``n``."""
    client.wait_for_workers(n, timeout=timeout_s)
    return sorted(str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values())


@scenario
def worker_names(client: Client, ctl: Control) -> list[str]:
    """Names of the workers in the cluster now."""
    return sorted(str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values())


@scenario
def workers_respond(client: Client, ctl: Control) -> dict:
    """Each worker's name and process id, asked through the scheduler."""
    names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    pids = client.run(os.getpid, on_error="raise") if names else {}
    return {names[a]: pid for a, pid in pids.items()}


@scenario
def clients(client: Client, ctl: Control) -> list[str]:
    """The client ids the scheduler holds now."""
    return client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.clients))


# ---------------------------------------------------------------- ranks and rendezvous


@scenario
def layout(client: Client, ctl: Control, world_size: int, workers: list[str] | None = None) -> dict:
    """Where each rank of a new group runs and what it sees."""
    with WorkerGroup(client, HostWorker, world_size=world_size, workers=workers) as wg:
        return {"ranks": wg.where(), "workers": wg.workers, "master": list(wg.master_addr_port)}


@scenario
def gloo(
    client: Client, ctl: Control, world_size: int, worker_env: dict | None = None, timeout_s: float = 8.0
):
    """A gloo process group over a new group's ranks: how each rank's rendezvous went
    (``ranks``: ``{"ok", "seconds", "error", "host_name_resolves_to"}``) and, where all
    joined, the all-gather."""
    with WorkerGroup(client, HostWorker, world_size=world_size, worker_env=worker_env) as wg:
        resolves = [r["host_name_resolves_to"] for r in wg.where()]
        ranks = [{**r, "host_name_resolves_to": a} for r, a in zip(wg.try_init_gloo(timeout_s), resolves)]
        gathered = wg.all_gather_rank() if all(r["ok"] for r in ranks) else None
        wg.destroy()
        return {"ranks": ranks, "gathered": gathered}


# ---------------------------------------------------------------- where the bytes go


@scenario
def fan_out(client: Client, ctl: Control, world_size: int, calls: int, rounds: int, bench: str) -> dict:
    """``benchmarks/fanout.py``'s rows, direct against host-leader fan-out (``bench``: its folder)."""
    sys.path.insert(0, bench)
    from fanout import measure

    return measure(client, None, world_size, calls, rounds)


@scenario
def blocking_result(client: Client, ctl: Control, workers: list[str], rows: int, cols: int) -> dict:
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:
        out, seconds = measured(ctl, lambda: wg.make_sync(seed(rows, cols)))
        return {"ok": rows_ok(out, rows), "seconds": seconds}


@scenario
def blocking_arguments(client: Client, ctl: Control, workers: list[str], rows: int, cols: int) -> dict:
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:
        batch = wg.make_sync(seed(rows, cols))
        out, seconds = measured(ctl, lambda: wg.summary(batch))
        return {"rows": sum(o["rows"] for o in out), "ok": all(o["ok"] for o in out), "seconds": seconds}


@scenario
def non_blocking_arguments(client: Client, ctl: Control, workers: list[str], rows: int, cols: int) -> dict:
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:
        batch = wg.make_sync(seed(rows, cols))

        def step():
            future = wg.echo_async(batch)
            wait(list(future.futures))
            return future

        future, seconds = measured(ctl, step)
        out = wg.summary(future)  # outside the measured step: only checks the rows arrived
        return {"rows": sum(o["rows"] for o in out), "ok": all(o["ok"] for o in out), "seconds": seconds}


@scenario
def future_get(client: Client, ctl: Control, workers: list[str], rows: int, cols: int) -> dict:
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:
        future = wg.make(seed(rows, cols))
        wait(list(future.futures))
        out, seconds = measured(ctl, future.get)
        return {"ok": rows_ok(out, rows), "seconds": seconds}


@scenario
def blocking_call_taking_future(
    client: Client, ctl: Control, workers: list[str], rows: int, cols: int
) -> dict:
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:
        future = wg.make(seed(rows, cols))
        wait(list(future.futures))
        out, seconds = measured(ctl, lambda: wg.echo(future))
        return {"ok": rows_ok(out, rows), "seconds": seconds}


@scenario
def reshard(
    client: Client, ctl: Control, producers: list[str], consumers: list[str], rows: int, cols: int
) -> dict:
    """Rows made by one group, read by another of a different size, the driver seeing
    only summaries."""
    with (
        WorkerGroup(client, BulkWorker, workers=producers) as made_by,
        WorkerGroup(client, BulkWorker, workers=consumers) as read_by,
    ):
        future = made_by.make(seed(rows, cols))
        wait(list(future.futures))
        out, seconds = measured(ctl, lambda: read_by.summary(future))
        return {
            "rows": [o["rows"] for o in out],
            "first": [o["first"] for o in out],
            "ok": all(o["ok"] for o in out),
            "seconds": seconds,
        }


@scenario
def chain(client: Client, ctl: Control, workers: list[str], rows: int, cols: int) -> dict:
    """make → echo_async → summary: the batch stays on the workers."""
    with WorkerGroup(client, BulkWorker, workers=workers) as wg:

        def step():
            return wg.summary(wg.echo_async(wg.make(seed(rows, cols))))

        out, seconds = measured(ctl, step)
        return {"rows": sum(o["rows"] for o in out), "ok": all(o["ok"] for o in out), "seconds": seconds}


# ---------------------------------------------------------------- detached groups


@scenario
def detached_build(client: Client, ctl: Control, name: str, world_size: int, value: int) -> list[str]:
    wg = WorkerGroup(client, HostWorker, world_size=world_size, detached=True, name=name)
    wg.set_value(value)
    return wg.workers


@scenario
def detached_attach(client: Client, ctl: Control, name: str) -> dict:
    t0 = time.perf_counter()
    wg = WorkerGroup.attach(client, name)
    attach_s = time.perf_counter() - t0
    values = wg.get_value()
    hostnames = [r["hostname"] for r in wg.where()]
    wg.shutdown()
    return {"attach_s": attach_s, "values": values, "hostnames": hostnames, "workers": wg.workers}


# ---------------------------------------------------------------- restart


@scenario
def restart(client: Client, ctl: Control, world_size: int, timeout_s: float = 10.0) -> dict:
    """A cross-host group's ranks before and after ``restart()``, and gloo over the new ones."""
    with WorkerGroup(
        client, HostWorker, world_size=world_size, worker_env={"GLOO_SOCKET_IFNAME": "eth0"}
    ) as wg:
        before = wg.where()
        t0 = time.perf_counter()
        wg.restart()
        seconds = time.perf_counter() - t0
        after = wg.where()
        wg.init_gloo(timeout_s)
        gathered = wg.all_gather_rank()
        wg.destroy()
        return {"before": before, "after": after, "seconds": seconds, "gathered": gathered}


# ---------------------------------------------------------------- partitions


@scenario
def partition_during_call(
    client: Client, ctl: Control, workers: list[str], flag: str, wait_s: float, mode: str
) -> dict:
    """A call in flight when the test takes a worker host's link down: ``mode``
    ``"blocking"`` (``wg.hold``) or ``"non-blocking"`` (``wg.hold_rows(...).get()``).
    Returns what became of it within ``wait_s`` seconds of the link going down."""
    wg = WorkerGroup(client, HostWorker, workers=workers)
    wg.ping()
    if mode == "blocking":
        thread, box = in_thread(lambda: wg.hold(flag, 120.0))
    else:
        rows = DataProto.from_dict(
            {"i": torch.arange(len(workers))}, meta_info={"flag": flag, "limit_s": 120.0}
        )
        future = wg.hold_rows(rows)
        thread, box = in_thread(future.get)
    wait_started(flag, len(workers))
    ctl.event("started")
    t_down = ctl.wait("down")["t"]
    return outcome(thread, box, t_down, t_down + wait_s)


@scenario
def partition_while_idle(
    client: Client, ctl: Control, workers: list[str], idle_s: float, wait_s: float
) -> dict:
    """A group idle when the link goes down; what becomes of its next call, made
    ``idle_s`` seconds later, within ``wait_s`` seconds of the link going down."""
    wg = WorkerGroup(client, HostWorker, workers=workers)
    wg.ping()
    ctl.event("started")
    t_down = ctl.wait("down")["t"]
    time.sleep(max(t_down + idle_s - time.monotonic(), 0))
    t_call = time.monotonic()
    thread, box = in_thread(wg.ping)
    result = outcome(thread, box, t_down, t_down + wait_s)
    result["seconds_after_call"] = round(result["seconds"] - (t_call - t_down), 3)
    return result


@scenario
def lost_call_then_new_group(client: Client, ctl: Control, workers: list[str], wait_s: float) -> dict:
    """A call in flight (sent on the test's ``call``, queued behind another driver's held
    call) when the link goes down; what became of it within ``wait_s`` seconds (event
    ``detected``); then, once the test says the link is back and the workers are still
    in the cluster, what a new group on the same workers does."""
    wg = WorkerGroup(client, HostWorker, workers=workers)
    wg.ping()
    ctl.event("built")
    ctl.wait("call")
    thread, box = in_thread(wg.ping)
    time.sleep(1.0)  # the request reaches the worker (where it waits its turn)
    ctl.event("started")
    t_down = ctl.wait("down")["t"]
    first = outcome(thread, box, t_down, t_down + wait_s)
    ctl.event("detected", **first)
    ctl.wait("healed")
    wg.shutdown()
    t0 = time.monotonic()
    try:
        with WorkerGroup(client, HostWorker, workers=workers) as again:
            again.ping()
        new_group = {"type": "returned", "message": "", "seconds": round(time.monotonic() - t0, 3)}
    except daskwg.WorkerGroupError as exc:
        new_group = error_info(exc, t0)
    return {"first": first, "new_group": new_group}


@scenario
def reconnect(client: Client, ctl: Control, workers: list[str], reconnect_s: float = 60.0) -> dict:
    """A group built before this driver's own link went down; once the test says it is
    back: whether the same client reconnected, and what the old group and a new group do."""
    wg = WorkerGroup(client, HostWorker, workers=workers)
    wg.ping()
    ctl.event("ready", client=client.id)
    ctl.wait("healed", timeout=180)
    t0 = time.monotonic()
    while client.status != "running" and time.monotonic() - t0 < reconnect_s:
        time.sleep(0.1)
    result: dict = {
        "status": client.status,
        "client": client.id,
        "reconnect_s": round(time.monotonic() - t0, 3),
    }
    t1 = time.monotonic()
    try:
        wg.ping()
        result["old_group"] = {"type": "returned", "message": "", "seconds": round(time.monotonic() - t1, 3)}
    except daskwg.WorkerGroupError as exc:
        result["old_group"] = error_info(exc, t1)
    wg.shutdown()
    t2 = time.monotonic()
    try:
        with WorkerGroup(client, HostWorker, workers=workers) as again:
            again.ping()
        result["new_group"] = {"type": "returned", "message": "", "seconds": round(time.monotonic() - t2, 3)}
    except daskwg.WorkerGroupError as exc:
        result["new_group"] = error_info(exc, t2)
    return result


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: multihost_driver.py <scheduler address>", file=sys.stderr)
        return 2
    runs: queue.Queue = queue.Queue()
    signals: queue.Queue = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip():
                message = json.loads(line)
                (runs if "run" in message else signals).put(message)
        runs.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    try:
        client = Client(argv[0], timeout=60)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        emit({"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()})
        return 1
    while (message := runs.get()) is not None:
        run_id = message.get("id")
        try:
            fn = SCENARIOS[message["run"]]
            result = fn(client, Control(signals, run_id), **message.get("args", {}))
            emit({"result": result, "id": run_id})
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
            emit(
                {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                    "id": run_id,
                }
            )
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
