"""Worker classes for the colocation, pool, detached-group, dispatch-mode and verl-parity
tests; a module of its own so worker processes import them by reference."""

from __future__ import annotations

import asyncio
import os

import torch
from tensordict import TensorDict

from daskwg import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from daskwg.dispatch.modes import collect_all_to_all, dispatch_one_to_all
from daskwg.groups.colocate import ColocatedWorker

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ROLE_ENV")


def rank_environment() -> dict:
    return {k: os.environ.get(k) for k in ENV_KEYS} | {"pid": os.getpid()}


# ---------------------------------------------------------------- colocation


class Policy(Worker):
    """A seeded linear layer: ``forward`` is ``x @ w`` with ``w`` drawn from ``seed + rank``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + self.rank)
        self.w = torch.randn(4, 3, generator=gen)
        self.seen_env = rank_environment()
        self.value = None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def forward(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] @ self.w})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> str:
        return f"policy{self.rank}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_env(self) -> dict:
        return self.seen_env

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_value(self, value) -> None:
        self.value = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_value(self):
        return self.value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peer_whoami(self, role: str) -> str:
        return self.get_fused_worker_by_name(role).whoami()


class Value(Worker):
    """Same method names as :class:`Policy`, different weights and answers; async forward."""

    def __init__(self, seed: int = 100, scale: float = 2.0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + self.rank)
        self.w = torch.randn(4, 3, generator=gen) * scale
        self.value = None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def forward(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0)
        return DataProto.from_dict({"y": data.batch["x"] @ self.w})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> str:
        return f"value{self.rank}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_value(self, value) -> None:
        self.value = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_value(self):
        return self.value


class MeshByBlock(Worker):
    """Mesh "train": dp rank ``rank // 2``, collected from even ranks."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def tag(self, data: DataProto) -> DataProto:
        data.batch["a"] += 10 * (self.rank + 1)
        return data


class MeshByStride(Worker):
    """Mesh "train" laid out the other way: dp rank ``rank % 2``, collected from ranks 0 and 1."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank % 2, is_collect=self.rank < 2)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def tag(self, data: DataProto) -> DataProto:
        data.batch["a"] += 10 * (self.rank + 1)
        return data


# verl's tests/single_controller/test_colocated_workers.py roles


class VerlActor(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank
        return data


class VerlCritic(Worker):
    def __init__(self, config):
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def sub(self, data: DataProto) -> DataProto:
        data.batch["a"] -= self.config["b"]
        return data


# verl's tests/single_controller/test_fused_workers_on_cpu.py roles


class FusedActor(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank


class FusedCritic(Worker):
    def __init__(self, val):
        super().__init__()
        self.val = val

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val


class HybridWorker(ColocatedWorker):
    """verl's fused-worker pattern: a colocated class with a method that uses two roles."""

    def __init__(self):
        super().__init__(
            {"actor": ClassWithInitArgs(FusedActor), "critic": ClassWithInitArgs(FusedCritic, val=10)}
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def foo(self, x):
        return self.critic.sub(self.actor.add(x))


# ---------------------------------------------------------------- pools and detached groups


class EnvWorker(Worker):
    """Reports the environment it sees at each call, and keeps a value."""

    def __init__(self, tag: int = 0):
        super().__init__()
        self.tag = tag
        self.value = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        return rank_environment()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank + self.tag
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_value(self, value) -> None:
        self.value = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_value(self):
        return self.value


# ---------------------------------------------------------------- dispatch modes


def two_to_all_dispatch_fn(worker_group, *args, **kwargs):
    """verl's example custom dispatch: two values, repeated interleaved over the ranks
    (without appending to the caller's lists, as verl's version does)."""
    n = worker_group.world_size
    return tuple([arg[i % 2] for i in range(n)] for arg in args), {
        key: [value[i % 2] for i in range(n)] for key, value in kwargs.items()
    }


def even_ranks_collect_fn(worker_group, outputs):
    return outputs[::2]


TWO_TO_ALL = register_dispatch_mode("TWO_TO_ALL", two_to_all_dispatch_fn, collect_all_to_all)
SWAPPABLE = register_dispatch_mode("SWAPPABLE", dispatch_one_to_all, collect_all_to_all)
DICT_MODE = {"dispatch_fn": two_to_all_dispatch_fn, "collect_fn": even_ranks_collect_fn}


def infer_mesh(rank: int) -> tuple[int, int]:
    """(dp, tp) of ``rank`` in an ``init_device_mesh`` of shape [dp=2, tp=4] (row-major)."""
    return rank // 4, rank % 4


def train_mesh(rank: int) -> tuple[int, int, int]:
    """(pp, dp, tp) of ``rank`` in an ``init_device_mesh`` of shape [pp=2, dp=2, tp=2]."""
    return rank // 4, (rank // 2) % 2, rank % 2


class ModeWorker(Worker):
    """One method per dispatch mode, blocking and not; meshes of verl's
    test_device_mesh_register (ranks laid out as ``init_device_mesh`` lays them out)."""

    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset
        dp, tp = infer_mesh(self.rank)
        self._register_dispatch_collect_info("infer", dp_rank=dp, is_collect=tp == 0)
        pp, dp, tp = train_mesh(self.rank)
        self._register_dispatch_collect_info("train", dp_rank=dp, is_collect=tp == 0 and pp == 1)

    def _add(self, x, y):
        return self.offset + x + y

    # ---- list modes
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def one_to_all(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def one_to_all_nb(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, blocking=False)
    def all_to_all_nb(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero(self, x):
        return self._add(x, self.rank)

    @register(dispatch_mode=Dispatch.RANK_ZERO, blocking=False)
    def rank_zero_nb(self, x):
        return self._add(x, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def execute_rank_zero_nb(self, x):
        return self._add(x, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_compute(self, x):
        return self._add(x, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def dp_compute_nb(self, x):
        return self._add(x, self.rank)

    # ---- DataProto modes
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def dp_proto_nb(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def dp_proto_td_nb(self, data: TensorDict) -> TensorDict:
        data["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, func, data: DataProto) -> DataProto:
        return func(self, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, blocking=False)
    def apply_nb(self, func, data: DataProto) -> DataProto:
        return func(self, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["a"].sum())}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC, blocking=False)
    def metric_nb(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def rows_seen(self, data: DataProto) -> DataProto:
        """What this rank received: its rank and the row count, one row per input row."""
        n = len(data)
        return DataProto.from_dict(
            {"rank": torch.full((n,), self.rank), "rows": torch.full((n,), n), "a": data.batch["a"].clone()}
        )

    # ---- custom modes
    @register(dispatch_mode=TWO_TO_ALL)
    def two_to_all(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=TWO_TO_ALL, blocking=False)
    def two_to_all_nb(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=SWAPPABLE)
    def swappable(self, x):
        return self._add(x, self.rank)

    @register(dispatch_mode=DICT_MODE)
    def dict_mode(self, x, y):
        return self._add(x, y)

    @register(dispatch_mode=DICT_MODE, blocking=False)
    def dict_mode_nb(self, x, y):
        return self._add(x, y)

    # ---- async def
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def async_one_to_all(self, x):
        await asyncio.sleep(0.01)
        return self._add(x, self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def async_dp_proto_nb(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0.01)
        data.batch["a"] = data.batch["a"] * 2 + self.rank
        return data

    # ---- materialize_futures
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def kind_of_argument(self, data) -> DataProto:
        return DataProto.from_dict({"is_dataproto": torch.full((len(data),), isinstance(data, DataProto))})

    # ---- meshes (verl's test_device_mesh_register)
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"))
    def generate_data_proto(self, data: DataProto) -> DataProto:
        dp, tp = infer_mesh(self.rank)
        data.batch["a"] += (tp + 1) * dp
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"))
    def generate_tensordict(self, data: TensorDict) -> TensorDict:
        dp, tp = infer_mesh(self.rank)
        data["a"] += (tp + 1) * dp
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"), blocking=False)
    def generate_data_proto_nb(self, data: DataProto) -> DataProto:
        dp, tp = infer_mesh(self.rank)
        data.batch["a"] += (tp + 1) * dp
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def train_data_proto(self, data: DataProto) -> DataProto:
        pp, dp, tp = train_mesh(self.rank)
        data.batch["a"] += (tp + 1) * (dp + 2) * (pp + 3)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def train_tensordict(self, data: TensorDict) -> TensorDict:
        pp, dp, tp = train_mesh(self.rank)
        data["a"] += (tp + 1) * (dp + 2) * (pp + 3)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"), blocking=False)
    def train_tensordict_nb(self, data: TensorDict) -> TensorDict:
        pp, dp, tp = train_mesh(self.rank)
        data["a"] += (tp + 1) * (dp + 2) * (pp + 3)
        return data


# ---------------------------------------------------------------- verl's single_controller tests


class BasicsActor(Worker):
    """verl's test_worker_group_basics ``TestActor``."""

    def __init__(self, x):
        super().__init__()
        self._x = x

    def foo(self, y):
        return self._x + y

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + y + x

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def foo_one_to_all(self, x, y):
        return self._x + y + x

    @register(Dispatch.ALL_TO_ALL, blocking=False)
    def foo_all_to_all(self, x, y):
        return self._x + y + x

    @register(dispatch_mode={"dispatch_fn": two_to_all_dispatch_fn, "collect_fn": collect_all_to_all})
    def foo_custom(self, x, y):
        return self._x + y + x


class PaddingActor(Worker):
    """verl's test_auto_padding_on_cpu ``Actor``."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank
        return data


class DecoratorTestWorker(Worker):
    """verl's test_decorator_on_cpu worker."""

    def __init__(self, initial_value=0):
        super().__init__()
        self.value = initial_value
        self._register_dispatch_collect_info(mesh_name="train", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def dp_compute(self, data: DataProto) -> DataProto:
        rank_value = torch.tensor(self.rank, dtype=data.batch["input"].dtype)
        data.batch["output"] = data.batch["input"] + self.value + rank_value
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def async_dp_compute(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0.01)
        rank_value = torch.tensor(self.rank, dtype=data.batch["input"].dtype)
        data.batch["output_async"] = data.batch["input"] * 2 + self.value + rank_value
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def dp_compute_td(self, data: TensorDict) -> TensorDict:
        data["output"] = data["input"] + self.value + self.rank
        position_ids = data.pop("position_ids")
        for i, position_id in enumerate(position_ids.unbind(dim=0)):
            expected = torch.arange(4 + self.rank * 2 + i).expand(position_id.shape)
            if not torch.equal(position_id, expected):
                raise AssertionError(f"rank {self.rank} row {i}: position ids {position_id} != {expected}")
        return data


class ModelActor(Worker):
    """verl's test_driverfunc_to_worker actor: its ``__init__`` does not call ``Worker.__init__``."""

    def __init__(self):
        pass


class SplitActor(Worker):
    """verl's test_split_resource_pool ``Actor`` (without its NCCL process group)."""

    def __init__(self, worker_id):
        super().__init__()
        self.worker_id = worker_id

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank + self.worker_id
        return data


class GetenvActor(Worker):
    """verl's test_ray_local_envs_on_cpu ``TestActor``."""

    def getenv(self, key):
        return os.getenv(key, f"{key} not set")


class TransferWorker(Worker):
    """verl's test_data_transfer ``DummyWorker`` (without its process group)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def do_nothing(self, data: DataProto) -> DataProto:
        for key in data.batch.keys():
            data.batch[key] += 1
        return data


class NestedActor(Worker):
    """verl's test_nested_worker ``TestActor``."""

    def __init__(self, x):
        super().__init__()
        self.a = x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get(self):
        return self.a + self.rank


class HighLevelActor(Worker):
    """verl's test_nested_worker ``TestHighLevelActor``: builds a NestedActor in-process."""

    def __init__(self, x=None):
        super().__init__()
        self.test_actor = NestedActor(x=x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get(self):
        return self.test_actor.get()
