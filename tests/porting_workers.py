"""Worker classes for the porting-fidelity tests (issue 13); a module of its own so worker
processes can import them by reference."""

from __future__ import annotations

import threading

import distributed
import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from daskwg import DataProto, Dispatch, Worker, register
from daskwg.protocol import all_gather_data_proto


class PortedWorker(Worker):
    """Methods shaped like the verl code that broke when ported."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag_rank(self, data: DataProto) -> DataProto:
        data.meta_info["gen_rank"] = self.rank
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_rank_async(self, data: DataProto) -> DataProto:
        data.meta_info["gen_rank"] = self.rank
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def count_rows(self, data: DataProto) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def tag_metrics(self, data: DataProto) -> DataProto:
        data.meta_info["metrics"] = {"gen_rank": self.rank}
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate(self, data: DataProto) -> DataProto:
        """Each rank pads ``responses`` to its own longest response: width 3 + 2 * rank."""
        return DataProto.from_dict({"responses": torch.zeros(len(data), 3 + 2 * self.rank)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_async(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"responses": torch.zeros(len(data), 3 + 2 * self.rank)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        """A numeric non-tensor field of width 3 + 2 * rank."""
        return DataProto.from_dict(non_tensors={"scores": np.zeros((len(data), 3 + 2 * self.rank))})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_td(self, data: TensorDict) -> TensorDict:
        rows = data.batch_size[0]
        return TensorDict({"responses": torch.zeros(rows, 3 + 2 * self.rank)}, batch_size=[rows])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self, lock=None) -> str:
        return "pong"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def make_lock(self):
        return threading.Lock()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hosting_worker(self) -> str:
        return distributed.get_worker().address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def hosting_worker_async(self) -> str:
        return distributed.get_worker().address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self) -> bool:
        dist.init_process_group(backend="gloo")
        return dist.is_initialized()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_gather_rows(self) -> tuple[list[int], list[str]]:
        """Each rank holds ``[r, r]``; all_gather_data_proto gives every rank all rows."""
        data = DataProto.from_dict(
            {"a": torch.tensor([self.rank, self.rank])}, {"tag": [f"r{self.rank}"] * 2}
        )
        all_gather_data_proto(data, None)
        return data.batch["a"].tolist(), data.non_tensor_batch["tag"].tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
