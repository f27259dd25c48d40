"""Issue 20's figures on hosts made of network namespaces (root only; see tests/multihost.py).

    python benchmarks/multihost.py                  # everything, outages of 45 s
    python benchmarks/multihost.py --only bytes     # the get() figures alone
    python benchmarks/multihost.py --outage 60

The cluster is the one of tests/test_multihost.py: the scheduler on h0, two workers each
on h1 and h2, the drivers on h3 (and h4). It prints, for a 64 MiB result:

- the bytes each link carried during ``DataProtoFuture.get()`` and a blocking call, and
  the seconds each took, with h0's link free and capped at ``--cap`` (``tbf``);

and, with Dask's default timeouts and an outage of ``--outage`` seconds:

- what a driver sees, and after how many seconds of h2's link being down, for a blocking
  call, a non-blocking call and a group idle on h2 (one driver each, at once), and how
  many workers the cluster has once h2's link is back;
- what a driver whose own link was down that long sees when it calls its old group and
  builds a new one on the same client.

The tests assert the behaviour (loosely); this script measures it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

from multihost import MultiHost, unavailable_reason  # noqa: E402

WORKERS = ["h1-0", "h1-1", "h2-0", "h2-1"]
ROWS, COLS = 8192, 2048  # 64 MiB of float32


def measure(net: MultiHost, driver, scenario: str, **args) -> tuple[dict, dict]:
    driver.start(scenario, **args)
    driver.expect("ready", 300)
    before = net.counters()
    driver.signal("go")
    driver.expect("done", 300)
    moved = net.counters_since(before)
    return driver.result(300), moved


def bytes_figures(net: MultiHost, driver, cap: str, repeats: int) -> None:
    for capped in (False, True):
        if capped:
            net.limit_bandwidth("h0", cap)
        try:
            for scenario in ("future_get", "blocking_call_taking_future", "blocking_result"):
                runs = [
                    measure(net, driver, scenario, workers=WORKERS, rows=ROWS, cols=COLS)
                    for _ in range(repeats)
                ]
                seconds = statistics.median(r["seconds"] for r, _ in runs)
                moved = runs[-1][1]
                print(
                    f"{scenario:28s} h0 {'capped at ' + cap if capped else 'free':18s}: "
                    f"{seconds:6.2f} s (median of {repeats}); h0 {moved['h0']}; h3 {moved['h3']}",
                    flush=True,
                )
        finally:
            net.unlimit_bandwidth("h0")


def partition_figures(net: MultiHost, scheduler: str, driver, outage: float) -> None:
    flags = tempfile.mkdtemp(prefix="multihost-held-")
    drivers = {
        name: net.start_driver("h3", "multihost_driver.py", scheduler, name=f"h3-{name}")
        for name in ("blocking", "non-blocking", "idle")
    }
    drivers["idle"].start("partition_while_idle", workers=["h2-0"], idle_s=2.0, wait_s=outage + 30)
    drivers["idle"].expect("started", 300)
    held = {"blocking": ["h1-0", "h2-0"], "non-blocking": ["h1-1", "h2-1"]}
    for mode, workers in held.items():
        drivers[mode].start(
            "partition_during_call",
            workers=workers,
            flag=os.path.join(flags, mode),
            wait_s=outage + 30,
            mode=mode,
        )
    for mode in held:
        drivers[mode].expect("started", 300)
    net.link_down("h2")
    t_down = time.monotonic()
    try:
        for d in drivers.values():
            d.signal("down", t=t_down)
        time.sleep(outage)
    finally:
        net.link_up("h2")
    for name, d in drivers.items():
        r = d.result(120)
        print(
            f"h2 down {outage:g} s, {name:12s} call: {r['type']} after {r['seconds']:.1f} s {r['message'][:150]}"
        )
    for mode in held:
        open(os.path.join(flags, mode), "w").close()
    for d in drivers.values():
        d.close()
    shutil.rmtree(flags, ignore_errors=True)
    time.sleep(20)  # the time Dask's workers and nannies take to decide
    names = driver.call("worker_names")
    print(f"workers 20 s after h2's link came back: {names}", flush=True)


def driver_link_figures(net: MultiHost, scheduler: str, driver, outage: float) -> None:
    h4 = net.start_driver("h4", "multihost_driver.py", scheduler, name="h4")
    h4.start("reconnect", workers=["h1-0", "h1-1"])
    client = h4.expect("ready", 300)["client"]
    net.link_down("h4")
    t_down = time.monotonic()
    dropped = None
    try:
        while time.monotonic() - t_down < outage:
            if dropped is None and client not in driver.call("clients"):
                dropped = time.monotonic() - t_down
            time.sleep(1.0)
    finally:
        net.link_up("h4")
    h4.signal("healed")
    r = h4.result(300)
    dropped_s = "never" if dropped is None else f"{dropped:.1f} s"
    print(
        f"h4 (driver) down {outage:g} s: scheduler dropped its client after {dropped_s}; client {r['status']} again after "
        f"{r['reconnect_s']:.1f} s, same id: {r['client'] == client}; old group: {r['old_group']['type']} "
        f"{r['old_group']['message'][:100]}; new group: {r['new_group']['type']} {r['new_group']['message'][:150]}"
    )
    h4.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("bytes", "partition", "driver-link"), help="one part only")
    parser.add_argument("--outage", type=float, default=45.0, help="seconds a link stays down (default 45)")
    parser.add_argument("--cap", default="200mbit", help="tbf rate for h0's link (default 200mbit)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per byte measurement (default 3)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    with MultiHost(["h0", "h1", "h2", "h3", "h4"]) as net:
        scheduler = net.start_scheduler("h0")
        for host in ("h1", "h2"):
            net.start_workers(host, scheduler, nworkers=2)
        driver = net.start_driver("h3", "multihost_driver.py", scheduler, name="h3-main")
        driver.call("wait_for_workers", timeout=310, n=4, timeout_s=300)
        driver.call("layout", timeout=300, world_size=4)  # workers import torch and daskwg
        if args.only in (None, "bytes"):
            bytes_figures(net, driver, args.cap, args.repeats)
        if args.only in (None, "driver-link"):
            driver_link_figures(net, scheduler, driver, args.outage)
        if args.only in (None, "partition"):
            partition_figures(net, scheduler, driver, args.outage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
