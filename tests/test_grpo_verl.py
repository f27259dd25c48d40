"""The main job written with verl's own classes, examples/grpo_verl.py: its worker takes and
returns verl's ``DataProto`` on daskwg.verl's groups, and a short run takes exactly the steps
examples/grpo.py takes (same rewards, same final weights), run as a user runs both, against
one cluster started with the ``dask`` command line."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import cloudpickle
import pytest
import verl
from conftest import CLICluster, wait_for_workers
from distributed import Client

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def run(example: str, tmp_path, address: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLES, example),
            *("--steps", "3", "--final-window", "3", "--checkpoint-every", "0", "--min-reward", "0"),
            *("--checkpoint-dir", str(tmp_path / example), "--out", str(tmp_path / f"{example}.png")),
            *("--scheduler", address),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return proc.stdout


def last_line(stdout: str, label: str) -> str:
    match = re.search(rf"^{label}.*$", stdout, re.M)
    assert match, f"no {label!r} in:\n{stdout}"
    return match.group(0)


@pytest.fixture(scope="module")
def cli_cluster4():
    cluster = CLICluster(4)
    try:
        with Client(cluster.address) as client:
            wait_for_workers(client, 4, timeout=600)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def grpo_verl():
    sys.path.insert(0, EXAMPLES)
    try:
        module = importlib.import_module("grpo_verl")
    finally:
        sys.path.remove(EXAMPLES)
    # The workers cannot import the example (run as a script, it is __main__ and travels by value).
    cloudpickle.register_pickle_by_value(module)
    yield module
    cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.timeout(300)
def test_verl_worker_generates_verl_dataproto_batches_on_a_ray_worker_group(grpo_verl, cli_cluster4):
    grpo = grpo_verl.grpo
    args = grpo.parse_args(["--world-size", "2", "--prompts-per-step", "4", "--n", "3"])
    with Client(cli_cluster4.address):  # the default client, which verl's pools take workers from
        groups = grpo_verl.build_groups(None, args)
        try:
            prompts = grpo.make_prompts(4, 0, 0, verl.DataProto)
            prompts.meta_info.update(n=3, step=0)
            batch = groups.rollout.generate_sequences(prompts)
            assert isinstance(batch, verl.protocol.DataProtoFuture)
            rewarded = groups.actor.compute_reward(batch).get()
        finally:
            groups.shutdown()
    assert type(rewarded) is verl.DataProto
    assert len(rewarded) == 12
    assert rewarded.batch["uid"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert rewarded.batch["token_level_scores"].shape == (12, 3)


@pytest.mark.timeout(900)
def test_verl_worker_takes_the_steps_of_the_native_one(tmp_path, cli_cluster4):
    native = run("grpo.py", tmp_path, cli_cluster4.address)
    with_verl = run("grpo_verl.py", tmp_path, cli_cluster4.address)
    assert "actor on 4 ranks, rollout on 4 ranks, 4 Dask workers" in with_verl
    for label in ("final mean reward", "weights identical on all 4 ranks"):
        assert last_line(with_verl, label) == last_line(native, label)
