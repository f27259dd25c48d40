"""Worker classes and byte counters for the data-plane tests (importable by reference
in worker processes)."""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import torch

from daskwg import DataProto, Dispatch, Worker, register


def tcp_bytes_received() -> int:
    """Bytes this process received over all its TCP sockets (Linux ``TCP_INFO``
    ``tcpi_bytes_received``), whatever library read them."""
    return _tcp_info_total(128)


def tcp_bytes_sent() -> int:
    """Bytes this process sent (and had acknowledged) over all its open TCP sockets
    (``tcpi_bytes_acked``)."""
    return _tcp_info_total(120)


def _tcp_info_total(offset: int) -> int:
    import psutil

    total = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0:
            continue
        try:
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
        except OSError:
            continue
        finally:
            sock.detach()
        if len(info) >= 136:
            total += struct.unpack_from("Q", info, offset)[0]
    return total


def gathered_files(dask_worker=None) -> dict:
    """This process's files of rows gathered by their producers: ``{"free": n, "made": n}``."""
    from daskwg.plugin import gathered

    return gathered.counts()


def count_part_info_asks(dask_worker=None) -> int:
    """``daskwg_part_info`` requests this worker answered since the first call of this."""
    handlers = dask_worker.handlers
    if not hasattr(dask_worker, "_daskwg_part_info_asks"):
        original = handlers["daskwg_part_info"]
        dask_worker._daskwg_part_info_asks = 0

        async def counted(**kwargs):
            dask_worker._daskwg_part_info_asks += 1
            return await original(**kwargs)

        handlers["daskwg_part_info"] = counted
    return dask_worker._daskwg_part_info_asks


def no_shared_memory(side: str, dask_worker=None) -> None:
    """Fault injection: this worker cannot make (``"producer"``: nor write into a
    consumer's) or map (``"consumer"``) shared-memory files; ``"undo"`` undoes both."""
    from daskwg.plugin import gathered, inputs, shared

    def refuse(*_):
        raise OSError("/proc/<pid>/fd is not ours to open here (fault injection)")

    saved = dask_worker.__dict__.setdefault(
        "_daskwg_saved", (shared.available, inputs.attach, gathered._write_rows)
    )
    shared.available, inputs.attach, gathered._write_rows = saved
    if side == "producer":
        shared.available = lambda: False
        gathered._write_rows = refuse
    elif side == "consumer":
        inputs.attach = refuse


class Producer(Worker):
    """Makes batches whose row ``i`` is known: ``id == i`` and ``x[i, :] == i``."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, seed: DataProto) -> DataProto:
        ids = seed.batch["id"]
        cols = seed.meta_info.get("cols", 4)
        x = ids.to(torch.float32)[:, None].expand(-1, cols).contiguous()
        return DataProto.from_dict(
            {"id": ids.clone(), "x": x, "noise": torch.zeros(len(ids), cols)},
            non_tensors={"tag": np.array([f"row{i}" for i in ids.tolist()], dtype=object)},
            meta_info={"producer_world": self.world_size},
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make_dense(self, seed: DataProto) -> DataProto:
        """As :meth:`make`, tensors only (``x`` float32, ``mask`` bool, ``id`` int64)."""
        ids = seed.batch["id"]
        x = ids.to(torch.float32)[:, None].expand(-1, seed.meta_info.get("cols", 4)).contiguous()
        return DataProto.from_dict(
            {"id": ids.clone(), "x": x, "mask": (ids % 2 == 0)[:, None].expand(-1, 3).contiguous()},
            meta_info={"producer_world": self.world_size},
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make_gated(self, seed: DataProto) -> DataProto:
        """As :meth:`make`, once the file ``seed.meta_info["gate"]`` exists (a producer that is
        still running while the driver hands its future on)."""
        gate = seed.meta_info["gate"]
        for _ in range(6000):
            if os.path.exists(gate):
                break
            time.sleep(0.05)
        return DataProto.from_dict({"id": seed.batch["id"].clone()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make_or_fail(self, seed: DataProto) -> DataProto:
        if self.rank == 0:
            raise ValueError("rank 0 cannot make its rows")
        return DataProto.from_dict({"id": seed.batch["id"].clone()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def derive(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["id"] * 10})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_async(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


class Consumer(Worker):
    """Summarises the rows it got, so the driver never sees the batch."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def summary(self, data: DataProto) -> dict:
        out = {
            "ids": data.batch["id"].tolist(),
            "keys": sorted(data.batch.keys()),
            "non_tensor": sorted(data.non_tensor_batch),
            "meta": dict(data.meta_info),
        }
        if "x" in data.batch.keys():
            out["x_ok"] = bool((data.batch["x"] == data.batch["id"].to(torch.float32)[:, None]).all())
        if "y" in data.batch.keys():
            out["y"] = data.batch["y"].tolist()
        if "mask" in data.batch.keys():
            out["mask_ok"] = bool((data.batch["mask"] == (data.batch["id"] % 2 == 0)[:, None]).all())
        if "tag" in data.non_tensor_batch:
            out["tag"] = list(data.non_tensor_batch["tag"])
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def pair(self, data: DataProto, other: DataProto) -> list:
        """Row by row: this rank's ``id`` of ``data`` beside its ``j`` of ``other``."""
        return list(zip(data.batch["id"].tolist(), other.batch["j"].tolist()))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def zip_async(self, data: DataProto, other: DataProto) -> DataProto:
        """This rank's ``id`` of ``data`` beside its ``j`` of ``other``, as one batch."""
        return DataProto.from_dict({"id": data.batch["id"].clone(), "j": other.batch["j"].clone()})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def scribble(self, data: DataProto) -> list:
        """Negates its rows of ``x`` in place (a rank may change its input)."""
        data.batch["x"].mul_(-1.0)
        return data.batch["id"].tolist()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def ids(self, data: DataProto) -> DataProto:
        return data.select(batch_keys=["id"])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump_and_keep(self, data: DataProto) -> DataProto:
        """Adds 1 to its rows of ``x`` in place, keeps them (:meth:`kept`) and returns them."""
        data.batch["x"].add_(1.0)
        self.held = getattr(self, "held", []) + [data]
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kept(self) -> list:
        """The sums of ``x`` of what :meth:`bump_and_keep` kept, then lets go of it."""
        sums = [float(d.batch["x"].sum()) for d in getattr(self, "held", [])]
        self.held = []
        return sums

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def ids_async(self, data: DataProto) -> DataProto:
        return data.select(batch_keys=["id"])


class Stateful(Worker):
    """Keeps tensors that later calls change in place."""

    def __init__(self, big_elements: int = 1 << 20):
        super().__init__()
        self.w = torch.zeros(4)
        self.big = torch.arange(big_elements, dtype=torch.float32)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def weights_async(self) -> dict:
        return {"w": self.w}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict:
        return {"w": self.w}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self) -> None:
        self.w.add_(1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def head(self, n: int) -> torch.Tensor:
        return self.big[:n]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def head_async(self, n: int) -> torch.Tensor:
        return self.big[:n]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, *args, **kwargs) -> float:
        values = [*args, *kwargs.values()]
        return float(sum(v.to_dense().sum() if v.layout != torch.strided else v.sum() for v in values))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def same(self, value):
        return value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def same_async(self, value):
        return value
