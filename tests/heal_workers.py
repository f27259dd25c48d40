"""Worker classes for the heal and resize tests (``test_heal.py``), importable by worker processes."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from daskwg import Dispatch, Worker, register


class HealWorker(Worker):
    """A rank with state of its own, a gloo default process group, and a record of the
    membership changes it saw."""

    def __init__(self, tag: str = "t"):
        super().__init__()
        self.tag = tag
        self.state = None
        self.events: list = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_state(self, value) -> None:
        self.state = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_state(self):
        return self.state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def place(self) -> tuple:
        """What the rank sees of its group: ``(tag, rank, world_size, MASTER_ADDR, MASTER_PORT)``."""
        return self.tag, self.rank, self.world_size, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_pg(self, timeout_s: float = 20.0) -> bool:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        return dist.is_initialized()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_on(self, ranks: list[int]) -> str:
        """An all-reduce that only ``ranks`` join (the others' input was lost, say): they
        time out. Returns ``"left out"`` or the error the rank's all-reduce raised."""
        if self.rank not in ranks:
            return "left out"
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            return str(exc)
        return "finished"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def all_reduce_later(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def membership_events(self) -> list:
        return [(e.kind, e.old_world_size, e.new_world_size, tuple(e.new_ranks)) for e in self.events]

    def on_membership_change(self, event) -> None:
        self.events.append(event)
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
