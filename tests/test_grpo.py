"""The main job, examples/grpo.py: short runs of both placements, a resume and a killed
worker, run as a user runs them (the full run to reward 0.9 is ``tox -e demo``).

The colocated run starts its own local cluster, as ``python examples/grpo.py`` does; the
split and killed-worker runs share a cluster started with the ``dask`` command line and
attach to it with ``--scheduler``, as on a cluster a user already runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import CLICluster, wait_for_workers
from distributed import Client

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "grpo.py")


def load_example():
    if "grpo_example" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["grpo_example"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["grpo_example"]


def run_example(*args: str, timeout: float = 840) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--min-reward", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return proc


def number(stdout: str, label: str) -> float:
    match = re.search(rf"{label}: ([0-9.]+)", stdout)
    assert match, f"no {label!r} in:\n{stdout}"
    return float(match.group(1))


def rollout_batch_bytes(stdout: str) -> int:
    """One step's rollout batch (responses, prompts, log-probs, ...), as grpo.py prints it:
    what the driver would receive per step if the batch went through it. The calls'
    replies (each with its result's part descriptions) cost about as much as the responses
    alone at this toy size, so the batch is the measure that tells the two apart."""
    match = re.search(
        r"one step's responses: [0-9]+ bytes \(([0-9]+) bytes with the rest of the rollout batch\)", stdout
    )
    assert match, f"no rollout batch size in:\n{stdout}"
    return int(match.group(1))


def short_run_args(tmp_path, *extra: str) -> list[str]:
    return [
        "--steps",
        "4",
        "--final-window",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "checkpoint"),
        "--out",
        str(tmp_path / "grpo.png"),
        *extra,
    ]


def test_reward_is_the_fraction_of_answer_tokens_right():
    grpo = load_example()
    eos, pad = grpo.EOS, grpo.PAD
    responses = torch.tensor([[1, 5, eos], [1, eos, pad], [5, eos, pad], [7, 3, 1], [eos, pad, pad]])
    mask = grpo.response_mask_of(responses)
    truth = torch.tensor([15, 15, 5, 7, 0])
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    scores = grpo.score_responses(responses, mask, truth)
    # 15: all three of "1 5 <eos>"; "1 <eos>" gets 1 of 3; 5: both of "5 <eos>";
    # 7: "7 3 1" gets 1 of 3; 0: "<eos>" gets 0 of "0 <eos>".
    assert scores.tolist() == pytest.approx([1.0, 1 / 3, 1.0, 1 / 3, 0.0])


def test_log_probs_of_sampled_responses_match_the_sampling_distribution():
    grpo = load_example()
    torch.manual_seed(0)
    policy = grpo.GRUPolicy(hidden=16)
    prompts = grpo.make_prompts(32, step=0, seed=0).batch["prompts"]
    responses, mask = grpo.sample_responses(policy, prompts, torch.Generator().manual_seed(0))
    # Teacher forcing must score exactly the tokens sampling drew: recompute the
    # first token's log-prob from the prompt alone.
    first = torch.log_softmax(policy(prompts)[0][:, -1], dim=-1)
    first = first.gather(1, responses[:, :1].clamp(max=grpo.ANSWER_TOKENS - 1)).squeeze(1)
    log_probs = grpo.response_log_probs(policy, prompts, responses)
    assert torch.allclose(log_probs[:, 0], first, atol=1e-6)
    assert bool((mask.sum(1) >= 1).all())


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("grpo-colocated")
    return tmp_path, run_example(*short_run_args(tmp_path))


@pytest.mark.timeout(900)
def test_colocated_run_keeps_responses_off_the_driver(colocated_run):
    tmp_path, proc = colocated_run
    assert "actor on 4 ranks, rollout on 4 ranks, 4 Dask workers" in proc.stdout
    assert "weights identical on all 4 ranks" in proc.stdout
    assert number(proc.stdout, "driver bytes per step") < rollout_batch_bytes(proc.stdout)
    assert 0.0 <= number(proc.stdout, "final mean reward") <= 1.0
    assert (tmp_path / "grpo.png").stat().st_size > 10_000


@pytest.mark.timeout(900)
def test_resume_continues_from_the_last_checkpoint(colocated_run):
    tmp_path, _ = colocated_run
    proc = run_example(*short_run_args(tmp_path, "--steps", "6", "--resume"))
    assert "resumed from step 4" in proc.stdout
    assert "steps: 2 run" in proc.stdout


@pytest.mark.timeout(900)
def test_the_step_as_a_plan_trains_the_same_weights_with_one_message_per_worker(colocated_run, tmp_path):
    _, proc = colocated_run
    planned = run_example(*short_run_args(tmp_path, "--plan"))
    assert "step plan: 4 replays of 6 calls, the last one message per worker" in planned.stdout
    weights = re.compile(r"weights identical on all 4 ranks \(sha256 ([0-9a-f]+)")
    assert weights.search(planned.stdout).group(1) == weights.search(proc.stdout).group(1)
    assert number(planned.stdout, "final mean reward") == number(proc.stdout, "final mean reward")


@pytest.fixture(scope="module")
def cli_cluster6():
    cluster = CLICluster(6)
    try:
        with Client(cluster.address) as client:
            wait_for_workers(client, 6, timeout=600)
        yield cluster
    finally:
        cluster.close()


@pytest.mark.timeout(900)
def test_split_placement_reshards_batches_and_syncs_weights_worker_to_worker(tmp_path, cli_cluster6):
    proc = run_example(*short_run_args(tmp_path, "--placement", "split", "--scheduler", cli_cluster6.address))
    assert "actor on 4 ranks, rollout on 2 ranks, 6 Dask workers" in proc.stdout
    # The rollout ranks hold the trainer's weights only if every sync arrived.
    assert "weights identical on all 6 ranks" in proc.stdout
    assert number(proc.stdout, "driver bytes per step") < rollout_batch_bytes(proc.stdout)


@pytest.mark.timeout(900)
def test_killed_worker_is_replaced_and_training_resumes_from_the_checkpoint(tmp_path, cli_cluster6):
    proc = run_example(
        *short_run_args(
            tmp_path, "--steps", "5", "--kill-worker-at-step", "4", "--scheduler", cli_cluster6.address
        )
    )
    assert "killing the worker of trainer rank 1" in proc.stdout + proc.stderr
    assert "groups rebuilt 1 time(s), resumed from step(s) [2]" in proc.stdout
    assert "steps: 6 run" in proc.stdout  # 1-3, then 3-5 again after the restart from step 2
    assert "weights identical on all 4 ranks" in proc.stdout


@pytest.mark.timeout(900)
def test_heal_replaces_a_killed_trainer_and_rollout_rank_and_loses_no_step(tmp_path, cli_cluster6):
    proc = run_example(
        *short_run_args(
            tmp_path,
            *("--placement", "split", "--heal", "--steps", "4"),
            *(
                "--kill-worker-at-step",
                "2",
                "--kill-rollout-at-step",
                "3",
                "--scheduler",
                cli_cluster6.address,
            ),
        )
    )
    out = proc.stdout + proc.stderr
    assert "killing the worker of trainer rank 1" in out and "killing the worker of rollout rank 1" in out
    assert out.count("steps lost: 0; running step") == 2, out
    assert "healed in" in out and "groups rebuilt" not in out  # no checkpoint reload
    assert "groups healed 2 time(s), resumed from step(s) [1, 2]" in proc.stdout
    assert "steps: 4 run" in proc.stdout
    assert "weights identical on all 6 ranks" in proc.stdout


@pytest.mark.timeout(900)
def test_async_split_trains_one_version_behind_and_survives_a_killed_worker(tmp_path, cli_cluster6):
    proc = run_example(
        *short_run_args(
            tmp_path,
            *("--placement", "split", "--async", "--steps", "5", "--kill-worker-at-step", "4"),
            *("--scheduler", cli_cluster6.address),
        )
    )
    assert "groups rebuilt 1 time(s), resumed from step(s) [2]" in proc.stdout
    # Kept steps 1-2 (staleness 0, 1); after the restart, step 3 is generated afresh (0)
    # and steps 4-5 were generated during the step before (1, 1): the rollout started on
    # the broken groups is dropped, not trained on.
    assert (
        "staleness (policy versions a batch is behind the actor it trains): mean 0.60, max 1" in proc.stdout
    )
    # The last sync reached the rollout ranks after the last generation ran.
    assert "weights identical on all 6 ranks" in proc.stdout


@pytest.mark.timeout(900)
def test_a_lost_worker_past_max_restarts_is_named_as_the_cause(tmp_path, cli_cluster6):
    # Seen: --max-restarts 0 --async with a killed worker ended on a surviving rank's gloo
    # RankError (the first error to arrive), not on the lost worker.
    args = short_run_args(
        tmp_path,
        *("--placement", "split", "--async", "--steps", "3", "--kill-worker-at-step", "2"),
        *("--max-restarts", "0", "--scheduler", cli_cluster6.address),
    )
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--min-reward", "0", *args], capture_output=True, text=True, timeout=840
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-5000:]
    assert "step 2: a worker was lost (" in proc.stderr
    assert "rebuilt 0 time(s) of --max-restarts 0, so the run stops here" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_async_needs_the_split_placement():
    proc = subprocess.run([sys.executable, EXAMPLE, "--async"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert (
        "--async overlaps the rollout with the update on separate ranks: it needs --placement split"
        in proc.stderr
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "--n must be at least 1, got 0"),
        (["--prompts-per-step", "0"], "--prompts-per-step must be at least 1, got 0"),
        (["--hidden", "0"], "--hidden must be at least 1, got 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be at least 0, got -1"),
        (["--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
        (["--final-window", "0"], "--final-window must be at least 1, got 0"),
        (
            ["--kill-worker-at-step", "50", "--steps", "5"],
            "--kill-worker-at-step counts steps from 1 to --steps (5)",
        ),
        (
            ["--plan", "--async", "--placement", "split"],
            "--plan records the step from the prompts to the update",
        ),
    ],
)
def test_values_no_run_can_use_are_refused_before_a_cluster_starts(args, message):
    # Found by a new user: each of these started the cluster, then failed inside a step
    # (or, for the last three, ran without saying the value did nothing).
    proc = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_prompts_per_step_must_keep_prompt_groups_whole():
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--placement", "split", "--prompts-per-step", "6"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "must be a multiple of every dp size [4, 2]" in proc.stderr
