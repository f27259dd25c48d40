"""A worker class of the step-plan tests written as a verl user writes it: verl's own
``Worker``, ``register``, ``Dispatch`` and ``DataProto``, nothing from daskwg. A module of its
own so worker processes import it by reference (verl must be installed there)."""

from __future__ import annotations

import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


class VerlStepWorker(Worker):
    """RL-shaped stages in every mode a verl trainer uses, and calls no plan can compile."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("train", dp_rank=self.rank, is_collect=True)

    # -- DP_COMPUTE_PROTO: batches cut by rows --

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto) -> DataProto:
        assert type(data) is DataProto, type(data)
        return DataProto.from_dict(
            {"x": data.batch["prompts"] * 2.0 + self.rank}, meta_info=dict(data.meta_info)
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def produce_now(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"x": data.batch["prompts"] * 2.0 + self.rank}, meta_info=dict(data.meta_info)
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def step(self, data: DataProto) -> DataProto:
        assert type(data) is DataProto, type(data)
        return DataProto.from_dict({"loss": data.batch["x"] * 10.0 + self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def rows_and_sum(self, data: DataProto) -> tuple[int, float]:
        return len(data), float(data.batch["x"].sum())

    # -- ONE_TO_ALL / ALL_TO_ALL / DP_COMPUTE: one value per rank --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seed(self, x: int) -> int:
        return x * 100 + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def seed_later(self, x: int) -> int:
        return x * 100 + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x, y=0):
        return x + y + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, blocking=False)
    def add_later(self, x, y=0):
        return x + y + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def tick(self, x: int) -> int:
        return x + 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, values: list) -> float:
        return float(sum(values))

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def on_rank_zero(self, x):
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def pass_on(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def rows(self, data: DataProto) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, value):
        return value

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def step_on_mesh(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"loss": data.batch["x"] * 10.0 + self.rank})


def batch(rows: int, **meta) -> DataProto:
    """verl's DataProto of ``rows`` rows of ``prompts``."""
    return DataProto.from_dict({"prompts": torch.arange(float(rows))}, meta_info=meta)
