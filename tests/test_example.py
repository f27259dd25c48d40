"""The main job, examples/train_digits.py, run as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_digits.py")


@pytest.mark.timeout(300)
def test_train_digits_reaches_95_percent_with_bit_identical_ranks(tmp_path):
    out = tmp_path / "curves.png"
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.95
    assert "weights identical on all 4 ranks" in proc.stdout
    assert out.stat().st_size > 10_000
