"""The worker class of tests/test_two_jobs.py, in a module of its own so that worker
processes and subprocess drivers import it by reference."""

from __future__ import annotations

import os
import time

from daskwg import Dispatch, Worker, register


def _note(log: str, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


class JobWorker(Worker):
    """One job's rank: calls that note themselves in a log file, one that holds the host
    thread until a file appears (ended by the test, never by a timer)."""

    def __init__(self, x: int = 0):
        super().__init__()
        self.x = x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def value(self) -> int:
        return self.x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def note(self, log: str, line: str) -> str:
        _note(log, line)
        return line

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def note_later(self, log: str, line: str) -> str:
        _note(log, line)
        return line

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def hold(self, log: str, until: str) -> str:
        """Note ``"hold"``, then keep the host thread until the file ``until`` exists."""
        _note(log, "hold")
        while not os.path.exists(until):
            time.sleep(0.02)
        return "held"
