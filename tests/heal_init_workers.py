"""A worker that joins torch.distributed in ``__init__`` (as verl's do), without an
``on_membership_change`` hook: what ``wg.heal()`` must rebuild without a deadlock."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from daskwg import Dispatch, Worker, register


class InitPGWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()
