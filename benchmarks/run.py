"""daskwg vs verl's RayWorkerGroup, side by side, on this machine.

    python benchmarks/run.py                              # print the table
    python benchmarks/run.py --write docs/performance.md  # and write the report

The same worker logic (:func:`make_worker_class`) is registered with each system's own
``Worker``/``register``/``Dispatch`` and driven with the same calls. Each system runs
in its own driver subprocess (``--child daskwg|verl``), and the peak-RSS measurement
gets one more fresh subprocess per system (``--child X --rss``), so neither
system's imports, threads or memory affect the other's numbers.

How "bytes through the driver" is measured: before and after the call, the driver sums
``tcpi_bytes_received`` and ``tcpi_bytes_acked`` (Linux ``TCP_INFO``) over every TCP
socket it owns (``psutil.Process().net_connections()`` gives the file descriptors).
These are the kernel's per-socket byte counters, so they count everything the driver
received or sent whatever library did it (Dask's comm, Ray's gRPC). Ray can also move
objects to a same-host process through shared memory, which no socket counter sees, so
the driver's RSS growth during the call is reported next to it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1 << 20
COLS = 4096
SHAPES = {"1024x16": (1024, 16), "4096x4096": (4096, 4096), "16384x4096": (16384, 4096)}
CHAIN_ROWS = 4096  # group A produces [4096, 4096] float32 = 67 MB
RANKS = (1, 2, 4)

# Repetitions per measurement (after one warm-up call). Sized so that the whole
# run, both systems, stays well under 15 minutes on 2 cores.
REPS = {
    "latency": 200,
    "1024x16": 40,
    "4096x4096": 7,
    "16384x4096": 3,
    "chain": 5,
    "create": 3,
}


# ----------------------------------------------------------------------- worker logic


def make_worker_class(Worker: type, register: Any, Dispatch: Any, DataProto: type) -> type:
    """The benchmark worker, built on one system's ``Worker``/``register``/``Dispatch``."""
    import torch

    class BenchWorker(Worker):
        def __init__(self):
            super().__init__()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def echo(self, x):
            return x

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def inplace(self, data):
            data.batch["x"].add_(1.0)
            return data

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def produce(self, data):
            rows = len(data)
            return DataProto.from_dict(tensors={"x": torch.full((rows, COLS), float(self.rank) + 1.0)})

        @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
        def consume(self, data):
            return float(data.batch["x"].sum())

    return BenchWorker


def make_plane_class(Worker: type, register: Any, Dispatch: Any, DataProto: type) -> type:
    """The data-plane benchmark worker (resharding, chains, views), on one system's API."""
    import torch

    class PlaneWorker(Worker):
        def __init__(self):
            super().__init__()
            self.big = None

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def produce(self, seed):
            ids = seed.batch["i"]
            x = ids.to(torch.float32)[:, None].expand(-1, COLS).contiguous()
            return DataProto.from_dict(tensors={"x": x, "id": ids.clone()})

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def derive(self, data):
            return DataProto.from_dict(tensors={"y": data.batch["id"] * 10})

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def echo_async(self, data):
            return data

        @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
        def consume(self, data):
            # Exact check of every row: x[i, :] == id[i] (and y == 10 id where present).
            ids = data.batch["id"].to(torch.float32)
            ok = bool((data.batch["x"] == ids[:, None]).all())
            if "y" in data.batch.keys():
                ok = ok and bool((data.batch["y"] == data.batch["id"] * 10).all())
            return (float(data.batch["id"].sum()), len(data), ok)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def rx(self):
            return tcp_bytes()[0]

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def make_big(self, elements):
            self.big = torch.zeros(elements, dtype=torch.float32)
            return elements

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def view(self):
            return self.big[:16]

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def view_clone(self):
            return self.big[:16].clone()

    return PlaneWorker


# ----------------------------------------------------------------------- measuring


def tcp_bytes() -> tuple[int, int]:
    """(received, sent) bytes over all TCP sockets of this process, from ``TCP_INFO``."""
    import psutil

    rx = tx = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0:
            continue
        try:
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        except OSError:
            continue
        finally:
            sock.detach()
        if len(info) >= 136:
            # struct tcp_info: tcpi_bytes_acked at offset 120, tcpi_bytes_received at 128.
            acked, received = struct.unpack_from("QQ", info, 120)
            rx += received
            tx += acked
    return rx, tx


class PeakRSS:
    """Polls this process's RSS every millisecond in a thread; ``peak`` in bytes."""

    def __init__(self):
        import psutil

        self._proc = psutil.Process()
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def timeit(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------- the systems


class DaskSystem:
    name = "daskwg"

    def start(self, n_workers: int) -> None:
        import dask
        from distributed import Client

        import daskwg

        dask.config.set({"distributed.worker.daemon": False, "distributed.logging.distributed": "error"})
        self.daskwg = daskwg
        self.cluster = daskwg.local_cluster(n_workers, dashboard_address=":0")
        self.client = Client(self.cluster)
        self.client.wait_for_workers(n_workers)
        self.cls = make_worker_class(daskwg.Worker, daskwg.register, daskwg.Dispatch, daskwg.DataProto)
        self.DataProto = daskwg.DataProto

    def group(self, n: int):
        pool = self.daskwg.ResourcePool(self.client, world_size=n)
        return self.group_on(pool)

    def api(self) -> tuple:
        d = self.daskwg
        return d.Worker, d.register, d.Dispatch, d.DataProto

    def split_pool(self, sizes: list[int]):
        pools = self.daskwg.ResourcePool(self.client, world_size=sum(sizes)).split(sizes)
        return pools

    def pool(self, n: int):
        return self.daskwg.ResourcePool(self.client, world_size=n)

    def group_on(self, pool):
        return self.daskwg.WorkerGroup(self.client, self.daskwg.ClassWithInitArgs(self.cls), workers=pool)

    def close_group(self, wg) -> None:
        wg.shutdown()

    def close_pool(self, pool) -> None:
        pass

    def stop(self) -> None:
        self.client.close()
        self.cluster.close()

    def versions(self) -> dict:
        import dask
        import distributed

        import daskwg

        return {
            "daskwg": daskwg.__version__,
            "dask": dask.__version__,
            "distributed": distributed.__version__,
        }


class VerlSystem:
    name = "verl"

    def start(self, n_workers: int) -> None:
        import ray

        # verl's RayResourcePool reserves max_colocate_count (10) logical CPUs per rank.
        ray.init(num_cpus=10 * n_workers, include_dashboard=False, log_to_driver=False, logging_level="error")
        from verl import DataProto
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, register

        self.ray = ray
        self._api = (Worker, register, Dispatch, DataProto)
        self.cls = make_worker_class(Worker, register, Dispatch, DataProto)
        self.remote_cls = ray.remote(self.cls)
        self.DataProto = DataProto

    def pool(self, n: int):
        from verl.single_controller.ray import RayResourcePool

        return RayResourcePool([n], use_gpu=False)

    def group(self, n: int):
        return self.group_on(self.pool(n))

    def api(self) -> tuple:
        return self._api

    def split_pool(self, sizes: list[int]):
        return [self.pool(n) for n in sizes]

    def group_on(self, pool):
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        return RayWorkerGroup(pool, RayClassWithInitArgs(cls=self.remote_cls))

    def close_group(self, wg) -> None:
        for actor in wg.workers:
            self.ray.kill(actor)

    def close_pool(self, pool) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in pool.pgs or []:
            remove_placement_group(pg)

    def stop(self) -> None:
        self.ray.shutdown()

    def versions(self) -> dict:
        from importlib.metadata import version

        import ray
        import tensordict
        import torch

        return {
            "verl": version("verl"),
            "ray": ray.__version__,
            "tensordict": tensordict.__version__,
            "torch": torch.__version__,
        }


SYSTEMS = {"daskwg": DaskSystem, "verl": VerlSystem}

# Data plane: a [PLANE_ROWS, 4096] float32 batch (64 MiB) on 6 worker processes /
# actors, producers and consumers on different ones; a 1 GiB tensor for the view case.
PLANE_ROWS = 4096
PLANE_WORKERS = 6
VIEW_ELEMENTS = 1 << 28
PLANE_REPS = {"reshard": 5, "chain": 5, "roundtrip": 5, "view": 5}


def _wait_all(system, fut) -> None:
    if system.name == "daskwg":
        from distributed import wait

        wait(list(fut.futures))
    else:
        system.ray.wait(list(fut.futures), num_returns=len(fut.futures))


def run_plane_child(name: str) -> dict:
    """Resharding, a union/select chain, a driver round trip and a returned view."""
    import torch

    torch.set_num_threads(1)
    system = SYSTEMS[name]()
    system.start(PLANE_WORKERS)
    cls = make_plane_class(*system.api())
    system.cls = cls
    if name == "verl":
        system.remote_cls = system.ray.remote(cls)
    samples: dict[str, list[float]] = {}
    extra: dict[str, Any] = {}
    rows = PLANE_ROWS
    batch_bytes = rows * (COLS * 4 + 8)
    seed = system.DataProto.from_dict(tensors={"i": torch.arange(rows)})
    expected = float(rows * (rows - 1) // 2)

    def check(metrics, what):
        total = sum(m[0] for m in metrics)
        if total != expected or sum(m[1] for m in metrics) != rows or not all(m[2] for m in metrics):
            raise AssertionError(f"{what}: wrong rows ({total} != {expected})")

    for m, n in ((4, 2), (2, 4)):
        p_pool, c_pool = system.split_pool([m, n])
        producers, consumers = system.group_on(p_pool), system.group_on(c_pool)
        times, per_rank = [], []
        for rep in range(PLANE_REPS["reshard"] + 1):
            fut = producers.produce(seed)
            _wait_all(system, fut)
            before = consumers.rx()
            t = time.perf_counter()
            metrics = consumers.consume(fut)
            elapsed = time.perf_counter() - t
            after = consumers.rx()
            check(metrics, f"reshard {m}->{n}")
            if rep:
                times.append(elapsed)
                per_rank.append(max(b - a for a, b in zip(before, after)))
            del fut
        samples[f"reshard {m}->{n}"] = times
        extra[f"reshard {m}->{n}"] = {"max_rank_rx": per_rank, "share": batch_bytes / n}
        system.close_group(producers)
        system.close_group(consumers)
        system.close_pool(p_pool)
        system.close_pool(c_pool)

    # Chain: P (dp 2) produces, derives y, the union of both (x, y, id) feeds C (dp 2).
    p_pool, c_pool = system.split_pool([2, 2])
    producers, consumers = system.group_on(p_pool), system.group_on(c_pool)
    times, driver_rx, growth = [], [], []
    for rep in range(PLANE_REPS["chain"] + 1):
        r0, _ = tcp_bytes()
        with PeakRSS() as mem:
            t = time.perf_counter()
            fa = producers.produce(seed)
            fb = producers.derive(fa)
            if name == "daskwg":
                batch = fa.union(fb).select(batch_keys=["x", "y", "id"])
            else:  # verl's DataProtoFuture has no union/select: the driver materialises both
                batch = fa.get().union(fb.get()).select(batch_keys=["x", "y", "id"])
            metrics = consumers.consume(batch)
            elapsed = time.perf_counter() - t
        r1, _ = tcp_bytes()
        check(metrics, "chain")
        if rep:
            times.append(elapsed)
            driver_rx.append(r1 - r0)
            growth.append(mem.peak - mem.baseline)
        del fa, fb, batch
    samples["chain union/select"] = times
    extra["chain union/select"] = {"driver_rx": driver_rx, "rss_growth": growth, "batch": batch_bytes}
    system.close_group(consumers)

    # Non-blocking round trip from the driver: P.echo_async(batch).get().
    data = system.DataProto.from_dict(tensors={"x": torch.ones(rows, COLS), "id": torch.arange(rows)})
    times, held = [], []
    for rep in range(PLANE_REPS["roundtrip"] + 1):
        t = time.perf_counter()
        fut = producers.echo_async(data)
        if name == "daskwg":
            held.append(system.client.run_on_scheduler(_task_spec_bytes))
        out = fut.get()
        elapsed = time.perf_counter() - t
        if not torch.equal(out.batch["x"], data.batch["x"]):
            raise AssertionError("round trip changed the batch")
        if rep:
            times.append(elapsed)
        del fut, out
    samples["driver round trip"] = times
    extra["driver round trip"] = {"scheduler_task_bytes": held}
    system.close_group(producers)
    system.close_pool(p_pool)
    system.close_pool(c_pool)

    # A 16-element view of a big tensor, returned, against a 16-element clone.
    pool = system.pool(1)
    wg = system.group_on(pool)
    wg.make_big(VIEW_ELEMENTS)
    for label, fn in (("view of big tensor", wg.view), ("16-element clone", wg.view_clone)):
        times = []
        for rep in range(PLANE_REPS["view"] + 1):
            t = time.perf_counter()
            out = fn()
            if rep:
                times.append(time.perf_counter() - t)
        samples[label] = times
        extra[label] = {"bytes": int(out[0].numel() * out[0].element_size())}
    system.close_group(wg)
    system.close_pool(pool)
    system.stop()
    return {"samples": samples, "extra": extra, "view_elements": VIEW_ELEMENTS, "rows": rows}


def _task_spec_bytes(dask_scheduler) -> int:
    import pickle

    return sum(len(pickle.dumps(ts.run_spec)) for ts in dask_scheduler.tasks.values() if ts.run_spec)


def build_plane_report(d: dict, v: dict | None) -> tuple[str, dict]:
    """The data-plane table (daskwg and, where given, verl) and its verdicts."""
    verdicts = {}
    lines = [
        "| data plane | daskwg median (min–max) | verl median (min–max) | daskwg/verl | bytes |",
        "|---|---|---|---|---|",
    ]
    for key, ds in d["samples"].items():
        vs = v["samples"].get(key) if v else None
        ratio = f"{statistics.median(ds) / statistics.median(vs):.2f}" if vs else ""
        e = d["extra"].get(key, {})
        notes = ""
        if key.startswith("reshard"):
            worst = max(e["max_rank_rx"]) / e["share"]
            notes = f"daskwg: max received by a consumer rank {worst:.2f}× its share"
            if v:
                ve = v["extra"][key]
                notes += (
                    f"; verl: {max(ve['max_rank_rx']) / ve['share']:.2f}× (TCP only; Ray uses shared memory)"
                )
            verdicts[f"{key} bytes ≤ 1.25× share"] = worst <= 1.25
            if vs:
                verdicts[f"{key} time ≤ 0.25× verl"] = statistics.median(ds) <= 0.25 * statistics.median(vs)
        elif key == "chain union/select":
            share = max(e["driver_rx"]) / e["batch"]
            notes = (
                f"daskwg driver+scheduler received {fmt_b(max(e['driver_rx']))} ({share:.1%} of the batch)"
            )
            if v:
                ve = v["extra"][key]
                notes += (
                    f"; verl driver {fmt_b(max(ve['driver_rx']))}, RSS growth {fmt_b(max(ve['rss_growth']))}"
                )
            verdicts["chain < 1% through the driver"] = share < 0.01
        elif key == "driver round trip":
            notes = f"scheduler holds {fmt_b(max(e['scheduler_task_bytes']))} of task specs"
            verdicts["scheduler holds < 1 MiB"] = max(e["scheduler_task_bytes"]) < MB
        lines.append(f"| {key} | {cell(ds)} | {cell(vs) if vs else 'n/a'} | {ratio} | {notes} |")
    view, clone = d["samples"].get("view of big tensor"), d["samples"].get("16-element clone")
    if view and clone:
        verdicts["view costs ≤ 1.5× a clone"] = statistics.median(view) <= 1.5 * statistics.median(clone)
    return "\n".join(lines), verdicts


def batch(system, shape) -> Any:
    import torch

    return system.DataProto.from_dict(tensors={"x": torch.zeros(shape, dtype=torch.float32)})


def run_child(name: str, ranks: tuple[int, ...]) -> dict:
    import torch

    torch.set_num_threads(1)
    system = SYSTEMS[name]()
    results: dict[str, Any] = {"samples": {}, "extra": {}}
    samples = results["samples"]
    t0 = time.perf_counter()
    system.start(max(ranks))
    results["extra"]["runtime_start_s"] = time.perf_counter() - t0
    results["versions"] = system.versions()

    for n in ranks:
        pool = system.pool(n)
        wg = system.group_on(pool)
        samples[f"latency/{n}"] = timeit(functools.partial(wg.echo, 1), REPS["latency"])
        for label, shape in SHAPES.items():
            data = batch(system, shape)
            samples[f"{label}/{n}"] = timeit(functools.partial(wg.inplace, data), REPS[label])
            del data
        # chain: group B on the same pool (same processes for daskwg, same placement
        # group for verl) consumes what group A left on the workers.
        wg_b = system.group_on(pool)
        seed = system.DataProto.from_dict(tensors={"i": torch.arange(CHAIN_ROWS)})
        expected = sum(float(r + 1) * (CHAIN_ROWS // n) * COLS for r in range(n))

        def chain(wg=wg, wg_b=wg_b, seed=seed, expected=expected):
            fut = wg.produce(seed)
            metrics = wg_b.consume(fut)
            if abs(sum(metrics) - expected) > 1e-3 * expected:
                raise AssertionError(f"chain result {sum(metrics)} != {expected}")

        chain()
        times, rx, tx, rss = [], [], [], []
        for _ in range(REPS["chain"]):
            r0, s0 = tcp_bytes()
            with PeakRSS() as mem:
                t = time.perf_counter()
                chain()
                times.append(time.perf_counter() - t)
            r1, s1 = tcp_bytes()
            rx.append(r1 - r0)
            tx.append(s1 - s0)
            rss.append(mem.peak - mem.baseline)
        samples[f"chain/{n}"] = times
        results["extra"][f"chain/{n}"] = {"rx": rx, "tx": tx, "rss_growth": rss}
        system.close_group(wg_b)
        system.close_group(wg)
        system.close_pool(pool)

    n = max(ranks)
    times = []
    for _ in range(REPS["create"]):
        t = time.perf_counter()
        pool = system.pool(n)
        wg = system.group_on(pool)
        wg.echo(1)
        times.append(time.perf_counter() - t)
        system.close_group(wg)
        system.close_pool(pool)
    samples[f"create/{n}"] = times
    system.stop()
    return results


def run_rss_child(name: str, n: int) -> dict:
    """Driver memory during one [16384, 4096] float32 round trip, in a fresh process."""
    import torch

    torch.set_num_threads(1)
    system = SYSTEMS[name]()
    system.start(n)
    wg = system.group(n)
    wg.inplace(batch(system, (64, 16)))  # warm up the call path with a tiny batch
    shape = SHAPES["16384x4096"]
    with PeakRSS() as mem:
        data = batch(system, shape)
        out = wg.inplace(data)
    ok = bool(out.batch["x"][0, 0] == 1.0)
    del out, data
    result = {
        "batch_bytes": shape[0] * shape[1] * 4,
        "baseline": mem.baseline,
        "peak": mem.peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "ok": ok,
    }
    system.close_group(wg)
    system.stop()
    return result


# ----------------------------------------------------------------------- report


def machine() -> dict:
    import psutil

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def fmt_s(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def fmt_b(x: float) -> str:
    if abs(x) >= MB:
        return f"{x / MB:.1f} MiB"
    if abs(x) >= 1024:
        return f"{x / 1024:.0f} KiB"
    return f"{x:.0f} B"


def cell(samples: list[float]) -> str:
    return f"{fmt_s(statistics.median(samples))} ({fmt_s(min(samples))}–{fmt_s(max(samples))})"


TARGETS = {"latency/4": 0.5, "4096x4096/": 0.25, "16384x4096/": 0.25, "chain/": 0.25, "create/": 1.0}
LABELS = {
    "latency": "small call (ONE_TO_ALL echo)",
    "1024x16": "round trip [1024,16] f32 (64 KiB)",
    "4096x4096": "round trip [4096,4096] f32 (64 MiB)",
    "16384x4096": "round trip [16384,4096] f32 (256 MiB)",
    "chain": "chain A→B, 64 MiB DataProtoFuture",
    "create": "create group + first call",
}


def target_for(key: str) -> float | None:
    for prefix, target in TARGETS.items():
        if key.startswith(prefix):
            return target
    return None


def build_report(res: dict, rss: dict, mach: dict) -> tuple[str, dict]:
    d, v = res["daskwg"], res["verl"]
    lines = [
        "| benchmark | ranks | daskwg median (min–max) | verl median (min–max) | daskwg/verl | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = {}
    for key in d["samples"]:
        bench, n = key.split("/")
        ds, vs = d["samples"][key], v["samples"][key]
        ratio = statistics.median(ds) / statistics.median(vs)
        target = target_for(key)
        met = "" if target is None else ("yes" if ratio <= target else "**no**")
        if target is not None:
            verdicts[key] = ratio <= target
        lines.append(
            f"| {LABELS[bench]} | {n} | {cell(ds)} | {cell(vs)} | {ratio:.2f} | "
            f"{'' if target is None else f'≤ {target}'} | {met} |"
        )
    table = "\n".join(lines)

    lines = [
        "| chain | ranks | daskwg: driver TCP in / out, RSS growth | verl: driver TCP in / out, RSS growth |",
        "|---|---|---|---|",
    ]
    batch_bytes = CHAIN_ROWS * COLS * 4
    for key in d["extra"]:
        if not key.startswith("chain/"):
            continue
        n = key.split("/")[1]
        cells = []
        for sysres, name in ((d, "daskwg"), (v, "verl")):
            e = sysres["extra"][key]
            rx, tx, growth = max(e["rx"]), max(e["tx"]), max(e["rss_growth"])
            cells.append(f"{fmt_b(rx)} / {fmt_b(tx)}, {fmt_b(growth)}")
            if name == "daskwg":
                verdicts[f"chain-bytes/{n}"] = rx + tx < 0.01 * batch_bytes
        lines.append(f"| {LABELS['chain']} | {n} | {cells[0]} | {cells[1]} |")
    bytes_table = "\n".join(lines)

    lines = [
        "| driver memory, 256 MiB round trip, 4 ranks | daskwg | verl |",
        "|---|---|---|",
    ]
    rd, rv = rss["daskwg"], rss["verl"]
    lines.append(f"| RSS before the batch exists | {fmt_b(rd['baseline'])} | {fmt_b(rv['baseline'])} |")
    lines.append(f"| peak RSS (1 ms polling) | {fmt_b(rd['peak'])} | {fmt_b(rv['peak'])} |")
    lines.append(f"| peak RSS (ru_maxrss) | {fmt_b(rd['ru_maxrss'])} | {fmt_b(rv['ru_maxrss'])} |")
    growth = {k: (r["peak"] - r["baseline"]) / r["batch_bytes"] for k, r in rss.items()}
    lines.append(
        f"| peak growth / batch size (target ≤ 2.5) | {growth['daskwg']:.2f}× | {growth['verl']:.2f}× |"
    )
    verdicts["rss"] = growth["daskwg"] <= 2.5
    rss_table = "\n".join(lines)
    lines = [
        "| runtime start (not in any row above) | daskwg | verl |",
        "|---|---|---|",
        f"| `local_cluster(4)` + `Client` / `ray.init` | {fmt_s(d['extra']['runtime_start_s'])} | "
        f"{fmt_s(v['extra']['runtime_start_s'])} |",
    ]
    start_table = "\n".join(lines)
    return "\n\n".join([table, bytes_table, rss_table, start_table]), verdicts


DISCUSSION = """\
## How it is measured

* One script, `benchmarks/run.py`; each system runs in its own driver subprocess, one
  after the other, and the peak-RSS case in one more fresh subprocess per system.
* The worker class is the same code for both systems (`make_worker_class`), registered
  with each system's `Worker`, `register` and `Dispatch`. daskwg runs on
  `daskwg.local_cluster(4)` (a process `LocalCluster`, one thread per worker); verl on
  `ray.init()` with `RayResourcePool([n], use_gpu=False)`, `RayClassWithInitArgs` and
  `RayWorkerGroup`. Groups of 1, 2 and 4 ranks use the first 1, 2, 4 Dask workers / a
  new placement group. Torch uses one thread in every driver.
* Every timing is wall-clock time of the blocking group call in the driver, after one
  warm-up call; medians and min–max over the repetitions in `REPS`.
* Round trips: `DP_COMPUTE_PROTO` over a DataProto of float32 zeros; every rank adds 1
  to its piece in place and returns it; the driver gets the concatenation back.
* Chain: group A (`blocking=False`) produces a `[4096, 4096]` float32 DataProto from a
  4096-row seed; group B (built on the same pool: same Dask workers / same Ray
  placement group) consumes the returned future and returns one float per rank
  (`DP_COMPUTE_METRIC`). The time covers both calls.
* Bytes through the driver: the sum of the kernel's `TCP_INFO` counters
  (`tcpi_bytes_received`, `tcpi_bytes_acked`) over every TCP socket the driver owns,
  taken before and after the chain (largest of the repetitions). Those count every byte
  whichever library sent it. Same-host Ray can hand objects over through shared memory,
  invisible to socket counters, so the driver's RSS growth during the chain is shown
  too: a 64 MiB batch passing through the driver would show in one or the other.
* Driver memory: RSS polled every millisecond by a thread (and `ru_maxrss`) in a fresh
  process; "growth" is the peak minus the RSS just before the batch was created, so
  the batch itself counts as 1×.
* Data plane (a separate driver subprocess per system, 6 Dask workers / Ray actors,
  producers and consumers on different processes, a `[4096, 4096]` float32 batch):
  *reshard m→n* times the consuming `DP_COMPUTE_METRIC` call on a finished
  `DataProtoFuture` of a dp-`m` group, consumed by a dp-`n` group, and reports the most
  any consumer process received over TCP (`TCP_INFO`, read by a method of the rank
  itself) against its share of the batch; Ray can move objects between same-host
  processes through shared memory, which no socket counter sees. *chain union/select*:
  `produce` (`blocking=False`), `derive` on its output, the union of both selected to
  `x, y, id` and consumed by a second group; daskwg composes the futures lazily, verl
  (whose `DataProtoFuture` has no `union`/`select`) materialises both in the driver.
  *driver round trip*: `echo_async(batch).get()`, with the bytes of task specs the Dask
  scheduler holds meanwhile. *view*: a rank returns `self.big[:16]` of a 1 GiB tensor,
  next to returning a 16-element clone.
* Group creation: a 4-rank group on an already started runtime, plus its first call.
  For Ray that includes starting one actor process per rank (that is what a
  `RayWorkerGroup` is); Dask workers already exist and the group instantiates the class
  inside them. Starting the runtime itself is listed separately.
"""


def write_report(path: str, report: str, verdicts: dict, res: dict, mach: dict, wall: float) -> None:
    versions = {**res["verl"]["versions"], **res["daskwg"]["versions"]}
    numpy_v = __import__("numpy").__version__
    versions["numpy"] = numpy_v
    ok = [k for k, v in verdicts.items() if v]
    missed = [k for k, v in verdicts.items() if not v]
    text = [
        "# Performance: daskwg vs verl's RayWorkerGroup",
        "",
        "Generated by `python benchmarks/run.py --write docs/performance.md` "
        "(`tox -e bench`); do not edit by hand.",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram_gib']} GiB RAM, no GPU; "
        f"{mach['os']}, Python {mach['python']}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ".",
        "",
        f"Whole run: {wall:.0f} s.",
        "",
        "## Results",
        "",
        report,
        "",
        "## Targets",
        "",
        "Small-call latency at 4 ranks ≤ 0.5× verl; 64 MiB and 256 MiB round trips ≤ 0.25×; "
        "chain ≤ 0.25× with none of the batch passing through the driver; group creation "
        "≤ 1.0×; driver peak RSS growth ≤ 2.5× the batch during the 256 MiB round trip.",
        "",
        f"Met: {', '.join(ok) or 'none'}.",
        "",
        f"Missed: {', '.join(missed) or 'none'}.",
        "",
        DISCUSSION,
    ]
    notes = os.path.join(HERE, "NOTES.md")
    if os.path.exists(notes):
        with open(notes) as f:
            text += ["", f.read().strip()]
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")


def spawn(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--out", out], check=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the markdown report here")
    parser.add_argument("--systems", default="daskwg,verl")
    parser.add_argument("--child", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plane", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--only-plane", action="store_true", help="run only the data-plane cases (reshard, chain, views)"
    )
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also save the raw samples here")
    parser.add_argument("--from-json", metavar="PATH", help="report from saved samples, run nothing")
    args = parser.parse_args()
    ranks = tuple(int(r) for r in args.ranks.split(","))
    if args.quick:
        global PLANE_ROWS, VIEW_ELEMENTS
        for k in REPS:
            REPS[k] = max(1, REPS[k] // 10)
        for k in PLANE_REPS:
            PLANE_REPS[k] = 1
        PLANE_ROWS, VIEW_ELEMENTS = 1024, 1 << 24

    if args.child:
        if args.plane:
            result = run_plane_child(args.child)
        elif args.rss:
            result = run_rss_child(args.child, max(ranks))
        else:
            result = run_child(args.child, ranks)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    t0 = time.time()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        res, rss, wall = saved["results"], saved["rss"], saved["wall_s"]
        report, verdicts = build_report(res, rss, saved["machine"])
        if saved.get("plane"):
            plane = saved["plane"]
            table, plane_verdicts = build_plane_report(plane["daskwg"], plane.get("verl"))
            report += "\n\n" + table
            verdicts.update(plane_verdicts)
        print(report)
        if args.write:
            write_report(args.write, report, verdicts, res, saved["machine"], wall)
        return
    passthrough = ["--ranks", args.ranks] + (["--quick"] if args.quick else [])
    systems = args.systems.split(",")
    res, rss, plane = {}, {}, {}
    for name in systems:
        print(f"[bench] {name}: data plane", flush=True)
        plane[name] = spawn(["--child", name, "--plane", *passthrough])
    if args.only_plane:
        table, plane_verdicts = build_plane_report(plane["daskwg"], plane.get("verl"))
        print(table)
        print("\nmet:", plane_verdicts)
        return
    for name in systems:
        print(f"[bench] {name}: timings", flush=True)
        res[name] = spawn(["--child", name, *passthrough])
        print(f"[bench] {name}: driver memory", flush=True)
        rss[name] = spawn(["--child", name, "--rss", *passthrough])
    mach = machine()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"results": res, "rss": rss, "plane": plane, "machine": mach, "wall_s": time.time() - t0}, f
            )
    if set(systems) != {"daskwg", "verl"}:
        for name in systems:
            for key, samples in res[name]["samples"].items():
                print(f"{name:7s} {key:14s} {cell(samples)}")
            r = rss[name]
            print(f"{name:7s} rss growth/batch {(r['peak'] - r['baseline']) / r['batch_bytes']:.2f}")
        return
    report, verdicts = build_report(res, rss, mach)
    table, plane_verdicts = build_plane_report(plane["daskwg"], plane.get("verl"))
    report += "\n\n" + table
    verdicts.update(plane_verdicts)
    print(report)
    print("\nmet:", {k: v for k, v in verdicts.items()})
    if args.write:
        write_report(args.write, report, verdicts, res, mach, time.time() - t0)
        print(f"[bench] wrote {args.write}")


if __name__ == "__main__":
    main()
