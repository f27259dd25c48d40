"""Workers of tests/test_wide_batches.py (imported by reference in the worker processes)."""

from __future__ import annotations

import torch

from daskwg import DataProto, Dispatch, Worker, register


class WideWorker(Worker):
    """Echoes wide batches and changes them in place, blocking and not."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_later(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def bump_one(self, data: DataProto) -> DataProto:
        """Adds the rank + 1 in place to the column ``k010``."""
        data.batch["k010"] += self.rank + 1
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def checksums(self, data: DataProto) -> DataProto:
        """One float64 row per input row: the sum over every column of that row."""
        total = torch.zeros(len(data), dtype=torch.float64)
        for value in data.batch.values():
            total += value.reshape(len(data), -1).to(torch.float64).sum(dim=1)
        return DataProto.from_dict({"sum": total})
