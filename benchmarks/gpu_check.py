"""Everything in daskwg that needs a GPU, in one prepared run of a few minutes, printing one table.

    python benchmarks/gpu_check.py                 # tox -e gpu
    python benchmarks/gpu_check.py --cpu           # the CPU parts only (what the suite runs)

Meant for a machine lent for minutes: run it once, read the table, put it in
docs/performance.md. Each check is one row; a check that needs more GPUs than the machine
has prints ``skipped`` with why, never a failure. On a machine without a GPU (or with
``--cpu``) the GPU checks are skipped and the CPU counterparts of the others run (gloo,
CPU tensors), so the script itself is tested in the suite.

Checks, in order (GPU / CPU):

0. ``cluster``: ``daskwg.local_cluster()`` starts (``LocalCUDACluster``: one worker per
   GPU; ``LocalCluster`` of 2 on CPU).
1. ``layout``: one group over every worker: each rank's ``RANK``, ``LOCAL_RANK``,
   ``CUDA_VISIBLE_DEVICES`` and the GPU it sees, all different.
2. ``all_reduce``: ``torch.distributed`` with nccl (gloo) initialised by the ranks of a
   group from the env daskwg sets, and a ``daskwg.create_collective_group`` all-reduce.
3. ``blocking`` / ``nonblocking``: a CUDA (CPU) tensor as an argument and as a
   result, through the blocking path and through ``blocking=False`` + ``daskwg.get``.
4. ``data_plane``: a ``DataProtoFuture`` of CUDA (CPU) tensors from one group's
   ``blocking=False`` call consumed by a second group, worker to worker.
5. ``main_job``: ``examples/grpo_llm.py`` for a few steps (nccl, bfloat16 on GPUs; gloo,
   float32 on CPU), trainer and rollout on different GPUs: needs 2 GPUs (1 trainer + 1
   rollout rank); with 4 or more, 2 + 2.
6. ``sharded_sync``: the ``sharded-sync`` row of ``benchmarks/run.py`` (daskwg only), with
   nccl over the GPUs (trainer ranks → rollout ranks, half the GPUs each): needs 2 GPUs;
   on CPU a 32 MiB state dict, 2 → 2 ranks over gloo.

Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MAIN_JOB_STEPS = 3


@dataclass
class Check:
    """One row of the table: ``status`` is ``ok``, ``FAILED`` or ``skipped``."""

    name: str
    status: str
    seconds: float
    detail: str


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


def gpus(cpu_only: bool) -> int:
    """GPUs this run uses: 0 with ``--cpu`` or where torch sees none."""
    if cpu_only:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_worker_class():
    import torch

    import daskwg
    from daskwg import DataProto, Dispatch, register

    class CheckWorker(daskwg.Worker):
        def __init__(self):
            super().__init__()
            torch.set_num_threads(1)
            self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def layout(self) -> dict:
            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
            uuid = str(torch.cuda.get_device_properties(0).uuid) if torch.cuda.is_available() else None
            return {
                "rank": self.rank,
                "RANK": os.environ.get("RANK"),
                "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu": gpu,
                "uuid": uuid,
                "pid": os.getpid(),
            }

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def torch_all_reduce(self, backend: str) -> float:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group(backend)
            x = torch.full((4,), float(self.rank + 1), device=self.device)
            dist.all_reduce(x)
            out = float(x[0])
            dist.destroy_process_group()
            return out

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def collective_all_reduce(self, name: str) -> float:
            from daskwg import collective

            x = torch.full((1024,), float(self.rank + 1), device=self.device)
            collective.allreduce(x, name)
            return float(x[0])

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def add_one(self, x):
            if x.device.type != self.device.type:
                raise TypeError(f"the argument arrived on {x.device}, expected {self.device.type}")
            return x.to(self.device) + 1

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        def add_one_later(self, x):
            return x.to(self.device) + 1

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def produce(self, data: DataProto) -> DataProto:
            ids = data.batch["i"].to(self.device)
            return DataProto.from_dict({"i": ids, "x": ids.float() * 2})

        @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
        def consume(self, data: DataProto) -> tuple:
            x = data.batch["x"]
            return (str(x.device.type), float(x.sum()), len(x))

    return CheckWorker


class Session:
    """One local cluster and one group over all its workers, shared by checks 1-4."""

    def __init__(self, n_gpus: int):
        from distributed import Client

        import daskwg

        self.daskwg, self.n_gpus = daskwg, n_gpus
        self.n = n_gpus if n_gpus else 2
        self.backend = "nccl" if n_gpus else "gloo"
        kwargs = {"dashboard_address": ":0"}
        if n_gpus:
            self.cluster = daskwg.local_cluster(**kwargs)  # LocalCUDACluster: one worker per GPU
        else:
            self.cluster = daskwg.local_cluster(self.n, **kwargs)
        self.client = Client(self.cluster)
        self.client.wait_for_workers(self.n)
        self.cls = make_worker_class()
        self.group = daskwg.WorkerGroup(self.client, daskwg.ClassWithInitArgs(self.cls), world_size=self.n)

    def close(self) -> None:
        self.group.shutdown()
        self.client.close()
        self.cluster.close()


def check_layout(s: Session) -> str:
    rows = s.group.layout()
    ranks = [r["rank"] for r in rows]
    if ranks != list(range(s.n)) or [r["RANK"] for r in rows] != [str(i) for i in range(s.n)]:
        raise AssertionError(f"ranks {ranks}, RANK {[r['RANK'] for r in rows]}")
    if len({r["pid"] for r in rows}) != s.n:
        raise AssertionError("two ranks share a worker process")
    if s.n_gpus:
        uuids = [r["uuid"] for r in rows]
        if len(set(uuids)) != s.n:
            raise AssertionError(f"ranks see the same GPU: {uuids}")
        where = ", ".join(f"rank {r['rank']}: CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']}" for r in rows)
        return f"{s.n} ranks, one GPU each ({rows[0]['gpu']}); {where}"
    return f"{s.n} ranks on {s.n} worker processes, LOCAL_RANK {[r['LOCAL_RANK'] for r in rows]} (no GPU)"


def check_all_reduce(s: Session) -> str:
    want = float(sum(range(1, s.n + 1)))
    got = s.group.torch_all_reduce(s.backend)
    if got != [want] * s.n:
        raise AssertionError(f"torch.distributed all_reduce gave {got}, expected {want}")
    with s.daskwg.create_collective_group([s.group], name="gpu-check", backend=s.backend):
        got = s.group.collective_all_reduce("gpu-check")
    if got != [want] * s.n:
        raise AssertionError(f"collective all_reduce gave {got}, expected {want}")
    return f"{s.backend}: torch.distributed over the group's env and a daskwg collective, {s.n} ranks, sum {want:g}"


def _tensor(s: Session):
    import torch

    return torch.arange(8, dtype=torch.float32, device="cuda" if s.n_gpus else "cpu")


def check_blocking(s: Session) -> str:
    x = _tensor(s)
    out = s.group.add_one(x)
    for y in out:
        if y.device.type != x.device.type or not bool((y.cpu() == x.cpu() + 1).all()):
            raise AssertionError(f"got {y} on {y.device}")
    return f"a {x.device.type} tensor in and out of {s.n} ranks, results on {out[0].device}"


def check_nonblocking(s: Session) -> str:
    x = _tensor(s)
    out = s.daskwg.get(s.group.add_one_later(x))
    for y in out:
        if y.device.type != x.device.type or not bool((y.cpu() == x.cpu() + 1).all()):
            raise AssertionError(f"got {y} on {y.device}")
    return f"blocking=False + daskwg.get, results on {out[0].device}"


def check_data_plane(s: Session) -> str:
    import torch

    consumer = s.daskwg.WorkerGroup(s.client, s.daskwg.ClassWithInitArgs(s.cls), world_size=s.n)
    try:
        rows = 64 * s.n
        fut = s.group.produce(s.daskwg.DataProto.from_dict({"i": torch.arange(rows)}))
        got = consumer.consume(fut)
    finally:
        consumer.shutdown()
    devices = {g[0] for g in got}
    total = sum(g[1] for g in got)
    if total != float(2 * sum(range(rows))) or sum(g[2] for g in got) != rows:
        raise AssertionError(f"consumers got {got}")
    want = "cuda" if s.n_gpus else "cpu"
    if devices != {want}:
        raise AssertionError(f"the batch arrived on {devices}, expected {want}")
    return f"a DataProtoFuture of {rows} rows from one group to another, arrived on {want}"


def check_main_job(n_gpus: int, cpu_only: bool) -> str:
    if not cpu_only and n_gpus < 2:
        raise Skip(f"needs 2 GPUs (a trainer and a rollout rank, each its own NCCL rank); found {n_gpus}")
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise Skip(f"needs transformers ({exc})") from None
    trainer = max(1, n_gpus // 2) if n_gpus else 1
    args = ["--steps", str(MAIN_JOB_STEPS), "--final-window", "1", "--min-reward", "0"]
    args += ["--world-size", str(trainer), "--rollout-world-size", str(trainer), "--prompts-per-step", "16"]
    args += ["--out", os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_check_grpo_llm.png")]
    env = dict(os.environ)
    if n_gpus:
        args += ["--dtype", "bfloat16"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu on a GPU machine: gloo, CPU tensors
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "grpo_llm.py"), *args],
        capture_output=True,
        text=True,
        timeout=480,  # the CPU counterpart on a loaded 2-core machine: its start-up alone took 345 s
        env=env,
    )
    if proc.returncode != 0 or "rollout weights match the trainer: yes" not in proc.stdout:
        raise AssertionError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    first = re.search(r"actor: .*", proc.stdout)
    step = re.search(r"\(([0-9.]+) s/step", proc.stdout)
    sync = re.search(r"weight sync: median ([0-9.]+) ms", proc.stdout)
    return (
        f"{first.group(0) if first else ''}; {MAIN_JOB_STEPS} steps at {step.group(1) if step else '?'} s/step, "
        f"sync median {sync.group(1) if sync else '?'} ms, weights matched"
    )


def check_sharded_sync(n_gpus: int, cpu_only: bool) -> str:
    if not cpu_only and n_gpus < 2:
        raise Skip(f"needs 2 GPUs (trainer and rollout ranks on different GPUs, NCCL); found {n_gpus}")
    sys.path.insert(0, HERE)
    import run as bench

    ranks = max(1, n_gpus // 2) if n_gpus else 2
    bench.SHARDED_RANKS, bench.SHARDED_WORKERS = ranks, 2 * ranks
    bench.SHARDED_BYTES = (512 if n_gpus else 32) * bench.MB
    bench.SHARDED_REPS = 2 if n_gpus else 1
    result = bench.run_sharded_child("daskwg", backend="nccl" if n_gpus else "gloo")
    table, _ = bench.build_sharded_report({"daskwg": result})
    lines = [line for line in table.splitlines()[2:] if "daskwg" in line]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    return "; ".join(f"{c[0]}: {c[2]} ({c[3]} p2p), egress {c[5]}" for c in cells)


SESSION_CHECKS = {
    "layout": check_layout,
    "all_reduce": check_all_reduce,
    "blocking": check_blocking,
    "nonblocking": check_nonblocking,
    "data_plane": check_data_plane,
}
CHECKS = ("cluster", *SESSION_CHECKS, "main_job", "sharded_sync")


def run_checks(cpu_only: bool, only: tuple[str, ...] = CHECKS) -> list[Check]:
    """Run the checks named in ``only`` (the cluster starts for any of ``cluster`` and
    :data:`SESSION_CHECKS`); returns the rows."""
    n_gpus = gpus(cpu_only)
    out: list[Check] = []

    def run(name: str, fn: Callable[[], str]) -> None:
        t = time.perf_counter()
        try:
            status, detail = "ok", fn()
        except Skip as exc:
            status, detail = "skipped", str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
            status, detail = "FAILED", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        out.append(Check(name, status, time.perf_counter() - t, detail.replace("|", "/").replace("\n", " ")))
        print(f"[gpu_check] {name}: {status} ({time.perf_counter() - t:.1f} s)", flush=True)

    session: Session | None = None

    def start() -> str:
        nonlocal session
        session = Session(n_gpus)
        return f"{type(session.cluster).__name__} of {session.n} workers"

    if "cluster" in only or set(only) & set(SESSION_CHECKS):
        run("cluster", start)
    for name, fn in SESSION_CHECKS.items():
        if name not in only:
            continue
        if session is None:
            out.append(Check(name, "skipped", 0.0, "the cluster did not start"))
            continue
        run(name, lambda fn=fn: fn(session))
    if session is not None:
        session.close()
    if "main_job" in only:
        run("main_job", lambda: check_main_job(n_gpus, cpu_only))
    if "sharded_sync" in only:
        run("sharded_sync", lambda: check_sharded_sync(n_gpus, cpu_only))
    return out


def table(checks: list[Check], n_gpus: int) -> str:
    import torch

    where = (
        f"{n_gpus} × {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        if n_gpus
        else f"no GPU used (CPU parts only), torch {torch.__version__}"
    )
    lines = [f"| check ({where}) | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds:.1f} | {c.detail} |" for c in checks]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="skip the GPU checks, run the CPU parts")
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated checks (default all): {', '.join(CHECKS)}"
    )
    args = parser.parse_args(argv)
    only = tuple(c for c in args.only.split(",") if c)
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose among {', '.join(CHECKS)}")
    n_gpus = gpus(args.cpu)
    if not n_gpus:
        print(
            "[gpu_check] no GPU used: the GPU checks are skipped; their CPU counterparts run (gloo, CPU tensors)"
        )
    start = time.perf_counter()
    checks = run_checks(args.cpu, only)
    print(table(checks, n_gpus))
    print(f"[gpu_check] done in {time.perf_counter() - start:.0f} s")
    return 1 if any(c.status == "FAILED" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
