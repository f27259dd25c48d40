"""GRPO on a worker group: a small policy learns single-digit addition by reinforcement.

The main job of daskwg: the single-controller RL loop of verl's ``RayPPOTrainer.fit``
with GRPO advantages, on Dask, on CPU, in a couple of minutes.

The task. A prompt is ``a + b =`` with ``a, b`` in ``0..9`` (4 tokens); the response is
the sum's digits followed by an end-of-sequence token, sampled token by token (at most 3
tokens; ``7 + 8 =`` should be answered ``1 5 <eos>``). The reward is verifiable: the
fraction of positions of ``digits + <eos>`` the response got right, so a random policy
scores about 0.08 and a perfect one 1.0. Responses have different lengths, so the
response masks, per-token log-probabilities and the KL to the reference are real.

The policy is a 128-unit GRU language model over prompt and response tokens, started from
random weights. Every step samples ``n`` responses per prompt, scores them, normalises the
scores within each prompt's group (GRPO), and takes PPO-clip steps with a KL penalty to the
frozen initial policy (the reference), gradients all-reduced over ``torch.distributed``
(gloo on CPU, nccl on GPUs).

verl's roles and steps. One hybrid worker class, ``ActorRolloutRefWorker`` (verl's name),
holds the roles of a rank. Each step, the driver calls, in the order of verl's
``RayPPOTrainer.fit``:

====================================  =========================================================
call here                             verl step it mirrors
====================================  =========================================================
``rollout.generate_sequences``        ``actor_rollout_wg.generate_sequences`` (``n`` samples
                                      per prompt, ``repeat(interleave=True)``)
``actor.compute_reward``              ``compute_reward(batch, reward_fn)``, on the ranks
``actor.compute_advantage``           ``compute_advantage(..., adv_estimator=GRPO)``, on the
                                      ranks: a prompt's ``n`` samples are on one rank
``actor.compute_log_prob``            ``actor_rollout_wg.compute_log_prob`` (``old_log_probs``)
``actor.compute_ref_log_prob``        ``ref_policy_wg.compute_ref_log_prob`` (``ref_log_prob``)
``actor.update_actor``                ``actor_rollout_wg.update_actor`` (PPO-clip + KL loss)
``actor.get_weights`` →               the weight sync of verl's hybrid engine / separate
``rollout.load_weights``              rollout (``--placement split`` only)
====================================  =========================================================

Every stage before ``update_actor`` is registered ``blocking=False``: it returns a
``DataProtoFuture`` at once, and the next call takes that future, so the batch moves from
worker to worker (or stays in the worker) and never reaches the driver. The driver sends
prompts and receives the metrics ``update_actor`` returns; at the end it prints how many
bytes it received per step.

Placements:

* ``--placement colocated`` (default): every role on every one of ``--world-size`` ranks
  (verl's hybrid engine); the rollout uses the actor's weights in place.
* ``--placement split``: the rollout on its own group of ``--rollout-world-size`` ranks on
  other workers, the actor and reference on ``--world-size`` ranks. Generated batches
  reshard from the rollout's dp size to the trainer's on their way; after each update the
  trainer's rank 0 weights go to the rollout ranks worker to worker.

Faults: ``--kill-worker-at-step K`` SIGKILLs the Dask worker process of trainer rank 1 while
step K is in flight. The driver gets ``WorkerLostError``, builds the groups again once the
nanny has restarted the worker, reloads the last checkpoint (``--checkpoint-every``) and
carries on. ``--kill-rollout-at-step K`` does the same to rollout rank 1 (split placement).
With ``--heal`` the groups are healed instead (``wg.heal()``): the surviving ranks keep
their processes and state, the replacement trainer rank takes weights, reference and
optimizer state from a surviving trainer rank by a broadcast over the rebuilt gloo process
group (``recover_state``: worker to worker, no checkpoint read), a replacement rollout rank
loads the trainer's weights worker to worker, and the interrupted step runs again; it
prints ``healed in X s`` and ``steps lost: N`` for each. ``--grow-at-step K`` adds a Dask
worker before step K and grows the rollout group into it (``wg.resize``)::

    python examples/grpo.py --placement split --heal --kill-worker-at-step 8 --kill-rollout-at-step 14

Run it on a local cluster (``dask scheduler`` and ``dask worker`` started for you)::

    python examples/grpo.py                       # colocated, 4 ranks
    python examples/grpo.py --placement split     # 2 rollout + 4 trainer ranks
    python examples/grpo.py --kill-worker-at-step 10

or on a cluster you started (on several machines, checkpoints must be on a file system
every worker sees; on GPUs, with ``dask cuda worker``)::

    dask scheduler --port 8786 &
    dask worker tcp://127.0.0.1:8786 --nworkers 4 --nthreads 1 &
    python examples/grpo.py --scheduler tcp://127.0.0.1:8786

It prints ``final mean reward: X`` (mean over the last ``--final-window`` steps) and
``driver bytes per step: N``, writes reward, KL and response-length curves to ``--out``, and
exits with status 1 if the final mean reward is below ``--min-reward``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import daskwg
from daskwg import DataProto, DataProtoFuture, Dispatch, Execute, WorkerGroupError, WorkerLostError, register
from daskwg.wire.frames import received_bytes

# ---- the task: single-digit addition --------------------------------------------------------

PLUS, EQUALS, EOS, PAD = 10, 11, 12, 13
VOCAB = 14  # digits 0-9, "+", "=", <eos>, <pad>
ANSWER_TOKENS = 11  # what the policy emits: digits 0-9 and <eos> (index 10 stands for EOS)
MAX_RESPONSE_LEN = 3  # two digits and <eos>


def plural(n: int, noun: str) -> str:
    """``"1 rank"``, ``"4 ranks"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def make_prompts(n_prompts: int, step: int, seed: int, dataproto: type = DataProto) -> DataProto:
    """The prompts of one step, the same for a given ``(seed, step)`` (so a resumed run
    sees the prompts the interrupted one would have), as a ``dataproto`` (daskwg's, or
    verl's in ``grpo_verl.py``).

    Returns:
        DataProto with ``prompts`` [n, 4] int64 (``a + b =``), ``ground_truth`` [n] int64
        (``a + b``) and ``uid`` [n] int64 (unique per prompt in the run: GRPO's group id).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    a = torch.randint(0, 10, (n_prompts,), generator=generator)
    b = torch.randint(0, 10, (n_prompts,), generator=generator)
    prompts = torch.stack([a, torch.full_like(a, PLUS), b, torch.full_like(a, EQUALS)], dim=1)
    uid = step * n_prompts + torch.arange(n_prompts)
    return dataproto.from_dict({"prompts": prompts, "ground_truth": a + b, "uid": uid})


def score_responses(
    responses: torch.Tensor, response_mask: torch.Tensor, ground_truth: torch.Tensor
) -> torch.Tensor:
    """The verifiable reward: the fraction of the positions of ``digits + <eos>`` (target or
    response, whichever is longer) where the response has the target's token.

    Args:
        responses: [b, R] int64 (``PAD`` after the first ``EOS``).
        response_mask: [b, R] float, 1 up to and including the first ``EOS``.
        ground_truth: [b] int64, the sums.
    Returns:
        [b] float32 in [0, 1].
    """
    scores = []
    for response, length, total in zip(
        responses.tolist(), response_mask.sum(1).tolist(), ground_truth.tolist()
    ):
        target = [int(c) for c in str(total)] + [EOS]
        got = response[: int(length)]
        right = sum(t == g for t, g in zip(target, got))
        scores.append(right / max(len(target), len(got)))
    return torch.tensor(scores, dtype=torch.float32)


# ---- the policy -----------------------------------------------------------------------------


class GRUPolicy(nn.Module):
    """A GRU language model: token embeddings → one GRU layer → logits over the answer tokens."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, ANSWER_TOKENS)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None):
        """``tokens`` [b, t] → logits [b, t, 11] and the GRU state."""
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


@torch.no_grad()
def sample_responses(
    policy: GRUPolicy, prompts: torch.Tensor, generator: torch.Generator, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per prompt row, token by token, until ``EOS`` or 3 tokens.

    Returns:
        ``responses`` [b, 3] int64 (``PAD`` after the first ``EOS``) and ``response_mask``
        [b, 3] float32 (1 up to and including the first ``EOS``).
    """
    batch = prompts.shape[0]
    responses = torch.full((batch, MAX_RESPONSE_LEN), PAD, dtype=torch.long, device=prompts.device)
    done = torch.zeros(batch, dtype=torch.bool, device=prompts.device)
    logits, state = policy(prompts)
    for t in range(MAX_RESPONSE_LEN):
        probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        token = torch.where(token == ANSWER_TOKENS - 1, torch.full_like(token, EOS), token)
        token = torch.where(done, torch.full_like(token, PAD), token)
        responses[:, t] = token
        done |= token == EOS
        logits, state = policy(token[:, None], state)
    return responses, response_mask_of(responses)


def response_mask_of(responses: torch.Tensor) -> torch.Tensor:
    """1 for every response token up to and including the first ``EOS``, 0 after it."""
    is_eos = (responses == EOS).int()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_before == 0).float()


def response_log_probs(policy: GRUPolicy, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities [b, R] of ``responses`` given ``prompts`` (teacher forcing).

    Positions after the first ``EOS`` hold the log-probability of ``EOS``; mask them out.
    """
    answer_ids = responses.clamp(max=ANSWER_TOKENS - 1)  # EOS and PAD → the EOS output
    tokens = torch.cat([prompts, responses.clamp(max=EOS)], dim=1)[:, :-1]
    logits, _ = policy(tokens)
    log_probs = torch.log_softmax(logits[:, prompts.shape[1] - 1 :], dim=-1)
    return log_probs.gather(-1, answer_ids.unsqueeze(-1)).squeeze(-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


# ---- the worker: verl's ActorRolloutRefWorker ----------------------------------------------


@dataclass
class GRPOConfig:
    """Hyper-parameters every rank gets (verl's ``actor_rollout_ref`` config, in small)."""

    hidden: int = 128
    lr: float = 5e-3
    # verl: actor.kl_loss_coef, with kl_loss_type=low_var_kl. Higher than verl's 0.001 for
    # LLMs: the reference here is a random policy, and the KL to it keeps the policy from
    # settling early on a wrong answer it then samples every time (a group of identical
    # samples has no advantage to learn from). With 0.01, seeds 0-4 ended at 0.87-0.95;
    # with 0.05, at 0.955-0.983 (one rank each, the default steps).
    kl_coef: float = 0.05
    clip_ratio: float = 0.2  # verl: actor.clip_ratio
    ppo_epochs: int = 4  # verl: actor.ppo_epochs
    ppo_mini_batches: int = 2  # verl: train_batch_size / ppo_mini_batch_size
    grad_clip: float = 1.0
    temperature: float = 1.0
    seed: int = 0
    # Seconds a gloo collective waits for a peer. With --heal it is kept short: when a peer
    # dies inside update_actor, ranks not connected to it directly wait this long before
    # they fail and can be kept by wg.heal() (a rank still stuck is replaced, losing its state).
    pg_timeout_s: float = 30.0


def _with(data: DataProto, **tensors: torch.Tensor) -> DataProto:
    """``data`` plus new tensor keys, as a new DataProto.

    The input may be the very object the worker keeps as an earlier call's result (a
    same-rank DataProtoFuture resolves to it), so it is not changed in place. The result
    has the input's class (verl's ``DataProto`` in ``grpo_verl.py``).
    """
    batch = data.batch.clone(recurse=False)
    for key, value in tensors.items():
        batch[key] = value
    return type(data)(
        batch=batch, non_tensor_batch=dict(data.non_tensor_batch), meta_info=dict(data.meta_info)
    )


def _repeat_for_sampling(data: DataProto, n: int) -> DataProto:
    """``n`` rows per prompt, a prompt's rows next to each other (verl's
    ``batch.repeat(n, interleave=True)``). Done on the rank, so only the prompts travel.

    Switch point (issue 9): with a lazy ``DataProtoFuture.repeat`` the driver can do this
    on the future instead, without moving any bytes.
    """
    return data.repeat(n, interleave=True)


class ActorRolloutRefWorker(daskwg.Worker):
    """One rank holding some of the roles actor, rollout and reference (verl's hybrid worker).

    Args:
        role: ``"actor_rollout_ref"`` (all three, the colocated placement), ``"actor_ref"``
            (the trainer of the split placement) or ``"rollout"``.
        cfg: the :class:`GRPOConfig`.
    """

    ROLES = ("actor_rollout_ref", "actor_ref", "rollout")

    def __init__(self, role: str, cfg: GRPOConfig):
        super().__init__()
        if role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {role!r}")
        # Ranks usually share a machine's cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)
        self.role = role
        self.cfg = cfg
        self.has_actor = "actor" in role

    # -- setup --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> str:
        """Build the policy (and, with the actor role, the reference, the optimizer and
        the process group the gradients are all-reduced over). Returns the backend."""
        backend = self._build_model()
        if not self.has_actor:
            return "none"
        if dist.is_initialized():
            # Left over from a group on this worker that broke (a peer was killed).
            dist.destroy_process_group()
        self._init_process_group(backend)
        return backend

    def _build_model(self) -> str:
        """Policy, and with the actor role reference and optimizer, from the seed; returns
        the backend of this device."""
        if torch.cuda.is_available():
            backend, self.device = "nccl", torch.device("cuda", 0)  # dask-cuda: one GPU per worker
            torch.cuda.set_device(self.device)
        else:
            backend, self.device = "gloo", torch.device("cpu")
        torch.manual_seed(self.cfg.seed)  # same initial weights on every rank of every group
        self.policy = GRUPolicy(self.cfg.hidden).to(self.device)
        self.version = 0  # actor updates applied to self.policy
        self._before_update = None  # (version, state) kept by update_actor, for recover_state
        if self.has_actor:
            self.ref = GRUPolicy(self.cfg.hidden).to(self.device)
            self.ref.load_state_dict(self.policy.state_dict())
            self.ref.requires_grad_(False)
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.lr)
        return backend

    def _init_process_group(self, backend: str) -> None:
        from datetime import timedelta

        # If a peer dies inside a collective, its neighbours fail at once but the other
        # ranks wait for this timeout (gloo's default is 30 minutes), and the groups can
        # only be rebuilt (or healed keeping them) after that.
        dist.init_process_group(backend, timeout=timedelta(seconds=self.cfg.pg_timeout_s))

    # -- heal and resize (wg.heal(), wg.resize(n); --heal, --grow-at-step) --

    def on_membership_change(self, event) -> None:
        """After ``wg.heal()`` or ``wg.resize(n)``, on every rank at once: a new rank builds
        its model (from the seed: its weights come from a peer next, see ``recover_state``
        and ``Groups.sync_weights``), and the trainer ranks rendezvous again (daskwg has
        destroyed the survivors' old process group and set the new ``MASTER_PORT``)."""
        if self.rank in event.new_ranks:
            self._build_model()
        if self.has_actor:
            self._init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    def _training_state(self) -> dict:
        return {
            "policy": self.policy.state_dict(),
            "ref": self.ref.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def _load_training_state(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.ref.load_state_dict(state["ref"])
        self.optimizer.load_state_dict(state["optimizer"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def recover_state(self, version: int, source: int, new_ranks: list[int]) -> int:
        """After a heal: every surviving trainer rank goes back to the state of actor
        update ``version`` (the updates the driver saw finish), and the replacement ranks
        ``new_ranks`` take the weights, reference and optimizer state of rank ``source``
        (a survivor: data-parallel ranks hold identical state) over the rebuilt process
        group: worker to worker, never through the driver, no checkpoint read.

        A survivor may have begun the update the failure interrupted, or finished it
        while a peer did not: ``update_actor`` keeps the state it started from, and that is
        put back here. Returns this rank's version afterwards.

        Raises:
            RuntimeError: a survivor holds neither ``version`` nor the state before it.
        """
        if self.rank not in new_ranks:
            kept = self._before_update
            if kept is not None and kept[0] == version:
                self._load_training_state(kept[1])
                self.version = version
            if self.version != version:
                raise RuntimeError(
                    f"rank {self.rank} holds actor version {self.version} and cannot go back to {version}"
                )
        payload = [self._training_state() if self.rank == source else None]
        dist.broadcast_object_list(payload, src=source)
        if self.rank in new_ranks:
            self._load_training_state(payload[0])
            self.version = version
        return self.version

    # -- rollout --

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``meta_info["n"]`` responses per prompt.

        Args:
            prompts: ``prompts`` [p, 4], ``ground_truth`` [p], ``uid`` [p]; meta_info
                ``n``, ``step``.
        Returns:
            [p*n] rows: the input keys repeated, plus ``responses`` [p*n, 3],
            ``response_mask`` [p*n, 3], ``input_ids`` [p*n, 7] (prompt + response).
        """
        n, step = int(prompts.meta_info["n"]), int(prompts.meta_info["step"])
        data = _repeat_for_sampling(prompts, n)
        generator = torch.Generator(self.device).manual_seed(
            (self.cfg.seed * 1_000_003 + step) * 1009 + self.rank
        )
        prompt_ids = data.batch["prompts"].to(self.device)
        self.policy.eval()
        responses, response_mask = sample_responses(self.policy, prompt_ids, generator, self.cfg.temperature)
        responses, response_mask = responses.cpu(), response_mask.cpu()
        return _with(
            data,
            responses=responses,
            response_mask=response_mask,
            input_ids=torch.cat([data.batch["prompts"], responses], dim=1),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, weights) -> None:
        """Load the actor's weights (a TensorDict of the state dict) into the rollout policy."""
        self.policy.load_state_dict({k: v.to(self.device) for k, v in weights.items()})

    # -- reward and advantage (verl computes these in the driver; here they stay on the ranks) --

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_reward(self, data: DataProto) -> DataProto:
        """``token_level_scores`` [b, R]: the sequence's score on its last response token."""
        scores = score_responses(
            data.batch["responses"], data.batch["response_mask"], data.batch["ground_truth"]
        )
        mask = data.batch["response_mask"]
        last = (mask.sum(1).long() - 1).clamp(min=0)
        token_scores = torch.zeros_like(mask).scatter_(1, last[:, None], scores[:, None])
        return _with(data, token_level_scores=token_scores, token_level_rewards=token_scores)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_advantage(self, data: DataProto) -> DataProto:
        """GRPO advantages: each sequence's score normalised by the mean and standard
        deviation of its prompt's group (``uid``), broadcast over the response tokens.

        Raises:
            RuntimeError: a prompt's group is not whole on this rank (the prompts per step
                must be a multiple of every dp size so that no group is cut).
        """
        scores = data.batch["token_level_rewards"].sum(1)
        uid = data.batch["uid"]
        n = int(data.meta_info["n"])
        groups, index = torch.unique(uid, return_inverse=True)
        counts = torch.bincount(index, minlength=len(groups))
        if bool((counts != n).any()):
            raise RuntimeError(
                f"rank {self.rank} holds {counts.tolist()} samples of its prompts instead of {n} each: "
                "a prompt's group was cut between ranks; make the prompts per step a multiple of every dp size"
            )
        grouped = torch.zeros(len(groups), n)
        slot = torch.zeros_like(index)
        for g in range(len(groups)):
            members = (index == g).nonzero().squeeze(1)
            slot[members] = torch.arange(len(members))
        grouped[index, slot] = scores
        mean, std = grouped.mean(1), grouped.std(1)
        advantages = (scores - mean[index]) / (std[index] + 1e-6)
        return _with(data, advantages=advantages[:, None] * data.batch["response_mask"])

    # -- actor and reference --

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    @torch.no_grad()
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` [b, R]: the log-probs of the responses under the current actor."""
        self.policy.eval()
        return _with(data, old_log_probs=self._log_probs(self.policy, data).cpu())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    @torch.no_grad()
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` [b, R]: the log-probs of the responses under the reference."""
        return _with(data, ref_log_prob=self._log_probs(self.ref, data).cpu())

    def _log_probs(self, policy: GRUPolicy, data: DataProto) -> torch.Tensor:
        return response_log_probs(
            policy, data.batch["prompts"].to(self.device), data.batch["responses"].to(self.device)
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO-clip steps with a KL penalty to the reference: ``ppo_epochs`` passes over
        ``ppo_mini_batches`` mini-batches of this rank's rows. Each mini-batch's loss is the token-mean over all
        ranks: gradients of the summed loss and the token count are all-reduced together.

        Returns:
            sums over this rank's rows, for the driver to aggregate: ``reward``, ``sequences``,
            ``response_tokens``, ``kl``, ``pg_loss``, ``clipped`` (tokens), ``tokens``.
        """
        cfg = self.cfg
        batch = {key: data.batch[key].to(self.device) for key in data.batch.keys()}
        mask = batch["response_mask"]
        metrics = {
            "reward": float(batch["token_level_scores"].sum()),
            "sequences": float(len(mask)),
            "response_tokens": float(mask.sum()),
            "kl": 0.0,
            "pg_loss": 0.0,
            "clipped": 0.0,
            "tokens": 0.0,
        }
        # What recover_state puts back if this update is interrupted (a peer lost): the
        # state it starts from. Copies, as the optimizer changes its tensors in place.
        self._before_update = (self.version, copy.deepcopy(self._training_state()))
        self.policy.train()
        params = list(self.policy.parameters())
        mini_batches = torch.tensor_split(torch.arange(len(mask), device=self.device), cfg.ppo_mini_batches)
        for rows in [rows for _ in range(cfg.ppo_epochs) for rows in mini_batches]:
            m = mask[rows]
            log_probs = response_log_probs(self.policy, batch["prompts"][rows], batch["responses"][rows])
            ratio = torch.exp(log_probs - batch["old_log_probs"][rows])
            advantages = batch["advantages"][rows]
            clipped_ratio = ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
            pg = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
            # verl's "low_var_kl" (k3) estimator of KL(actor || ref), clamped as verl does.
            delta = (batch["ref_log_prob"][rows] - log_probs).clamp(-20, 20)
            kl = (torch.exp(delta) - delta - 1).clamp(-10, 10)
            loss_sum = masked_sum(pg + cfg.kl_coef * kl, m)
            self.optimizer.zero_grad(set_to_none=False)
            loss_sum.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [m.sum().reshape(1)])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            tokens = flat[-1].clamp(min=1)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / tokens)
                offset += p.numel()
            nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            self.optimizer.step()
            metrics["kl"] += float(masked_sum(kl.detach(), m))
            metrics["pg_loss"] += float(masked_sum(pg.detach(), m))
            metrics["clipped"] += float(masked_sum((ratio.detach() != clipped_ratio.detach()).float(), m))
            metrics["tokens"] += float(m.sum())
        self.version += 1
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def get_weights(self):
        """The actor's weights as a TensorDict (no batch dimension); rank 0 only."""
        from tensordict import TensorDict

        return TensorDict(
            {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}, batch_size=[]
        )

    # -- checkpoints --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def save_checkpoint(self, directory: str, step: int) -> str:
        """Write policy, reference and optimizer state to ``directory/policy.pt`` (rank 0;
        every rank holds the same state). Returns the path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "policy.pt")
        state = {
            "step": step,
            "policy": self.policy.state_dict(),
            "ref": self.ref.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a killed run never leaves half a checkpoint
        return path

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> int:
        """Load ``directory/policy.pt`` on every rank; returns its step."""
        state = torch.load(os.path.join(directory, "policy.pt"), map_location=self.device)
        self.policy.load_state_dict(state["policy"])
        if self.has_actor:
            self.ref.load_state_dict(state["ref"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.version, self._before_update = int(state["step"]), None
        return int(state["step"])

    # -- end --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> str:
        """sha256 of the policy's flattened parameters."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.policy.parameters()]).cpu()
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy_process_group(self) -> None:
        """Leave the process group (call before the group's ``shutdown()``)."""
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------


@dataclass
class Groups:
    """The worker groups of a placement: ``rollout`` and ``actor`` are the same group when
    colocated."""

    actor: daskwg.WorkerGroup
    rollout: daskwg.WorkerGroup
    backend: str = "gloo"
    dataproto: type = DataProto  # the batches the driver sends (verl's in grpo_verl.py)
    actor_version: int = 0  # actor updates so far (the policy version)
    step_plan: daskwg.StepPlan | None = None  # --plan: the step, recorded once
    rollout_version: int = 0  # the policy version the rollout ranks sample with

    @property
    def split(self) -> bool:
        return self.rollout is not self.actor

    def all(self) -> list[daskwg.WorkerGroup]:
        return [self.actor, self.rollout] if self.split else [self.actor]

    def sync_weights(self) -> None:
        """Send the actor's weights to the rollout ranks, worker to worker.

        ``get_weights`` runs on trainer rank 0 and leaves its result there as a Dask
        future; wrapped as a ``DataProtoFuture``, it is an argument the rollout ranks
        fetch from that worker themselves. ``load_weights`` waits until they have loaded
        it (a few milliseconds), so its failures surface here as ``RankError`` or
        ``WorkerLostError``.
        """
        if self.split:  # else the hybrid engine: the rollout samples with the actor's own weights
            self.rollout.load_weights(DataProtoFuture.concat([self.actor.get_weights()]))
        self.rollout_version = self.actor_version

    def shutdown(self) -> None:
        for group in self.all():
            if not group.is_broken:
                try:
                    group.destroy_process_group()
                except WorkerGroupError:
                    pass
            group.shutdown()


#: ``--heal``: seconds a trainer collective waits for a lost peer before it fails, and the
#: seconds ``daskwg.rank-failure-grace`` gives the other ranks of a failed call to finish
#: (longer, so the survivors stuck in that collective fail and are kept by the heal). The
#: timeout must also exceed the time ranks can drift apart before a collective: 8 s failed
#: a healthy step on this 2-core machine at a load average of 46.
HEAL_PG_TIMEOUT_S, HEAL_GRACE_S = 30.0, 40.0


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    """The :class:`GRPOConfig` of the command line."""
    return GRPOConfig(
        hidden=args.hidden,
        lr=args.lr,
        kl_coef=args.kl_coef,
        ppo_epochs=args.ppo_epochs,
        seed=args.seed,
        pg_timeout_s=HEAL_PG_TIMEOUT_S if getattr(args, "heal", False) else 30.0,
    )


def build_groups(client, args: argparse.Namespace) -> Groups:
    """The groups of ``args.placement`` on the cluster's workers, models initialised."""
    config = grpo_config(args)
    if args.placement == "colocated":
        hybrid = daskwg.ClassWithInitArgs(ActorRolloutRefWorker, "actor_rollout_ref", config)
        wg = daskwg.WorkerGroup(client, hybrid, world_size=args.world_size)
        groups = Groups(actor=wg, rollout=wg)
    else:
        pool = daskwg.ResourcePool(client, world_size=args.world_size + args.rollout_world_size)
        trainer_pool, rollout_pool = pool.split([args.world_size, args.rollout_world_size])
        actor = daskwg.WorkerGroup(
            client, daskwg.ClassWithInitArgs(ActorRolloutRefWorker, "actor_ref", config), workers=trainer_pool
        )
        rollout = daskwg.WorkerGroup(
            client, daskwg.ClassWithInitArgs(ActorRolloutRefWorker, "rollout", config), workers=rollout_pool
        )
        groups = Groups(actor=actor, rollout=rollout)
    for group in groups.all():
        backends = group.init_model()
        if group is groups.actor:
            groups.backend = backends[0]
    return groups


def rebuild_groups(client, groups: Groups, args: argparse.Namespace, build=build_groups) -> Groups:
    """New groups after a lost worker: drop the broken ones, wait until the lost worker's
    nanny has restarted it and the surviving ranks have left the broken collective (their
    process group's timeout), then build and initialise the groups again.

    Switch point (issue 10): ``wg.restart()`` gives each group fresh processes, the same
    class and arguments and a new rendezvous; call it on each group, then ``init_model()``.
    """
    for group in groups.all():
        group.shutdown()
    needed = args.world_size + (args.rollout_world_size if args.placement == "split" else 0)
    deadline = time.monotonic() + args.recover_timeout
    while True:
        try:
            # client.nthreads() is a small answer; wait_for_workers would poll the
            # scheduler's full worker info ten times a second, into the driver's bytes.
            if len(client.nthreads()) < needed:
                raise TimeoutError(f"{len(client.nthreads())} of {needed} workers are up")
            return build(client, args)
        except (WorkerGroupError, TimeoutError, OSError) as exc:
            # A surviving rank is still in the broken collective (GroupBrokenError), or
            # the restarted worker is not up yet: try again until the deadline.
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"could not rebuild the groups within {args.recover_timeout} s: {exc}; "
                    f"the cluster needs {needed} workers"
                ) from exc
            time.sleep(1.0)


def heal_groups(groups: Groups, step: int, args: argparse.Namespace) -> list:
    """``--heal``: replace the lost ranks of the groups and carry on from step ``step``
    (the first step not finished), keeping every surviving rank and its state.

    ``wg.heal()`` rebuilds each broken group on free workers (a worker whose nanny has
    restarted it is free); ``on_membership_change`` builds the replacements' models and
    the trainer ranks' new process group. The trainer ranks rendezvous again even when
    none was lost (``rendezvous=True``): a lost rollout rank's rows never reach some
    trainer ranks, the others' gradient all-reduce times out, and gloo closes its
    connections, so the old process group would fail the next collective. Then every trainer rank goes back to the state
    after ``step`` updates and the replacements take it from a surviving trainer rank
    (``recover_state``, a broadcast over that process group), and the rollout ranks load
    the trainer's weights worker to worker (``sync_weights``). Nothing goes through the
    driver and no checkpoint is read. Returns the ``MembershipReport`` of each group healed.
    """
    reports = []
    for group in groups.all():
        report = group.heal(timeout=args.recover_timeout, rendezvous=group is groups.actor)
        if report.event is not None:
            reports.append((group, report))
    actor_report = next((r for g, r in reports if g is groups.actor), None)
    new_ranks = sorted(actor_report.moved) if actor_report is not None else []
    survivors = [r for r in range(groups.actor.world_size) if r not in new_ranks]
    if not survivors:
        raise RuntimeError(
            "every trainer rank was replaced: no rank holds the training state any more; "
            "run without --heal to resume from the last checkpoint"
        )
    groups.actor_version = min(groups.actor.recover_state(step, survivors[0], new_ranks))
    groups.sync_weights()
    return reports


def caused_by_lost_worker(groups: Groups, exc: WorkerGroupError, wait_s: float = 10.0) -> bool:
    """Whether ``exc`` comes from a lost worker: a ``WorkerLostError``, or another error
    (a peer's collective failing first, say) after which a group breaks within ``wait_s``."""
    if isinstance(exc, WorkerLostError):
        return True
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if any(group.is_broken for group in groups.all()):
            return True
        time.sleep(0.2)
    return False


def kill_worker(client, address: str) -> None:
    """SIGKILL the Dask worker process at ``address`` (its nanny, if any, restarts it)."""

    async def sigkill_self() -> None:  # wait=False takes coroutine functions only
        os.kill(os.getpid(), signal.SIGKILL)

    client.run(sigkill_self, workers=[address], wait=False)


class DriverBytes:
    """Bytes this process received, by every transport the driver uses: over TCP, from the
    kernel's per-socket counters (Linux ``TCP_INFO`` ``tcpi_bytes_received``), so everything
    counts whatever library read it; and what daskwg's call streams received where no socket
    counter sees it (Unix-domain sockets to workers of this host, shared-memory files;
    ``daskwg.wire.frames.received_bytes``). ``sample()`` after every step adds each open
    socket's growth since the last sample, so sockets that close later (a lost worker's)
    keep what they counted. ``total`` is ``None`` where ``TCP_INFO`` is not available.
    """

    #: The transports counted by daskwg's call streams alone (TCP ones the kernel counts).
    NOT_TCP = ("unix", "files", "inproc")

    def __init__(self) -> None:
        self.total: int | None = 0 if sys.platform.startswith("linux") else None
        self.by_transport = {"tcp": 0, **{kind: 0 for kind in self.NOT_TCP}}
        self._last: dict[tuple, int] = {}
        self._last = self._read()
        self._last_streams = received_bytes()

    def _read(self) -> dict[tuple, int]:
        counts = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                sock = socket.socket(fileno=int(name))
            except (OSError, ValueError):
                continue  # not a socket, or already closed
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
                    if len(info) >= 136:
                        key = (int(name), sock.getsockname(), sock.getpeername())
                        counts[key] = struct.unpack_from("Q", info, 128)[0]  # tcpi_bytes_received
            except OSError:
                pass  # not connected
            finally:
                sock.detach()
        return counts

    def sample(self) -> None:
        if self.total is None:
            return
        now = self._read()
        tcp = sum(count - self._last.get(key, 0) for key, count in now.items())
        self._last = now
        streams = received_bytes()
        self.by_transport["tcp"] += tcp
        for kind in self.NOT_TCP:
            self.by_transport[kind] += streams[kind] - self._last_streams[kind]
        self._last_streams = streams
        self.total = sum(self.by_transport.values())


def response_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """(bytes of one step's ``responses`` tensor, bytes of one step's whole rollout batch),
    measured on a batch generated here like ``generate_sequences`` does."""
    prompts = make_prompts(args.prompts_per_step, 0, args.seed).repeat(args.n, interleave=True)
    torch.manual_seed(args.seed)
    responses, mask = sample_responses(GRUPolicy(args.hidden), prompts.batch["prompts"], torch.Generator())
    batch = {
        **{k: prompts.batch[k] for k in prompts.batch.keys()},
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompts.batch["prompts"], responses], 1),
    }
    return responses.nbytes, sum(t.nbytes for t in batch.values())


@dataclass
class Rollout:
    """A step's batch being generated: the ``DataProtoFuture`` of ``generate_sequences``
    and the policy version (actor updates) the rollout ranks sample it with."""

    step: int
    batch: DataProtoFuture
    version: int


def generate(groups: Groups, step: int, args: argparse.Namespace) -> Rollout:
    """Start generating step ``step``'s batch on the rollout ranks (returns at once)."""
    prompts = make_prompts(args.prompts_per_step, step, args.seed, groups.dataproto)
    prompts.meta_info.update(n=args.n, step=step)
    return Rollout(step, groups.rollout.generate_sequences(prompts), groups.rollout_version)


def run_step(
    client,
    groups: Groups,
    step: int,
    args: argparse.Namespace,
    kill: str | None = None,
    ahead: Rollout | None = None,
) -> tuple[dict[str, float], Rollout | None]:
    """One GRPO step (verl's ``RayPPOTrainer.fit`` loop body); returns the step's metrics
    and, with ``--async``, the next step's rollout, already under way.

    Only the prompts leave the driver and only the metrics come back: every other call
    returns a ``DataProtoFuture`` that the next call consumes on the workers.

    ``--async`` is verl's one-step off-policy recipe (``recipe/one_step_off_policy``): the
    rollout ranks generate step ``t + 1``'s batch with the weights of before update ``t``
    while the trainer ranks run update ``t``; the weights reach the rollout ranks at the
    step's end (``load_weights`` runs there after that generation, calls on a rank running
    in order). A batch is then one policy version old when it is trained on (its
    ``staleness``), and ``old_log_probs`` are computed by the trainer's current actor, as
    in verl.

    Args:
        ahead: this step's rollout, started during the step before (``--async``), or
            ``None`` to start it now.
    """
    if args.plan:
        per_rank, version = planned_step(client, groups, step, args, kill), groups.rollout_version
    else:
        rollout = ahead if ahead is not None and ahead.step == step else generate(groups, step, args)
        ahead = generate(groups, step + 1, args) if args.async_rollout and step + 1 < args.steps else None
        # Switch point (issue 9): with lazy union/select, each call returns only its new keys
        # and the driver unions the futures (batch = batch.union(...)), as verl's trainer does.
        batch = train_stages(groups, rollout.batch)
        if kill is not None:
            kill_worker(client, kill)
        per_rank, version = groups.actor.update_actor(batch), rollout.version
    staleness = groups.actor_version - version
    groups.actor_version += 1
    groups.sync_weights()
    total = {key: sum(m[key] for m in per_rank) for key in per_rank[0]}
    metrics = {
        "reward": total["reward"] / total["sequences"],
        "kl": total["kl"] / max(total["tokens"], 1.0),
        "response_length": total["response_tokens"] / total["sequences"],
        "pg_clipfrac": total["clipped"] / max(total["tokens"], 1.0),
        "staleness": float(staleness),
    }
    return metrics, ahead


def train_stages(groups: Groups, batch: DataProtoFuture) -> DataProtoFuture:
    """Reward, advantage, log-prob and ref log-prob of a generated batch (each call's
    ``DataProtoFuture`` is the next one's input)."""
    batch = groups.actor.compute_reward(batch)
    batch = groups.actor.compute_advantage(batch)
    batch = groups.actor.compute_log_prob(batch)
    return groups.actor.compute_ref_log_prob(batch)


def planned_step(client, groups: Groups, step: int, args: argparse.Namespace, kill: str | None) -> list:
    """``--plan``: the step from the prompts to the update, recorded once as a ``daskwg.plan``
    and replayed: one message per worker when the placement is colocated (every call reads
    only its own rank's rows), the calls one by one otherwise. Returns ``update_actor``'s
    per-rank metrics."""
    if groups.step_plan is None:
        with daskwg.plan("grpo step") as plan:
            batch = groups.rollout.generate_sequences(plan.input("prompts"))
            plan.output(groups.actor.update_actor(train_stages(groups, batch)))
        groups.step_plan = plan
    prompts = make_prompts(args.prompts_per_step, step, args.seed, groups.dataproto)
    prompts.meta_info.update(n=args.n, step=step)
    if kill is not None:
        kill_worker(client, kill)
    return groups.step_plan.run(prompts=prompts)


@dataclass
class History:
    """Per-step metrics of the run (what the plot and ``--resume`` need)."""

    metrics: list[dict[str, float]] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)  # steps at which the groups were rebuilt
    heals: list[int] = field(default_factory=list)  # --heal: steps at which the groups were healed

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "history.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"metrics": self.metrics, "restarts": self.restarts}, f)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, directory: str, step: int) -> History:
        with open(os.path.join(directory, "history.json")) as f:
            data = json.load(f)
        return cls(metrics=data["metrics"][:step], restarts=[s for s in data["restarts"] if s <= step])


def restore(groups: Groups, args: argparse.Namespace) -> int:
    """Load the last checkpoint into the groups; returns its step (0 if there is none)."""
    if not os.path.exists(os.path.join(args.checkpoint_dir, "policy.pt")):
        return 0
    step = groups.actor.load_checkpoint(args.checkpoint_dir)[0]
    groups.actor_version = step
    groups.sync_weights()
    return step


def grow_rollout(groups: Groups, args: argparse.Namespace, add_worker, say) -> None:
    """``--grow-at-step``: add a Dask worker to the cluster (``add_worker()``; on a cluster
    you run, start one yourself) and grow the rollout group into it (``wg.resize``): the
    rollout ranks keep their processes and weights, the new rank builds its model in
    ``on_membership_change`` and loads the trainer's weights worker to worker."""
    if add_worker is not None:
        add_worker()
    else:
        say("--grow-at-step: waiting for a Dask worker to join (start one: dask worker <scheduler>)")
    t0 = time.perf_counter()
    report = groups.rollout.resize(groups.rollout.world_size + 1, timeout=args.recover_timeout)
    groups.sync_weights()
    say(
        f"rollout grown to {plural(groups.rollout.world_size, 'rank')} in {time.perf_counter() - t0:.2f} s ({report})"
    )


def fit(client, args: argparse.Namespace, build=build_groups, add_worker=None) -> int:
    """Train (verl's ``RayPPOTrainer.fit``) on the groups ``build(client, args)``; returns the exit status.

    ``add_worker()``, if given, adds a Dask worker to the cluster (``--grow-at-step``)."""
    from tqdm import tqdm

    groups = build(client, args)
    history = History()
    step = 0
    if args.resume:
        if not os.path.exists(os.path.join(args.checkpoint_dir, "policy.pt")):
            raise SystemExit(f"--resume: no checkpoint in {args.checkpoint_dir}; run without --resume first")
        step = restore(groups, args)
        if step >= args.steps:
            groups.shutdown()
            raise SystemExit(
                f"--resume: the checkpoint in {args.checkpoint_dir} is of step {step}, and --steps is "
                f"{args.steps}: nothing to run; raise --steps to train on"
            )
        history = History.load(args.checkpoint_dir, step)
        print(f"resumed from step {step} ({args.checkpoint_dir})")
    else:
        # A fresh run: an older run's checkpoint must not be what a recovery reloads.
        for name in ("policy.pt", "history.json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.checkpoint_dir, name))
    workers = len(set(groups.actor.workers + groups.rollout.workers))
    print(
        f"placement {args.placement}: actor on {plural(groups.actor.world_size, 'rank')}, "
        f"rollout on {plural(groups.rollout.world_size, 'rank')}, {plural(workers, 'Dask worker')}, "
        f"gradients all-reduced over {groups.backend}"
    )
    kills = {  # step -> (group, rank) whose worker is SIGKILLed during that step
        k: v
        for k, v in (
            (args.kill_worker_at_step, ("trainer", groups.actor)),
            (getattr(args, "kill_rollout_at_step", None), ("rollout", groups.rollout)),
        )
        if k is not None
    }
    grow_at = getattr(args, "grow_at_step", None)
    if getattr(args, "heal", False):
        import dask

        # The survivors of a lost trainer rank fail their collective within
        # HEAL_PG_TIMEOUT_S; heal() keeps ranks that finish within this grace.
        dask.config.set({"daskwg.rank-failure-grace": HEAL_GRACE_S})
    steps_run = 0
    refresh_s = 0.1 if sys.stderr.isatty() else 5.0
    received, start_time = DriverBytes(), time.perf_counter()
    reached: tuple[int, float] | None = None  # (step, seconds) when the windowed mean first made it
    bar = tqdm(total=args.steps, initial=step, unit="step", file=sys.stderr, mininterval=refresh_s)
    ahead: Rollout | None = None
    with bar:
        while step < args.steps:
            try:
                kill = None
                if step + 1 in kills:
                    role, _ = kills.pop(step + 1)
                    group = groups.actor if role == "trainer" else groups.rollout
                    rank = min(1, group.world_size - 1)
                    kill = group.workers[rank]
                    bar.write(f"step {step + 1}: killing the worker of {role} rank {rank} ({kill})")
                if grow_at is not None and step + 1 == grow_at:
                    grow_at = None
                    grow_rollout(groups, args, add_worker, bar.write)
                metrics, ahead = run_step(client, groups, step, args, kill, ahead)
            except WorkerGroupError as exc:
                ahead = None  # a rollout started on the broken groups
                if not caused_by_lost_worker(groups, exc):
                    raise
                if len(history.restarts) + len(history.heals) >= args.max_restarts:
                    # Name the cause: the error that arrived first may be a surviving peer's
                    # collective failing (a gloo RankError), not the lost worker itself.
                    groups.shutdown()
                    raise SystemExit(
                        f"step {step + 1}: a worker was lost ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                        f"the groups were rebuilt {len(history.restarts)} time(s) of --max-restarts "
                        f"{args.max_restarts}, so the run stops here. --resume continues from the last "
                        f"checkpoint in {args.checkpoint_dir}"
                    ) from exc
                bar.write(f"step {step + 1}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                if getattr(args, "heal", False):
                    t0 = time.perf_counter()
                    reports = heal_groups(groups, step, args)
                    seconds = time.perf_counter() - t0
                    resumed = groups.actor_version  # the updates the trainer ranks hold now
                    history.heals.append(step)
                    moved = "; ".join(f"{g.name}: {r}" for g, r in reports) or "no rank moved"
                    bar.write(f"step {step + 1}: healed in {seconds:.2f} s ({moved})")
                    bar.write(
                        f"step {step + 1}: steps lost: {step - resumed}; running step {resumed + 1} again"
                    )
                    history.metrics = history.metrics[:resumed]
                    step = resumed
                    continue
                groups = rebuild_groups(client, groups, args, build)
                lost_from, step = step, restore(groups, args)
                bar.write(f"step {lost_from + 1}: steps lost: {lost_from - step}")
                history.metrics = history.metrics[:step]
                history.restarts.append(step)
                bar.write(f"groups rebuilt; resuming from the checkpoint of step {step}")
                bar.n = step
                bar.refresh()
                continue
            step += 1
            steps_run += 1
            history.metrics.append(metrics)
            received.sample()
            window = [m["reward"] for m in history.metrics[-args.final_window :]]
            if (
                reached is None
                and len(window) == args.final_window
                and sum(window) / len(window) >= args.min_reward
            ):
                reached = (step, time.perf_counter() - start_time)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.3f}", refresh=False)
            bar.update()
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                groups.actor.save_checkpoint(args.checkpoint_dir, step)
                history.save(args.checkpoint_dir)
    elapsed = time.perf_counter() - start_time
    checksums = groups.actor.weights_checksum() + (groups.rollout.weights_checksum() if groups.split else [])
    groups.shutdown()

    plot(history, args)
    window = history.metrics[-args.final_window :]
    final = sum(m["reward"] for m in window) / len(window)
    print(f"steps: {steps_run} run in {elapsed:.1f} s ({elapsed / max(steps_run, 1):.3f} s/step)")
    if reached is not None:
        print(
            f"mean reward over {args.final_window} steps first >= {args.min_reward} at step {reached[0]}, "
            f"{reached[1]:.1f} s into training"
        )
    if history.restarts:
        print(f"groups rebuilt {len(history.restarts)} time(s), resumed from step(s) {history.restarts}")
    if history.heals:
        print(f"groups healed {len(history.heals)} time(s), resumed from step(s) {history.heals}")
    staleness = [m.get("staleness", 0.0) for m in history.metrics]
    print(
        f"staleness (policy versions a batch is behind the actor it trains): "
        f"mean {sum(staleness) / max(len(staleness), 1):.2f}, max {max(staleness, default=0):.0f}"
    )
    resp, rollout = response_bytes(args)
    print(f"one step's responses: {resp} bytes ({rollout} bytes with the rest of the rollout batch)")
    if received.total is not None and steps_run:
        print(f"driver bytes per step: {received.total // steps_run}")
        print(
            "driver bytes per step by transport: "
            + ", ".join(f"{kind} {count // steps_run}" for kind, count in received.by_transport.items())
        )
    else:
        print("driver bytes per step: n/a (needs Linux TCP_INFO)")
    if args.plan and groups.step_plan is not None:
        plan = groups.step_plan
        print(f"step plan: {plural(plan.replays, 'replay')} of {plan.calls} calls, the last {plan.route}")
    print(f"plot written to {args.out}")
    print(f"final mean reward: {final:.4f} (mean over the last {len(window)} steps)")
    if len(set(checksums)) != 1:
        print(f"ERROR: the ranks' weights differ after training: {checksums}", file=sys.stderr)
        return 1
    print(f"weights identical on all {plural(len(checksums), 'rank')} (sha256 {checksums[0][:16]}...)")
    if final < args.min_reward:
        print(f"ERROR: final mean reward {final:.4f} is below {args.min_reward}", file=sys.stderr)
        return 1
    return 0


def plot(history: History, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(history.metrics) + 1))
    panels = [
        ("reward", "mean reward", "reward (fraction of answer tokens right)"),
        ("kl", "KL to reference", "KL(actor || reference), k3 estimate"),
        ("response_length", "tokens", "response length (incl. <eos>)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, ylabel, title) in zip(axes, panels):
        ax.plot(steps, [m[key] for m in history.metrics], lw=1)
        for restart in history.restarts:
            ax.axvline(restart, color="tab:red", ls=":", lw=1, label="worker killed, resumed here")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
    axes[0].axhline(args.min_reward, color="gray", ls="--", lw=1, label=f"required ({args.min_reward})")
    axes[0].set_ylim(0, 1)
    axes[0].legend(loc="lower right")
    mode = " --async" if args.async_rollout else ""
    fig.suptitle(f"GRPO on daskwg, {args.placement}{mode} placement", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=80)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="attach to this Dask scheduler instead of starting a local cluster",
    )
    parser.add_argument(
        "--placement", choices=("colocated", "split"), default="colocated", help="default colocated"
    )
    parser.add_argument(
        "--async",
        dest="async_rollout",
        action="store_true",
        help="with --placement split: generate step t+1 while the trainer updates on step t "
        "(verl's one-step off-policy recipe)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="record the step once as a daskwg.plan and replay it every step (one message per worker "
        "where every call reads only its own rank's rows)",
    )
    parser.add_argument("--world-size", type=int, default=4, help="actor (trainer) ranks (default 4)")
    parser.add_argument(
        "--rollout-world-size", type=int, default=2, help="rollout ranks with --placement split (default 2)"
    )
    parser.add_argument("--steps", type=int, default=150, help="default 150")
    parser.add_argument("--prompts-per-step", type=int, default=64, help="default 64")
    parser.add_argument(
        "--n", type=int, default=8, help="responses sampled per prompt (GRPO group size, default 8)"
    )
    parser.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate (default 5e-3)")
    parser.add_argument(
        "--ppo-epochs", type=int, default=4, help="passes over each step's batch in update_actor (default 4)"
    )
    parser.add_argument("--kl-coef", type=float, default=0.05, help="weight of the KL loss (default 0.05)")
    parser.add_argument("--hidden", type=int, default=128, help="GRU units (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts, the sampling and the weights")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        metavar="K",
        help="checkpoint every K steps (0: never; default 5)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=os.path.join("examples", "out", "grpo_checkpoint"),
        help="default examples/out/grpo_checkpoint",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir"
    )
    parser.add_argument(
        "--kill-worker-at-step",
        type=int,
        metavar="K",
        help="SIGKILL the worker of trainer rank 1 (rank 0 with --world-size 1) during step K",
    )
    parser.add_argument(
        "--kill-rollout-at-step",
        type=int,
        metavar="K",
        help="with --placement split: SIGKILL the worker of rollout rank 1 (rank 0 with one) during step K",
    )
    parser.add_argument(
        "--heal",
        action="store_true",
        help="after a lost worker, wg.heal() the groups (the survivors keep their state, replacements "
        "take theirs from a surviving trainer rank) and run the interrupted step again, instead of "
        "rebuilding them and reloading the last checkpoint",
    )
    parser.add_argument(
        "--grow-at-step",
        type=int,
        metavar="K",
        help="with --placement split: before step K, add a Dask worker (the local cluster) and grow the "
        "rollout group into it (wg.resize)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="rebuild (or heal) the groups at most this often (default 3)",
    )
    parser.add_argument(
        "--recover-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the workers, at the start and to come back (default 300)",
    )
    parser.add_argument(
        "--final-window",
        type=int,
        default=10,
        help="the final mean reward averages this many last steps (default 10)",
    )
    parser.add_argument(
        "--min-reward", type=float, default=0.9, help="exit 1 below this final mean reward (default 0.9)"
    )
    parser.add_argument(
        "--out",
        default=os.path.join("examples", "out", "grpo.png"),
        help="the PNG (default examples/out/grpo.png)",
    )
    args = parser.parse_args(argv)
    for option, least in (
        ("prompts_per_step", 1),
        ("n", 1),
        ("hidden", 1),
        ("ppo_epochs", 1),
        ("final_window", 1),
        ("checkpoint_every", 0),
        ("max_restarts", 0),
    ):
        if getattr(args, option) < least:
            parser.error(
                f"--{option.replace('_', '-')} must be at least {least}, got {getattr(args, option)}"
            )
    sizes = [args.world_size] + ([args.rollout_world_size] if args.placement == "split" else [])
    for size in sizes:
        if size < 1:
            parser.error("world sizes must be at least 1")
        if args.prompts_per_step % size:
            parser.error(
                f"--prompts-per-step {args.prompts_per_step} must be a multiple of every dp size {sizes}, "
                "so that each prompt's samples stay on one rank"
            )
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.plan and args.async_rollout:
        parser.error(
            "--plan records the step from the prompts to the update; --async generates the next step's "
            "batch ahead, outside the step: use one or the other"
        )
    if args.async_rollout and args.placement != "split":
        parser.error(
            "--async overlaps the rollout with the update on separate ranks: it needs --placement split"
        )
    for option in ("kill_worker_at_step", "kill_rollout_at_step", "grow_at_step"):
        value = getattr(args, option)
        if value is not None and not 1 <= value <= args.steps:
            parser.error(f"--{option.replace('_', '-')} counts steps from 1 to --steps ({args.steps})")
    for option in ("kill_rollout_at_step", "grow_at_step"):
        if getattr(args, option) is not None and args.placement != "split":
            parser.error(f"--{option.replace('_', '-')} acts on the rollout group of --placement split")
    if args.kill_rollout_at_step is not None and args.kill_rollout_at_step == args.kill_worker_at_step:
        parser.error("--kill-rollout-at-step and --kill-worker-at-step must be different steps")
    if args.grow_at_step is not None and args.prompts_per_step % (args.rollout_world_size + 1):
        parser.error(
            f"--grow-at-step grows the rollout to {args.rollout_world_size + 1} ranks: --prompts-per-step "
            f"{args.prompts_per_step} must be a multiple of that too (e.g. 48 with 2 rollout ranks)"
        )
    if args.heal and (args.async_rollout or args.plan):
        parser.error(
            "--heal runs the interrupted step again from the trainer's state; it is built for the plain "
            "step: leave out --async and --plan"
        )
    return args


@contextlib.contextmanager
def local_cluster_process(n_workers: int, timeout: float = 600.0):
    """A scheduler and ``n_workers`` worker processes (one thread each, under nannies)
    started with the ``dask`` command line, as on a real cluster; yields the scheduler's
    address and stops them on exit.

    Outside the driver process, so the driver's socket counters see only what the driver
    itself receives (an in-process ``LocalCluster`` would add the scheduler's and nannies'
    traffic). On GPUs, start ``dask cuda worker`` yourself and pass ``--scheduler``.
    """
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    dask_cli = [exe] if exe else [sys.executable, "-m", "dask"]
    common = ["--dashboard-address", ":0"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # The scheduler picks its own port and writes its address to a scheduler file (a port
    # picked here and released could be taken before the scheduler binds it).
    files = tempfile.mkdtemp(prefix="grpo-cluster-")
    scheduler_file = os.path.join(files, "scheduler.json")
    procs = [
        subprocess.Popen(
            [
                *dask_cli,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--scheduler-file",
                scheduler_file,
                *common,
            ],
            **quiet,
        ),
        subprocess.Popen(
            [
                *dask_cli,
                "worker",
                "--scheduler-file",
                scheduler_file,
                "--nworkers",
                str(n_workers),
                "--nthreads",
                "1",
                "--host",
                "127.0.0.1",
                *common,
            ],
            **quiet,
        ),
    ]
    address = None
    deadline = time.monotonic() + 60.0
    while address is None and procs[0].poll() is None and time.monotonic() < deadline:
        try:
            with open(scheduler_file) as f:
                address = json.load(f)["address"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    try:
        if address is None:
            raise SystemExit(
                f"the local dask scheduler did not start within 60 s (exit code {procs[0].poll()}); "
                "run `dask scheduler` yourself to see why, and pass its address with --scheduler"
            )
        print(f"local cluster of {n_workers} workers (dask scheduler + dask worker) at {address}")
        yield address
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(files, ignore_errors=True)


@contextlib.contextmanager
def local_worker_process(address: str):
    """One more ``dask worker`` process (one thread, under a nanny) joining the scheduler at
    ``address``, as ``cluster.scale(n + 1)`` adds one; stopped on exit."""
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    dask_cli = [exe] if exe else [sys.executable, "-m", "dask"]
    proc = subprocess.Popen(
        [*dask_cli, "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--dashboard-address", ":0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def connect(address: str, timeout: float = 60.0):
    """A ``Client`` of the scheduler at ``address``; ``SystemExit`` if it cannot be reached
    within ``timeout`` seconds."""
    from dask.distributed import Client

    try:
        return Client(address, timeout=timeout)
    except OSError as exc:
        raise SystemExit(f"could not reach the Dask scheduler at {address} (--scheduler): {exc}") from None


def wait_for_workers(client, n_workers: int, timeout: float) -> None:
    """Wait until the cluster has ``n_workers`` workers, saying so; ``SystemExit`` after
    ``timeout`` seconds, with how many came."""
    have = len(client.nthreads())
    if have < n_workers:
        print(f"waiting for {n_workers} Dask workers ({have} connected)...", flush=True)
    t0 = time.monotonic()
    while True:
        # In rounds, saying how many came: a worker process starting on a busy machine
        # (torch's import) may take minutes, and a silent wait looks like a hang.
        left = timeout - (time.monotonic() - t0)
        try:
            client.wait_for_workers(n_workers, timeout=max(min(15.0, left), 0.1))
            return
        except TimeoutError:
            if time.monotonic() - t0 < timeout:
                print(
                    f"  still waiting: {len(client.nthreads())} of {n_workers} Dask workers connected "
                    f"after {time.monotonic() - t0:.0f} s (worker processes start by importing torch)",
                    flush=True,
                )
                continue
        raise SystemExit(
            f"only {len(client.nthreads())} of the {n_workers} Dask workers this placement needs joined "
            f"{client.scheduler.address} within {timeout:g} s (--recover-timeout): start more workers "
            "(one thread each) or lower --world-size / --rollout-world-size"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a job scheduler's stop, a timeout) unwinds like Ctrl-C, so the local
    # cluster started below is stopped instead of left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    n_workers = args.world_size + (args.rollout_world_size if args.placement == "split" else 0)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        address = args.scheduler or stack.enter_context(local_cluster_process(n_workers))
        client = stack.enter_context(connect(address))
        wait_for_workers(client, n_workers, args.recover_timeout)
        add_worker = None
        if not args.scheduler:

            def add_worker():
                stack.enter_context(local_worker_process(address))

        status = fit(client, args, add_worker=add_worker)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
