"""Worker classes of the step-plan tests (imported by reference on the workers)."""

from __future__ import annotations

import os
import time

from daskwg import DataProto, Dispatch, Execute, Worker, register


def _grow(data: DataProto, **columns) -> DataProto:
    tensors = {k: data.batch[k] for k in data.batch.keys()}
    tensors.update(columns)
    return DataProto.from_dict(tensors=tensors, meta_info=dict(data.meta_info))


class StepWorker(Worker):
    """The stages of a tiny RL step, one per dispatch mode, and a per-rank call log."""

    def __init__(self):
        super().__init__()
        self.log: list[str] = []
        self.kept = None

    # -- a log of what ran here, in order --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def note(self, tag: str) -> int:
        self.log.append(tag)
        return len(self.log)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def history(self) -> list[str]:
        out, self.log = self.log, []
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def boom_on_rank_one(self, x: int) -> int:
        if self.rank == 1:
            raise ValueError(f"boom {x}")
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    # -- one method per dispatch mode --

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scale(self, x: int, factor: int = 2) -> int:
        self.log.append(f"scale {x}")
        return x * factor + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add_rank(self, x: int) -> int:
        self.log.append(f"add_rank {x}")
        return x + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def tick(self, x: int) -> int:
        self.log.append(f"tick {x}")
        return x + 1

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def tick_later(self, x: int) -> int:
        return x + 1

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def only_rank_zero(self, x: int) -> tuple:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def on_rank_zero(self, x: int) -> tuple:
        return (self.rank, x * 10)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> float:
        return float(data.batch["prompts"].sum())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return _grow(data, applied=fn(data.batch["prompts"]))

    # -- an RL-shaped chain of DP_COMPUTE_PROTO stages --

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate(self, data: DataProto) -> DataProto:
        self.log.append(f"generate {len(data)}")
        return _grow(data, responses=data.batch["prompts"] + 1.0 + self.rank)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def reward(self, data: DataProto) -> DataProto:
        self.log.append(f"reward {len(data)}")
        return _grow(data, scores=data.batch["responses"].sum(-1))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def advantage(self, data: DataProto) -> DataProto:
        self.log.append(f"advantage {len(data)}")
        return _grow(data, advantages=data.batch["scores"] - data.batch["scores"].mean())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update(self, data: DataProto) -> DataProto:
        self.log.append(f"update {len(data)}")
        return DataProto.from_dict(tensors={"loss": data.batch["advantages"] * 2.0})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def bump_in_place(self, data: DataProto) -> DataProto:
        data.batch["prompts"].add_(100.0)
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def keep_and_return(self, data: DataProto) -> DataProto:
        self.kept = data  # the rank holds what it returns
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def drop_a_row_on_rank_one(self, data: DataProto) -> DataProto:
        return data[1:] if self.rank == 1 else data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept_prompts(self) -> list:
        return self.kept.batch["prompts"].tolist()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def repeat_rows(self, data: DataProto) -> DataProto:
        """Each row ``meta_info["n"]`` times (a rollout's samples per prompt)."""
        return DataProto.concat([data] * int(data.meta_info.get("n", 1)))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def fail_on_rank(self, data: DataProto) -> DataProto:
        if self.rank == 1 and data.meta_info.get("fail"):
            raise ValueError(f"stage failed on rank {self.rank}")
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def die_on_rank_one(self, data: DataProto) -> DataProto:
        if self.rank == 1 and data.meta_info.get("die"):
            os._exit(1)
        return data
