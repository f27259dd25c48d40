"""benchmarks/gpu_check.py (``tox -e gpu``): its CPU parts, as they run where no GPU is lent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_check.py")


@pytest.mark.timeout(600)
def test_cpu_checks_pass_and_print_one_table_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cpu", "--only", "layout,all_reduce,blocking,nonblocking,data_plane"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "no GPU used: the GPU checks are skipped" in proc.stdout
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| check")
    }
    assert rows == {
        name: "ok" for name in ("cluster", "layout", "all_reduce", "blocking", "nonblocking", "data_plane")
    }, proc.stdout


def test_an_unknown_check_is_refused_before_anything_starts():
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cpu", "--only", "layout,warp_drive"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown checks ['warp_drive']" in proc.stderr
