"""Worker classes used by the tests; a module of its own so worker processes can
import them by reference (test modules are not importable there)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from daskwg import DataProto, Dispatch, Execute, Worker, register


class AddWorker(Worker):
    """verl's test worker: ``foo`` returns ``self._x + x + y``."""

    def __init__(self, x: int = 2):
        super().__init__()
        self._x = x
        self.log: list[int] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def foo(self, x, y):
        return self._x + x + y

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def foo_all(self, x, y):
        return self._x + x + y

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def foo_rank_zero(self, x, y):
        return self._x + x + y

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_rank_async(self, data: DataProto) -> DataProto:
        data.batch["a"] += self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
        keys += ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        return {k: os.environ.get(k) for k in keys}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def record(self, i: int, delay: float = 0.0) -> int:
        if delay:
            time.sleep(delay)
        self.log.append(i)
        return i

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_log(self) -> list[int]:
        return list(self.log)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int, message: str = "boom") -> int:
        if self.rank == rank:
            raise ValueError(message)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    def not_registered(self):
        return 1


class CollectiveWorker(Worker):
    """Joins a gloo process group from the environment the group set."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self) -> bool:
        dist.init_process_group(backend="gloo")
        return dist.is_initialized()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_gather_rank(self) -> list[int]:
        mine = torch.tensor([self.rank, self.rank])
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return torch.cat(out).tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class PathWorker(Worker):
    """Calls that take a while on the host thread, chained by their futures (tests/test_call_path.py)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap_async(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data: DataProto) -> DataProto:
        time.sleep(data.meta_info.get("seconds", 0.0))
        return DataProto.from_dict({"x": data.batch["x"] + 1})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double_now(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 2})


def block_event_loop(seconds: float) -> float:
    """Hold the calling worker's event loop (``client.run`` runs a plain function on it)."""
    time.sleep(seconds)
    return seconds


def _refuse_to_load() -> None:
    raise ValueError("this result refuses to be unpickled")


class Unloadable:
    """Pickles anywhere; unpickling it raises ``ValueError`` (not a pickling error)."""

    def __reduce__(self):
        return (_refuse_to_load, ())


class UnloadableWorker(PathWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def unloadable(self) -> Unloadable:
        return Unloadable()
