"""The groups' records on the scheduler (Dask's metadata under ``"daskwg-groups"``): what
``WorkerGroup.attach`` reads to reattach a detached group by name, what the name check
of a new group reads, and what the dashboard page lists."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distributed import Client

__all__ = ["GroupRecord", "ROOT", "key_of", "publish", "lookup", "forget", "check_name_free"]

#: The metadata key under which every group's record lives (``[ROOT, name]``).
ROOT = "daskwg-groups"


@dataclass(frozen=True)
class GroupRecord:
    """One group as the scheduler remembers it.

    Attributes:
        group_id: the group's unique id.
        owner: the client id that owns its ranks.
        detached: whether it outlives its driver.
        workers: worker address per rank.
        server_ids: worker process id per rank (a restarted worker has a new one).
        cls: the rank class, cloudpickled (bytes).
        master_addr: ``MASTER_ADDR`` of its ranks.
        master_port: ``MASTER_PORT`` of its ranks.
    """

    group_id: str
    owner: str
    detached: bool
    workers: list[str]
    server_ids: list[str]
    cls: bytes
    master_addr: str
    master_port: int


def key_of(name: str) -> list[str]:
    """The metadata key of group ``name``."""
    return [ROOT, name]


def publish(client: Client, name: str, record: GroupRecord) -> None:
    """Store ``record`` as group ``name``'s (replacing an earlier one)."""
    client.set_metadata(key_of(name), asdict(record))


def lookup(client: Client, name: str) -> GroupRecord | None:
    """Group ``name``'s record, or ``None``."""
    stored = client.get_metadata(key_of(name), default=None)
    return GroupRecord(**stored) if stored else None


def forget(client: Client, name: str) -> None:
    """Forget group ``name``'s record (best effort: the scheduler may be gone)."""
    try:
        client.set_metadata(key_of(name), None)
    except Exception:  # noqa: BLE001 - the scheduler may be gone already
        pass


def check_name_free(client: Client, name: str, owner: str) -> None:
    """Refuse a new group named like one that lives on: a detached one, one of this
    driver, or one whose driver is still connected (a record left by a driver that
    exited without ``shutdown()`` is stale).

    Raises:
        ValueError: the name is taken.
    """
    record = lookup(client, name)
    if record is None:
        return
    taken = record.detached or record.owner == owner
    if not taken:
        taken = record.owner in client.run_on_scheduler(_connected_clients)
    if taken:
        raise ValueError(
            f"a worker group named {name!r} already exists on this cluster; "
            "pick another name, shut it down, or WorkerGroup.attach() to it"
        )


def _connected_clients(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.clients)
