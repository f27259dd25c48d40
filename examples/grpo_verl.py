"""GRPO with verl's own classes on daskwg: ``examples/grpo.py``'s job, its worker written
as a verl user writes it, run through ``daskwg.verl``'s verl-shaped groups.

The worker subclasses verl's ``verl.single_controller.base.Worker``, marks its methods
with verl's ``register`` and ``Dispatch``/``Execute``, and takes and returns verl's
``verl.protocol.DataProto``; nothing of daskwg is imported into it. The driver builds
verl's ``RayResourcePool``, ``RayClassWithInitArgs`` and ``RayWorkerGroup``, imported from
``daskwg.verl`` instead of ``verl.single_controller.ray``: the one import a verl program
changes. Everything else is ``grpo.py``'s, reused, not copied: the task, the policy, the
method bodies (each registered here with verl's decorator), the config and the training
loop. With the same seed the two programs take the same steps: the same rewards and the
same final weights (``tests/test_grpo_verl.py`` checks it on a short run).

Run it as ``grpo.py`` (the same options)::

    python examples/grpo_verl.py                    # colocated, 4 ranks
    python examples/grpo_verl.py --placement split  # 2 rollout + 4 trainer ranks

It needs daskwg's ``verl`` extra (what verl imports on CPU) and verl itself installed
without its dependencies (``pip install --no-deps verl==0.9.1``); ``tox -e demo-verl`` does both.
``--kill-worker-at-step`` is refused: verl's trainer does not recover from a lost worker
(``grpo.py`` shows daskwg's recovery), and lost workers end the run (``--max-restarts 0``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import cloudpickle
import grpo
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, Execute, register

from daskwg.verl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, split_resource_pool

# The workers cannot import grpo.py (it is not installed there): its functions and
# classes travel by value, as the __main__ module's do.
cloudpickle.register_pickle_by_value(grpo)


def recipe(name: str):
    """The body of ``grpo.ActorRolloutRefWorker``'s method ``name``: the function under
    daskwg's ``register``, to be registered here with verl's."""
    return getattr(grpo.ActorRolloutRefWorker, name).__wrapped__


class ActorRolloutRefWorker(Worker):
    """verl's hybrid worker: ``grpo.ActorRolloutRefWorker``'s roles and methods on verl's ``Worker``.

    Args:
        role: ``"actor_rollout_ref"``, ``"actor_ref"`` or ``"rollout"`` (as in ``grpo.py``).
        cfg: the :class:`grpo.GRPOConfig`.
    """

    ROLES = grpo.ActorRolloutRefWorker.ROLES

    def __init__(self, role: str, cfg: grpo.GRPOConfig):
        super().__init__()  # verl's Worker reads RANK, WORLD_SIZE, MASTER_ADDR, ... from the environment
        if role not in self.ROLES:
            raise ValueError(f"role must be one of {self.ROLES}, got {role!r}")
        torch.set_num_threads(1)  # as grpo.py's worker: one intra-op thread per rank
        self.role = role
        self.cfg = cfg
        self.has_actor = "actor" in role

    init_model = register(dispatch_mode=Dispatch.ONE_TO_ALL)(recipe("init_model"))
    generate_sequences = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(
        recipe("generate_sequences")
    )
    load_weights = register(dispatch_mode=Dispatch.ONE_TO_ALL)(recipe("load_weights"))
    compute_reward = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(
        recipe("compute_reward")
    )
    compute_advantage = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(
        recipe("compute_advantage")
    )
    compute_log_prob = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(
        recipe("compute_log_prob")
    )
    compute_ref_log_prob = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(
        recipe("compute_ref_log_prob")
    )
    # The recipes' private helpers, taken as they are (no decorator on them).
    _build_model = grpo.ActorRolloutRefWorker._build_model
    _init_process_group = grpo.ActorRolloutRefWorker._init_process_group
    _training_state = grpo.ActorRolloutRefWorker._training_state
    _load_training_state = grpo.ActorRolloutRefWorker._load_training_state
    _log_probs = grpo.ActorRolloutRefWorker._log_probs
    update_actor = register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)(recipe("update_actor"))
    get_weights = register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)(
        recipe("get_weights")
    )
    save_checkpoint = register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)(
        recipe("save_checkpoint")
    )
    load_checkpoint = register(dispatch_mode=Dispatch.ONE_TO_ALL)(recipe("load_checkpoint"))
    weights_checksum = register(dispatch_mode=Dispatch.ONE_TO_ALL)(recipe("weights_checksum"))
    destroy_process_group = register(dispatch_mode=Dispatch.ONE_TO_ALL)(recipe("destroy_process_group"))


def build_groups(client, args) -> grpo.Groups:
    """verl's groups of ``args.placement`` (``RayWorkerGroup`` on ``RayResourcePool``), models
    initialised. ``client`` is the default client the pools take their workers from."""
    config = grpo.grpo_config(args)
    if args.placement == "colocated":
        pool = RayResourcePool(process_on_nodes=[args.world_size], use_gpu=False, name_prefix="global_pool")
        hybrid = RayClassWithInitArgs(cls=ActorRolloutRefWorker, role="actor_rollout_ref", cfg=config)
        wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=hybrid)
        groups = grpo.Groups(actor=wg, rollout=wg, dataproto=DataProto)
    else:
        pool = RayResourcePool(process_on_nodes=[args.world_size + args.rollout_world_size], use_gpu=False)
        trainer_pool, rollout_pool = split_resource_pool(pool, [args.world_size, args.rollout_world_size])
        actor = RayWorkerGroup(
            resource_pool=trainer_pool,
            ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, role="actor_ref", cfg=config),
        )
        rollout = RayWorkerGroup(
            resource_pool=rollout_pool,
            ray_cls_with_init=RayClassWithInitArgs(cls=ActorRolloutRefWorker, role="rollout", cfg=config),
        )
        groups = grpo.Groups(actor=actor, rollout=rollout, dataproto=DataProto)
    for group in groups.all():
        backends = group.init_model()
        if group is groups.actor:
            groups.backend = backends[0]
    return groups


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Its own plot and checkpoints, beside grpo.py's (a --resume must not take the other's).
    defaults = {"--out": "grpo_verl.png", "--checkpoint-dir": "grpo_verl_checkpoint"}
    for option, name in defaults.items():
        if not any(a == option or a.startswith(option + "=") for a in argv):
            argv += [option, os.path.join("examples", "out", name)]
    args = grpo.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the local cluster started below is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.kill_worker_at_step is not None:
        raise SystemExit(
            "--kill-worker-at-step: verl's trainer does not recover from a lost worker; run examples/grpo.py"
        )
    args.max_restarts = 0

    n_workers = args.world_size + (args.rollout_world_size if args.placement == "split" else 0)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        address = args.scheduler or stack.enter_context(grpo.local_cluster_process(n_workers))
        client = stack.enter_context(grpo.connect(address))
        grpo.wait_for_workers(client, n_workers, args.recover_timeout)
        status = grpo.fit(client, args, build=build_groups)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
