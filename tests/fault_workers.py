"""Worker classes for the fault-injection tests (importable by worker processes)."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from daskwg import DataProto, Dispatch, Worker, register

#: Calls seen by this worker process, across every group hosted in it.
PROCESS_LOG: list = []


class FaultWorker(Worker):
    """Records calls process-wide, returns odd things, fails on demand."""

    def __init__(self, fail_rank: int = -1, marker_dir: str | None = None):
        super().__init__()
        if self.rank == fail_rank:
            raise RuntimeError(f"__init__ fails on rank {fail_rank}")
        self.marker_dir = marker_dir

    def __del__(self):
        if getattr(self, "marker_dir", None):
            with open(os.path.join(self.marker_dir, f"deleted-{os.getpid()}-{self.rank}"), "w") as f:
                f.write("x")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep_async(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def record(self, tag: str, i: int) -> None:
        PROCESS_LOG.append((tag, i))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def process_log(self) -> list:
        return list(PROCESS_LOG)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, value):
        return value

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo_proto(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_proto_async(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ones(self, nbytes: int) -> torch.Tensor:
        return torch.ones(nbytes, dtype=torch.uint8)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, t: torch.Tensor) -> int:
        # Summed in slices: t.sum(dtype=int64) would first cast the whole tensor (8x its size).
        return sum(int(part.sum(dtype=torch.int64)) for part in t.split(1 << 24))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lock(self):
        return threading.Lock()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def lock_async(self):
        return threading.Lock()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def proto_with_lock(self) -> DataProto:
        return DataProto.from_dict({"a": torch.zeros(2)}, meta_info={"lock": threading.Lock()})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def environment(self) -> dict:
        return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK")}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self, timeout_s: float | None = None) -> bool:
        import datetime

        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend="gloo", **kwargs)
        return dist.is_initialized()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_or_fail(self, failing_rank: int) -> float:
        if self.rank == failing_rank:
            raise RuntimeError(f"rank {failing_rank} fails before the all-reduce")
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)
