"""What a removed worker means, in words, and futures that fail with daskwg's typed errors.

The scheduler announces a worker's removal on the worker's event topic with a stimulus
id (``handle-worker-cleanup-…``, ``retire-workers-…``), preceded, when the worker closed
itself, by a ``closing-worker`` event naming why (``client-restart-workers-…``). A worker
whose process died says nothing; its Nanny logs the exit code. :func:`removal_reason`
turns these into the sentence a :class:`~daskwg.errors.WorkerLostError` carries.

:func:`fail_futures` gives a task-path future that can never finish (pinned to a worker
that is gone, or given up on a paused worker) its typed error, so that ``future.result()``
raises ``WorkerLostError`` / ``WorkerPausedError`` instead of Dask's
``FutureCancelledError``.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Sequence
from typing import Any

from distributed import Client, Future

__all__ = ["removal_reason", "needs_exit_detail", "exit_detail", "fail_futures"]

#: Seconds the driver waits for a Nanny to say how its worker process ended (it logs
#: the death when it notices it, which on a loaded machine comes after the scheduler's
#: removal event): asked again every ``_EXIT_DETAIL_POLL`` seconds until then.
EXIT_DETAIL_TIMEOUT = 2.0
_EXIT_DETAIL_POLL = 0.1

_DEATH = re.compile(
    r"Worker process (\d+) (was killed by signal (\d+)|was killed by unknown signal|exited with status (\d+))"
)


#: A worker's own reason for closing (its ``closing-worker`` event), first match wins.
_CLOSING = (
    ("client-restart-workers", "it was restarted (client.restart_workers or wg.restart())"),
    ("client-restart", "it was restarted with every worker (client.restart())"),
    ("nanny-close", "its Nanny closed it (the cluster was scaled down, or the Nanny was stopped)"),
    ("nanny-instantiate", "its Nanny replaced it"),
    ("worker-handle-scheduler-connection-broken", "it lost its connection to the scheduler and closed"),
    ("scheduler-close", "the scheduler closed it (the scheduler is shutting down)"),
    ("scheduler-remove-worker", "the scheduler closed it"),
    ("worker-close", "it was closed (Worker.close)"),
)


def needs_exit_detail(msg: dict, closing: str | None) -> bool:
    """Whether a removal (``msg``, the scheduler's ``remove-worker`` event) came without the
    worker saying why, so that its Nanny may know how the process ended."""
    return closing is None and str(msg.get("stimulus_id", "")).startswith("handle-worker-cleanup")


def removal_reason(msg: dict, closing: str | None, detail: str | None = None) -> str:
    """Why a worker left, in words.

    Args:
        msg: the scheduler's ``remove-worker`` event.
        closing: the reason of the worker's own ``closing-worker`` event before it
            (``None``: it closed without one, e.g. its process died).
        detail: how the process ended, from its Nanny (:func:`exit_detail`), if known.

    Returns:
        e.g. ``"its process was killed by signal 9 (SIGKILL)"``, ``"it was retired
        (client.retire_workers, or the cluster scaled down)"``.
    """
    stimulus = str(msg.get("stimulus_id", ""))
    if stimulus.startswith("retire-workers"):
        return "it was retired (client.retire_workers, or the cluster scaled down)"
    if closing is not None:
        for prefix, words in _CLOSING:
            if closing.startswith(prefix):
                return words
        return f"it closed ({closing.rsplit('-', 1)[0] if closing[-1:].isdigit() else closing})"
    if stimulus.startswith("handle-worker-cleanup"):
        if detail:
            return f"its process {detail}"
        return "its process exited or was killed, or its connection to the scheduler dropped"
    if stimulus.startswith("check-worker-ttl"):
        return (
            "it did not answer the scheduler within distributed.scheduler.worker-ttl (a frozen or stopped "
            "process, or a network cut)"
        )
    return f"the scheduler removed it ({stimulus.rsplit('-', 1)[0] if stimulus else 'no reason given'})"


async def exit_detail(rpc: Any, pid: int | None, timeout: float = EXIT_DETAIL_TIMEOUT) -> str | None:
    """How worker process ``pid`` ended, as its Nanny logged it (``rpc``: the Nanny's):
    ``"was killed by signal 9 (SIGKILL)"``, ``"exited with status 1"``; ``None`` if the
    Nanny does not say within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            logs = await asyncio.wait_for(rpc.get_logs(n=50), max(remaining, 0.05))
        except Exception:  # noqa: BLE001 - no Nanny, or one that is gone: the reason stays general
            return None
        detail = _death_in(logs, pid)
        if detail is not None or time.monotonic() + _EXIT_DETAIL_POLL >= deadline:
            return detail
        await asyncio.sleep(_EXIT_DETAIL_POLL)


def _death_in(logs: Any, pid: int | None) -> str | None:
    """The death of process ``pid`` in a Nanny's log lines (newest first), in words."""
    for _, line in logs:
        match = _DEATH.search(str(line))
        if match is None or (pid is not None and int(match.group(1)) != pid):
            continue
        if match.group(3) is not None:
            number = int(match.group(3))
            try:
                name = f" ({signal.Signals(number).name})"
            except ValueError:
                name = ""
            return f"was killed by signal {number}{name}"
        return match.group(2)
    return None


async def fail_futures(client: Client, futures: Sequence[Future], errors: Sequence[BaseException]) -> None:
    """Let go of ``futures`` on the scheduler and make each raise its error here.

    ``Client._cancel`` drops a future's state from the client before it cancels it, so no
    later scheduler message reaches that state; setting its error afterwards makes
    ``future.result()``, ``future.exception()`` and ``client.gather`` raise ``errors[i]``
    (a daskwg error) instead of ``FutureCancelledError``.
    """
    futures = list(futures)
    if not futures:
        return
    await client._cancel(futures, reason="daskwg", msg=f"{type(errors[0]).__name__}: {errors[0]}")
    for future, error in zip(futures, errors):
        future._state.set_error(error, None)
