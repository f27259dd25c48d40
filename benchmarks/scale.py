"""Scale rows of ``benchmarks/run.py`` (``--rows scale``): per-call cost from 2 to 32 ranks,
daskwg and verl's ``RayWorkerGroup`` side by side in the same run, and the wide-batch row.

Every size gets one worker process per rank: daskwg a fresh ``daskwg.local_cluster(n)``
(its start is not measured), verl ``n`` new actors (one ``ray.init`` for all sizes; the
actors' start is part of "group creation", as it is part of making a ``RayWorkerGroup``).
Each system runs in its own driver subprocess, as the other rows do. At each size:

* ``one_to_all``: a small blocking ``ONE_TO_ALL`` call (``echo(1)``, every rank answers 1);
* ``nonblocking``: a ``blocking=False`` ``ONE_TO_ALL`` call + gather (``daskwg.get``, ``ray.get``);
* ``dp1`` / ``dp64``: a 1 MiB / 64 MiB ``DP_COMPUTE_PROTO`` round trip (``[256, 1024]`` /
  ``[4096, 4096]`` float32, every rank adds 1 in place and returns its piece);
* ``seq8``: per call of 8 blocking calls in a row (``DP_COMPUTE``); ``seq8 plan``: per call
  of the same 8 calls as one ``daskwg.plan`` (daskwg only; compared with verl's calls);
* ``create``: group creation + its first call.

Next to each median the driver process's CPU time per call (``time.process_time``, all its
threads, less its background CPU over as long with no call running: daskwg's
``local_cluster`` scheduler and nannies run inside the driver process, Ray's GCS and raylet
do not) and, for daskwg, the threads, file descriptors and TCP connections of the
driver and of the busiest worker process (``psutil``), which ``docs/scaling.md`` uses.

The wide-batch row (daskwg, 2 ranks): a ``DP_COMPUTE_PROTO`` echo of 4, 64 and 512 float32
keys of 8 rows at equal bytes (16 KiB in all), blocking and ``blocking=False`` + ``get``,
against ``DataProto.concat(batch.chunk(2))`` in the driver; the per-key cost is the
difference between 512 and 4 keys, divided by 508.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MB = 1 << 20
SIZES = (2, 4, 8, 16, 32)
#: Repetitions per size after one warm-up call (per call for ``seq8``: sequences of 8).
REPS = {"one_to_all": 40, "nonblocking": 40, "dp1": 10, "dp64": 3, "seq8": 8, "create": 1}
#: (row key, label) of the per-call rows, in report order.
LABELS = (
    ("one_to_all", "ONE_TO_ALL small blocking call"),
    ("nonblocking", "`blocking=False` call + gather"),
    ("dp1", "1 MiB DP_COMPUTE_PROTO round trip"),
    ("dp64", "64 MiB DP_COMPUTE_PROTO round trip"),
    ("seq8", "per call, 8 calls in a row"),
    ("seq8 plan", "per call, 8-call `daskwg.plan` (verl: its calls)"),
    ("create", "group creation + first call"),
)
WIDE_KEYS = (4, 64, 512)
WIDE_ROWS = 8
WIDE_ELEMENTS = 512 * WIDE_ROWS  # float32 elements of every wide batch: equal bytes
WIDE_REPS = 20


def _timed(fn, reps: int) -> tuple[list[float], float]:
    """Wall seconds of each of ``reps`` calls (after one warm-up) and the driver process's
    CPU seconds per call, less what the process spends with no call running over as long
    (its background: the in-process scheduler of ``local_cluster``, heartbeats, Ray's
    threads), measured right after over at most 2 s."""
    fn()
    out = []
    cpu = time.process_time()
    t0 = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    busy, wall = time.process_time() - cpu, time.perf_counter() - t0
    idle_s = min(wall, 2.0)
    cpu = time.process_time()
    time.sleep(idle_s)
    idle = (time.process_time() - cpu) * wall / idle_s
    return out, max(busy - idle, 0.0) / reps


def _expect(got: Any, want: Any, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


def _process_counts(pid: int | None = None) -> dict:
    import psutil

    p = psutil.Process(pid)
    return {
        "threads": p.num_threads(),
        "fds": p.num_fds(),
        "tcp": len(p.net_connections(kind="tcp")),
    }


def _worker_counts(dask_worker=None) -> dict:
    return _process_counts()


def measure_size(system, n: int, reps: dict, samples: dict, cpu: dict, extra: dict) -> None:
    """The scale rows at ``n`` ranks on a started ``system`` (``run.DaskSystem`` / ``run.VerlSystem``)."""
    import torch

    t = time.perf_counter()
    pool = system.pool(n)
    wg = system.group_on(pool)
    _expect(list(wg.echo(1)), [1] * n, "echo")
    samples[f"create/{n}"] = [time.perf_counter() - t]
    try:
        rows = [
            ("one_to_all", lambda: _expect(list(wg.echo(1)), [1] * n, "echo")),
            (
                "nonblocking",
                lambda: _expect(list(system.gather(wg.echo_nonblocking(1))), [1] * n, "echo_nonblocking"),
            ),
        ]
        for key, fn in rows:
            samples[f"{key}/{n}"], cpu[f"{key}/{n}"] = _timed(fn, reps[key])
        for key, shape in (("dp1", (256, 1024)), ("dp64", (4096, 4096))):
            data = system.DataProto.from_dict(tensors={"x": torch.zeros(shape)})
            samples[f"{key}/{n}"], cpu[f"{key}/{n}"] = _timed(lambda data=data: wg.inplace(data), reps[key])
            if float(data.batch["x"][0, 0]) != 0.0:
                raise AssertionError(f"{key}: the driver's batch changed")
            del data

        def seq():
            xs = [0] * n
            for _ in range(8):
                xs = wg.tick(xs)
            _expect(list(xs), [8] * n, "tick")

        times, c = _timed(seq, reps["seq8"])
        samples[f"seq8/{n}"], cpu[f"seq8/{n}"] = [x / 8 for x in times], c / 8
        if system.name == "daskwg":
            with system.daskwg.plan("seq8") as step:
                xs = step.input("xs")
                for _ in range(8):
                    xs = wg.tick(xs)
                step.output(xs)

            def replay():
                _expect(list(step.run(xs=[0] * n)), [8] * n, "tick plan")

            times, c = _timed(replay, reps["seq8"])
            samples[f"seq8 plan/{n}"], cpu[f"seq8 plan/{n}"] = [x / 8 for x in times], c / 8
            workers = system.client.run(_worker_counts)
            extra[f"processes/{n}"] = {
                "driver": _process_counts(),
                "worker max": {k: max(w[k] for w in workers.values()) for k in ("threads", "fds", "tcp")},
            }
    finally:
        system.close_group(wg)
        system.close_pool(pool)


def run_scale_child(name: str, sizes: tuple[int, ...], quick: bool = False) -> dict:
    """The scale rows of one system at every size in ``sizes``; for daskwg also the wide row."""
    import torch
    from run import SYSTEMS, make_rows_class

    torch.set_num_threads(1)
    reps = {k: max(1, v // 10) for k, v in REPS.items()} if quick else dict(REPS)
    samples: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    extra: dict[str, Any] = {}
    system = SYSTEMS[name]()
    versions: dict = {}
    if name == "verl":
        system.start(max(sizes), slots=max(sizes))
    for n in sizes:
        t = time.perf_counter()
        if name == "daskwg":
            system.start(n)
        system.cls = make_rows_class(*system.api())
        if name == "verl":
            system.remote_cls = system.ray.remote(system.cls)
        try:
            measure_size(system, n, reps, samples, cpu, extra)
            if name == "daskwg" and n == 2:
                extra["wide"] = run_wide(system, WIDE_REPS // (10 if quick else 1))
            versions = system.versions()
        finally:
            if name == "daskwg":
                system.stop()
        print(f"[bench]   {name} scale {n} ranks: {time.perf_counter() - t:.1f} s", flush=True)
    if name == "verl":
        system.stop()
    return {"samples": samples, "cpu": cpu, "extra": extra, "versions": versions}


def run_wide(system, reps: int) -> dict:
    """The wide-batch row on a started daskwg system: seconds and driver CPU seconds per call."""
    import torch

    DataProto = system.DataProto
    pool = system.pool(2)
    wg = system.group_on(pool)
    out: dict[str, dict] = {}
    try:
        for keys in WIDE_KEYS:
            cols = WIDE_ELEMENTS // keys // WIDE_ROWS
            tensors = {f"k{i}": torch.full((WIDE_ROWS, cols), float(i)) for i in range(keys)}
            data = system.DataProto.from_dict(tensors=tensors)

            def check(got, keys=keys, data=data):
                last = f"k{keys - 1}"
                if list(got.batch.keys()) != list(data.batch.keys()) or not torch.equal(
                    got.batch[last], data.batch[last]
                ):
                    raise AssertionError(f"wide {keys}: wrong batch back")

            row = {
                "blocking": _timed(lambda data=data: check(wg.echo_proto(data)), reps),
                "nonblocking": _timed(lambda data=data: check(wg.echo_async(data).get()), reps),
                "own": _timed(lambda data=data: DataProto.concat(data.chunk(2)), reps),
            }
            out[str(keys)] = {k: {"wall": statistics.median(w), "cpu": c} for k, (w, c) in row.items()}
    finally:
        system.close_group(wg)
        system.close_pool(pool)
    return out


# ----------------------------------------------------------------------- report


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares line through ``(xs, ys)``: (seconds per added rank, intercept)."""
    import numpy as np

    if len(xs) < 2:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return float(slope), float(intercept)


def _median(samples: dict, key: str) -> float | None:
    got = samples.get(key)
    return statistics.median(got) if got else None


def build_report(
    res: dict, fmt_s, plot_path: str | None = None, plot_ref: str | None = None
) -> tuple[str, dict]:
    """The scale tables (per size: both medians, the ratio, daskwg's driver CPU per call per
    rank; per row: both slopes and their ratio), the wide-batch table, and the verdicts of
    issue 46. Writes the plot to ``plot_path`` when given (referenced as ``plot_ref``)."""
    d, v = res.get("daskwg", {}), res.get("verl", {})
    ds, vs = d.get("samples", {}), v.get("samples", {})
    sizes = sorted({int(k.split("/")[1]) for k in [*ds, *vs] if "/" in k})
    verdicts: dict[str, bool | None] = {}
    lines = [
        "| row | ranks | daskwg | verl | daskwg ÷ verl | daskwg driver CPU per call per rank | "
        "verl driver CPU per call per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    slopes = []
    for key, label in LABELS:
        vkey = "seq8" if key == "seq8 plan" else key
        xs_d, ys_d, xs_v, ys_v = [], [], [], []
        cpu_d, cpu_v = [], []  # (ranks, driver CPU seconds per call)
        for n in sizes:
            dm, vm = _median(ds, f"{key}/{n}"), _median(vs, f"{vkey}/{n}")
            if dm is None and vm is None:
                continue
            dc, vc = d.get("cpu", {}).get(f"{key}/{n}"), v.get("cpu", {}).get(f"{vkey}/{n}")
            ratio = dm / vm if dm is not None and vm else None
            if dc is not None:
                cpu_d.append((n, dc))
            if vc is not None:
                cpu_v.append((n, vc))
            if dm is not None:
                xs_d.append(n)
                ys_d.append(dm)
            if vm is not None:
                xs_v.append(n)
                ys_v.append(vm)
            if key in ("one_to_all", "nonblocking", "dp1") and n >= 16 and ratio is not None:
                verdicts[f"scale {key} at {n} ranks ≤ 0.5× verl"] = ratio <= 0.5
            lines.append(
                f"| {label} | {n} | {fmt_s(dm) if dm is not None else 'n/a'} | "
                f"{fmt_s(vm) if vm is not None else 'n/a'} | {'n/a' if ratio is None else f'{ratio:.2f}'} | "
                f"{fmt_s(dc / n) if dc is not None else ''} | {fmt_s(vc / n) if vc is not None else ''} |"
            )
        sd, _ = _fit(xs_d, ys_d)
        sv, _ = _fit(xs_v, ys_v)
        cd, _ = _fit([n for n, _ in cpu_d], [c for _, c in cpu_d])
        cv, _ = _fit([n for n, _ in cpu_v], [c for _, c in cpu_v])
        slopes.append((key, label, sd, sv, (xs_d, ys_d, xs_v, ys_v), (cd, cv)))
    tables = ["\n".join(lines)]
    lines = [
        "| row | daskwg: each added rank | verl: each added rank | daskwg ÷ verl | "
        "driver CPU per call, each added rank: daskwg | verl |",
        "|---|---|---|---|---|---|",
    ]
    for key, label, sd, sv, _, (cd, cv) in slopes:
        if sd != sd and sv != sv:  # NaN: fewer than two sizes
            continue
        ratio = sd / sv if sv == sv and sv > 0 and sd == sd else None
        if key in ("one_to_all", "nonblocking", "dp1") and ratio is not None:
            verdicts[f"scale {key}: slope ≤ 0.5× verl"] = ratio <= 0.5
        lines.append(
            f"| {label} | {fmt_s(sd) if sd == sd else 'n/a'} | {fmt_s(sv) if sv == sv else 'n/a'} | "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'} | "
            f"{fmt_s(cd) if cd == cd else ''} | {fmt_s(cv) if cv == cv else ''} |"
        )
    tables.append("\n".join(lines))
    wide = d.get("extra", {}).get("wide")
    if wide:
        tables.append(_wide_table(wide, fmt_s, verdicts))
    procs = {k: x for k, x in d.get("extra", {}).items() if k.startswith("processes/")}
    if procs:
        lines = [
            "| daskwg ranks | driver threads / fds / TCP | busiest worker threads / fds / TCP |",
            "|---|---|---|",
        ]
        for k in sorted(procs, key=lambda k: int(k.split("/")[1])):
            a, b = procs[k]["driver"], procs[k]["worker max"]
            lines.append(
                f"| {k.split('/')[1]} | {a['threads']} / {a['fds']} / {a['tcp']} | "
                f"{b['threads']} / {b['fds']} / {b['tcp']} |"
            )
        tables.append("\n".join(lines))
    if plot_path and sizes:
        plot(slopes, plot_path)
        if plot_ref:
            tables.append(f"![cost per call against ranks, daskwg and verl]({plot_ref})")
    return "\n\n".join(tables), verdicts


def _wide_table(wide: dict, fmt_s, verdicts: dict) -> str:
    lines = [
        "| wide batch, 2 ranks, 16 KiB | keys | blocking call | `blocking=False` + get | "
        "driver's own chunk + concat | driver CPU: blocking / non-blocking / own |",
        "|---|---|---|---|---|---|",
    ]
    for keys, row in wide.items():
        lines.append(
            f"| | {keys} | {fmt_s(row['blocking']['wall'])} | {fmt_s(row['nonblocking']['wall'])} | "
            f"{fmt_s(row['own']['wall'])} | {fmt_s(row['blocking']['cpu'])} / "
            f"{fmt_s(row['nonblocking']['cpu'])} / {fmt_s(row['own']['cpu'])} |"
        )
    lo, hi = str(WIDE_KEYS[0]), str(WIDE_KEYS[-1])
    if lo in wide and hi in wide:
        span = WIDE_KEYS[-1] - WIDE_KEYS[0]
        cells = []
        for what in ("wall", "cpu"):
            own = (wide[hi]["own"][what] - wide[lo]["own"][what]) / span
            for path in ("blocking", "nonblocking"):
                per_key = (wide[hi][path][what] - wide[lo][path][what]) / span
                ratio = per_key / own if own > 0 else None
                cells.append(
                    f"{path} {what}: {fmt_s(per_key)} ({'n/a' if ratio is None else f'{ratio:.2f}'}×)"
                )
                if what == "wall" and ratio is not None:
                    verdicts[f"wide batch {path}: per-key cost ≤ 2× the driver's own"] = ratio <= 2.0
            cells.append(f"own {what}: {fmt_s(own)}")
        lines.append(f"| per added key ({lo} → {hi} keys) | | {'; '.join(cells)} | | | |")
    return "\n".join(lines)


def plot(slopes: list, path: str) -> None:
    """Cost per call against ranks, one panel per row, daskwg and verl (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in slopes if s[4][1] or s[4][3]]
    cols = 3
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (_, label, _, _, (xs_d, ys_d, xs_v, ys_v), _) in zip(axes.flat, shown):
        if xs_d:
            ax.plot(xs_d, [y * 1e3 for y in ys_d], "o-", label="daskwg")
        if xs_v:
            ax.plot(xs_v, [y * 1e3 for y in ys_v], "s--", label="verl (Ray)")
        ax.set_title(label.replace("`", ""), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
