"""Worker classes for the deadline, hang and restart tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import types

import torch
import torch.distributed as dist

from daskwg import DataProto, Dispatch, Worker, register
from daskwg.dispatch.modes import collect_dp_compute_data_proto, dispatch_one_to_all


class BadStrError(Exception):
    """An exception whose ``__str__`` itself raises."""

    def __str__(self) -> str:
        raise ValueError("this __str__ raises")


class HangWorker(Worker):
    """Sleeps, spins, blocks in collectives and fails in odd ways, on demand."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def head(self, x) -> float:
        """The sum of the first four elements of ``x`` (a large argument, a small result)."""
        return float(x[:4].sum())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep_async(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def serve_async(self, seconds: float) -> int:
        """An async method (a rollout server's request loop, say) that notes how it ended."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.__dict__.setdefault("events", []).append("serve cancelled")
            raise
        self.__dict__.setdefault("events", []).append("serve finished")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def note_async(self, event: str) -> None:
        self.__dict__.setdefault("events", []).append(event)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_events(self) -> list[str]:
        events, self.events = self.__dict__.get("events", []), []
        return events

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def wait_for_file_async(self, path: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.05)
        return os.path.exists(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spin_until(self, rank: int, path: str, seconds: float) -> bool:
        """Rank ``rank`` does not return until ``path`` exists (a loop the driver cannot
        tell from an infinite one; bounded by ``seconds`` so the test can always end it)."""
        end = time.monotonic() + seconds
        while self.rank == rank and not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.05)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, timeout=1.0)
    def sleep_with_timeout(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spin_on(self, rank: int) -> int:
        """Rank ``rank`` never returns (a pure-Python infinite loop)."""
        n, me = 0, self.rank
        while me == rank:
            n += 1
        return n

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def add(self, i: int) -> int:
        return i + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def threads(self) -> int:
        return threading.active_count()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self) -> str:
        dist.init_process_group(backend="gloo")
        return os.environ["MASTER_PORT"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_or_fail(self, failing_rank: int) -> float:
        if self.rank == failing_rank:
            raise RuntimeError(f"rank {failing_rank} fails before the all-reduce")
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_worker_only(self) -> None:
        # A class that exists only in this process: the driver cannot rebuild it.
        module = types.ModuleType("daskwg_worker_only_errors")
        exec("class WorkerOnlyError(Exception):\n    pass\n", module.__dict__)
        sys.modules[module.__name__] = module
        raise module.WorkerOnlyError(f"only on rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def raise_worker_only_async(self) -> None:
        self.raise_worker_only()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_bad_str(self) -> None:
        raise BadStrError()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_key_error(self) -> None:
        raise KeyError("missing")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def raise_key_error_async(self) -> None:
        raise KeyError("missing")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def clashing_parts(self, data: DataProto) -> DataProto:
        # Parts whose meta_info disagree: concatenating them fails.
        return DataProto.from_dict({"x": data.batch["x"]}, meta_info={"step": self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def consume(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def raise_worker_only_proto(self, data: DataProto) -> DataProto:
        self.raise_worker_only()
        return data


#: One seed per rank in, a DataProtoFuture of the ranks' outputs back (a producer that
#: takes plain arguments).
ONE_TO_ALL_PROTO = {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_dp_compute_data_proto}


class LeakWorker(Worker):
    """Producers and consumers that fail, for what failed calls leave on the workers."""

    @register(dispatch_mode=ONE_TO_ALL_PROTO, blocking=False)
    def produce(self, mib: int) -> DataProto:
        return DataProto.from_dict({"x": torch.ones(mib * 2**18, 1)})

    @register(dispatch_mode=ONE_TO_ALL_PROTO, blocking=False)
    def produce_fail(self, seed: int) -> DataProto:
        raise ValueError(f"produce_fail({seed}) fails on rank {self.rank}")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def consume_fail(self, data: DataProto) -> DataProto:
        raise ValueError(f"consume_fail of {len(data)} rows fails on rank {self.rank}")


def step_wall_clock(seconds: float) -> None:
    """Step this process's wall clock (``time.time``) by ``seconds`` from the true time, as
    NTP or a resumed VM steps it; ``0`` puts it back."""
    real = getattr(time, "_unstepped_time", time.time)
    time._unstepped_time = real
    time.time = real if seconds == 0 else (lambda: real() + seconds)


def tensor_bytes() -> int:
    """Bytes of the storages of every tensor alive in this process (what its Python objects hold)."""
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class SlowInitWorker(Worker):
    """Its ``__init__`` sleeps ``seconds`` on the ranks in ``slow`` (a model still loading)."""

    def __init__(self, seconds: float, slow: tuple = (0, 1)):
        super().__init__()
        if self.rank in slow:
            time.sleep(seconds)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()
