"""Worker classes for the long-lived-rank tests (event loops, child processes, memory,
process groups, signals); a module of its own so worker processes import them by reference."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from daskwg import DataProto, Dispatch, Worker, register


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(await reader.read(100))
    await writer.drain()
    writer.close()


class ActorWorker(Worker):
    """Code that assumes an actor runtime: event loops, servers, background tasks."""

    def __init__(self):
        super().__init__()
        self.ticks = 0
        self.log: list[int] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def loop_id(self) -> int:
        loop = asyncio.get_event_loop()
        loop.run_until_complete(asyncio.sleep(0))
        return id(loop)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def run_asyncio(self) -> int:
        return asyncio.run(asyncio.sleep(0, result=7))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def start(self) -> int:
        self.server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        self.ticker = asyncio.create_task(self._tick())
        return self.server.sockets[0].getsockname()[1]

    async def _tick(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.01)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_ticks(self) -> int:
        return self.ticks

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def running_loop_id(self) -> int:
        return id(asyncio.get_running_loop())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def append_later(self, i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        self.log.append(i)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def append_later_async(self, i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        self.log.append(i)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_log(self) -> list[int]:
        return list(self.log)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def dataloader_sum(self) -> int:
        loader = DataLoader(list(range(8)), batch_size=4, num_workers=2)
        return int(sum(batch.sum() for batch in loader))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def child_exit_code(self) -> int:
        child = multiprocessing.Process(target=os.getpid)
        child.start()
        child.join(60)
        return child.exitcode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wait_for_file(self, path: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


class StateWorker(Worker):
    """Holds ``mib`` MiB of state from its constructor on, as a model would."""

    def __init__(self, mib: int):
        super().__init__()
        self.state = torch.ones(mib * 2**20, dtype=torch.uint8)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state_mib(self) -> int:
        return self.state.numel() // 2**20

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def state_mib_async(self) -> int:
        return self.state.numel() // 2**20

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_one_async(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] + 1})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def numel_async(self, values: list) -> int:
        return len(values)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def grow(self, mib: int) -> int:
        self.more = torch.ones(mib * 2**20, dtype=torch.uint8)
        time.sleep(30)  # the nanny's memory monitor acts meanwhile
        return mib


class ProcessGroupWorker(Worker):
    """verl's way into torch.distributed: initialise unless already initialised."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self) -> list[int]:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return [dist.get_rank(), dist.get_world_size()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ones(self) -> list[float]:
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy_process_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, x: int) -> int:
        return x


class SignalWorker(Worker):
    """An engine constructor that registers SIGTERM/SIGINT handlers (SGLang does)."""

    def __init__(self):
        super().__init__()
        self.previous = signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, lambda *_: None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def previous_is_kept(self) -> bool:
        return signal.getsignal(signal.SIGTERM) is self.previous

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def install_sigusr1(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: None)
