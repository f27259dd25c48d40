"""daskwg vs verl's RayWorkerGroup, side by side, on this machine.

    python benchmarks/run.py                              # print the tables
    python benchmarks/run.py --write docs/performance.md  # and write the report
    python benchmarks/run.py --rows weights,broadcast     # only some rows (see --help)
    python benchmarks/run.py --rows heal --systems daskwg # SIGKILL -> healed group (benchmarks/heal.py)

The same worker logic (:func:`make_worker_class`, :func:`make_rows_class`) is registered
with each system's own ``Worker``/``register``/``Dispatch`` and driven with the same
calls. Each system runs in its own driver subprocess (``--child daskwg|verl``), and the
peak-RSS measurement gets one more fresh subprocess per system (``--child X --rss``),
so neither system's imports, threads or memory affect the other's numbers.

Two kinds of sections:

* **Rows measured in several runs** (``--runs``, default 3): the per-call rows, the data
  plane, broadcast and weight sync (:func:`run_rows_child`, 6 Dask workers / Ray
  actors), each run with a fresh driver subprocess per system and the physical floors
  of this machine measured in a subprocess of their own in the same run
  (``benchmarks/floors.py``). Ratios are computed per run (daskwg ÷ verl and daskwg ÷
  floor) and reported run by run, with the load average at the start and end of each
  run.
* **Rows measured once** (``timings``: round trips at 1, 2, 4 ranks, the A→B chain,
  group creation; ``rss``: driver memory), after the runs.

How "bytes through the driver" is measured: before and after the call, the driver sums
``tcpi_bytes_received`` and ``tcpi_bytes_acked`` (Linux ``TCP_INFO``) over every TCP
socket it owns (``psutil.Process().net_connections()`` gives the file descriptors).
These are the kernel's per-socket byte counters, so they count everything the driver
received or sent whatever library did it (Dask's comm, Ray's gRPC). Ray can also move
objects to a same-host process through shared memory, which no socket counter sees (so
does daskwg, for a whole value that ranks on other workers of the producer's host take:
weights, ``daskwg.shared-memory``), so the driver's RSS growth during the call is reported next to it. A rank's process is
measured the same way by a method of the rank itself (``net``), which is how the
source egress of a broadcast or weight sync is counted.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
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

# Repetitions per measurement of the once-measured sections (after one warm-up call).
# verl's 256 MiB round trips (seconds each) and group creations (an actor process per
# rank) are most of their time.
REPS = {
    "latency": 100,
    "1024x16": 20,
    "4096x4096": 5,
    "16384x4096": 2,
    "chain": 5,
    "create": 2,
}

# The rows measured in every run (--rows picks a subset), each a key of ROW_REPS:
# repetitions per run, after one warm-up. Sized so that the default `tox -e bench`
# (3 runs plus the once-measured sections) stays under about 15 minutes on 2 cores.
ROW_REPS = {
    "one_to_all": 200,
    "nonblocking": 300,  # a 0.2 s window (100 calls) took one load transient whole: 0.39-0.41 -> 0.62
    "chain6": 30,
    "seq8": 40,
    "dp64": 5,
    "reshard": 4,
    "broadcast": 2,  # daskwg: seconds per 256 MiB broadcast on 2 cores
    "weights": 2,  # ... per route and case
    "union": 4,
    "roundtrip": 4,
    "view": 1,  # verl returns the whole 1 GiB tensor behind a view: seconds per call
}
# Warm-up repetitions of the weight rows: the 4 loading ranks keep the weights they loaded
# until the next ones replace them (as a rollout keeps serving the old weights while the
# new arrive), so a steady state holds two sets; until both exist, every set lands in
# memory the process never had. Both systems get the same warm-up.
WEIGHT_WARMUPS = 2
ONCE = ("timings", "rss", "grpo", "scale", "sharded-sync", "heal")  # measured once, after the runs
GRPO_STEPS = 30  # steps of each examples/grpo.py run of the "grpo" measurement
PLANE_ROWS_NAMES = ("reshard", "union", "roundtrip", "view")  # what --only-plane selects
ROWS_WORKERS = 6  # Dask workers of a rows run: a 4-rank and a 2-rank group side by side
TINY_ROWS = 16  # rows of the tiny batch of the 6-call chain
SEQ_CALLS = 8  # calls per sequence of the seq8 row
WEIGHT_BYTES = 256 * MB  # the state dict of the broadcast and weight-sync rows
WEIGHT_TENSORS = 32  # ... as this many float32 tensors of 8 MiB


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

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def echo_proto(self, data):
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


def make_rows_class(Worker: type, register: Any, Dispatch: Any, DataProto: type, Execute: Any) -> type:
    """The worker of the rows measured in every run, on one system's API.

    It extends the data-plane worker (:func:`make_plane_class`) with tiny calls, the
    6 stages of an RL step, a per-rank counter for call sequences and a state dict
    that a trainer rank hands out and rollout ranks load.
    """
    import torch

    def grow(data, **cols):
        # Each stage returns what it received plus its own column, as verl's trainer
        # unions stage outputs into the batch.
        tensors = {k: data.batch[k] for k in data.batch.keys()}
        tensors.update(cols)
        return DataProto.from_dict(tensors=tensors)

    class RowsWorker(make_plane_class(Worker, register, Dispatch, DataProto)):
        def __init__(self):
            super().__init__()
            self.weights = None
            self.loaded = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def echo(self, x):
            return x

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def echo_nonblocking(self, x):
            return x

        @register(dispatch_mode=Dispatch.DP_COMPUTE)
        def tick(self, x):
            return x + 1

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def inplace(self, data):
            data.batch["x"].add_(1.0)
            return data

        # -- an RL step of 6 calls, tiny data, each taking the previous call's future --

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def generate(self, data):
            return grow(data, responses=data.batch["prompts"] + 1.0)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def reward(self, data):
            return grow(data, scores=data.batch["responses"].sum(-1))

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def advantage(self, data):
            return grow(data, advantages=data.batch["scores"] * 0.5)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def log_prob(self, data):
            return grow(data, old_log_probs=data.batch["responses"] * -0.01)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def ref_log_prob(self, data):
            return grow(data, ref_log_probs=data.batch["responses"] * -0.02)

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def update(self, data):
            b = data.batch
            loss = (b["advantages"][:, None] * (b["old_log_probs"] - b["ref_log_probs"])).sum(-1)
            return DataProto.from_dict(tensors={"loss": loss})

        # -- weights: a trainer's state dict, rollout ranks loading it --

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def net(self):
            return tcp_bytes()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_weights(self, nbytes, tensors):
            per = nbytes // tensors // 4
            self.weights = {f"layer{i}.weight": torch.zeros(per) for i in range(tensors)}
            return nbytes

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def bump(self, version):
            # A new version in place, as an optimizer step updates parameters in place.
            for t in self.weights.values():
                t[0] = version
                t[-1] = version

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
        def get_weights(self):
            from tensordict import TensorDict

            return TensorDict(self.weights, batch_size=[])

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_weights(self, weights):
            from tensordict import TensorDictBase

            if not isinstance(weights, TensorDictBase):
                kind = type(weights)
                raise TypeError(f"load_weights got a {kind.__module__}.{kind.__name__}, not a TensorDict")
            versions = {float(t[0]) for t in weights.values()} | {float(t[-1]) for t in weights.values()}
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            self.loaded = weights
            return (versions.pop() if len(versions) == 1 else None, nbytes)

        # -- weights over a cross-group collective (daskwg.create_collective_group) --

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
        def send_weights(self, name):
            from daskwg import collective

            for t in self.weights.values():
                collective.broadcast(t, 0, name)
            return sum(t.numel() * t.element_size() for t in self.weights.values())

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def receive_weights(self, name, nbytes, tensors):
            from daskwg import collective

            per = nbytes // tensors // 4
            buffers = getattr(self, "received", None)
            if buffers is None or len(buffers) != tensors or buffers[0].numel() != per:
                buffers = self.received = [torch.empty(per) for _ in range(tensors)]
            for t in buffers:
                collective.broadcast(t, 0, name)
            versions = {float(t[0]) for t in buffers} | {float(t[-1]) for t in buffers}
            return (versions.pop() if len(versions) == 1 else None, sum(t.numel() * 4 for t in buffers))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def drop(self):
            self.weights = self.loaded = self.big = self.received = None

    return RowsWorker


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


class NoRSS:
    """:class:`PeakRSS`'s interface without its polling thread, for the timed repetitions:
    a thread that takes the GIL every millisecond in each of 8 processes on 2 cores delays
    the GIL's hand-back after every socket wait (tens of ms per sync of a small model)."""

    baseline = peak = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


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

    def start(self, n_workers: int, slots: int | None = None) -> None:
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
        return d.Worker, d.register, d.Dispatch, d.DataProto, d.Execute

    def gather(self, futures: Any) -> Any:
        """``daskwg.get`` where this daskwg has it (Ray's ``ray.get``), else Dask's gather."""
        get = getattr(self.daskwg, "get", None)
        return get(futures) if get is not None else self.client.gather(futures)

    def wait(self, futures: list) -> None:
        from distributed import wait

        wait(futures)

    def rows_pools(self) -> dict:
        """A 4-rank and a 2-rank pool on different workers, a 1-rank pool on the
        2-rank pool's first worker and a 2-rank pool on the 4-rank pool's first two."""
        p4, p2 = self.daskwg.ResourcePool(self.client, world_size=ROWS_WORKERS).split([4, 2])
        return {
            "g4": p4,
            "g2": p2,
            "g1": self.daskwg.ResourcePool(self.client, workers=p2.workers[:1]),
            "c2": self.daskwg.ResourcePool(self.client, workers=p4.workers[:2]),
        }

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

    def start(self, n_workers: int, slots: int | None = None) -> None:
        import ray

        # verl's RayResourcePool reserves max_colocate_count (10) logical CPUs per rank;
        # ``slots``: how many ranks may exist at once (default ``n_workers``).
        ray.init(
            num_cpus=10 * (slots or n_workers),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="error",
        )
        from verl import DataProto
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, Execute, register

        self.ray = ray
        self._api = (Worker, register, Dispatch, DataProto, Execute)
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

    def gather(self, futures: Any) -> Any:
        return self.ray.get(futures)

    def wait(self, futures: list) -> None:
        self.ray.wait(futures, num_returns=len(futures))

    def rows_pools(self) -> dict:
        """The pools of :meth:`DaskSystem.rows_pools`; with Ray every group is its own actors."""
        return {"g4": self.pool(4), "g2": self.pool(2), "g1": self.pool(1), "c2": self.pool(2)}

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

# ----------------------------------------------------------------------- rows of every run

# Data plane: a [PLANE_ROWS, 4096] float32 batch (64 MiB) on 6 worker processes /
# actors, producers and consumers on different ones; a 1 GiB tensor for the view case.
PLANE_ROWS = 4096
VIEW_ELEMENTS = 1 << 28
PLANE_KEYS = (
    "reshard 4->2",
    "reshard 2->4",
    "chain union/select",
    "driver round trip",
    "view of big tensor",
    "16-element clone",
)


class RouteUnavailable(Exception):
    """A route the installed daskwg (or Ray) does not offer: its row prints n/a and why."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


def _wait_all(system, fut) -> None:
    system.wait(list(fut.futures))


def _expect(got: Any, want: Any, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


class Rows:
    """One rows child: the system, its groups (built on first use) and what was measured.

    Groups, on :meth:`DaskSystem.rows_pools`: ``g4`` (4 ranks: the per-call rows, the
    consumers of reshard 2->4 and the rollout of broadcast and weight sync), ``g2`` (2
    ranks on two other workers: reshard 4->2's consumers, the 2-rank trainer, the
    union/select producers), ``g1`` (1 rank: the 1-rank trainer and broadcast source,
    the returned view) and ``c2`` (2 ranks: the union/select consumers).
    """

    def __init__(self, system):
        self.system = system
        self.samples: dict[str, list[float]] = {}
        self.extra: dict[str, dict] = {}
        self.na: dict[str, str] = {}
        self._pools = system.rows_pools()
        self._groups: dict[str, Any] = {}

    def group(self, key: str):
        if key not in self._groups:
            self._groups[key] = self.system.group_on(self._pools[key])
        return self._groups[key]

    def close(self) -> None:
        for wg in self._groups.values():
            self.system.close_group(wg)
        for pool in self._pools.values():
            self.system.close_pool(pool)


def row_one_to_all(r: Rows) -> None:
    wg = r.group("g4")
    r.samples["one_to_all"] = timeit(lambda: _expect(wg.echo(1), [1] * 4, "echo"), ROW_REPS["one_to_all"])


def row_nonblocking(r: Rows) -> None:
    wg = r.group("g4")

    def once():
        _expect(list(r.system.gather(wg.echo_nonblocking(1))), [1] * 4, "echo_nonblocking")

    r.samples["nonblocking"] = timeit(once, ROW_REPS["nonblocking"])


def _rl_seed(system) -> tuple[Any, Any]:
    """The tiny batch of the 6-call chain and the ``loss`` its last stage must return."""
    import torch

    prompts = torch.arange(TINY_ROWS * 8, dtype=torch.float32).reshape(TINY_ROWS, 8)
    responses = prompts + 1.0
    advantages = responses.sum(-1) * 0.5
    loss = (advantages[:, None] * (responses * -0.01 - responses * -0.02)).sum(-1)
    return system.DataProto.from_dict(tensors={"prompts": prompts}), loss


def chain6_ordinary(system, wg, seed) -> Any:
    """generate → reward → advantage → log-prob → ref-log-prob → update, each a
    ``blocking=False`` call taking the previous call's ``DataProtoFuture``; the last one
    is gathered in the driver."""
    fut = wg.generate(seed)
    for stage in (wg.reward, wg.advantage, wg.log_prob, wg.ref_log_prob, wg.update):
        fut = stage(fut)
    return fut.get()


_PLANS: dict[tuple[str, int], Any] = {}  # (route, id of the group) -> its recorded step


def chain6_plan(system, wg, seed) -> Any:
    """The same 6 calls recorded once as a ``daskwg.plan`` (the step's input: the batch) and
    replayed; returns the replayed step's gathered output (a DataProto with ``loss``)."""
    if getattr(system.daskwg, "plan", None) is None:
        raise RouteUnavailable("this daskwg has no daskwg.plan (issue 22)")
    step = _PLANS.get(("chain6", id(wg)))
    if step is None:
        with system.daskwg.plan("chain6") as step:
            fut = wg.generate(step.input("batch"))
            for stage in (wg.reward, wg.advantage, wg.log_prob, wg.ref_log_prob, wg.update):
                fut = stage(fut)
            step.output(fut)
        _PLANS[("chain6", id(wg))] = step
        step.run(batch=seed).get()  # the first replay learns each stage's rows, call by call
    out = step.run(batch=seed).get()
    if step.route != "one message per worker":
        raise AssertionError(f"the chain6 plan replayed {step.route}")
    return out


def row_chain6(r: Rows) -> None:
    import torch

    wg = r.group("g4")
    seed, loss = _rl_seed(r.system)
    routes = [("chain6", chain6_ordinary)]
    if r.system.name == "daskwg":
        routes.append(("chain6 plan", chain6_plan))
    for key, route in routes:

        def once(route=route, key=key):
            out = route(r.system, wg, seed)
            if not torch.allclose(out.batch["loss"], loss):
                raise AssertionError(f"{key}: wrong loss {out.batch['loss'].tolist()}")

        try:
            r.samples[key] = timeit(once, ROW_REPS["chain6"])
        except RouteUnavailable as exc:
            r.na[key] = str(exc)


def seq_ordinary(system, wg, reps: int) -> list[float]:
    """8 ordinary blocking calls; each rank's counter goes 0 → 8 (``DP_COMPUTE``)."""
    n = wg.world_size

    def once():
        xs = [0] * n
        for _ in range(SEQ_CALLS):
            xs = wg.tick(xs)
        _expect(list(xs), [SEQ_CALLS] * n, "tick")

    return [t / SEQ_CALLS for t in timeit(once, reps)]


def seq_plan(system, wg, reps: int) -> list[float]:
    """:func:`seq_ordinary`'s 8 calls recorded once as a ``daskwg.plan`` (per-rank input
    ``[0] * 4``), replayed ``reps`` times after one warm-up, each checked to give ``[8] * 4``;
    returns the seconds per call (replay time / 8)."""
    if getattr(system.daskwg, "plan", None) is None:
        raise RouteUnavailable("this daskwg has no daskwg.plan (issue 22)")
    n = wg.world_size
    with system.daskwg.plan("seq8") as step:
        xs = step.input("xs")
        for _ in range(SEQ_CALLS):
            xs = wg.tick(xs)
        step.output(xs)

    def once():
        _expect(list(step.run(xs=[0] * n)), [SEQ_CALLS] * n, "tick plan")

    once()
    if step.route != "one message per worker":
        raise AssertionError(f"the seq8 plan replayed {step.route}")
    return [t / SEQ_CALLS for t in timeit(once, reps)]


def seq_compiled_graph(system, wg, reps: int) -> list[float]:
    """The same 8-stage shape as a Ray Compiled Graph over the group's actors: stage k of
    every actor takes that actor's stage k-1 output (``tick.bind``), the graph's input
    is 0 and its outputs are the 4 last stages (``MultiOutputNode``)."""
    try:
        from ray.dag import InputNode, MultiOutputNode
    except ImportError as exc:
        raise RouteUnavailable(f"ray.dag does not import here: {_first_line(exc)}") from None
    actors = list(wg.workers)
    with InputNode() as inp:
        outs = [a.tick.bind(inp) for a in actors]
        for _ in range(SEQ_CALLS - 1):
            outs = [a.tick.bind(o) for a, o in zip(actors, outs)]
        dag = MultiOutputNode(outs)
    try:
        compiled = dag.experimental_compile()
    except Exception as exc:  # noqa: BLE001 - any failure to compile means: not available here
        raise RouteUnavailable(
            f"Ray Compiled Graphs do not work here: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    try:

        def once():
            _expect(list(system.ray.get(compiled.execute(0))), [SEQ_CALLS] * len(actors), "compiled graph")

        return [t / SEQ_CALLS for t in timeit(once, reps)]
    finally:
        compiled.teardown()


SEQ_ROUTES = (
    ("seq8", ("daskwg", "verl"), seq_ordinary),
    ("seq8 plan", ("daskwg",), seq_plan),
    ("seq8 compiled graph", ("verl",), seq_compiled_graph),
)


def row_seq8(r: Rows) -> None:
    wg = r.group("g4")
    for key, systems, route in SEQ_ROUTES:
        if r.system.name not in systems:
            continue
        try:
            r.samples[key] = route(r.system, wg, ROW_REPS["seq8"])
        except RouteUnavailable as exc:
            r.na[key] = str(exc)


def row_dp64(r: Rows) -> None:
    import torch

    wg = r.group("g4")
    data = r.system.DataProto.from_dict(tensors={"x": torch.zeros(PLANE_ROWS, COLS)})
    r.samples["dp64"] = timeit(functools.partial(wg.inplace, data), ROW_REPS["dp64"])
    r.extra["dp64"] = {"bytes": PLANE_ROWS * COLS * 4}


def _plane_check(metrics, what: str, rows: int) -> None:
    expected = float(rows * (rows - 1) // 2)
    total = sum(m[0] for m in metrics)
    if total != expected or sum(m[1] for m in metrics) != rows or not all(m[2] for m in metrics):
        raise AssertionError(f"{what}: wrong rows ({total} != {expected})")


def row_reshard(r: Rows) -> None:
    """A finished ``DataProtoFuture`` of a dp-m group consumed by a dp-n group on other processes."""
    import torch

    rows = PLANE_ROWS
    batch_bytes = rows * (COLS * 4 + 8)
    seed = r.system.DataProto.from_dict(tensors={"i": torch.arange(rows)})
    for producers, consumers, key in (("g4", "g2", "reshard 4->2"), ("g2", "g4", "reshard 2->4")):
        producers, consumers = r.group(producers), r.group(consumers)
        times, per_rank = [], []
        for rep in range(ROW_REPS["reshard"] + 1):
            fut = producers.produce(seed)
            _wait_all(r.system, fut)
            before = consumers.rx()
            t = time.perf_counter()
            metrics = consumers.consume(fut)
            elapsed = time.perf_counter() - t
            after = consumers.rx()
            _plane_check(metrics, key, rows)
            if rep:
                times.append(elapsed)
                per_rank.append(max(b - a for a, b in zip(before, after)))
            del fut
        r.samples[key] = times
        r.extra[key] = {"max_rank_rx": per_rank, "share": batch_bytes / consumers.world_size}


def _egress(wg) -> int:
    """TCP bytes the processes of ``wg``'s ranks have sent so far (each rank its own process)."""
    return sum(tx for _, tx in wg.net())


def _check_loaded(out: list, version: int, what: str) -> None:
    want = [(float(version), WEIGHT_BYTES)] * len(out)
    _expect([(v, n) for v, n in out], want, what)


def shared_value(system, fut) -> Any:
    """A single-rank future as an argument every rank of the next call resolves: in
    daskwg the documented ``DataProtoFuture.concat([future])``; in verl the ObjectRef
    itself (Ray resolves refs passed to actor calls)."""
    if system.name == "daskwg":
        return system.daskwg.DataProtoFuture.concat([fut])
    return fut


def row_broadcast(r: Rows) -> None:
    """A 256 MiB state dict already on one rank, loaded by the 4 ranks of another group."""
    src, dst = r.group("g1"), r.group("g4")
    src.init_weights(WEIGHT_BYTES, WEIGHT_TENSORS)
    times, egress, driver = [], [], []
    for rep in range(ROW_REPS["broadcast"] + WEIGHT_WARMUPS):
        src.bump(rep + 1)
        fut = src.get_weights()
        r.system.wait([fut])
        arg = shared_value(r.system, fut)
        s0, d0 = _egress(src), tcp_bytes()[1]
        t = time.perf_counter()
        out = dst.load_weights(arg)
        elapsed = time.perf_counter() - t
        s1, d1 = _egress(src), tcp_bytes()[1]
        _check_loaded(out, rep + 1, "broadcast")
        if rep >= WEIGHT_WARMUPS:
            times.append(elapsed)
            egress.append(s1 - s0)
            driver.append(d1 - d0)
        del fut, arg, out
    dst.drop()
    r.samples["broadcast"] = times
    r.extra["broadcast"] = {"source_tx": egress, "driver_tx": driver, "bytes": WEIGHT_BYTES}


# Weight sync: one function per route; each loads the trainer's current weights into
# every rollout rank and returns ``load_weights``' per-rank results, or raises
# RouteUnavailable (its rows then print n/a with the reason).


def ws_future(system, trainer, rollout) -> list:
    """The trainer's future itself as the argument, ``load_weights(get_weights())``.

    This is Ray's route: the ObjectRef that ``get_weights`` returns is stored once in
    the trainer's object store and every rollout actor resolves it. daskwg resolves
    plain futures in call arguments on the ranks once issue 17 lands; a daskwg where
    that fails prints n/a with the error.
    """
    if system.name != "daskwg":
        return rollout.load_weights(trainer.get_weights())
    d = system.daskwg
    try:
        return rollout.load_weights(trainer.get_weights())
    except (d.RankError, d.DispatchError) as exc:
        # "rank 0 (tcp://...) raised in 'load_weights': TypeError: ..." -> the part after the method.
        why = _first_line(exc).split("': ", 1)[-1]
        raise RouteUnavailable(f"fails in this daskwg: {type(exc).__name__}: {why}") from None


def ws_concat(system, trainer, rollout) -> list:
    """daskwg's documented route: ``load_weights(DataProtoFuture.concat([get_weights()]))``;
    every rollout rank fetches the weights from the trainer's worker itself."""
    return rollout.load_weights(system.daskwg.DataProtoFuture.concat([trainer.get_weights()]))


def ws_driver(system, trainer, rollout) -> list:
    """Through the driver: the weights are gathered into the driver, then sent to every rank."""
    return rollout.load_weights(system.gather(trainer.get_weights()))


def ws_collective(system, trainer, rollout) -> list:
    """A torch broadcast over a collective of trainer rank 0 and the rollout ranks, declared
    by the driver (``daskwg.create_collective_group``, ``ray.util.collective``'s shape; built
    in the first warm-up repetition, then reused): trainer rank 0 broadcasts each tensor of its
    state dict, every rollout rank receives into buffers of its own. Returns the rollout
    ranks' ``(version, bytes)`` as ``load_weights`` does."""
    d = system.daskwg
    if getattr(d, "create_collective_group", None) is None:
        raise RouteUnavailable("this daskwg has no cross-group collective (issue 17)")
    name = f"bench-weights-{trainer.name}"
    collectives = system.__dict__.setdefault("collectives", {})
    if name not in collectives:
        collectives[name] = d.create_collective_group([(trainer, 0), rollout], name=name)
    sent = trainer.send_weights(name)
    received = rollout.receive_weights(name, WEIGHT_BYTES, WEIGHT_TENSORS)
    d.get(sent)
    return d.get(received)


def ws_relay(system, trainer, rollout) -> list:
    """A data-plane broadcast relayed along a chain of the rollout ranks, each fetching from
    the previous one over TCP: the route between hosts. On one host daskwg's data plane
    hands the weights over in shared memory (``daskwg.shared-memory``; the ``future`` and
    ``concat`` routes), so this route turns that off."""
    import dask

    if "shared-memory" not in dask.config.get("daskwg", {}):
        raise RouteUnavailable("this daskwg relays by itself: the future and concat routes are relayed")
    with dask.config.set({"daskwg.shared-memory": False}):
        return rollout.load_weights(system.daskwg.DataProtoFuture.concat([trainer.get_weights()]))


WEIGHT_ROUTES = (
    # (key, label, systems that run it, function)
    (
        "future",
        "`load_weights(get_weights())`: the future as the argument (Ray's route)",
        ("daskwg", "verl"),
        ws_future,
    ),
    ("concat", "`load_weights(DataProtoFuture.concat([get_weights()]))`", ("daskwg",), ws_concat),
    ("driver", "through the driver: `load_weights(get(get_weights()))`", ("daskwg",), ws_driver),
    ("collective", "cross-group collective broadcast", ("daskwg",), ws_collective),
    (
        "relay",
        "relayed data-plane broadcast (`daskwg.shared-memory: false`: the route between hosts)",
        ("daskwg",),
        ws_relay,
    ),
)
WEIGHT_CASES = (("2->4", "g2"), ("1->4", "g1"))


def row_weights(r: Rows) -> None:
    """Weight sync, trainer (2 ranks, then 1) → 4 rollout ranks, every route this system has."""
    rollout = r.group("g4")
    version = 0
    for case, trainer_key in WEIGHT_CASES:
        trainer = r.group(trainer_key)
        trainer.init_weights(WEIGHT_BYTES, WEIGHT_TENSORS)
        for route_key, _, systems, route in WEIGHT_ROUTES:
            if r.system.name not in systems:
                continue
            key = f"weights {case} {route_key}"
            times, egress, driver = [], [], []
            try:
                for rep in range(ROW_REPS["weights"] + WEIGHT_WARMUPS):
                    version += 1
                    trainer.bump(version)
                    s0, d0 = _egress(trainer), tcp_bytes()[1]
                    t = time.perf_counter()
                    out = route(r.system, trainer, rollout)
                    elapsed = time.perf_counter() - t
                    s1, d1 = _egress(trainer), tcp_bytes()[1]
                    _check_loaded(out, version, key)
                    if rep >= WEIGHT_WARMUPS:
                        times.append(elapsed)
                        egress.append(s1 - s0)
                        driver.append(d1 - d0)
                    del out
            except RouteUnavailable as exc:
                r.na[key] = str(exc)
                continue
            r.samples[key] = times
            r.extra[key] = {"source_tx": egress, "driver_tx": driver, "bytes": WEIGHT_BYTES}
        trainer.drop()
    rollout.drop()


def row_union(r: Rows) -> None:
    """P (dp 2) produces, derives y, the union of both (x, y, id) feeds C (dp 2)."""
    import torch

    producers, consumers = r.group("g2"), r.group("c2")
    rows = PLANE_ROWS
    seed = r.system.DataProto.from_dict(tensors={"i": torch.arange(rows)})
    times, driver_rx, growth = [], [], []
    for rep in range(ROW_REPS["union"] + 1):
        r0, _ = tcp_bytes()
        with PeakRSS() as mem:
            t = time.perf_counter()
            fa = producers.produce(seed)
            fb = producers.derive(fa)
            if r.system.name == "daskwg":
                batch = fa.union(fb).select(batch_keys=["x", "y", "id"])
            else:  # verl's DataProtoFuture has no union/select: the driver materialises both
                batch = fa.get().union(fb.get()).select(batch_keys=["x", "y", "id"])
            metrics = consumers.consume(batch)
            elapsed = time.perf_counter() - t
        r1, _ = tcp_bytes()
        _plane_check(metrics, "chain", rows)
        if rep:
            times.append(elapsed)
            driver_rx.append(r1 - r0)
            growth.append(mem.peak - mem.baseline)
        del fa, fb, batch
    r.samples["chain union/select"] = times
    r.extra["chain union/select"] = {
        "driver_rx": driver_rx,
        "rss_growth": growth,
        "batch": rows * (COLS * 4 + 8),
    }


def row_roundtrip(r: Rows) -> None:
    """Non-blocking round trip from the driver: ``P.echo_async(batch).get()``."""
    import torch

    producers = r.group("g2")
    rows = PLANE_ROWS
    data = r.system.DataProto.from_dict(tensors={"x": torch.ones(rows, COLS), "id": torch.arange(rows)})
    times, held = [], []
    for rep in range(ROW_REPS["roundtrip"] + 1):
        t = time.perf_counter()
        fut = producers.echo_async(data)
        if r.system.name == "daskwg":
            held.append(r.system.client.run_on_scheduler(_task_spec_bytes))
        out = fut.get()
        elapsed = time.perf_counter() - t
        if not torch.equal(out.batch["x"], data.batch["x"]):
            raise AssertionError("round trip changed the batch")
        if rep:
            times.append(elapsed)
        del fut, out
    r.samples["driver round trip"] = times
    r.extra["driver round trip"] = {"scheduler_task_bytes": held}


def row_view(r: Rows) -> None:
    """A 16-element view of a big tensor, returned, against a 16-element clone."""
    wg = r.group("g1")
    wg.make_big(VIEW_ELEMENTS)
    for label, fn in (("view of big tensor", wg.view), ("16-element clone", wg.view_clone)):
        times = []
        for rep in range(ROW_REPS["view"] + 1):
            t = time.perf_counter()
            out = fn()
            if rep:
                times.append(time.perf_counter() - t)
        r.samples[label] = times
        r.extra[label] = {"bytes": int(out[0].numel() * out[0].element_size())}
    wg.drop()


# In this order: the compiled graph takes the actors over until its teardown, so last.
ROW_FUNCTIONS = {
    "one_to_all": row_one_to_all,
    "nonblocking": row_nonblocking,
    "chain6": row_chain6,
    "dp64": row_dp64,
    "reshard": row_reshard,
    "broadcast": row_broadcast,
    "weights": row_weights,
    "union": row_union,
    "roundtrip": row_roundtrip,
    "view": row_view,
    "seq8": row_seq8,
}


def run_rows_child(name: str, rows: list[str]) -> dict:
    """The rows of one run, ``rows`` among :data:`ROW_FUNCTIONS`, on 6 workers / actors."""
    import torch

    torch.set_num_threads(1)
    system = SYSTEMS[name]()
    system.start(ROWS_WORKERS, slots=12)
    system.cls = make_rows_class(*system.api())
    if name == "verl":
        system.remote_cls = system.ray.remote(system.cls)
    r = Rows(system)
    for key, fn in ROW_FUNCTIONS.items():
        if key in rows:
            t = time.perf_counter()
            fn(r)
            print(f"[bench]   {name} {key}: {time.perf_counter() - t:.1f} s", flush=True)
    r.close()
    system.stop()
    return {
        "samples": r.samples,
        "extra": r.extra,
        "na": r.na,
        "versions": system.versions(),
        "view_elements": VIEW_ELEMENTS,
        "rows": PLANE_ROWS,
    }


def run_floors_child() -> dict:
    """The physical floors of this machine (``benchmarks/floors.py``), in seconds per sample."""
    import floors
    import torch

    torch.set_num_threads(1)
    q = FLOOR_REPS
    nbytes = FLOOR_COPY_BYTES
    out = {
        "memcpy warm": floors.memcpy_warm(nbytes, q["memcpy"]),
        "memcpy fresh torch": floors.memcpy_fresh_torch(nbytes, q["memcpy"]),
        "memcpy fresh numpy": floors.memcpy_fresh_numpy(nbytes, q["memcpy"]),
        "tcp warm": floors.tcp_transfer(WEIGHT_BYTES, q["tcp"], fresh=False),
        "p2p": floors.tcp_transfer(WEIGHT_BYTES, q["tcp"], fresh=True),
        "rtt4": floors.socket_rtt(4, q["rtt"]),
        "chain4": floors.tcp_chain(WEIGHT_BYTES, 4, q["tcp"]),
    }
    out.update(floors.dask_rpc(4, q["rpc"]))
    return {"samples": out, "copy_bytes": nbytes, "transfer_bytes": WEIGHT_BYTES}


FLOOR_REPS = {"memcpy": 10, "tcp": 5, "rtt": 2000, "rpc": 300}
FLOOR_COPY_BYTES = 64 * MB


def _task_spec_bytes(dask_scheduler) -> int:
    import pickle

    return sum(len(pickle.dumps(ts.run_spec)) for ts in dask_scheduler.tasks.values() if ts.run_spec)


def build_plane_report(d: dict, v: dict | None) -> tuple[str, dict]:
    """The data-plane table (daskwg and, where given, verl) and its verdicts, from the
    samples of every run pooled (:func:`pool_runs`)."""
    verdicts = {}
    lines = [
        "| data plane | daskwg median (min–max) | verl median (min–max) | daskwg/verl | bytes |",
        "|---|---|---|---|---|",
    ]
    for key in PLANE_KEYS:
        ds = d["samples"].get(key)
        if not ds:
            continue
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


# ----------------------------------------------------------------------- sharded weight sync

# The sharded-sync row (measured once): a state dict sharded over SHARDED_RANKS trainer ranks
# (FSDP2's layout: every tensor Shard(0) on a 1-D mesh) reaching SHARDED_RANKS rollout ranks,
# each of which ends with the full weights. Two state dicts: the example's model
# (examples/grpo_llm.py's Qwen2, its state dict's shapes) and a synthetic one of
# SHARDED_BYTES in SHARDED_TENSORS float32 tensors.
SHARDED_BYTES = 512 * MB
SHARDED_TENSORS = 32
SHARDED_RANKS = 4
SHARDED_BUCKET = 16 * MB  # daskwg.sync.DEFAULT_BUCKET_BYTES
SHARDED_REPS = 2  # timed syncs per route and state dict, after one warm-up
SHARDED_WORKERS = 2 * SHARDED_RANKS


def sharded_state_dicts() -> dict[str, Any]:
    """name -> ``[(tensor name, full shape)]`` of the state dicts of the sharded-sync row, or
    a string saying why a state dict is not available."""
    cols = 1024
    rows = SHARDED_BYTES // SHARDED_TENSORS // 4 // cols
    out: dict[str, Any] = {
        f"synthetic {SHARDED_BYTES // MB} MiB": [
            (f"layer{i}.weight", (rows, cols)) for i in range(SHARDED_TENSORS)
        ]
    }
    try:
        import torch

        sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
        import grpo_llm

        with torch.device("meta"):
            model = grpo_llm.build_model(grpo_llm.LLMConfig(), torch.device("meta"))
        shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        nbytes = sum(math.prod(shape) * 4 for _, shape in shapes)
        out[f"examples/grpo_llm.py's Qwen2 ({nbytes / MB:.2f} MiB)"] = shapes
    except ImportError as exc:
        out["examples/grpo_llm.py's Qwen2"] = f"needs transformers ({exc})"
    return out


def _chunk_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of ``rank``'s Shard(0) piece: ``torch.chunk``'s split, as FSDP2's."""
    per = -(-rows // ranks)
    first = min(rank * per, rows)
    return first, max(0, min(per, rows - first))


def make_shard_class(Worker: type, register: Any, Dispatch: Any, Execute: Any) -> type:
    """The worker of the sharded-sync row, on one system's API: a trainer rank holds its
    Shard(0) pieces (daskwg: as DTensors on a gloo mesh of the trainer ranks) or, on verl's
    route, rank 0 the full state dict; a rollout rank holds full tensors it loads into."""
    import torch

    class ShardWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def net(self):
            return tcp_bytes()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def hold(self, shapes, layout, backend="gloo"):
            """``layout``: "dtensor" (this rank's Shard(0) pieces as DTensors on a 1-D mesh of
            the group's ranks, over ``backend``), "full" (the whole state dict: a rollout rank,
            or verl's trainer rank 0). With nccl the tensors are on the rank's GPU."""
            self.state = {}
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            if layout == "dtensor":
                import torch.distributed as dist
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import DTensor, Shard

                if not dist.is_initialized():
                    dist.init_process_group(backend)
                mesh = init_device_mesh(device.type, (self.world_size,))
                for name, shape in shapes:
                    _, rows = _chunk_rows(shape[0], self.world_size, self.rank)
                    local = torch.zeros((rows, *shape[1:]), device=device)
                    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
                    self.state[name] = DTensor.from_local(
                        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
                    )
            elif layout == "full":
                self.state = {name: torch.zeros(shape, device=device) for name, shape in shapes}
            return sum(
                v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for v in self.state.values()
            )

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def bump(self, version):
            # A new version in place, as an optimizer step changes every parameter.
            for v in self.state.values():
                local = v.to_local() if hasattr(v, "to_local") else v
                local.fill_(float(version))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def send(self, group_name, senders, bucket, watch=False):
            from daskwg import sync

            # psutil's scan of the process's sockets takes milliseconds: only where watched.
            tx0 = tcp_bytes()[1] if watch else 0
            with PeakRSS() if watch else NoRSS() as mem:
                start = time.perf_counter()
                report = sync.send_shards(self.state, group_name, senders=senders, bucket_bytes=bucket)
                end = time.perf_counter()
            return {
                "tx": tcp_bytes()[1] - tx0 if watch else 0,
                "shard": report.shard_bytes,
                "growth": mem.peak - mem.baseline,
                "span": (start, end),
                "route": report.route,
            }

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def digest(self):
            # Outside the timed calls: sha256 of a 512 MiB model on every rank takes longer
            # than the sync itself here.
            from daskwg import sync

            return sync.shard_digest(self.state, self.rank)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def receive(self, group_name, senders, watch=False):
            from daskwg import sync

            with PeakRSS() if watch else NoRSS() as mem:
                start = time.perf_counter()
                sync.receive_shards(self.state, group_name, senders=senders)
                end = time.perf_counter()
            return {
                "growth": mem.peak - mem.baseline,
                "span": (start, end),
            }

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def digests(self, group_name):
            from daskwg import sync

            return sync.assembled_digests(self.state, group_name)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
        def get_full(self):
            from tensordict import TensorDict

            return TensorDict(self.state, batch_size=[])

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_full(self, weights, watch=False):
            with PeakRSS() if watch else NoRSS() as mem:
                for name, value in weights.items():
                    self.state[name].copy_(value)
                versions = {float(v.view(-1)[0]) for v in self.state.values()}
                versions |= {float(v.view(-1)[-1]) for v in self.state.values()}
            return {"versions": sorted(versions), "growth": mem.peak - mem.baseline}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def drop(self):
            self.state = {}

    return ShardWorker


def _sharded_reps(shapes) -> int:
    """Timed syncs of a state dict: ``SHARDED_REPS``, five times as many below 64 MiB (a
    small model's sync takes milliseconds, and two samples of it are noise here)."""
    nbytes = sum(math.prod(shape) * 4 for _, shape in shapes)
    return SHARDED_REPS if nbytes > 64 * MB else 5 * SHARDED_REPS


def _sharded_daskwg(system, shapes, trainer, rollout, name: str, backend: str) -> dict:
    d = system.daskwg
    trainer.hold(shapes, "dtensor", backend)
    rollout.hold(shapes, "full", backend)
    group = d.create_collective_group([trainer, rollout], name=name, backend=backend)
    times, in_ranks, egress, t_growth, r_growth = [], [], [], [], []
    route = None
    reps = _sharded_reps(shapes)
    try:
        # Rep 0 warms up; the last rep (untimed) watches memory and egress.
        for rep in range(reps + 2):
            watch = rep == reps + 1
            trainer.bump(rep + 1)
            t = time.perf_counter()
            sent, got = d.get(
                [
                    trainer.send(name, trainer.world_size, SHARDED_BUCKET, watch),
                    rollout.receive(name, trainer.world_size, watch),
                ]
            )
            elapsed = time.perf_counter() - t
            digests = trainer.digest()
            if any(g != digests for g in rollout.digests(name)):
                raise AssertionError(
                    f"sharded sync {name}: a rollout rank's weights differ from the trainer's"
                )
            if watch:
                egress.append(max(s["tx"] / max(s["shard"], 1) for s in sent))
                t_growth.append(max(s["growth"] for s in sent))
                r_growth.append(max(g["growth"] for g in got))
            elif rep:
                times.append(elapsed)
                # The sync's own time: from when its last member called it (perf_counter is
                # CLOCK_MONOTONIC, one clock for the processes of a host) to when the last
                # member returned; the driver's time adds the two group calls around it.
                spans = [r["span"] for r in sent + got]
                in_ranks.append(max(e for _, e in spans) - max(b for b, _ in spans))
                route = sent[0]["route"]
    finally:
        group.destroy()
        trainer.drop()
        rollout.drop()
    return {
        "times": times,
        "in_ranks": in_ranks,
        "route": route,
        "egress": egress,
        "trainer_growth": t_growth,
        "rollout_growth": r_growth,
    }


def _sharded_verl(system, shapes, trainer, rollout) -> dict:
    # verl's route: the full state dict on trainer rank 0 (FSDP's full_state_dict gather,
    # not timed here), returned as an ObjectRef that every rollout actor resolves.
    trainer.hold(shapes, "full")  # every trainer actor holds it; only rank 0's is used
    rollout.hold(shapes, "full")
    nbytes = sum(math.prod(shape) * 4 for _, shape in shapes)
    times, egress, r_growth = [], [], []
    reps = _sharded_reps(shapes)
    try:
        # As daskwg's: rep 0 warms up, the last rep (untimed) watches memory.
        for rep in range(reps + 2):
            watch = rep == reps + 1
            trainer.bump(rep + 1)
            tx0 = trainer.net()[0][1]
            t = time.perf_counter()
            out = rollout.load_full(trainer.get_full(), watch)
            elapsed = time.perf_counter() - t
            _expect({tuple(o["versions"]) for o in out}, {(float(rep + 1),)}, "verl route")
            if watch:
                r_growth.append(max(o["growth"] for o in out))
            elif rep:
                times.append(elapsed)
                egress.append((trainer.net()[0][1] - tx0) / (nbytes / trainer.world_size))
    finally:
        trainer.drop()
        rollout.drop()
    return {"times": times, "egress": egress, "rollout_growth": r_growth}


def run_sharded_child(name: str, backend: str = "gloo") -> dict:
    """The sharded-sync row on one system: every state dict of :func:`sharded_state_dicts`,
    ``SHARDED_RANKS`` trainer ranks to as many rollout ranks; with daskwg also the floor
    (one point-to-point transfer of the whole state dict, loopback TCP into fresh memory).
    ``backend``: daskwg's collective, "gloo" (CPU tensors) or "nccl" (GPU tensors, one GPU
    per worker: ``benchmarks/gpu_check.py``)."""
    import torch

    torch.set_num_threads(1)
    dicts = sharded_state_dicts()
    result: dict[str, Any] = {"cases": {}, "na": {}, "bucket": SHARDED_BUCKET}
    if name == "daskwg":
        import floors

        for case, shapes in dicts.items():
            if isinstance(shapes, list):
                nbytes = sum(math.prod(shape) * 4 for _, shape in shapes)
                result.setdefault("p2p", {})[case] = floors.tcp_transfer(
                    nbytes, _sharded_reps(shapes) + 1, fresh=True
                )[1:]
                # Not the bar's floor; shown beside it: the least one rollout rank's copy of
                # the whole model costs on one host (the same-host route makes one per rank).
                result.setdefault("copy", {})[case] = floors.memcpy_warm(nbytes, _sharded_reps(shapes) + 1)[
                    1:
                ]
    system = SYSTEMS[name]()
    system.start(SHARDED_WORKERS, slots=SHARDED_WORKERS)
    cls = make_shard_class(*(system.api()[i] for i in (0, 1, 2, 4)))
    if name == "verl":
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        remote = system.ray.remote(cls)
        pools = system.split_pool([SHARDED_RANKS, SHARDED_RANKS])
        trainer, rollout = (RayWorkerGroup(p, RayClassWithInitArgs(cls=remote)) for p in pools)
    else:
        pools = system.split_pool([SHARDED_RANKS, SHARDED_RANKS])
        trainer, rollout = (
            system.daskwg.WorkerGroup(system.client, system.daskwg.ClassWithInitArgs(cls), workers=p)
            for p in pools
        )
    result["versions"] = system.versions()
    for i, (case, shapes) in enumerate(dicts.items()):
        if not isinstance(shapes, list):
            result["na"][case] = shapes
            continue
        nbytes = sum(math.prod(shape) * 4 for _, shape in shapes)
        t = time.perf_counter()
        if name == "daskwg":
            got = _sharded_daskwg(system, shapes, trainer, rollout, f"bench-shards-{i}", backend)
        else:
            got = _sharded_verl(system, shapes, trainer, rollout)
        result["cases"][case] = {**got, "bytes": nbytes}
        print(f"[bench]   {name} sharded-sync {case}: {time.perf_counter() - t:.1f} s", flush=True)
    for wg in (trainer, rollout):
        system.close_group(wg)
    for pool in pools:
        system.close_pool(pool)
    system.stop()
    return result


def build_sharded_report(res: dict) -> tuple[str, dict]:
    """The sharded-sync table: per state dict, daskwg's sharded sync, verl's Ray route and the
    point-to-point floor, side by side (one run, medians of :func:`_sharded_reps` syncs)."""
    d, v = res.get("daskwg") or {}, res.get("verl") or {}
    bucket = d.get("bucket", SHARDED_BUCKET)
    lines = [
        f"| sharded weight sync, {SHARDED_RANKS} trainer ranks → {SHARDED_RANKS} rollout ranks | route | time | "
        "÷ one p2p transfer of the whole model | ÷ verl's route | egress per trainer rank ÷ its shard | "
        f"peak RSS growth per rank (trainer; rollout) | met (≤ 1.0× p2p, ≤ 0.5× verl) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts = {}
    cases = list(dict.fromkeys([*d.get("cases", {}), *v.get("cases", {}), *d.get("na", {})]))
    for case in cases:
        if case in d.get("na", {}):
            lines.append(f"| {case} | | n/a: {d['na'][case]} | | | | | |")
            continue
        dc, vc = d.get("cases", {}).get(case), v.get("cases", {}).get(case)
        p2p = d.get("p2p", {}).get(case)
        p2p_s = statistics.median(p2p) if p2p else None
        ds = statistics.median(dc["times"]) if dc else None
        vs = statistics.median(vc["times"]) if vc else None
        if ds is not None:
            over_p2p = ds / p2p_s if p2p_s else None
            over_verl = ds / vs if vs else None
            met = None if over_p2p is None or over_verl is None else over_p2p <= 1.0 and over_verl <= 0.5
            verdicts[f"sharded sync {case}: ≤ 1.0× p2p, ≤ 0.5× verl"] = met
            inside = statistics.median(dc["in_ranks"]) if dc.get("in_ranks") else None
            inside_met = None
            if inside is not None and p2p_s and vs:
                inside_met = inside / p2p_s <= 1.0 and inside / vs <= 0.5
                verdicts[f"sharded sync {case}, its time in the ranks: ≤ 1.0× p2p, ≤ 0.5× verl"] = inside_met
            growth = (
                f"{fmt_b(max(dc['trainer_growth']))} ({max(dc['trainer_growth']) / bucket:.2f}× the "
                f"{fmt_b(bucket)} bucket); {fmt_b(max(dc['rollout_growth']))} "
                f"({max(dc['rollout_growth']) / bucket:.2f}×)"
            )
            how = {
                "same-host": "each rollout rank copies every trainer rank's shard straight from its memory "
                "into its parameters (`process_vm_readv`)",
                "chain": "each trainer rank's shard chained along the rollout ranks on gloo",
            }.get(dc.get("route"), "route not recorded")
            lines.append(
                f"| {case} | daskwg `sync.send_shards` / `receive_shards`, timed in the driver "
                f"(the two group calls around the sync); route {dc.get('route')}: {how} | {fmt_s(ds)} | "
                f"{'n/a' if over_p2p is None else _x(over_p2p)} | {'n/a' if over_verl is None else _x(over_verl)} | "
                f"{_x(max(dc['egress']))} (TCP) | {growth} | {_met_cell(met)} |"
            )
            if inside is not None:
                lines.append(
                    f"| {case} | the same syncs, timed in the ranks (from when the last member called "
                    f"it to when the last one returned) | {fmt_s(inside)} | "
                    f"{_x(inside / p2p_s) if p2p_s else 'n/a'} | {_x(inside / vs) if vs else 'n/a'} | | | "
                    f"{_met_cell(inside_met)} |"
                )
        if vs is not None:
            lines.append(
                f"| {case} | verl on Ray: the full state dict on trainer rank 0, an ObjectRef every rollout "
                f"actor resolves (the gather to rank 0 not timed) | {fmt_s(vs)} | "
                f"{_x(vs / p2p_s) if p2p_s else 'n/a'} | 1.00× | {_x(max(vc['egress']))} (TCP only: same-host "
                f"Ray moves objects through shared memory) | –; {fmt_b(max(vc['rollout_growth']))} | |"
            )
        if p2p_s is not None:
            lines.append(
                f"| {case} | floor: one point-to-point transfer of the whole state dict (loopback TCP into "
                f"fresh memory) | {fmt_s(p2p_s)} | 1.00× | | | | |"
            )
        copy = d.get("copy", {}).get(case)
        if copy and p2p_s:
            copy_s = statistics.median(copy)
            lines.append(
                f"| {case} | for comparison, not the bar: one copy of the whole state dict into warm memory "
                f"in one process (what each rollout rank's copy costs at least on the same-host route; "
                f"{SHARDED_RANKS} rollout ranks make {SHARDED_RANKS}, on this machine's cores) | "
                f"{fmt_s(copy_s)} | {_x(copy_s / p2p_s)} | | | | |"
            )
    return "\n".join(lines), verdicts


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


def build_report(res: dict, rss: dict) -> tuple[str, dict]:
    """The tables of the once-measured sections: ``res`` (timings) and ``rss``, either may be empty."""
    tables, verdicts = [], {}
    if res:
        d, v = res["daskwg"], res["verl"]
        lines = [
            "| benchmark | ranks | daskwg median (min–max) | verl median (min–max) | daskwg/verl | target | met |",
            "|---|---|---|---|---|---|---|",
        ]
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
        tables.append("\n".join(lines))

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
        tables.append("\n".join(lines))

    if rss:
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
        tables.append("\n".join(lines))

    if res:
        d, v = res["daskwg"], res["verl"]
        lines = [
            "| runtime start (not in any row above) | daskwg | verl |",
            "|---|---|---|",
            f"| `local_cluster(4)` + `Client` / `ray.init` | {fmt_s(d['extra']['runtime_start_s'])} | "
            f"{fmt_s(v['extra']['runtime_start_s'])} |",
        ]
        tables.append("\n".join(lines))
    return "\n\n".join(tables), verdicts


# ----------------------------------------------------------------------- report: rows of every run


def floor_values(floors: dict) -> dict[str, float]:
    """Seconds per floor of one run, from the floors child's samples (medians)."""
    s = {k: statistics.median(v) for k, v in floors["samples"].items()}
    tcp_rate = floors["transfer_bytes"] / s["tcp warm"]  # bytes per second
    copy_rate = floors["copy_bytes"] / s["memcpy warm"]
    return {
        "2x64 copy": 2 * 64 * MB / copy_rate,
        "rpc+hop": s["rpc+hop"],
        "rpc+hop/8": s["rpc+hop"] / SEQ_CALLS,
        "64 tcp": 64 * MB / tcp_rate,
        "p2p": s["p2p"],
        "chain4": s.get("chain4"),  # absent from older saved runs
    }


FLOOR_LABELS = {
    "rpc+hop": "Dask rpc + thread hop, 4 workers",
    "rpc+hop/8": "⅛ of a Dask rpc + hop (one message per 8 calls)",
    "2x64 copy": "2 × 64 MiB copied into a warm buffer (same host: into shared memory and out)",
    "64 tcp": "64 MiB at loopback TCP speed",
    "p2p": "one 256 MiB point-to-point transfer",
}

# (daskwg key, label, verl key, floor, target ratio to verl, absolute target in seconds)
ISSUE_ROWS = (
    (
        "nonblocking",
        "`blocking=False` call + gather, 4 ranks, tiny data",
        "nonblocking",
        "rpc+hop",
        0.5,
        None,
    ),
    (
        "chain6",
        "6-call `DataProtoFuture` chain (RL step), tiny data, 4 ranks",
        "chain6",
        "rpc+hop",
        0.25,
        None,
    ),
    ("chain6 plan", "the 6-call chain as a `daskwg.plan`", "chain6", "rpc+hop", 0.1, 3e-3),
    ("one_to_all", "ONE_TO_ALL small blocking call, 4 ranks", "one_to_all", "rpc+hop", 0.5, None),
    ("seq8", "per call, 8-call sequence, 4 ranks: ordinary calls", "seq8", "rpc+hop/8", None, None),
    (
        "seq8",
        "per call, 8 ordinary calls vs a Ray Compiled Graph",
        "seq8 compiled graph",
        "rpc+hop/8",
        None,
        None,
    ),
    ("seq8 plan", "per call, 8-call `daskwg.plan` vs verl's calls", "seq8", "rpc+hop/8", 0.15, 0.25e-3),
    (
        "seq8 plan",
        "per call, 8-call `daskwg.plan` vs a Ray Compiled Graph",
        "seq8 compiled graph",
        "rpc+hop/8",
        None,
        None,
    ),
    ("dp64", "64 MiB DP round trip, 4 ranks", "dp64", "2x64 copy", 0.25, None),
    ("reshard 4->2", "reshard 4→2, 64 MiB", "reshard 4->2", "64 tcp", 0.5, None),
    ("reshard 2->4", "reshard 2→4, 64 MiB", "reshard 2->4", "64 tcp", 0.5, None),
    ("broadcast", "broadcast of a 256 MiB state dict, 1 → 4 ranks", "broadcast", "p2p", 0.75, None),
)


def _median_of(run: dict, name: str, key: str) -> float | None:
    samples = run.get(name, {}).get("samples", {}).get(key)
    return statistics.median(samples) if samples else None


def _na_of(runs: list[dict], name: str, key: str) -> str | None:
    for run in runs:
        reason = run.get(name, {}).get("na", {}).get(key)
        if reason:
            return reason
    return None


def _join(values: list, fmt) -> str:
    return " / ".join("n/a" if v is None else fmt(v) for v in values)


def _ratios(a: list, b: list) -> list:
    return [x / y if x is not None and y else None for x, y in zip(a, b)]


def _spread(values: list) -> str:
    got = [v for v in values if v is not None]
    if len(got) < 2 or min(got) <= 0:
        return "–"
    return f"{(max(got) / min(got) - 1) * 100:.0f}%"


def _x(v: float) -> str:
    return f"{v:.2f}"


def _na_cell(values: list, reason: str | None) -> str:
    if all(v is None for v in values):
        return f"n/a ({reason})" if reason else "n/a"
    return _join(values, fmt_s)


def _met(checks: list[list]) -> bool | None:
    """True when every check of every run holds, None when nothing could be checked."""
    flat = [c for run in checks for c in run]
    if not flat or any(c is None for c in flat):
        return None
    return all(flat)


def _met_cell(met: bool | None) -> str:
    return "n/a" if met is None else ("yes" if met else "**no**")


def build_rows_report(runs: list[dict]) -> tuple[str, dict]:
    """The tables of the rows measured in every run: the per-call and data rows, weight
    sync, the physical floors and the load averages; and their verdicts."""
    verdicts: dict[str, bool] = {}
    floors = [floor_values(run["floors"]) if run.get("floors") else {} for run in runs]
    n = len(runs)
    lines = [
        f"Each cell: the median of each of the {n} run(s), in run order; ratios are taken per run. "
        "Spread: largest ÷ smallest of the run medians, minus 1 (daskwg / verl).",
        "",
        "| row | daskwg | verl | daskwg ÷ verl | floor | daskwg ÷ floor | spread | bytes | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dkey, label, vkey, fkey, vs_target, abs_target in ISSUE_ROWS:
        d = [_median_of(run, "daskwg", dkey) for run in runs]
        v = [_median_of(run, "verl", vkey) for run in runs]
        if all(x is None for x in d) and all(x is None for x in v) and not _na_of(runs, "daskwg", dkey):
            continue  # not selected by --rows
        f = [fl.get(fkey) for fl in floors]
        ratio, over_floor = _ratios(d, v), _ratios(d, f)
        bytes_cell, checks = "", [[] for _ in runs]
        if vs_target is not None:
            for i, r in enumerate(ratio):
                checks[i].append(None if r is None else r <= vs_target)
        if abs_target is not None:
            for i, x in enumerate(d):
                checks[i].append(None if x is None else x <= abs_target)
        if dkey.startswith("reshard"):
            worst = {}
            for name in ("daskwg", "verl"):
                shares = [
                    max(e["max_rank_rx"]) / e["share"]
                    for run in runs
                    if (e := run.get(name, {}).get("extra", {}).get(dkey))
                ]
                worst[name] = max(shares) if shares else None
            if worst["daskwg"] is not None:
                bytes_cell = f"most any consumer received: daskwg {worst['daskwg']:.2f}× its share"
                if worst["verl"] is not None:
                    bytes_cell += f", verl {worst['verl']:.2f}× (TCP; Ray uses shared memory)"
        if dkey == "broadcast":
            src = [
                max(e["source_tx"]) / e["bytes"]
                for run in runs
                if (e := run.get("daskwg", {}).get("extra", {}).get("broadcast"))
            ]
            if src:
                bytes_cell = f"source egress {_join(src, _x)}× the state dict"
                for i, e in enumerate(src):
                    checks[i].append(e <= 1.25)
        target = []
        if vs_target is not None:
            target.append(f"≤ {vs_target}× verl")
        if abs_target is not None:
            target.append(f"≤ {fmt_s(abs_target)}")
        if dkey == "broadcast":
            target.append("egress ≤ 1.25×")
        met = _met(checks) if target else None
        if target:
            verdicts[f"{label}: {', '.join(target)}"] = met
        dcell = _na_cell(d, _na_of(runs, "daskwg", dkey))
        vcell = _na_cell(v, _na_of(runs, "verl", vkey))
        fcell = f"{FLOOR_LABELS[fkey]}: {_join(f, fmt_s)}"
        lines.append(
            f"| {label} | {dcell} | {vcell} | {_join(ratio, _x)} | {fcell} | {_join(over_floor, _x)} | "
            f"{_spread(d)} / {_spread(v)} | {bytes_cell} | {', '.join(target)} | "
            f"{_met_cell(met) if target else ''} |"
        )
    tables = ["\n".join(lines)]
    weights, weight_verdicts = _weights_table(runs, floors)
    if weights:
        tables.append(weights)
        verdicts.update(weight_verdicts)
    tables.append(_floors_table(runs))
    tables.append(_load_table(runs))
    return "\n\n".join(tables), verdicts


def _weights_table(runs: list[dict], floors: list[dict]) -> tuple[str, dict]:
    verdicts = {}
    p2p = [fl.get("p2p") for fl in floors]
    chain = [fl.get("chain4") for fl in floors]
    lines = [
        f"| weight sync, {WEIGHT_BYTES // MB} MiB | route | time | ÷ one p2p transfer | ÷ a raw chain to 4 | "
        "÷ verl's Ray route | egress ÷ weights: trainer ranks; driver process | spread | "
        "met (≤ 1.5× p2p, egress ≤ 1.25×) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    any_row = False
    for case, _ in WEIGHT_CASES:
        ray_key = f"weights {case} future"
        ray = [_median_of(run, "verl", ray_key) for run in runs]
        for system, routes in (("daskwg", WEIGHT_ROUTES), ("verl", WEIGHT_ROUTES[:1])):
            for route_key, label, systems, _ in routes:
                if system not in systems:
                    continue
                key = f"weights {case} {route_key}"
                t = [_median_of(run, system, key) for run in runs]
                reason = _na_of(runs, system, key)
                if all(x is None for x in t) and not reason:
                    continue
                any_row = True
                extras = [run.get(system, {}).get("extra", {}).get(key) for run in runs]
                src = [max(e["source_tx"]) / e["bytes"] if e else None for e in extras]
                drv = [max(e["driver_tx"]) / e["bytes"] if e else None for e in extras]
                over_p2p = _ratios(t, p2p)
                checks = [
                    [None if x is None else x <= 1.5, None if s is None else max(s, dr) <= 1.25]
                    for x, s, dr in zip(over_p2p, src, [x or 0.0 for x in drv])
                ]
                met = _met(checks)
                if system == "daskwg":
                    verdicts[f"weight sync {case} {route_key}: ≤ 1.5× p2p, egress ≤ 1.25×"] = met
                egress = (
                    "n/a"
                    if all(s is None for s in src)
                    else f"{_join(src, _x)}; {_join(drv, _x)}" + (" (TCP only)" if system == "verl" else "")
                )
                vs_ray = _join(_ratios(t, ray), _x) if system == "daskwg" else ""
                lines.append(
                    f"| {case.replace('->', ' → ')} {system} | {label} | {_na_cell(t, reason)} | "
                    f"{_join(over_p2p, _x)} | {_join(_ratios(t, chain), _x)} | {vs_ray} | {egress} | "
                    f"{_spread(t)} | {_met_cell(met)} |"
                )
    return ("\n".join(lines) if any_row else ""), verdicts


def _floors_table(runs: list[dict]) -> str:
    def rate(nbytes):
        return lambda s: f"{nbytes / s / 1e9:.1f} GB/s"

    rows = (
        ("memcpy into a warm buffer", "memcpy warm", "copy_bytes"),
        ("memcpy into fresh torch pages (`torch.empty`)", "memcpy fresh torch", "copy_bytes"),
        ("memcpy into fresh numpy pages (`numpy.empty`, huge pages)", "memcpy fresh numpy", "copy_bytes"),
        ("loopback TCP, one connection, warm receive buffer", "tcp warm", "transfer_bytes"),
        (
            "one point-to-point transfer of the state dict (loopback TCP into fresh `torch.empty`)",
            "p2p",
            None,
        ),
        ("8-byte socket round trip to 4 peers", "rtt4", None),
        (
            "the state dict through a pipelined chain of 4 raw-socket peers, forwarding every 4 MiB "
            "(the least a relayed or chained broadcast to 4 ranks costs here)",
            "chain4",
            None,
        ),
        ("raw Dask rpc round trip to 4 workers", "rpc", None),
        ("raw Dask rpc round trip to 4 workers, with the thread hop", "rpc+hop", None),
    )
    header = " | ".join(f"run {i + 1}" for i in range(len(runs)))
    lines = [
        f"| physical floor (measured in each run) | {header} |",
        "|---|" + "---|" * len(runs),
    ]
    for label, key, size in rows:
        cells = []
        for run in runs:
            fl = run.get("floors")
            if not fl or key not in fl["samples"]:
                cells.append("n/a")
                continue
            m = statistics.median(fl["samples"][key])
            cells.append(rate(fl[size])(m) if size else fmt_s(m))
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _load_table(runs: list[dict]) -> str:
    lines = [
        "| run | load average at start (1, 5, 15 min) | at end | wall |",
        "|---|---|---|---|",
    ]
    for i, run in enumerate(runs):
        start, end = run.get("load_start"), run.get("load_end")
        fmt = lambda la: ", ".join(f"{x:.2f}" for x in la) if la else "?"  # noqa: E731
        lines.append(f"| {i + 1} | {fmt(start)} | {fmt(end)} | {run.get('wall_s', 0):.0f} s |")
    return "\n".join(lines)


def pool_runs(runs: list[dict], name: str) -> dict | None:
    """One system's samples and byte counts of every run together (for the data-plane table)."""
    got = [run[name] for run in runs if run.get(name)]
    if not got:
        return None
    samples: dict[str, list] = {}
    extra: dict[str, dict] = {}
    for res in got:
        for key, values in res["samples"].items():
            samples.setdefault(key, []).extend(values)
        for key, e in res["extra"].items():
            into = extra.setdefault(key, {})
            for field, value in e.items():
                if isinstance(value, list):
                    into.setdefault(field, []).extend(value)
                else:
                    into.setdefault(field, value)
    return {"samples": samples, "extra": extra}


def run_grpo(plan: bool, steps: int) -> dict:
    """``examples/grpo.py`` (colocated, 4 ranks, its own local cluster) for ``steps`` steps,
    with or without ``--plan``: its step time and final weights."""
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "grpo.py")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--steps", str(steps), "--min-reward", "0", "--final-window", "2", "--checkpoint-every", "0"]
        args += ["--checkpoint-dir", tmp, "--out", os.path.join(tmp, "grpo.png")] + (
            ["--plan"] if plan else []
        )
        proc = subprocess.run([sys.executable, example, *args], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"examples/grpo.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    step_s = re.search(r"\(([0-9.]+) s/step\)", proc.stdout)
    weights = re.search(r"\(sha256 ([0-9a-f]+)", proc.stdout)
    route = re.search(r"step plan: .*", proc.stdout)
    return {
        "step_s": float(step_s.group(1)),
        "weights": weights.group(1) if weights else "?",
        "route": route.group(0) if route else "",
    }


def run_heal(quick: bool) -> dict:
    """``benchmarks/heal.py`` in a subprocess of its own (its worker class travels by value
    from its ``__main__``): the ``heal`` row's samples."""
    reps = 1 if quick else 2
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    try:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "heal.py"), "--reps", str(reps), "--out", out],
            check=True,
            timeout=1800,
        )
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def build_grpo_report(grpo: dict) -> str:
    """The GRPO step time with and without ``--plan``."""
    plain, planned = grpo["calls"], grpo["plan"]
    same = "yes" if plain["weights"] == planned["weights"] else "**no**"
    return "\n".join(
        [
            f"| `examples/grpo.py`, colocated, 4 ranks, {grpo['steps']} steps | s/step | ÷ without `--plan` | "
            "final weights as without `--plan` |",
            "|---|---|---|---|",
            f"| the calls one by one | {plain['step_s']:.3f} | 1.00 | |",
            f"| `--plan` ({planned['route'] or 'no plan line'}) | {planned['step_s']:.3f} | "
            f"{planned['step_s'] / plain['step_s']:.2f} | {same} |",
        ]
    )


def assemble(
    runs: list[dict],
    res: dict,
    rss: dict,
    grpo: dict | None = None,
    scaled: dict | None = None,
    plot=None,
    sharded: dict | None = None,
) -> tuple[str, dict]:
    """Every table of the report, in order, and every verdict. ``plot``: ``(path, reference)``
    of the scale rows' plot, written when the scale rows ran."""
    parts, verdicts = [], {}
    if runs:
        table, v = build_rows_report(runs)
        parts += ["### Rows measured in every run", "", table]
        verdicts.update(v)
        d, vr = pool_runs(runs, "daskwg"), pool_runs(runs, "verl")
        if d and any(k in d["samples"] for k in PLANE_KEYS):
            table, v = build_plane_report(d, vr)
            parts += ["", "### Data plane (all runs' samples together)", "", table]
            verdicts.update(v)
    if res or rss:
        table, v = build_report(res, rss)
        parts += ["", "### Measured once", "", table]
        verdicts.update(v)
    if grpo:
        parts += ["", "### The main job's step, with and without a step plan", "", build_grpo_report(grpo)]
    if scaled:
        import scale

        path, ref = plot or (None, None)
        table, v = scale.build_report(scaled, fmt_s, path, ref)
        parts += ["", "### Cost as the ranks grow (issue 46), and wide batches", "", table]
        verdicts.update(v)
    if sharded:
        table, v = build_sharded_report(sharded)
        parts += ["", "### Sharded weight sync (measured once)", "", table]
        verdicts.update(v)
    return "\n".join(parts), verdicts


DISCUSSION = """\
## How it is measured

* One script, `benchmarks/run.py`; each system runs in its own driver subprocess, one
  after the other, and the peak-RSS case in one more fresh subprocess per system.
* The worker classes are the same code for both systems (`make_worker_class`,
  `make_plane_class`, `make_rows_class`), registered with each system's `Worker`,
  `register`, `Dispatch` and `Execute`. daskwg runs on `daskwg.local_cluster(n)` (a
  process `LocalCluster`, one thread per worker); verl on `ray.init()` with
  `RayResourcePool([n], use_gpu=False)`, `RayClassWithInitArgs` and `RayWorkerGroup`.
  Torch uses one thread in every driver.
* **Rows measured in every run** (`--runs`, default 3): per run, the physical floors in
  a subprocess of their own (`benchmarks/floors.py`), then one driver subprocess per
  system (their order alternates from run to run) on 6 Dask workers / Ray actors: a
  4-rank group, a 2-rank group on two other processes, a 1-rank group (on the 2-rank
  group's first Dask worker; its own actor in Ray) and a second 2-rank group for the
  union/select chain. Each cell is one median per run, after one warm-up (two for
  the broadcast and weight-sync rows: the loading ranks keep the weights they loaded
  until the next ones replace them, so a steady state holds two sets, and the sets
  before it land in memory the process never had, which costs several times the
  transfer here); ratios are taken within a run. The load average is read at the start
  and end of every run.
  * *`blocking=False` call + gather*: a `ONE_TO_ALL` method registered
    `blocking=False` returns one future per rank; the driver gathers them
    (`daskwg.get` where daskwg has it, else `client.gather`; `ray.get`).
  * *6-call chain*: generate → reward → advantage → log-prob → ref-log-prob → update,
    all `DP_COMPUTE_PROTO` with `blocking=False`, each taking the previous call's
    `DataProtoFuture` (16 rows, a few float columns, each stage adding one), the last
    one gathered with `.get()` and checked.
  * *8-call sequence*: 8 blocking `DP_COMPUTE` calls, each rank's counter passed back
    in (0 → 8), time ÷ 8; the Ray Compiled Graph has the same shape (8 stages of
    `tick.bind` on each of the 4 actors, each stage taking that actor's previous
    output), compiled once with `experimental_compile()`, timed by `execute` + `ray.get`.
    The `daskwg.plan` routes (issue 22) record the same calls once with
    `with daskwg.plan() as step:` and time `step.run(...)` (one message per worker; the
    chain's plan is replayed once before timing, the replay that learns each stage's rows).
  * *64 MiB DP round trip*: `DP_COMPUTE_PROTO` over `[4096, 4096]` float32, every rank
    adds 1 in place and returns its piece. On one host daskwg's call streams carry the
    pieces and the replies through shared-memory files (`daskwg.wire.memfiles`: one copy in,
    one out), as Ray's object store does for large arguments; its floor is those two
    copies at warm memcpy speed. *reshard m→n*: a finished `DataProtoFuture`
    of `[4096, 4096]` float32 + ids from the dp-m group consumed by the dp-n group
    (`DP_COMPUTE_METRIC`, rows checked); "bytes": the most any consumer process
    received over TCP against its share.
  * *broadcast*: a 256 MiB state dict (32 float32 tensors, a `TensorDict` without batch
    dimension) returned by the 1-rank group (`Execute.RANK_ZERO`, `blocking=False`) and
    finished, then loaded by the 4 ranks (`ONE_TO_ALL`, each checks the version it got):
    daskwg takes `DataProtoFuture.concat([future])`, verl the ObjectRef. "Source egress":
    the bytes the source rank's process sent over TCP during the call (its `TCP_INFO`
    counters, read by a method of the rank) ÷ 256 MiB.
  * *weight sync*: the trainer (2 ranks, then 1) bumps its weights' version in place,
    then every route moves them to the 4 rollout ranks and they check the version;
    timed from `get_weights` until every rollout rank has loaded. Routes are functions
    (`ws_*` in `benchmarks/run.py`); one not available in the installed daskwg prints
    n/a with the reason. verl's Ray route: `get_weights` returns an ObjectRef (stored
    once in the trainer's object store) passed to the rollout's `load_weights`, which
    every actor resolves. Egress: the trainer ranks' processes and the driver process,
    over TCP; the driver process also runs `local_cluster`'s scheduler, and the
    through-the-driver route's gather (`client.gather`, Dask's default, not direct)
    passes the weights from the scheduler to the client inside it, one more 1×.
    Same-host Ray moves objects through shared memory, which no socket counter sees; so
    does daskwg's data plane (`daskwg.shared-memory`: the trainer's worker writes the
    weights once into a shared-memory file that every rollout rank maps copy-on-write),
    except on the relay route, which turns that off to measure the route between hosts.
  * *Floors*: see the floors table; every row's floor is named in its row. The
    per-call rows use the raw Dask rpc round trip with the thread hop that daskwg's
    contract requires (one round of it for a whole step: a plan's floor), the data
    rows the loopback TCP throughput, broadcast and weight sync one point-to-point
    transfer of 256 MiB into fresh memory.
* **Measured once** (after the runs): round trips at 1, 2 and 4 ranks
  (`DP_COMPUTE_PROTO`, every rank adds 1 in place and returns its piece), the chain
  A→B (group A `blocking=False` produces `[4096, 4096]` float32 from a 4096-row seed,
  group B on the same pool consumes the future, `DP_COMPUTE_METRIC`), group creation,
  driver memory. Medians and min–max over the repetitions in `REPS`, after one
  warm-up call.
* Bytes through the driver: the sum of the kernel's `TCP_INFO` counters
  (`tcpi_bytes_received`, `tcpi_bytes_acked`) over every TCP socket the driver owns,
  taken before and after the chain (largest of the repetitions). Those count every byte
  whichever library sent it. Same-host Ray can hand objects over through shared memory,
  invisible to socket counters, so the driver's RSS growth during the chain is shown
  too: a 64 MiB batch passing through the driver would show in one or the other.
* Driver memory: RSS polled every millisecond by a thread (and `ru_maxrss`) in a fresh
  process; "growth" is the peak minus the RSS just before the batch was created, so
  the batch itself counts as 1×.
* Data plane (from the runs' driver subprocesses): *chain union/select*: `produce`
  (`blocking=False`), `derive` on its output, the union of both selected to `x, y, id`
  and consumed by a second group; daskwg composes the futures lazily, verl (whose
  `DataProtoFuture` has no `union`/`select`) materialises both in the driver.
  *driver round trip*: `echo_async(batch).get()`, with the bytes of task specs the Dask
  scheduler holds meanwhile. *view*: a rank returns `self.big[:16]` of a 1 GiB tensor,
  next to returning a 16-element clone.
* Group creation: a 4-rank group on an already started runtime, plus its first call.
  For Ray that includes starting one actor process per rank (that is what a
  `RayWorkerGroup` is); Dask workers already exist and the group instantiates the class
  inside them. Starting the runtime itself is listed separately.
* Sharded weight sync (`--rows sharded-sync`, measured once): 4 Dask workers / Ray actors
  hold a state dict sharded as FSDP2 shards it (every tensor `Shard(0)` on a 1-D mesh; the
  daskwg trainer ranks hold real DTensors on a gloo mesh), 4 more are the rollout ranks,
  each ending with the full weights. daskwg: `daskwg.sync.send_shards` on every trainer rank
  and `receive_shards` on every rollout rank, 16 MiB buckets, checked by comparing each
  trainer rank's sha256 of its shards with each rollout rank's sha256 of the slices it
  filled. verl's route on Ray: trainer rank 0 holds the full state dict (the FSDP
  full-state-dict gather that puts it there is not timed, which favours verl) and returns
  it as an ObjectRef that every rollout actor resolves and copies into its tensors. The
  floor: one point-to-point transfer of the whole state dict (loopback TCP into fresh
  memory, in the daskwg child before its cluster starts). Two state dicts: the shapes of
  `examples/grpo_llm.py`'s Qwen2 (0.29 MiB; n/a without transformers) and a synthetic one
  of 512 MiB in 32 tensors. Egress: the TCP bytes a trainer rank's process sent during the
  sync ÷ its shard; peak RSS growth: polled every millisecond on every rank during the sync,
  the largest over the trainer ranks and over the rollout ranks, against the bucket. Medians
  of 2 syncs after a warm-up.
* The main job's step: `examples/grpo.py` (colocated, 4 ranks, its own local cluster,
  checkpoints off) for `GRPO_STEPS` steps, once as it is (the step's calls one by one)
  and once with `--plan` (the step recorded once and replayed), each as printed by the
  job (`s/step`, the whole training divided by the steps); the final weights' checksums
  must agree. Its step is mostly the GRU's own compute, which a plan does not change.
"""

TARGETS_TEXT = (
    "Issue 21: `blocking=False` call + gather ≤ 0.5× verl; 6-call chain ≤ 0.25×; ONE_TO_ALL small call "
    "≤ 0.5×; 64 MiB DP round trip ≤ 0.25× in every run; reshard ≤ 0.5×; broadcast ≤ 0.75× with "
    "source egress ≤ 1.25×. Issue 22: per call of an 8-call plan ≤ 0.25 ms and ≤ 0.15× verl; the "
    "6-call step as a plan ≤ 3 ms and ≤ 0.1× verl. Issue 17: weight sync ≤ 1.5× one point-to-point "
    "transfer with egress ≤ 1.25×. Measured once: small-call latency at 4 ranks ≤ 0.5× verl; 64 MiB "
    "and 256 MiB round trips ≤ 0.25×; chain ≤ 0.25× with none of the batch passing through the "
    "driver; group creation ≤ 1.0×; driver peak RSS growth ≤ 2.5× the batch during the 256 MiB "
    "round trip. Issue 45: sharded weight sync ≤ 1.0× one point-to-point transfer of the whole model "
    "and ≤ 0.5× verl's route, in the same run."
)


def collect_versions(runs: list[dict], res: dict) -> dict:
    versions: dict[str, str] = {}
    for source in [*(run.get(n) for run in runs for n in ("verl", "daskwg")), *res.values()]:
        if source and source.get("versions"):
            versions.update(source["versions"])
    versions["numpy"] = __import__("numpy").__version__
    return versions


def write_report(path: str, report: str, verdicts: dict, versions: dict, mach: dict, wall: float) -> None:
    ok = [k for k, v in verdicts.items() if v]
    missed = [k for k, v in verdicts.items() if v is False]
    na = [k for k, v in verdicts.items() if v is None]
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
        TARGETS_TEXT,
        "",
        f"Met: {'; '.join(ok) or 'none'}.",
        "",
        f"Missed: {'; '.join(missed) or 'none'}.",
        "",
        f"Not measurable in this daskwg (n/a): {'; '.join(na) or 'none'}.",
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
    """Run this script with ``args`` in a fresh subprocess and return what it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    t = time.perf_counter()
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--out", out], check=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)
        print(f"[bench]   ({time.perf_counter() - t:.0f} s)", flush=True)


ALL_ROWS = (*ROW_FUNCTIONS, *ONCE)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _quick() -> None:
    """Few repetitions and small sizes everywhere (a smoke test, not a measurement)."""
    global PLANE_ROWS, VIEW_ELEMENTS, WEIGHT_BYTES, FLOOR_COPY_BYTES, SHARDED_BYTES, SHARDED_REPS
    for reps in (REPS, ROW_REPS):
        for k in reps:
            reps[k] = max(1, reps[k] // 20)
    FLOOR_REPS.update(memcpy=2, tcp=2, rtt=50, rpc=20)
    PLANE_ROWS, VIEW_ELEMENTS, WEIGHT_BYTES, FLOOR_COPY_BYTES = 1024, 1 << 24, 32 * MB, 16 * MB
    SHARDED_BYTES, SHARDED_REPS = 32 * MB, 1


def _plot_target(args) -> tuple[str | None, str | None]:
    """Where the scale rows' plot goes and how the report refers to it."""
    if args.plot:
        return args.plot, os.path.basename(args.plot)
    if args.write:
        return os.path.join(os.path.dirname(os.path.abspath(args.write)), "img", "scale.png"), "img/scale.png"
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PATH", help="write the markdown report here")
    parser.add_argument("--systems", default="daskwg,verl")
    parser.add_argument(
        "--rows",
        default=",".join(ALL_ROWS),
        help=f"comma-separated rows to run (default: all): {', '.join(ALL_ROWS)}",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of the rows measured in every run")
    parser.add_argument(
        "--only-plane",
        action="store_true",
        help="only the data-plane rows (--rows " + ",".join(PLANE_ROWS_NAMES) + ")",
    )
    parser.add_argument("--child", choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    parser.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--sizes", default="2,4,8,16,32", help="ranks of the scale rows (default 2,4,8,16,32)"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write the scale rows' plot here (default with --write: docs/img/scale.png)",
    )
    parser.add_argument("--rows-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floors", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--quick", action="store_true", help="few repetitions, small sizes (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also save the raw samples here")
    parser.add_argument("--from-json", metavar="PATH", help="report from saved samples, run nothing")
    args = parser.parse_args()
    ranks = tuple(int(r) for r in args.ranks.split(","))
    rows = list(PLANE_ROWS_NAMES) if args.only_plane else [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ALL_ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose among {', '.join(ALL_ROWS)}")
    if args.quick:
        _quick()

    if args.floors:
        result = run_floors_child()
    elif args.child:
        if args.rows_child:
            result = run_rows_child(args.child, rows)
        elif args.sharded:
            result = run_sharded_child(args.child)
        elif args.rss:
            result = run_rss_child(args.child, max(ranks))
        elif args.scale:
            import scale

            result = scale.run_scale_child(
                args.child, tuple(int(n) for n in args.sizes.split(",")), args.quick
            )
        else:
            result = run_child(args.child, ranks)
    if args.floors or args.child:
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        runs, res, rss = saved.get("runs", []), saved.get("results", {}), saved.get("rss", {})
        report, verdicts = assemble(
            runs, res, rss, saved.get("grpo"), saved.get("scale"), _plot_target(args), saved.get("sharded")
        )
        print(report)
        if args.write:
            versions = collect_versions(runs, res)
            write_report(args.write, report, verdicts, versions, saved["machine"], saved["wall_s"])
        return

    t0 = time.time()
    quick = ["--quick"] if args.quick else []
    systems = args.systems.split(",")
    per_run = [r for r in rows if r in ROW_FUNCTIONS]
    runs: list[dict] = []
    for i in range(args.runs if per_run else 0):
        run: dict[str, Any] = {"load_start": _load()}
        t_run = time.time()
        print(f"[bench] run {i + 1}/{args.runs}: load average {run['load_start']}", flush=True)
        print("[bench] physical floors", flush=True)
        run["floors"] = spawn(["--floors", *quick])
        for name in systems if i % 2 == 0 else systems[::-1]:
            print(f"[bench] {name}: rows {','.join(per_run)}", flush=True)
            run[name] = spawn(["--child", name, "--rows-child", "--rows", ",".join(per_run), *quick])
        run["load_end"], run["wall_s"] = _load(), time.time() - t_run
        print(
            f"[bench] run {i + 1}/{args.runs} done in {run['wall_s']:.0f} s: load average {run['load_end']}"
        )
        runs.append(run)
    res, rss, grpo, scaled, sharded, heal = {}, {}, {}, {}, {}, {}
    if any(r in ONCE for r in rows):
        print(f"[bench] measured once: load average {_load()}", flush=True)
        passthrough = ["--ranks", args.ranks, *quick]
        for name in systems:
            if "timings" in rows:
                print(f"[bench] {name}: timings", flush=True)
                res[name] = spawn(["--child", name, *passthrough])
            if "rss" in rows:
                print(f"[bench] {name}: driver memory", flush=True)
                rss[name] = spawn(["--child", name, "--rss", *passthrough])
            if "scale" in rows:
                print(f"[bench] {name}: scale rows at {args.sizes} ranks", flush=True)
                scaled[name] = spawn(["--child", name, "--scale", "--sizes", args.sizes, *quick])
        if "grpo" in rows and "daskwg" in systems:
            steps = 4 if args.quick else GRPO_STEPS
            print(f"[bench] examples/grpo.py, {steps} steps, without and with --plan", flush=True)
            grpo = {"steps": steps, "calls": run_grpo(False, steps), "plan": run_grpo(True, steps)}
        if "sharded-sync" in rows:
            for name in systems:
                print(f"[bench] {name}: sharded weight sync", flush=True)
                sharded[name] = spawn(["--child", name, "--sharded", *quick])
        if "heal" in rows and "daskwg" in systems:
            print(
                "[bench] heal: SIGKILL -> an answering group, heal / warm spare / restart / rebuild",
                flush=True,
            )
            heal = run_heal(args.quick)
        print(f"[bench] measured once: done, load average {_load()}", flush=True)
    mach = machine()
    wall = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "runs": runs,
                    "results": res,
                    "rss": rss,
                    "grpo": grpo,
                    "scale": scaled,
                    "sharded": sharded,
                    "heal": heal,
                    "machine": mach,
                    "wall_s": wall,
                },
                f,
            )
    if heal:
        from heal import report as heal_report  # benchmarks/heal.py, beside this script

        print(heal_report(heal))
    if set(systems) != {"daskwg", "verl"}:
        if scaled:
            import scale

            print(scale.build_report(scaled, fmt_s, *_plot_target(args))[0])
        for name in systems:
            for run in runs:
                for key, samples in run[name]["samples"].items():
                    print(f"{name:7s} {key:28s} {cell(samples)}")
                for key, reason in run[name]["na"].items():
                    print(f"{name:7s} {key:28s} n/a ({reason})")
            for key, samples in res.get(name, {}).get("samples", {}).items():
                print(f"{name:7s} {key:28s} {cell(samples)}")
        if sharded:
            print(build_sharded_report(sharded)[0])
        return
    report, verdicts = assemble(runs, res, rss, grpo, scaled, _plot_target(args), sharded)
    print(report)
    print("\nmet:", verdicts)
    print(f"[bench] whole run {wall:.0f} s")
    if args.write and (set(rows) != set(ALL_ROWS) or args.quick):
        print(
            f"[bench] not writing {args.write}: a subset of the rows or --quick ran (use --json to keep it)"
        )
    elif args.write:
        write_report(args.write, report, verdicts, collect_versions(runs, res), mach, wall)
        print(f"[bench] wrote {args.write}")


if __name__ == "__main__":
    main()
