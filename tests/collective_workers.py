"""Rank code of the cross-group collective tests (``test_collective.py``)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from daskwg import Dispatch, Worker, collective, register


class Member(Worker):
    """A rank that has its group's own default process group and joins collectives."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_own_group(self) -> float:
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def exchange(self, name: str, own_group: bool = True) -> dict:
        """All-reduce, broadcast and all-gather on collective ``name``, then (``own_group``:
        when every rank of the group takes part) an all-reduce on the group's own default group."""
        me = collective.get_rank(name)
        summed = collective.allreduce(torch.tensor([float(me + 1)]), name)
        sent = torch.arange(4.0) * 10 if me == 0 else torch.zeros(4)
        collective.broadcast(sent, 0, name)
        gathered = collective.allgather(torch.tensor([float(me)]), name)
        collective.barrier(name)
        own = torch.ones(1)
        if own_group:
            dist.all_reduce(own)
        return {
            "rank": me,
            "size": collective.get_collective_group_size(name),
            "sum": summed.item(),
            "broadcast": sent.tolist(),
            "gathered": [t.item() for t in gathered],
            "own": own.item(),
            "torch_api": _torch_api(name),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def big_broadcast(self, name: str, src: int, elements: int) -> bool:
        """A tensor large enough to go along the chain of members, from collective rank ``src``."""
        me = collective.get_rank(name)
        t = torch.arange(elements, dtype=torch.float32) if me == src else torch.zeros(elements)
        collective.broadcast(t, src, name)
        return bool(torch.equal(t, torch.arange(elements, dtype=torch.float32)))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def strided(self, name: str) -> tuple:
        """All-reduce and broadcast of non-contiguous views (a column of a matrix)."""
        me = collective.get_rank(name)
        summed = torch.ones(4, 2)[:, 0]
        collective.allreduce(summed, name)
        sent = (torch.arange(8.0).reshape(4, 2) if me == 0 else torch.zeros(4, 2))[:, 0]
        collective.broadcast(sent, 0, name)
        return summed.tolist(), sent.tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sized_broadcast(self, name: str, elements: int) -> None:
        collective.broadcast(torch.ones(elements), 0, name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def is_member(self, name: str) -> bool:
        try:
            collective.get_rank(name)
        except ValueError:
            return False
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def broadcast_weights(self, name: str, die_rank: int, nbytes: int) -> float:
        """Broadcast ``nbytes`` from collective rank 0; collective rank ``die_rank`` exits
        its process instead (a member killed mid-broadcast)."""
        me = collective.get_rank(name)
        if me == die_rank:
            time.sleep(0.5)
            os._exit(1)
        weights = torch.ones(nbytes // 4) if me == 0 else torch.zeros(nbytes // 4)
        collective.broadcast(weights, 0, name)
        return weights.sum().item()

    # ---- weight sync through the data plane (no collective) --------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def get_weights(self) -> dict:
        """A replicated state dict: the same on every trainer rank."""
        return {"w": torch.arange(8.0), "b": torch.ones(2)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def get_shard(self) -> dict:
        """This rank's shard of ``w`` (rows ``4*rank..4*rank+3``), as FSDP holds it."""
        return {"w": torch.arange(8.0)[4 * self.rank : 4 * self.rank + 4]}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def big_weights(self, version: float, nbytes: int) -> dict:
        """A state dict of ``nbytes`` (two tensors of different sizes), all ``version``."""
        first = nbytes * 3 // 8 // 4
        return {"a": torch.full((first,), version), "b": torch.full((nbytes // 4 - first,), version)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def keep_weights(self, weights: dict, version: float) -> dict:
        """Check and keep ``weights`` (dropping the last ones), then change them in place:
        returns whether every element was ``version`` and where the tensors' memory is."""
        ok = all(bool((t == version).all()) for t in weights.values())
        self.kept = weights
        for t in weights.values():
            t.add_(100.0)  # must reach no other rank
        return {"ok": ok, "memory": sorted(t.data_ptr() for t in weights.values())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold_weights(self, weights: dict, version: float) -> bool:
        """Keep ``weights`` unchanged (dropping the last ones held); whether every element
        was ``version``."""
        self.held = weights
        return self.held_ok(version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held_ok(self, version: float) -> bool:
        """Whether the weights held are still all ``version``."""
        return all(bool((t == version).all()) for t in self.held.values())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tcp_sent(self) -> int:
        from plane_workers import tcp_bytes_sent

        return tcp_bytes_sent()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, weights) -> dict:
        """What arrived: a state dict, or a list of shards joined here."""
        if isinstance(weights, list):
            return {"shards": len(weights), "w": torch.cat([s["w"] for s in weights]).tolist()}
        return {k: v.tolist() for k, v in weights.items()}


def _torch_api(name: str) -> float:
    """torch.distributed's own functions take the collective's group too."""
    t = torch.ones(1)
    dist.all_reduce(t, group=collective.get_group(name))
    return t.item()
