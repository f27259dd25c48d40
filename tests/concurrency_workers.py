"""Workers for tests/test_concurrency_groups.py: a rollout rank whose ``generate`` (async
or sync) checks a flag that control methods (``concurrency_group="control"``) set while it
runs."""

from __future__ import annotations

import asyncio
import threading
import time

from daskwg import Dispatch, Worker, register

#: Seconds one decode step of ``generate`` takes: 2000 steps are 100 s, far past every
#: bounded wait of the tests, so a control call that waited for it would fail them.
STEP_S = 0.05


class Rollout(Worker):
    """``generate`` decodes step by step until ``abort()`` (a control method) stops it."""

    def __init__(self):
        super().__init__()
        self.steps = 0
        # The sync generate runs on the default group's thread, abort_sync on the control
        # group's: a threading.Event is the thread-safe flag between them.
        self.stop = threading.Event()
        self.aborted = False
        self.log: list[int] = []
        self.active = {"default": 0, "control": 0}
        self.most = {"default": 0, "control": 0}
        self.lock = threading.Lock()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def generate(self, max_steps: int) -> int:
        self.aborted, self.steps = False, 0
        for _ in range(max_steps):
            if self.aborted:  # set by abort() on this same event loop: no lock needed
                break
            self.steps += 1
            await asyncio.sleep(STEP_S)
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def generate_sync(self, max_steps: int) -> int:
        self.stop.clear()
        self.steps = 0
        for _ in range(max_steps):
            if self.stop.is_set():
                break
            self.steps += 1
            time.sleep(STEP_S)
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control")
    async def abort(self) -> int:
        self.aborted = True
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control")
    def abort_sync(self) -> int:
        self.stop.set()
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control")
    def get_progress(self) -> int:
        return self.steps

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control", blocking=False)
    def record(self, i: int) -> None:
        with self._in("control"):
            self.log.append(i)
            time.sleep(0.01)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control")
    def get_log(self) -> list[int]:
        return list(self.log)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def busy(self, i: int, seconds: float) -> None:
        with self._in("default"):
            self.log.append(i)
            time.sleep(seconds)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control")
    def most_at_once(self) -> dict:
        return dict(self.most)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="control", blocking=False)
    def hold(self, seconds: float) -> bool:
        return self.stop.wait(seconds)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group="release")
    def release(self) -> None:
        self.aborted = True
        self.stop.set()

    def _in(self, group: str):
        worker = self

        class _Active:
            def __enter__(self):
                with worker.lock:
                    worker.active[group] += 1
                    worker.most[group] = max(worker.most[group], worker.active[group])

            def __exit__(self, *exc):
                with worker.lock:
                    worker.active[group] -= 1

        return _Active()
