"""Which error a failed call raises when a worker of its group was lost: the root cause.

When a rank's process dies (SIGKILL, an OOM kill, a node going), its peers in a
collective fail at once ("Connection reset by peer", gloo's "Read error", a collective's
timeout), usually a few tenths of a second before the scheduler has removed the dead
worker: the first error the driver sees is then a survivor's ``RankError``, which sends
the user after the wrong rank. :func:`find_lost_rank` decides between them.

It is asked only when a call failed with an error that looks like a peer's failure
(:func:`looks_like_peer_failure`: an error inside ``torch.distributed``, a reset or closed
connection, a timeout) or while a worker of the group is already taken as lost. It looks
at the driver's lost marks (the scheduler's remove-worker events, the heartbeat, dropped
call streams), and opens a TCP connection to every other worker of the group once: a
worker whose port refuses the connection, or resets it before the first byte of Dask's
handshake, has no live process there any more. Where every
worker accepts, the answer is known within one connection (milliseconds on a LAN) and
the survivor's error stands. Where one refuses, the driver waits, at most
:data:`ROOT_CAUSE_WAIT` seconds, for the scheduler's word on why (so the error says "its
process was killed by signal 9"), then takes the worker as lost itself. A worker whose
host does not answer within the probe's timeout is left to the heartbeat
(``daskwg.heartbeat-timeout``): nothing here waits longer than :data:`ROOT_CAUSE_WAIT`.

:func:`with_survivors` makes the lost rank's ``WorkerLostError`` carry the survivors'
errors (``.survivor_errors``, and the first of them as ``__context__``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from distributed.comm.addressing import parse_address, parse_host_port

from ...errors import RankError, WorkerLostError

__all__ = ["ROOT_CAUSE_WAIT", "looks_like_peer_failure", "find_lost_rank", "with_survivors"]

#: The most seconds a failed call waits to learn whether a worker of its group was lost.
ROOT_CAUSE_WAIT = 2.0

#: Seconds a connection to a worker's port gets: a dead process's port refuses at once.
_PROBE_TIMEOUT = 1.0

#: How a peer's failure shows in a survivor's error (its type, message or traceback).
_PEER = re.compile(
    r"connection (?:reset|closed|refused|aborted)|broken pipe|by peer|read error|write error"
    r"|timed? ?out|timeout|socket|gloo|nccl|DistBackendError|DistNetworkError|distributed_c10d",
    re.IGNORECASE,
)


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (a rank's error, a timeout) may be the echo of another rank's
    failure: an error raised inside ``torch.distributed``, a reset or closed connection,
    a timeout."""
    if isinstance(exc, TimeoutError):
        return True
    if isinstance(exc, RankError):
        text = f"{exc.exception_type}\n{exc.message}\n{exc.remote_traceback}"
    else:
        text = f"{type(exc).__name__}\n{exc}"
    return bool(_PEER.search(text))


async def _probe(address: str) -> str:
    """``"refused"`` (no process listens there, or the one that did closed the connection
    unanswered: a process being torn down), ``"answers"`` or ``"unknown"`` (a host or
    worker that does not answer in time, or an address that is not TCP).

    A TCP connection alone does not tell: the kernel completes it from the listening
    socket's backlog while a killed process's sockets are still being closed, and its
    peers' collectives may already have failed by then. Over ``tcp://`` the probe
    therefore waits for the first byte of the worker's Dask handshake, which a live
    worker writes as soon as it accepts (``distributed.comm.core.Listener.on_connection``);
    a dying one's listening socket resets the connection instead. Over ``tls://`` the
    client speaks first, so the connection alone is taken as the answer.
    """
    writer = None
    try:
        scheme, location = parse_address(address)
        if scheme not in ("tcp", "tls"):
            return "unknown"
        host, port = parse_host_port(location)
        end = time.monotonic() + _PROBE_TIMEOUT
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _PROBE_TIMEOUT)
        if scheme == "tcp":
            first = await asyncio.wait_for(reader.read(1), max(end - time.monotonic(), 0.0))
            if not first:
                return "refused"
    except (ConnectionRefusedError, ConnectionResetError):
        return "refused"
    except (OSError, asyncio.TimeoutError, ValueError):
        return "unknown"
    finally:
        if writer is not None:
            writer.close()
    return "answers"


async def find_lost_rank(
    failures: Any, errors: Sequence[BaseException], wait: float = ROOT_CAUSE_WAIT, poll: float = 0.02
) -> int | None:
    """The rank of ``failures``' group whose worker was lost around a failed call, or
    ``None`` if none was.

    Args:
        failures: the group's :class:`~daskwg.transport.failure.state.FailureState`.
        errors: the errors the call's ranks raised so far.
        wait: the most seconds to wait for a refusing worker's removal (0: look once,
            without probing).
        poll: seconds between looks at the driver's lost marks.

    Returns:
        the lost rank (its worker is then marked lost on the driver and the group broken
        with its ``WorkerLostError``), or ``None``.

    Runs on any event loop (the client's or a calling thread's own).
    """
    ranks = failures.ranks
    for exc in errors:
        if isinstance(exc, WorkerLostError) and 0 <= exc.rank < len(ranks.slots):
            return exc.rank
    lost = [r for r in range(len(ranks.slots)) if ranks.is_lost(r)]
    if lost or wait <= 0 or not any(looks_like_peer_failure(e) for e in errors):
        return lost[0] if lost else None
    # The ranks that raised answered the driver after the collective failed: alive.
    raised = {e.rank for e in errors if isinstance(e, RankError)}
    candidates = [r for r in range(len(ranks.slots)) if r not in raised]
    addresses = {ranks.address(r) for r in candidates}
    probes = {a: asyncio.ensure_future(_probe(a)) for a in addresses}
    deadline = time.monotonic() + wait
    try:
        while True:
            lost = [r for r in range(len(ranks.slots)) if ranks.is_lost(r)]
            if lost:
                return lost[0]
            refused = [
                r
                for r in candidates
                if probes[ranks.address(r)].done() and probes[ranks.address(r)].result() == "refused"
            ]
            if not refused and all(p.done() for p in probes.values()):
                return None  # every worker of the group has a process listening
            if time.monotonic() >= deadline:
                if not refused:
                    return None
                # No word from the scheduler yet: the refusing port is evidence enough.
                rank = refused[0]
                slot = ranks.slots[rank]
                reason = ranks.driver.lost.setdefault(
                    slot.server_id,
                    "its process is gone: its port refused the driver's connection (or closed it unanswered) after "
                    "its peers failed",
                )
                failures.worker_lost(slot.address, reason)
                return rank
            await asyncio.sleep(poll)
    finally:
        for probe in probes.values():
            probe.cancel()


def with_survivors(lost: BaseException, errors: Sequence[BaseException]) -> BaseException:
    """``lost`` (the lost rank's ``WorkerLostError``) carrying the other ranks' ``errors``:
    as ``.survivor_errors`` and, the first of them, as ``__context__``."""
    survivors = [e for e in errors if not isinstance(e, WorkerLostError)]
    if isinstance(lost, WorkerLostError):
        lost.survivor_errors = list(survivors)
    if survivors and lost.__context__ is None:
        lost.__context__ = survivors[0]
    return lost
