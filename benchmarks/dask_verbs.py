"""Dask's own verbs on the futures of a non-blocking group call, against ``daskwg.get``.

4 ranks, a ``blocking=False`` ``ONE_TO_ALL`` call returning a small value, then its per-rank
futures are read with one of: ``daskwg.get``, ``client.gather``, ``distributed.wait`` +
``client.gather``, ``as_completed`` + ``Future.result``, ``[f.result() for f in futures]``.
The verbs take turns call by call (a busy machine slows them alike); medians in ms, and
each verb's ratio to ``daskwg.get``. Usage: ``python benchmarks/dask_verbs.py [calls]``.
"""

from __future__ import annotations

import statistics
import sys
import time

from distributed import Client, LocalCluster, as_completed, wait

import daskwg
from daskwg import Dispatch, Worker, WorkerGroup, register


class Echo(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def add(self, i: int) -> int:
        return i + self.rank


def _as_completed(client, futures):
    return [f.result() for f in as_completed(futures)]


VERBS = {
    "daskwg.get": lambda client, futures: daskwg.get(futures),
    "client.gather": lambda client, futures: client.gather(futures),
    "wait + gather": lambda client, futures: (wait(futures), client.gather(futures))[1],
    "as_completed": _as_completed,
    "f.result()": lambda client, futures: [f.result() for f in futures],
}


def main(calls: int = 300) -> dict[str, float]:
    with (
        LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        wg = WorkerGroup(client, Echo, world_size=4)
        samples: dict[str, list[float]] = {name: [] for name in VERBS}
        for i in range(calls + 20):
            for name, verb in VERBS.items():
                t0 = time.perf_counter()
                values = verb(client, wg.add(i))
                elapsed = time.perf_counter() - t0
                assert sorted(values) == [i, i + 1, i + 2, i + 3], values
                if i >= 20:  # warm-up
                    samples[name].append(elapsed)
        wg.shutdown()
    medians = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    base = medians["daskwg.get"]
    for name, ms in medians.items():
        print(f"{name:>14}: {ms:7.2f} ms  ({ms / base:.2f}x daskwg.get)")
    return medians


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
