"""What the ranks are doing, read from their workers: ``wg.status()`` and the verdict of
a :class:`daskwg.CallTimeoutError`.

Every worker's host plugin answers ``daskwg_status`` (see ``daskwg.plugin.HostPlugin``) with
one record per hosted rank and per queued call, the running one with its thread's
Python stack. A worker that does not answer within ``daskwg.status-timeout`` seconds is
"unresponsive" (a stopped or frozen process: its event loop cannot run); one the
scheduler removed, or that refuses connections, is "lost".
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...wire.messages import Handler, client_of

__all__ = [
    "query_status",
    "rank_record",
    "call_states",
    "innermost_frame",
    "verdict",
    "running_on",
    "describe_running",
]

UNRESPONSIVE = "unresponsive"
LOST = "lost"

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


async def query_status(rpc: Callable[[str], Any], addresses: Iterable[str], timeout: float) -> dict:
    """Ask every worker in ``addresses`` for its ``daskwg_status`` records, at once.

    Args:
        rpc: ``address -> rpc`` (a Dask ``ConnectionPool`` or ``client.rpc``).
        timeout: seconds each worker gets to answer.

    Returns:
        ``{address: [record, ...] | "unresponsive" | "lost"}``.
    """

    async def one(address: str) -> Any:
        try:
            return await asyncio.wait_for(getattr(rpc(address), Handler.STATUS)(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return UNRESPONSIVE
        except Exception:  # noqa: BLE001 - refused or closed: the process is gone
            return LOST

    addresses = list(dict.fromkeys(addresses))
    answers = await asyncio.gather(*(one(a) for a in addresses))
    return dict(zip(addresses, answers))


def innermost_frame(stack: str | None) -> str:
    """``"func (pkg/module.py:line)"`` of the innermost frame of a formatted stack, or ``""``."""
    frames = _FRAME.findall(stack or "")
    if not frames:
        return ""
    path, line, func = frames[-1]
    tail = "/".join(path.replace("\\", "/").split("/")[-3:])
    return f"{func} ({tail}:{line})"


def rank_record(rank: int, address: str, group_id: str, answer: Any, me: str | None = None) -> dict:
    """One ``wg.status()`` entry for ``rank`` from its worker's ``answer`` (``me``: the
    asking driver's client id, so that a call it waits behind is named as its own or
    another driver's).

    Returns:
        ``{"rank", "address", "state", "method", "seconds", "stack", "last_error",
        "queued", "cancelled", "concurrency_group", "concurrent"}``: ``state`` is
        ``"running"``, ``"queued"`` (a call for it waits on the worker; ``method`` is the
        first one), ``"idle"``, ``"unresponsive"`` or ``"lost"`` (also when the worker no
        longer hosts the rank); ``queued`` counts its waiting calls; ``cancelled`` says the
        running call's future was cancelled (a sync method cannot be interrupted and runs
        on); ``concurrency_group`` is the running call's (``None``: the default group, which
        comes first); ``concurrent`` lists the calls of other concurrency groups running
        beside it, each ``{"method", "concurrency_group", "seconds", "stack"}``; a
        ``"queued"`` rank also has ``behind``, the call that holds the worker (its method,
        group, driver, and whether that driver left).
    """
    record = {
        "rank": rank,
        "address": address,
        "state": answer if isinstance(answer, str) else "lost",
        "method": None,
        "seconds": None,
        "stack": None,
        "last_error": None,
        "queued": 0,
        "cancelled": False,
        "concurrency_group": None,
        "concurrent": [],
    }
    if isinstance(answer, str):
        return record
    mine = [r for r in answer if r.get("group_id") == group_id and r.get("rank") == rank]
    hosted = [r for r in mine if r["state"] != "queued"]
    queued = sorted((r for r in mine if r["state"] == "queued"), key=lambda r: r.get("seq") or 0)
    record["queued"] = len(queued)
    if hosted:
        keys = ("state", "method", "seconds", "stack", "last_error", "concurrency_group")
        record.update({k: hosted[0].get(k) for k in keys})
        record["cancelled"] = bool(hosted[0].get("cancelled", False))
        record["concurrent"] = [
            {k: r.get(k) for k in ("method", "concurrency_group", "seconds", "stack")}
            for r in hosted[1:]
            if r["state"] == "running"
        ]
    if record["state"] in ("idle", "lost") and queued:
        record.update(state="queued", method=queued[0]["method"], seconds=queued[0]["seconds"])
        blocker = running_on(answer, queued[0].get("concurrency_group"))
        if blocker is not None:
            record["behind"] = describe_running(blocker, me)
    return record


def running_on(answer: Sequence[dict], concurrency_group: str | None = None) -> dict | None:
    """The call of ``concurrency_group`` running on the worker, whichever driver sent it
    (calls of one group queue behind it, never behind another group's), from the worker's
    ``daskwg_status`` ``answer``; ``None`` if none runs."""
    return next(
        (
            r
            for r in answer
            if r.get("state") == "running" and r.get("concurrency_group") == concurrency_group
        ),
        None,
    )


def describe_running(record: dict, me: str | None = None) -> str:
    """The running call of a status ``record`` as a report names it: its method, group,
    the driver that sent it (``me``: the reporting driver's client id; ``None``: name the
    client) and for how long, e.g. ``"'nap' of group 'actor' of another driver
    client Client-1d88... (running 3.6 s)"``; a call whose driver left says so, and that it runs
    to its end (a sync method cannot be interrupted)."""
    seconds = record.get("seconds") or 0.0
    call = f"{record.get('method')!r} of group {record.get('group')!r}"
    client = record.get("client")
    if record.get("departed"):
        return (
            f"{call} of a driver that left, client {client} (running {seconds:.1f} s): its ranks were released, "
            "but a running sync method cannot be interrupted, so the worker runs it to its end and the calls "
            "behind it start then (restart that worker to end it now)"
        )
    if client is None:
        return f"{call} (running {seconds:.1f} s)"
    who = "this driver" if client == me else f"another driver, client {client}"
    return f"{call} of {who} (running {seconds:.1f} s)"


def call_states(
    calls: Sequence[Any], addresses: dict[int, str], done: set[int], answers: dict
) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """Where each rank of one call stands.

    Args:
        calls: the call's ``plugin.Call`` records (one per rank).
        addresses: rank → worker address.
        done: ranks whose part the driver already has.
        answers: :func:`query_status`'s result.

    Returns:
        ``(ranks, stacks, notes)``: rank → state (``"done"``, ``"running"``,
        ``"queued"``, ``"unresponsive"``, ``"lost"``), rank → stack text of running
        ranks, rank → a short explanation for the message.
    """
    ranks: dict[int, str] = {}
    stacks: dict[int, str] = {}
    notes: dict[int, str] = {}
    for call in calls:
        rank = call.rank
        answer = answers.get(addresses[rank], LOST)
        if rank in done:
            ranks[rank] = "done"
            continue
        if isinstance(answer, str):
            ranks[rank] = answer
            continue
        mine = next(
            (r for r in answer if r.get("session") == call.session and r.get("seq") == call.seq),
            None,
        )
        if mine is not None and mine["state"] == "running":
            ranks[rank] = "running"
            if mine.get("stack"):
                stacks[rank] = mine["stack"]
                where = innermost_frame(mine["stack"])
                if where:
                    notes[rank] = f"in {where}"
            continue
        ranks[rank] = "queued"
        blocker = running_on(answer, getattr(call, "concurrency_group", None))
        if blocker is not None:
            notes[rank] = f"behind {describe_running(blocker, client_of(call.session))}"
        elif mine is None:
            notes[rank] = "not yet on its worker (waiting for its inputs, or a paused worker)"
    return ranks, stacks, notes


def verdict(
    group: str,
    method: str,
    waited: float,
    timeout: float,
    ranks: dict[int, str],
    notes: dict[int, str],
    addresses: dict[int, str],
) -> str:
    """The message of a ``CallTimeoutError``: a sentence per state, worst first, e.g.
    ``"rank 1 still running 'update_actor' after 30.0 s, in all_reduce (torch/...); rank 0 done"``."""
    parts = []
    for rank in sorted(ranks, key=lambda r: (_ORDER.get(ranks[r], 9), r)):
        state = ranks[rank]
        note = f", {notes[rank]}" if rank in notes else ""
        if state == "running":
            parts.append(f"rank {rank} still running {method!r} after {waited:.1f} s{note}")
        elif state == "queued":
            parts.append(f"rank {rank} queued{(' ' + notes[rank]) if rank in notes else ''}")
        elif state == "unresponsive":
            parts.append(
                f"rank {rank} unresponsive (its worker {addresses[rank]} did not answer a status request: "
                "a stopped or frozen process?)"
            )
        elif state == "lost":
            parts.append(f"rank {rank} lost (worker {addresses[rank]} is gone)")
        else:
            parts.append(f"rank {rank} done")
    if method == "__init__":
        # No group to call wg.status() on: it was never built.
        advice = (
            "The group is not built: each rank's __init__ runs to its end and the rank is then destroyed. "
            "If __init__ is slow rather than stuck (loading a model, a rendezvous), give it longer: a longer "
            "daskwg.deadline(s) around WorkerGroup(...), or the daskwg.call-timeout setting"
        )
    else:
        advice = (
            "The ranks keep running the call; wg.status() shows them, wg.restart() replaces their processes"
        )
    return f"{group}.{method} passed its deadline of {timeout:g} s: " + "; ".join(parts) + ". " + advice


_ORDER = {"running": 0, "unresponsive": 1, "lost": 2, "queued": 3, "done": 4}
