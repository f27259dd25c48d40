"""Host-leader fan-out against direct sends (issue 46): driver CPU and wall per blocking call.

    python benchmarks/fanout.py --local 8 16            # one host: a local cluster per size
    python benchmarks/fanout.py --hosts 2x4 2x8          # hosts as network namespaces (root)
    python benchmarks/fanout.py --local 8 --calls 200 --rounds 7

Rows, per cluster and ``daskwg.fan-out`` mode (``direct``: one message and one reply per
rank; ``host``: one message per host to its leader, ``daskwg/transport/leader.py``):

- ``one_to_all``: ``wg.foo(1, 2)``, a small ``ONE_TO_ALL`` call (every rank returns an int);
- ``dp_proto``: ``wg.add_rank(batch)``, a ``DP_COMPUTE_PROTO`` call of a 64-row batch.

Per row: the median over ``--rounds`` rounds of the wall seconds per call, and the driver
process's CPU seconds per call (``time.process_time``: every thread of the driver, its
calling thread and the client's event loop; the scheduler and the workers run in processes
of their own, as ``dask scheduler`` and ``dask worker``). The modes take turns round by round, so a
load that comes and goes weighs on both alike. With ``--hosts HxR``: the scheduler in one
namespace, ``H`` hosts of ``R`` worker processes each, the driver in a namespace of its own
(every byte between the driver and a worker crosses a veth pair and a bridge).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, os.pardir, "tests")
sys.path.insert(0, TESTS)

MODES = ("direct", "host")


def measure(client, workers: list[str] | None, world_size: int, calls: int, rounds: int) -> dict:
    """Per row and mode: ``{"wall_ms", "cpu_ms"}`` per call (medians over the rounds)."""
    import dask
    import torch
    from workers import AddWorker

    from daskwg import DataProto, WorkerGroup

    batch = DataProto.from_dict({"a": torch.arange(64)})
    rows = {"one_to_all": lambda wg: wg.foo(1, 2), "dp_proto": lambda wg: wg.add_rank(batch)}
    out: dict = {}
    with WorkerGroup(client, AddWorker, world_size=world_size, workers=workers) as wg:
        for row, call in rows.items():
            walls: dict[str, list[float]] = {m: [] for m in MODES}
            cpus: dict[str, list[float]] = {m: [] for m in MODES}
            seen = []
            for mode in MODES:  # warm: streams open, leader streams open
                with dask.config.set({"daskwg.fan-out": mode}):
                    for _ in range(20):
                        result = call(wg)
                seen.append(result if isinstance(result, list) else result.batch["a"].tolist())
            if seen[0] != seen[1]:
                raise AssertionError(f"{row}: direct gave {seen[0]}, host {seen[1]}")
            for _ in range(rounds):
                for mode in MODES:
                    with dask.config.set({"daskwg.fan-out": mode}):
                        c0, t0 = time.process_time(), time.perf_counter()
                        for _ in range(calls):
                            call(wg)
                        walls[mode].append((time.perf_counter() - t0) / calls)
                        cpus[mode].append((time.process_time() - c0) / calls)
            out[row] = {
                m: {"wall_ms": 1e3 * statistics.median(walls[m]), "cpu_ms": 1e3 * statistics.median(cpus[m])}
                for m in MODES
            }
    return out


def show(label: str, result: dict) -> None:
    for row, modes in result.items():
        d, h = modes["direct"], modes["host"]
        print(
            f"{label:22s} {row:10s} wall/call direct {d['wall_ms']:7.2f} ms  host {h['wall_ms']:7.2f} ms "
            f"({h['wall_ms'] / d['wall_ms']:.2f}x)   driver CPU/call direct {d['cpu_ms']:6.2f} ms  "
            f"host {h['cpu_ms']:6.2f} ms ({h['cpu_ms'] / d['cpu_ms']:.2f}x)",
            flush=True,
        )


def local(sizes: list[int], calls: int, rounds: int) -> None:
    # The scheduler and workers in processes of their own (``dask scheduler``, ``dask
    # worker``), as on a real cluster: a LocalCluster's scheduler and nannies would run in
    # the driver's process and count in its CPU time.
    from conftest import CLICluster
    from distributed import Client

    for n in sizes:
        cluster = CLICluster(n)
        try:
            with Client(cluster.address, timeout=120) as client:
                client.wait_for_workers(n, timeout=600)
                show(f"1 host x {n} ranks", measure(client, None, n, calls, rounds))
        finally:
            cluster.close()


def hosts(layouts: list[str], calls: int, rounds: int) -> None:
    from multihost import MultiHost, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"--hosts skipped: {reason}", file=sys.stderr)
        return
    for layout in layouts:
        n_hosts, per_host = (int(x) for x in layout.split("x"))
        names = [f"h{i}" for i in range(n_hosts + 2)]  # scheduler, worker hosts, driver
        with MultiHost(names) as net:
            scheduler = net.start_scheduler(names[0])
            for host in names[1:-1]:
                net.start_workers(host, scheduler, nworkers=per_host)
            driver = net.start_driver(names[-1], "multihost_driver.py", scheduler)
            world = n_hosts * per_host
            driver.call("wait_for_workers", timeout=610, n=world, timeout_s=600)
            result = driver.call(
                "fan_out", timeout=1200, world_size=world, calls=calls, rounds=rounds, bench=HERE
            )
            show(f"{n_hosts} hosts x {per_host} ranks", result)
            driver.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local", type=int, nargs="*", default=[], help="ranks of one-host clusters")
    parser.add_argument("--hosts", nargs="*", default=[], help="HxR: H namespace hosts of R ranks (root)")
    parser.add_argument("--calls", type=int, default=100, help="calls per round (default 100)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode (default 5)")
    args = parser.parse_args(argv)
    if not args.local and not args.hosts:
        args.local = [8, 16]
    local(args.local, args.calls, args.rounds)
    hosts(args.hosts, args.calls, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
