"""Rank code of the sharded weight-sync and DTensor tests (``test_sharded_sync.py``)."""

from __future__ import annotations

import hashlib
import os
import socket
import struct

import torch
import torch.distributed as dist
from torch import nn

from daskwg import DataProto, Dispatch, Worker, register, sync


def make_model(width: int, layers: int) -> nn.Sequential:
    """``layers`` Linear(width, width) layers, the same random weights for a given shape."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def egress_bytes() -> int:
    """Bytes this process's TCP sockets sent and had acknowledged (Linux ``TCP_INFO``
    ``tcpi_bytes_acked``): gloo's sockets are this process's, so the sync's sends count
    whatever library made them."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
                if len(info) >= 128:
                    total += struct.unpack_from("Q", info, 120)[0]
        except OSError:
            pass
        finally:
            sock.detach()
    return total


def rss_peak_growth(run) -> tuple[object, int]:
    """``run()``'s result and how far this process's peak RSS rose above its RSS before it
    (bytes): ``/proc/self/clear_refs`` 5 resets ``VmHWM`` to the current RSS."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    result = run()
    return result, status("VmHWM:") - before


class Trainer(Worker):
    """A trainer rank: ``make_model`` sharded with FSDP2 over the group's gloo process group."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init(self, width: int, layers: int, frozen: int = 0) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.model = make_model(width, layers)
        for layer in list(self.model)[:frozen]:
            layer.requires_grad_(False)
        for layer in self.model:
            fully_shard(layer)
        fully_shard(self.model)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight(self, scale: float = 1.0):
        """The first layer's weight, a DTensor (``Shard(0)``), times ``scale``."""
        return self.model.state_dict()["0.weight"] * scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def weight_later(self):
        return self.model.state_dict()["0.weight"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> dict:
        """The sharded state dict (DTensors)."""
        return self.model.state_dict()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def weight_in_meta(self, data: DataProto) -> DataProto:
        data.meta_info["metrics"] = {"weight": self.model.state_dict()["0.weight"]}
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_digest(self) -> str:
        """sha256 of the full state dict (``full_tensor()`` of every DTensor), in name order."""
        digest = hashlib.sha256()
        for name, value in self.model.state_dict().items():
            digest.update(name.encode())
            digest.update(value.full_tensor().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self) -> None:
        """One SGD step on a random batch: the layers that are not frozen change."""
        optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)
        torch.manual_seed(1)
        self.model(torch.randn(4, self.model[0].in_features)).square().sum().backward()
        optimizer.step()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def forget(self, name: str) -> None:
        sync.forget(name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def move_weights(self) -> None:
        """Give every parameter new memory with the same values (as a reload would): a
        sync must not write or read where the old memory was."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = p.data.clone()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe(self):
        """This process's ``peer_memory`` probe (pid, a word's address, its token)."""
        from daskwg.sync import peer_memory

        return peer_memory.local_probe()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send(self, name: str, bucket_bytes: int, delta: bool = False, same_host: bool = True) -> dict:
        """Send this rank's shards; the report, the shard digest, the bytes its sockets
        sent meanwhile and how far its peak RSS rose."""
        state = self.model.state_dict()
        sent = egress_bytes()
        report, growth = rss_peak_growth(
            lambda: sync.send_shards(
                state,
                name,
                senders=self.world_size,
                bucket_bytes=bucket_bytes,
                delta=delta,
                same_host=same_host,
            )
        )
        return {
            **vars(report),
            "egress": egress_bytes() - sent,
            "rss_growth": growth,
            "digest": sync.shard_digest(state, self.rank),
        }


class Rollout(Worker):
    """A rollout rank: a full ``make_model`` with its weights zeroed until a sync fills them."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init(self, width: int, layers: int) -> None:
        torch.set_num_threads(1)
        self.model = make_model(width, layers)
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def forget(self, name: str) -> None:
        sync.forget(name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def move_weights(self) -> None:
        """Give every parameter new, zeroed memory: a sync must fill the new memory."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = torch.zeros_like(p.data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive(self, name: str, senders: int, same_host: bool = True, drop: str | None = None) -> dict:
        """Take a sync into this rank's model (``drop``: a name left out of the parameters
        handed to it, which the trainer sends)."""
        params = self.model.state_dict()
        if drop is not None:
            del params[drop]
        report, growth = rss_peak_growth(
            lambda: sync.receive_shards(params, name, senders=senders, same_host=same_host)
        )
        digest = hashlib.sha256()
        for key, value in params.items():
            digest.update(key.encode())
            digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return {
            **vars(report),
            "rss_growth": growth,
            "digests": sync.assembled_digests(params, name),
            "full_digest": digest.hexdigest(),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self, value) -> tuple:
        """What arrived here for ``value``: its type name and, for each ``LocalShard``
        inside, its local shape and placements."""
        items = value.values() if isinstance(value, dict) else [value]
        return type(value).__name__, [(tuple(v.local.shape), repr(v.placements)) for v in items]
