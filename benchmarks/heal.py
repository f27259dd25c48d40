"""The ``heal`` row of ``benchmarks/run.py``: a rank's process SIGKILLed, until the group
answers a gloo ``all_reduce`` over every rank again, four ways, in one run on one cluster:

* ``heal``: ``wg.heal()`` with no free worker but the killed one, which its Nanny
  restarts (a process start and the imports are paid);
* ``heal_spare``: ``wg.heal()`` onto a warm spare (``wg.keep_spares(1)``);
* ``restart``: ``wg.restart()`` (every rank's process replaced), then the process group;
* ``rebuild``: ``wg.shutdown()`` and a new ``WorkerGroup`` once the Nanny has restarted the
  killed worker, then the process group.

Each from the ``SIGKILL`` to the ``all_reduce``'s answer, the driver's error included.
Run alone (``python benchmarks/heal.py --out X.json``) or through ``run.py --rows heal``.
The worker class is defined here and travels by value (``__main__``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time


def make_class():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from daskwg import Dispatch, Worker, register

    class HealBench(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def pid(self) -> int:
            return os.getpid()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_pg(self) -> bool:
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("gloo", timeout=timedelta(seconds=20))
            return True

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def all_reduce(self) -> float:
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        def on_membership_change(self, event) -> None:
            dist.init_process_group("gloo", timeout=timedelta(seconds=20))

    return HealBench


def _kill_and_fail(wg, rank: int) -> float:
    """SIGKILL ``rank``'s process; returns the time of the kill after the call that fails."""
    from daskwg import WorkerGroupError

    pid = wg.pid()[rank]
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    try:
        wg.all_reduce()
    except WorkerGroupError:
        pass
    else:
        raise AssertionError("the call after the SIGKILL answered")
    return t0


def _answer(wg, n: int) -> None:
    out = wg.all_reduce()
    if out != [float(n)] * n:
        raise AssertionError(f"all_reduce answered {out}")


def measure(world_size: int, reps: int) -> dict:
    from distributed import Client, LocalCluster

    from daskwg import WorkerGroup

    cls = make_class()
    samples: dict[str, list[float]] = {"heal": [], "heal_spare": [], "restart": [], "rebuild": []}
    load = [round(x, 2) for x in os.getloadavg()]
    with (
        LocalCluster(
            n_workers=world_size + 1, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        client.wait_for_workers(world_size + 1, timeout=300)
        for _ in range(reps):
            # heal, nothing free: the extra worker is taken by a one-rank group.
            wg = WorkerGroup(client, cls, world_size=world_size)
            wg.init_pg()
            extra = [a for a in client.scheduler_info(n_workers=-1)["workers"] if a not in wg.workers]
            blocker = WorkerGroup(client, cls, workers=extra[:1])
            t0 = _kill_and_fail(wg, 1)
            wg.heal(timeout=300)
            _answer(wg, world_size)
            samples["heal"].append(time.perf_counter() - t0)
            blocker.shutdown()
            # heal onto a warm spare.
            client.wait_for_workers(world_size + 1, timeout=300)
            wg.keep_spares(1)
            t0 = _kill_and_fail(wg, 1)
            wg.heal(timeout=300)
            _answer(wg, world_size)
            samples["heal_spare"].append(time.perf_counter() - t0)
            wg.keep_spares(0)
            # restart: every rank's process replaced.
            client.wait_for_workers(world_size + 1, timeout=300)
            t0 = _kill_and_fail(wg, 1)
            wg.restart()
            wg.init_pg()
            _answer(wg, world_size)
            samples["restart"].append(time.perf_counter() - t0)
            # rebuild: a new group once the Nanny has restarted the killed worker.
            t0 = _kill_and_fail(wg, 1)
            wg.shutdown()
            client.wait_for_workers(world_size + 1, timeout=300)
            wg = WorkerGroup(client, cls, world_size=world_size)
            wg.init_pg()
            _answer(wg, world_size)
            samples["rebuild"].append(time.perf_counter() - t0)
            wg.shutdown()
            client.wait_for_workers(world_size + 1, timeout=300)
    return {
        "world_size": world_size,
        "samples": samples,
        "load_start": load,
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }


def report(result: dict) -> str:
    """The markdown table: median seconds and the ratio to ``restart()`` of each way."""
    import statistics

    s = {k: statistics.median(v) for k, v in result["samples"].items()}
    restart = s["restart"]
    rows = [
        ("`wg.heal()`, the killed worker restarted by its Nanny", "heal"),
        ("`wg.heal()` onto a warm spare (`keep_spares(1)`)", "heal_spare"),
        ("`wg.restart()`", "restart"),
        ("`shutdown()` + a new `WorkerGroup`", "rebuild"),
    ]
    n = len(result["samples"]["restart"])
    lines = [
        f"| SIGKILL of rank 1 of {result['world_size']} → an `all_reduce` answered ({n} rep(s), median) "
        "| s | ÷ `restart()` |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {s[key]:.2f} | {s[key] / restart:.2f} |" for label, key in rows]
    lines.append(
        f"\nLoad average (1, 5, 15 min): {result['load_start']} at the start, {result['load_end']} at the end. "
        "Goal: heal ≤ 0.25× `restart()`, ≤ 10 s with a warm spare."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", help="write the samples here (JSON)")
    args = parser.parse_args()
    result = measure(args.world_size, args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(report(result))


if __name__ == "__main__":
    main()
