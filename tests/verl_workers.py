"""Worker classes written as a verl user writes them: verl's own ``Worker``, ``register``,
``Dispatch``, ``Execute`` and ``DataProto``, nothing from daskwg. A module of its own so
worker processes import them by reference (verl must be installed there)."""

from __future__ import annotations

import os
import time

import ray
import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)

import daskwg


class VerlScaler(Worker):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor
        self._register_dispatch_collect_info("train", dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return (self.rank, self.world_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: DataProto) -> DataProto:
        assert type(data) is DataProto, f"got {type(data).__module__}.{type(data).__qualname__}"
        return DataProto.from_dict({"y": data.batch["x"] * self.factor})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale_later(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * self.factor})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def scale_on_mesh(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * self.factor})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def rows_seen(self, data: DataProto) -> tuple[str, int]:
        return type(data).__module__, len(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def type_seen(self, data: DataProto) -> DataProto:
        name = f"{type(data).__module__}.{type(data).__qualname__}"
        return DataProto.from_dict({"n": torch.ones(len(data))}, {"type": [name] * len(data)})

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def add_rank_zero(self, x, y):
        return self.factor + x + y

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, key):
        return os.environ.get(key)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def available_addr_port(self):
        return self.get_available_master_addr_port()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ray_node_ip(self):
        return ray.util.get_node_ip_address()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"rank {self.rank} fails on purpose")
        return self.rank


class VerlPair(Worker):
    """verl's ALL_TO_ALL: per-rank lists split, anything else goes to every rank (on RayWorkerGroup)."""

    def __init__(self, x):
        super().__init__()
        self._x = x

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x, y):
        return self._x + x + y

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def add_rank_zero(self, x, y):
        return self._x + x + y


class RemoteVerlScaler(VerlScaler):
    """Decorated below with ray's own ``@ray.remote``, as verl users decorate workers."""


RemoteVerlScaler = ray.remote(RemoteVerlScaler)


class DaskwgRegistersWithVerlModes(daskwg.Worker):
    """A daskwg Worker whose ``daskwg.register`` takes verl's ``Dispatch``/``Execute`` members."""

    @daskwg.register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.ALL)
    def rank_plus(self, x):
        return self.rank + x


def add_one(t):
    return t + 1


def double_rows(worker, data):
    return DataProto.from_dict({"y": data.batch["x"] * 2 + worker.rank * 0})
