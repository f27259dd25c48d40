"""The groups' records on the scheduler (Dask's metadata under ``"daskwg-groups"``): what
``WorkerGroup.attach`` reads to reattach a detached group by name, what the name check
of a new group reads, and what the dashboard page lists.

Names are scoped as Dask scopes a client's futures: a non-detached group's name belongs to
the client that built it (its record lives under ``"<name>/<client id>"``), so two driver
scripts on one cluster can each build a group named ``"actor"``; a detached group's name
holds on the whole cluster (its record lives under ``"<name>"``), since any client may
attach to it. A group name never holds a ``/`` (checked when the group is built), so the
two kinds of key cannot meet. A departed client's non-detached records are dropped by the
scheduler (:func:`drop_client`, from ``daskwg.scheduler.release``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distributed import Client

__all__ = [
    "GroupRecord",
    "ROOT",
    "key_of",
    "publish",
    "lookup",
    "forget",
    "check_name_free",
    "drop_client",
]

#: The metadata key under which every group's record lives (``[ROOT, key]``, see :func:`key_of`).
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
        name: the group's name (its metadata key also holds the owner when it is not
            detached; ``""`` in records of earlier versions, whose key is the name).
    """

    group_id: str
    owner: str
    detached: bool
    workers: list[str]
    server_ids: list[str]
    cls: bytes
    master_addr: str
    master_port: int
    name: str = ""


def key_of(name: str, owner: str | None = None) -> list[str]:
    """The metadata key of group ``name``: cluster-wide (a detached group) when ``owner``
    is ``None``, else scoped to client ``owner`` (a non-detached group)."""
    return [ROOT, name if owner is None else f"{name}/{owner}"]


def _key(record: GroupRecord, name: str) -> list[str]:
    return key_of(name, None if record.detached else record.owner)


def publish(client: Client, name: str, record: GroupRecord) -> list[str]:
    """Store ``record`` as group ``name``'s (replacing an earlier one); returns its key."""
    key = _key(record, name)
    client.set_metadata(key, {**asdict(record), "name": name})
    return key


def lookup(client: Client, name: str, any_client: bool = False) -> GroupRecord | None:
    """The record of the group ``name`` that ``client`` sees: its own non-detached group
    of that name, else the detached one; ``None`` if neither exists.

    ``any_client``: else the one non-detached group of that name any client owns, as a Ray
    named actor is found from any task of its job (verl's ``from_detached`` runs in remote
    tasks, whose Dask client is the worker's).

    Raises:
        ValueError: with ``any_client``, several clients own a group of that name.
    """
    for key in (key_of(name, client.id), key_of(name)):
        stored = client.get_metadata(key, default=None)
        if stored:
            return GroupRecord(**stored)
    if not any_client:
        return None
    groups = client.get_metadata([ROOT], default=None) or {}
    found = [r for k, r in groups.items() if r and k.startswith(f"{name}/")]
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} drivers each have a group named {name!r} (clients "
            f"{sorted(r['owner'] for r in found)}); attach from the driver that built it, or give "
            "the groups names of their own"
        )
    return GroupRecord(**found[0]) if found else None


def forget(client: Client, key: list[str]) -> None:
    """Forget the record under ``key`` (:func:`key_of`; best effort: the scheduler may be gone)."""
    try:
        client.set_metadata(key, None)
    except Exception:  # noqa: BLE001 - the scheduler may be gone already
        pass


def check_name_free(client: Client, name: str, owner: str, detached: bool) -> None:
    """Refuse a new group named like one that lives on where the new one's name would
    hold: a detached group of that name (its name holds on the whole cluster), a group of
    that name built by client ``owner``, and, for a new detached group, a group of that
    name of any client still connected. A record left by a driver that exited without
    ``shutdown()`` is stale and does not count.

    Raises:
        ValueError: the name is taken, saying by what.
    """
    holder = client.run_on_scheduler(_holder_of, name=name, owner=owner, detached=detached)
    if holder is None:
        return
    if detached:
        advice = "pick another name, or shut that group down first"
    else:
        advice = "pick another name, shut it down, or WorkerGroup.attach() to it if it is detached"
    raise ValueError(f"a worker group named {name!r} already exists ({holder}); {advice}")


def _holder_of(dask_scheduler: Any, name: str, owner: str, detached: bool) -> str | None:
    """What holds ``name`` where a new group of client ``owner`` would (see
    :func:`check_name_free`), or ``None`` (runs on the scheduler, in one go)."""
    groups = dask_scheduler.get_metadata([ROOT], default=None) or {}
    for key, record in list(groups.items()):
        if not isinstance(record, dict) or (record.get("name") or key) != name:
            continue
        if record.get("detached"):
            return "a detached group: its name holds on the whole cluster"
        if record.get("owner") == owner:
            return "built by this client"
        if detached and record.get("owner") in dask_scheduler.clients:
            return (
                f"built by client {record.get('owner')}, still connected: a detached group's name holds on the "
                "whole cluster"
            )
    return None


def drop_client(groups: Any, client: str) -> list[str]:
    """Drop from ``groups`` (the scheduler's metadata under :data:`ROOT`) the records of
    the non-detached groups of ``client``, a client that left (its ranks are released);
    returns their keys."""
    if not isinstance(groups, dict):
        return []
    keys = [
        key
        for key, record in groups.items()
        if isinstance(record, dict) and record.get("owner") == client and not record.get("detached")
    ]
    for key in keys:
        del groups[key]
    return keys
