"""daskwg's settings, in Dask's configuration under the ``daskwg`` namespace.

Defaults live in ``daskwg.yaml`` beside this module; override them like any Dask
setting (``dask.config.set({"daskwg.poll-interval": 0.5})``, a YAML file in
``~/.config/dask/``, or ``DASK_DASKWG__POLL_INTERVAL=0.5``).

Code reads them through :class:`Settings`, one record taken when a call is sent or
waited on and passed down its path, so a ``with dask.config.set(...)`` block around a
call applies to all of that call, and no lookup hides deep in a call path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import dask.config
import yaml

__all__ = ["Settings"]

_path = os.path.join(os.path.dirname(__file__), "daskwg.yaml")
with open(_path) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


# The Settings of the last daskwg config read, by its (key, value) pairs: Settings.current()
# runs several times per call, and building one costs ~10 us.
_LAST: dict[tuple, Settings] = {}


@dataclass(frozen=True)
class Settings:
    """The ``daskwg.*`` settings at one moment (see ``daskwg.yaml`` for each one's meaning).

    Attributes:
        poll_interval: seconds between the driver's checks for lost workers while it waits.
        rank_failure_grace: seconds the other ranks of a failed call get to finish.
        paused_warning: seconds on a paused worker before the driver warns.
        paused_timeout: seconds a task-path call waits on a paused worker before
            ``WorkerPausedError``.
        call_timeout: the default deadline of every call and wait in seconds (``None``: none).
        status_timeout: seconds a worker gets to answer a status request.
        shutdown_timeout: seconds ``shutdown()`` waits for ranks to destroy their objects.
        restart_timeout: seconds ``wg.restart()`` waits for the restarted worker processes.
        max_queued_calls: unfinished task-path calls per worker before the next one waits.
        scatter_above: argument bytes above which a task-path call's arguments go straight
            to the rank's worker.
        inline_results: bytes up to which a non-blocking call's result also comes back
            with its reply (it stays on the worker too); never one holding tensors or arrays,
            except a step plan's outputs.
        relay_above: bytes above which a result several ranks of one call take whole is
            relayed between them (results of unknown size are).
        relay_wait: seconds a relaying rank waits for its next consumer to ask.
        shared_memory: a result that ranks on other workers of its worker's host take whole
            is mapped by them from one shared-memory copy rather than sent to each; the
            large buffers of calls and replies between the driver and workers of its host
            go through shared-memory files (``daskwg.wire.memfiles``; read when a call stream
            opens: a driver thread's first call to a worker, kept for the client's life).
        skip_signal_handlers: groups built now let rank code skip SIGTERM/SIGINT handlers.
        check_process_group: groups built now refuse a rank whose process holds another
            group's default process group.
        heartbeat_interval: seconds between the keepalive probes of the driver's
            connection to each worker of its groups (groups built now).
        heartbeat_timeout: seconds without an answer to them before the worker is taken
            as lost (groups built now).
        fan_out: how a group call reaches a host's ranks: ``"direct"`` (one message per
            rank), ``"host"`` (one per host, through its leader) or ``"auto"`` (through the
            leader from ``daskwg.transport.leader.AUTO_RANKS`` ranks of a host on).
    """

    poll_interval: float
    rank_failure_grace: float
    paused_warning: float
    paused_timeout: float
    call_timeout: float | None
    status_timeout: float
    shutdown_timeout: float
    restart_timeout: float
    max_queued_calls: int
    scatter_above: int
    inline_results: int
    relay_above: int
    relay_wait: float
    shared_memory: bool
    skip_signal_handlers: bool
    check_process_group: bool
    heartbeat_interval: float
    heartbeat_timeout: float
    fan_out: str = "direct"

    @classmethod
    def current(cls) -> Settings:
        """The settings in force in this thread now (``dask.config.set`` blocks included)."""
        # Keys set through the environment (DASK_DASKWG__SHUTDOWN_TIMEOUT) may arrive spelt
        # with underscores; dask.config.get accepts both spellings, so does this.
        raw = dask.config.get("daskwg")
        try:
            # Nested sections (the dashboard's) are not settings of calls: not in the key.
            state = tuple(item for item in raw.items() if type(item[1]) is not dict)
            cached = _LAST.get(state)
        except TypeError:  # an unhashable value: read it afresh
            state, cached = None, None
        if cached is not None:
            return cached
        settings = cls._read({key.replace("_", "-"): value for key, value in raw.items()})
        if state is not None:
            _LAST.clear()  # the last state only: a config changes rarely, and few states recur
            _LAST[state] = settings
        return settings

    @classmethod
    def _read(cls, config: dict) -> Settings:
        timeout = config.get("call-timeout")
        return cls(
            poll_interval=float(config["poll-interval"]),
            rank_failure_grace=float(config["rank-failure-grace"]),
            paused_warning=float(config["paused-warning"]),
            paused_timeout=float(config["paused-timeout"]),
            call_timeout=None if timeout is None else float(timeout),
            status_timeout=float(config["status-timeout"]),
            shutdown_timeout=float(config["shutdown-timeout"]),
            # A key a user's own copy of the defaults may lack.
            restart_timeout=float(config.get("restart-timeout", 120.0)),
            max_queued_calls=int(config["max-queued-calls"]),
            scatter_above=int(config["scatter-above"]),
            inline_results=int(config["inline-results"]),
            relay_above=int(config["relay-above"]),
            relay_wait=float(config["relay-wait"]),
            shared_memory=bool(config["shared-memory"]),
            skip_signal_handlers=bool(config["skip-signal-handlers"]),
            check_process_group=bool(config["check-process-group"]),
            heartbeat_interval=float(config["heartbeat-interval"]),
            heartbeat_timeout=float(config["heartbeat-timeout"]),
            fan_out=_fan_out(config.get("fan-out", "direct")),
        )


def _fan_out(value: object) -> str:
    """``daskwg.fan-out``, checked.

    Raises:
        ValueError: not one of ``direct``, ``host``, ``auto``.
    """
    if value not in ("direct", "host", "auto"):
        raise ValueError(f"daskwg.fan-out is {value!r}: set it to 'direct', 'host' or 'auto'")
    return str(value)
