"""torch.distributed allows one default process group per process; the groups hosted
in one worker process share it. :class:`ProcessGroups` knows which hosted rank's call
initialised it, refuses calls that would use another group's by mistake, and destroys
it with the last rank of its group (as the end of a Ray actor's process would)."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .. import collective
from ..wire.messages import Call

__all__ = ["ProcessGroups", "ProcessGroupOwner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessGroupOwner:
    """The rank whose call initialised this process's torch.distributed default group."""

    group_id: str
    group_name: str
    rank: int
    world_size: int


class ProcessGroups:
    """The owner of this process's default process group, as the host thread sees it.

    Args:
        address: this worker's address (for messages).
        is_hosted: ``group_id -> bool``, whether a rank of that group is still hosted here.
    """

    def __init__(self, address: str, is_hosted: Callable[[str], bool]):
        self.address = address
        self._is_hosted = is_hosted
        self.owner: ProcessGroupOwner | None = None

    def check(self, call: Call, world_size: int, enabled: bool) -> None:
        """Refuse a call whose group would silently use another group's default process
        group: torch allows one per process, groups on overlapping workers share
        processes, and a collective over the wrong group waits until it times out.

        Raises:
            RuntimeError: naming both groups and what to do.
        """
        if not enabled or not (dist.is_available() and dist.is_initialized()):
            return
        owner = self.owner
        if owner is not None and owner.group_id == call.group_id:
            return  # the group's own (whatever layout it chose)
        pg_rank, pg_size = dist.get_rank(), dist.get_world_size()
        if (pg_rank, pg_size) == (call.rank, world_size):
            return  # same layout: the group's collectives line up with it
        if owner is None:
            whose = "was initialised outside any worker-group call"
            fix = "destroy it there first"
        else:
            whose = (
                f"belongs to rank {owner.rank} of group {owner.group_name!r} (world size {owner.world_size})"
                + (
                    ""
                    if self._is_hosted(owner.group_id)
                    else ", which was shut down without destroy_process_group()"
                )
            )
            fix = f"call torch.distributed.destroy_process_group() in group {owner.group_name!r} first"
        raise RuntimeError(
            f"rank {call.rank} of group {call.group_name!r} (world size {world_size}) cannot run "
            f"{call.method!r} on {self.address}: this process's torch.distributed default process group "
            f"{whose} and puts this process at rank {pg_rank} of {pg_size}. torch allows one default "
            f"process group per process, so a collective of {call.group_name!r} here would wait on the "
            f"other group's ranks until it times out. To use both groups: {fix}, put them on separate "
            "workers, or colocate their roles in one group (create_colocated_worker_cls). A group that "
            "never uses torch.distributed can be built with daskwg.check-process-group: False"
        )

    def note(self, call: Call, world_size: int) -> None:
        """After ``call`` ran: its group owns the default process group if it initialised it."""
        if not (dist.is_available() and dist.is_initialized()):
            self.owner = None
        elif self.owner is None:
            self.owner = ProcessGroupOwner(call.group_id, call.group_name, call.rank, world_size)

    def drop(self, group_id: str, hosted: Mapping[tuple[str, int], Any], timeout: float) -> None:
        """Destroy the default process group that ranks of ``group_id`` initialised here,
        once the last of them is gone, as the end of a Ray actor's process takes its
        process group with it (verl's workers never destroy theirs). A group still hosted
        here with the same layout (which may be using it) inherits it instead. Runs on the
        host thread, so no call of this process is inside a collective; bounded by
        ``timeout`` seconds (``daskwg.shutdown-timeout``).

        Args:
            hosted: the ranks hosted here now, ``(group_id, rank) -> HostedRank``.
        """
        collective.forget_group(group_id)  # the collectives its ranks here joined
        owner = self.owner
        if owner is None or owner.group_id != group_id or not (dist.is_available() and dist.is_initialized()):
            return
        layout = (dist.get_rank(), dist.get_world_size())
        if any(gid == group_id for gid, _ in hosted):
            return
        heirs = [(key, h) for key, h in hosted.items() if (key[1], h.world_size) == layout]
        if heirs:
            (gid, rank), heir = heirs[0]
            self.owner = ProcessGroupOwner(gid, heir.group_name, rank, heir.world_size)
            return
        self._destroy(owner, timeout)

    def backend_of(self, group_id: str) -> str | None:
        """The backend of the default process group ranks of ``group_id`` initialised here
        (``"gloo"``, ``"nccl"``, ...), else ``None``."""
        owner = self.owner
        if owner is None or owner.group_id != group_id or not (dist.is_available() and dist.is_initialized()):
            return None
        return str(dist.get_backend())

    def init_again(self, call: Call, world_size: int, backend: str, timeout: float) -> None:
        """Initialise the default process group again for ``call``'s rank after a membership
        change (``backend`` as before; the rendezvous from the environment now in place),
        waiting up to ``timeout`` seconds for the other ranks. On the host thread.

        Raises:
            RuntimeError, TimeoutError: torch's, when the rendezvous fails or times out.
        """
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        self.note(call, world_size)

    def leave(self, group_id: str, timeout: float) -> None:
        """Destroy the default process group that ranks of ``group_id`` initialised here,
        whatever else is hosted: the group's membership changed (``wg.heal()``,
        ``wg.resize()``), so a new ``init_process_group`` must be possible. Bounded by
        ``timeout`` seconds. On the host thread."""
        owner = self.owner
        if owner is None or owner.group_id != group_id or not (dist.is_available() and dist.is_initialized()):
            return
        self._destroy(owner, timeout)

    def _destroy(self, owner: ProcessGroupOwner, timeout: float) -> None:
        done = threading.Event()
        failure: list[BaseException] = []

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except BaseException as exc:  # noqa: BLE001
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=destroy, name="daskwg-destroy-process-group", daemon=True).start()
        if not done.wait(timeout):
            logger.warning(
                "destroying the process group of shut-down group %r (rank %d of %d) on %s did not "
                "finish within %.0f s (daskwg.shutdown-timeout); it stays initialised in this process",
                owner.group_name,
                owner.rank,
                owner.world_size,
                self.address,
                timeout,
            )
            return
        if failure:
            logger.warning(
                "destroying the process group of shut-down group %r on %s failed: %r",
                owner.group_name,
                self.address,
                failure[0],
            )
            return
        self.owner = None
        logger.info(
            "destroyed the default process group of shut-down group %r (rank %d of %d) on %s",
            owner.group_name,
            owner.rank,
            owner.world_size,
            self.address,
        )
