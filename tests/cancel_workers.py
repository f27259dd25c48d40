"""Worker classes for the cancellation tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import os
import time

import torch

from daskwg import DataProto, Dispatch, Worker, register


class CancelWorker(Worker):
    """Steps through a generation (async or sync), noting each step; on demand it waits for a
    file, so a test can hold a call running for as long as it needs."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def _note(self, event: str) -> None:
        self.events.append(event)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def generate(self, batch: DataProto) -> DataProto:
        """``meta_info["steps"]`` decode steps of ``meta_info["step_s"]`` seconds each (an
        async rollout's loop)."""
        steps, step_s = batch.meta_info["steps"], batch.meta_info["step_s"]
        self._note("generate started")
        try:
            for _ in range(steps):
                await asyncio.sleep(step_s)
        except asyncio.CancelledError:
            self._note("generate cancelled")
            raise
        self._note("generate finished")
        return DataProto.from_dict({"out": batch.batch["x"] + 1})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sync(self, batch: DataProto) -> DataProto:
        """Runs until ``meta_info["path"]`` exists (at most ``meta_info["seconds"]``): a sync
        method Python cannot stop."""
        path, seconds = batch.meta_info["path"], batch.meta_info["seconds"]
        self._note("generate_sync started")
        end = time.monotonic() + seconds
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.02)
        self._note("generate_sync finished")
        return DataProto.from_dict({"out": batch.batch["x"] + 1})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double(self, batch: DataProto) -> DataProto:
        self._note("double ran")
        return DataProto.from_dict({"out": batch.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def note(self, event: str) -> str:
        self._note(event)
        return event

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_of(self) -> int:
        return self.rank


def batch(rows: int = 4, **meta_info) -> DataProto:
    """``rows`` rows of ``x = 0, 1, ...``, with ``meta_info``."""
    return DataProto.from_dict({"x": torch.arange(rows, dtype=torch.float32)}, meta_info=meta_info)
