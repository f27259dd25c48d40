"""The flagship in every placement: ``examples/grpo.py`` for each placement and seed, as a table.

Each cell is one whole run of ``grpo.py`` (its own local cluster, started with Dask's
command line) with the default recipe; the table gives its final mean reward (the mean
over the last 10 steps; a run passes at ``--min-reward``, 0.9), and per placement the
median seconds per step and driver bytes per step. Placements:

* ``colocated``: every role on each of 4 ranks (verl's hybrid engine);
* ``split``: the rollout on 2 ranks, actor and reference on 4 others;
* ``split --async``: the same, the rollout of step t+1 overlapping update t (verl's
  one-step off-policy recipe; each batch is one policy version old);
* ``killed worker``: colocated, the worker of trainer rank 1 SIGKILLed during step 10;
  the groups are rebuilt and training resumes from the last checkpoint.

Run it with ``tox -e demo-matrix`` (``-- --seeds 0 1 --placements split``, say). It prints
a Markdown table and exits with status 1 if any run failed or fell short of the reward.
Runs go one after the other (``--jobs 1``) so that the seconds per step are each run's
own; ``--jobs 2`` halves the wall time and keeps the rewards (a run's steps do not depend
on timing) but not the timings.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

PLACEMENTS = {
    "colocated": [],
    "split": ["--placement", "split"],
    "split --async": ["--placement", "split", "--async"],
    "killed worker": ["--kill-worker-at-step", "10"],
}

_PATTERNS = {
    "reward": r"final mean reward: ([0-9.]+)",
    "s_per_step": r"\(([0-9.]+) s/step\)",
    "driver_bytes": r"driver bytes per step: ([0-9]+)",
    "staleness": r"staleness .*: mean ([0-9.]+)",
    "restarts": r"groups rebuilt ([0-9]+) time",
}


def run_one(placement: str, seed: int, extra: list[str], directory: str, timeout: float) -> dict:
    """Run ``grpo.py`` once; returns what it printed that the table needs.

    Returns:
        ``{"placement", "seed", "status", "seconds"}`` plus, when printed, ``reward``,
        ``s_per_step``, ``driver_bytes``, ``staleness``, ``restarts`` (floats), and
        ``tail`` (the last lines of its output) when it failed.
    """
    tag = f"{placement.replace(' ', '_').replace('-', '')}_{seed}"
    command = [
        sys.executable,
        os.path.join(HERE, "grpo.py"),
        *PLACEMENTS[placement],
        "--seed",
        str(seed),
        "--out",
        os.path.join(directory, f"{tag}.png"),
        "--checkpoint-dir",
        os.path.join(directory, f"{tag}_checkpoint"),
        *extra,
    ]
    t0 = time.perf_counter()
    # A session of its own: on a timeout, the run and the cluster it started go together.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        status: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        _stop_session(proc)
        output, _ = proc.communicate()
        status = f"timed out after {timeout:.0f} s"
    record = {"placement": placement, "seed": seed, "status": status, "seconds": time.perf_counter() - t0}
    for key, pattern in _PATTERNS.items():
        match = re.search(pattern, output)
        if match:
            record[key] = float(match.group(1))
    if status != 0:
        record["tail"] = "\n".join(output.strip().splitlines()[-5:])
    return record


def _stop_session(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the run's whole session (``grpo.py`` stops its cluster on it), SIGKILL
    whatever is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def table(records: list[dict], placements: list[str], seeds: list[int], min_reward: float) -> str:
    """The Markdown table: a row per placement, a column per seed (final mean reward, ``✗``
    below ``min_reward`` or failed), then medians of seconds and driver bytes per step."""
    head = ["placement", *[f"seed {s}" for s in seeds], "s/step (median)", "driver B/step", "staleness"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for placement in placements:
        mine = {r["seed"]: r for r in records if r["placement"] == placement}
        cells = [placement]
        for seed in seeds:
            r = mine.get(seed, {})
            if "reward" not in r:
                cells.append(f"failed ({r.get('status', 'not run')})")
            else:
                mark = "" if r["reward"] >= min_reward and r["status"] == 0 else " ✗"
                cells.append(f"{r['reward']:.4f}{mark}")

        cells += [
            _median(mine.values(), k, f)
            for k, f in (("s_per_step", ".3f"), ("driver_bytes", ".0f"), ("staleness", ".2f"))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(records, key: str, fmt: str) -> str:
    values = [r[key] for r in records if key in r]
    return format(statistics.median(values), fmt) if values else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="default 0-4")
    parser.add_argument(
        "--placements",
        nargs="+",
        choices=list(PLACEMENTS),
        default=list(PLACEMENTS),
        metavar="P",
        help=f"any of {list(PLACEMENTS)} (default all)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1: honest timings)")
    parser.add_argument("--min-reward", type=float, default=0.9, help="a run's bar (default 0.9)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    args, extra = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    ours = (
        "--seed",
        "--placement",
        "--async",
        "--kill-worker-at-step",
        "--out",
        "--checkpoint-dir",
        "--min-reward",
    )
    taken = [a for a in extra if a.split("=", 1)[0] in ours]
    if taken:
        parser.error(f"{taken[0].split('=', 1)[0]} is set per run by the matrix (use --seeds, --placements)")
    extra += ["--min-reward", str(args.min_reward)]
    cells = [(p, s) for p in args.placements for s in args.seeds]
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="grpo_matrix_") as directory,
        ThreadPoolExecutor(args.jobs) as pool,
    ):
        futures = [pool.submit(run_one, p, s, extra, directory, args.timeout) for p, s in cells]
        records = []
        for future in futures:
            record = future.result()
            records.append(record)
            reward = f"{record['reward']:.4f}" if "reward" in record else "n/a"
            print(
                f"{record['placement']:>14}  seed {record['seed']}: final mean reward {reward}, "
                f"exit {record['status']}, {record['seconds']:.0f} s",
                flush=True,
            )
            if "tail" in record:
                print("    " + record["tail"].replace("\n", "\n    "), flush=True)
    print(
        f"\n{len(cells)} runs of examples/grpo.py in {time.perf_counter() - start:.0f} s "
        f"({args.jobs} at a time; load average {os.getloadavg()[0]:.1f})\n"
    )
    print(table(records, args.placements, args.seeds, args.min_reward))
    failed = [r for r in records if r["status"] != 0]
    if failed:
        print(
            f"\n{len(failed)} of {len(records)} runs failed or fell short of {args.min_reward}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
