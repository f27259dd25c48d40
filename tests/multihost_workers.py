"""Worker classes of the multi-host tests (a module of its own so the worker processes in
the host namespaces import them by reference)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from daskwg import DataProto, Dispatch, Worker, register

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def hold_until(flag: str, rank: int, limit_s: float) -> float:
    """Mark this rank's call as started (``<flag>.r<rank>.started``), then wait until the
    file ``flag`` exists (the test releases every held call at once) or ``limit_s``
    seconds passed; returns the seconds held."""
    with open(f"{flag}.r{rank}.started", "w"):
        pass
    t0 = time.monotonic()
    while not os.path.exists(flag) and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)
    return time.monotonic() - t0


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


class HostWorker(Worker):
    """Says where it runs, joins gloo, holds calls for the partition tests, keeps a value."""

    def __init__(self, value: int = 0):
        super().__init__()
        self.value = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        return {
            "hostname": socket.gethostname(),
            "host_name_resolves_to": _resolve(socket.gethostname()),
            "pid": os.getpid(),
            **{key: os.environ.get(key) for key in ENV_KEYS},
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_gloo(self, timeout_s: float = 10.0) -> str:
        # A short timeout: ranks whose peers cannot connect give up soon, and do not keep
        # the worker's thread for gloo's default 30 minutes.
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        return dist.get_backend()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def try_init_gloo(self, timeout_s: float = 10.0) -> dict:
        """``init_gloo`` that reports instead of raising: ``{"ok", "seconds", "error"}``
        (the first line of the error), so every rank says how its rendezvous went."""
        t0 = time.monotonic()
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
            return {"ok": True, "seconds": time.monotonic() - t0, "error": None}
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test asserts on
            return {"ok": False, "seconds": time.monotonic() - t0, "error": str(exc).splitlines()[0][:300]}

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

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold(self, flag: str, limit_s: float = 120.0) -> float:
        return hold_until(flag, self.rank, limit_s)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def hold_rows(self, data: DataProto) -> DataProto:
        hold_until(data.meta_info["flag"], self.rank, data.meta_info.get("limit_s", 120.0))
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_value(self, value: int) -> None:
        self.value = value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_value(self) -> int:
        return self.value


class BulkWorker(Worker):
    """Makes and passes on batches whose row ``i`` is ``i`` in every column."""

    @staticmethod
    def _rows(ids: torch.Tensor, cols: int) -> DataProto:
        x = ids.to(torch.float32)[:, None].expand(-1, cols).contiguous()
        return DataProto.from_dict({"id": ids.clone(), "x": x})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, seed: DataProto) -> DataProto:
        return self._rows(seed.batch["id"], seed.meta_info["cols"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def make_sync(self, seed: DataProto) -> DataProto:
        return self._rows(seed.batch["id"], seed.meta_info["cols"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_async(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def summary(self, data: DataProto) -> dict:
        ids = data.batch["id"]
        return {
            "rows": len(ids),
            "first": int(ids[0]) if len(ids) else None,
            "ok": bool((data.batch["x"] == ids.to(torch.float32)[:, None]).all()),
        }
