"""The transformer main job, examples/grpo_llm.py: a two-step run as a user runs it (the full
run to reward 0.9 is ``tox -e demo-llm``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "grpo_llm.py")


@pytest.mark.timeout(600)
def test_two_steps_train_sync_the_shards_and_leave_the_rollout_with_the_trainers_weights(tmp_path):
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", "2", "--final-window", "1", "--min-reward", "0"]
        + ["--out", str(tmp_path / "grpo_llm.png")],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "rollout weights match the trainer: yes (3 syncs checked)" in proc.stdout
    assert "final mean reward: " in proc.stdout
    assert (tmp_path / "grpo_llm.png").exists()
