"""The worker side: a Dask ``WorkerPlugin`` that hosts the ranks of worker groups.

One :class:`HostPlugin` lives in every Dask worker process (registered once per
cluster under the name ``"daskwg"``). It keeps the user's Worker instances (one per
group that has a rank on this worker), sets each rank's environment before its code
runs, and runs every call on one dedicated thread, in the order the driver issued
them.

Calls arrive on two paths, both carrying a per-driver sequence number for this
worker:

* a Dask task (``client.submit`` pinned to this worker) running :func:`run_call`,
  used for non-blocking calls and whenever an argument is a future;
* a request to the ``daskwg_call`` handler this plugin installs on the worker's
  comm server (how Dask actors are reached), used for blocking calls.

The :class:`_Sequencer` releases calls to the thread strictly by sequence number, so
the two paths cannot overtake each other, and Dask's last-in-first-out start of
near-simultaneous tasks cannot reorder collectives.

Where rank code runs: sync methods (and ``__init__``) on the host thread
(``daskwg-host_0``), which has a current asyncio event loop of its own; ``async def``
methods on the rank's own event loop (:class:`_RankLoop`), which keeps running between
calls in a thread of its own, so tasks and servers they start keep serving, as in a
Ray async actor. Neither is the process's main thread.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import dask.config
import torch.distributed as dist
from distributed.comm.addressing import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .. import serialization  # serialization also installs the tensor serializer in workers
from ..errors import GroupBrokenError, RankError
from ..metrics import CallMetrics, payload_nbytes
from ..wire import PLUGIN_NAME, Call, LazyArg
from . import rows
from .exceptions import _picklable_error, _runtime_hint, _safe_str, _with_message
from .rank_loop import _install_signal_shim, _rank_thread, _RankLoop, _task_stack
from .sequencer import _Sequencer

__all__ = ["HostPlugin"]

logger = logging.getLogger(__name__)


@dataclass
class _Hosted:
    instance: Any
    env: dict
    owner: str
    detached: bool
    group_name: str
    world_size: int
    skip_signal_handlers: bool = False
    check_process_group: bool = True
    rank_loop: _RankLoop | None = None

    def close_loop(self, wait: bool) -> None:
        if self.rank_loop is not None:
            self.rank_loop.close(wait)
            self.rank_loop = None


@dataclass(frozen=True)
class _ProcessGroupOwner:
    """The rank whose call initialised this process's torch.distributed default group."""

    group_id: str
    group_name: str
    rank: int
    world_size: int


class HostPlugin(WorkerPlugin):
    """Hosts worker-group ranks inside a Dask worker (a ``distributed.WorkerPlugin``).

    Registered by :class:`daskwg.WorkerGroup` with ``client.register_plugin``; the
    plugin is idempotent, so every group and every driver share the one instance per
    worker. It installs the comm handlers ``daskwg_call``, ``daskwg_skip``, ``daskwg_cancel``,
    ``daskwg_reserve_port``, ``daskwg_release``, ``daskwg_info``, ``daskwg_memory``,
    ``daskwg_progress`` and ``daskwg_status`` on the worker.
    """

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker) -> None:
        """Dask's plugin hook: start the host thread and install the comm handlers."""
        self.worker = worker
        self.address = worker.address
        self._hosted: dict[tuple[str, int], _Hosted] = {}
        self._hosted_lock = threading.Lock()
        self._host_loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="daskwg-host", initializer=self._init_host_thread
        )
        self._sequencer = _Sequencer(self._executor)
        self._pg_owner: _ProcessGroupOwner | None = None
        _allow_child_processes()
        self._reserved_ports: set[int] = set()
        self._current_env: dict | None = None
        self._applied_env_keys: set[str] = set()
        self._original_env: dict[str, str | None] = {}
        # What the host thread is doing, for daskwg_status (the driver's wg.status(),
        # deadline reports, the dashboard): calls waiting for their turn, the running one.
        self._queued: dict[tuple[str, int], tuple[Call, float]] = {}
        self._running: tuple[Call, float, int] | None = None
        # Unfinished calls by (driver session, seq), so that cancelling a call's future
        # (Future.cancel, client.cancel) reaches it; and the running ones cancelled.
        self._calls: dict[tuple[str, int], tuple[Call, ConcurrentFuture]] = {}
        self._cancelled_calls: set[tuple[str, int]] = set()
        self._last_error: dict[tuple[str, int], str] = {}
        self._metrics = CallMetrics()
        worker.handlers["daskwg_call"] = self._handle_call
        worker.handlers["daskwg_skip"] = self._handle_skip
        worker.handlers["daskwg_cancel"] = self._handle_cancel
        worker.handlers["daskwg_reserve_port"] = self._handle_reserve_port
        worker.handlers["daskwg_release"] = self._handle_release
        worker.handlers["daskwg_info"] = self._handle_info
        worker.handlers["daskwg_memory"] = self._handle_memory
        worker.handlers["daskwg_progress"] = self._handle_progress
        worker.handlers["daskwg_status"] = self._handle_status
        worker.handlers["daskwg_metrics"] = self._handle_metrics
        rows.install(worker)

    def teardown(self, worker) -> None:
        """Dask's plugin hook (worker closing): drop the hosted ranks, stop the thread."""
        with self._hosted_lock:
            hosted = list(self._hosted.values())
            self._hosted.clear()
        for h in hosted:
            h.close_loop(wait=False)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def cancel_call(self, call: Call, result: ConcurrentFuture) -> str:
        """Cancel ``call`` as Ray cancels an actor task: a call still waiting for its turn
        never runs (its place in the order is given up, later calls go on); a running
        ``async def`` method gets ``asyncio.CancelledError`` at its current ``await``; a
        running sync method cannot be interrupted (Python cannot stop a thread), so it
        runs to the end, the rank's next calls wait for it, and ``status()`` shows it
        as cancelled. Returns what happened: ``"skipped"``, ``"interrupted"``,
        ``"running"`` or ``"done"``."""
        if result.cancel():
            self._queued.pop((call.session, call.seq), None)
            logger.info(
                "cancelled call %d (%r) of group %r rank %d before it ran; later calls go on",
                call.seq,
                call.method,
                call.group_name,
                call.rank,
            )
            return "skipped"
        running = self._running
        if running is None or (running[0].session, running[0].seq) != (call.session, call.seq):
            return "done"
        self._cancelled_calls.add((call.session, call.seq))
        with self._hosted_lock:
            hosted = self._hosted.get((call.group_id, call.rank))
        rank_loop = hosted.rank_loop if hosted is not None else None
        task = rank_loop.current_task if rank_loop is not None else None
        if task is not None:
            rank_loop.loop.call_soon_threadsafe(task.cancel)
            logger.info(
                "cancelled the running async call %r of group %r rank %d: CancelledError at its current await",
                call.method,
                call.group_name,
                call.rank,
            )
            return "interrupted"
        logger.warning(
            "call %r of group %r rank %d was cancelled while running; a running sync method cannot be "
            "interrupted, so it runs to the end and the rank's next calls wait for it (see wg.status())",
            call.method,
            call.group_name,
            call.rank,
        )
        return "running"

    # ---- entry points ----------------------------------------------------------------

    def enqueue(self, call: Call, payload: Any, lazy_values: list | None = None) -> ConcurrentFuture:
        """Queue ``call`` for the host thread; returns a future of its result."""
        if call.worker_id is not None and call.worker_id != self.worker.id:
            # Meant for the process this one replaced: its sequence numbers count on
            # from the old process, so queuing it would wait forever, and its group's
            # ranks are gone. Refused before it takes a place in the order.
            failed: ConcurrentFuture = ConcurrentFuture()
            failed.set_exception(
                GroupBrokenError(
                    f"rank {call.rank} of group {call.group_name!r} was on an earlier process of the worker at "
                    f"{self.address}, which restarted; its ranks are gone: build a new group"
                )
            )
            return failed
        self._queued[(call.session, call.seq)] = (call, time.time())
        result = self._sequencer.submit(
            call.session, call.seq, lambda: self._execute_counted(call, payload, lazy_values)
        )
        if result.done():  # refused at once: it never takes a place in the order
            self._queued.pop((call.session, call.seq), None)
        else:
            key = (call.session, call.seq)
            self._calls[key] = (call, result)
            result.add_done_callback(lambda _: self._calls.pop(key, None))
        return result

    async def _handle_call(self, call: tuple, payload: dict) -> dict:
        """The direct path: run one call (``Call`` fields as a plain tuple, arguments
        packed by :func:`daskwg.serialization.pack`) and reply with its packed result."""
        call = Call(*call)
        try:
            args = serialization.unpack(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the worker cannot import
            # The call never reaches the host: give up its place in the order.
            self._sequencer.skip(call.session, call.seq)
            hint = (
                f"the arguments of {call.method!r} could not be unpickled on this worker: {exc}; the workers "
                "must be able to import every class and function sent to them (install its module there)"
            )
            error = RankError(
                call.rank, self.address, call.method, traceback.format_exc(), _with_message(exc, hint)
            )
            return {"status": "error", "exception": to_serialize(error)}
        cfut = self.enqueue(call, args)
        try:
            result = await asyncio.wrap_future(cfut)
        except asyncio.CancelledError:
            # This worker is closing (retired, restarted, scaled down, lost its
            # scheduler): the driver sees the connection close and reports the
            # worker lost, never a bare CancelledError.
            raise
        except BaseException as exc:  # noqa: BLE001
            return {"status": "error", "exception": to_serialize(_picklable_error(exc))}
        try:
            packed = serialization.pack(result)
        except Exception as exc:  # noqa: BLE001 - _check_picklable lets some through
            error = RankError(call.rank, self.address, call.method, traceback.format_exc(), exc)
            return {"status": "error", "exception": to_serialize(error)}
        return {"status": "OK", "result": packed}

    def _handle_cancel(self, session: str, seqs: list[int]) -> list[str]:
        """Cancel calls ``seqs`` of driver ``session`` (their futures were cancelled), as
        :meth:`cancel_call` says; a call not here yet is skipped. Returns per call
        ``"skipped"``, ``"interrupted"``, ``"running"`` or ``"done"``."""
        outcomes = []
        for seq in seqs:
            entry = self._calls.get((session, seq))
            if entry is None:
                self._sequencer.skip(session, seq)
                outcomes.append("skipped")
            else:
                outcomes.append(self.cancel_call(*entry))
        return outcomes

    def _handle_progress(self, session: str) -> int:
        """The sequence number of the last call of driver ``session`` that finished here
        (-1 if none): the driver polls it to learn when a call it stopped waiting for
        (a straggler of a failed call) has returned."""
        return self._sequencer.progress.get(session, -1)

    def _handle_skip(self, session: str, seqs: list[int]) -> None:
        for seq in seqs:
            self._sequencer.skip(session, seq)

    def _handle_reserve_port(self, port: int | None = None) -> int:
        return self._reserve_port(port)

    def _handle_release(self, client: str) -> int:
        """Destroy the non-detached ranks owned by ``client`` (a driver that left)."""
        with self._hosted_lock:
            keys = [k for k, h in self._hosted.items() if h.owner == client and not h.detached]
            for key in keys:
                hosted = self._hosted.pop(key)
                # This runs on the worker's event loop: ask the rank loops to stop, do not wait.
                hosted.close_loop(wait=False)
                port = hosted.env.get("MASTER_PORT")
                if key[1] == 0 and port is not None:
                    self._reserved_ports.discard(int(port))
        # On the host thread, so it waits for a call of those ranks still running there.
        for group_id in {gid for gid, _ in keys}:
            self._executor.submit(self._drop_process_group, group_id)
        self._sequencer.forget(client)
        for key in [k for k, (c, _) in self._queued.items() if c.session == client]:
            self._queued.pop(key, None)
        if keys:
            logger.info("released %d rank(s) of driver %s", len(keys), client)
            gc.collect()
        return len(keys)

    def _handle_memory(self) -> dict:
        """This worker's memory figures, for messages about a paused worker: ``memory``
        (process bytes), ``memory_limit`` (bytes or ``None``), ``pause`` (the fraction
        of ``memory_limit`` above which it pauses, or ``False``)."""
        manager = self.worker.memory_manager
        return {
            "memory": self.worker.monitor.get_process_memory(),
            "memory_limit": manager.memory_limit,
            "pause": manager.memory_pause_fraction,
        }

    def _handle_info(self) -> dict:
        with self._hosted_lock:
            return {
                "pid": os.getpid(),
                "worker_id": self.worker.id,
                "groups": sorted({(h.group_name, gid, rank) for (gid, rank), h in self._hosted.items()}),
            }

    def _handle_status(self) -> list[dict]:
        """One record per rank hosted here, and one per call queued for a rank.

        Each record: ``group`` (name), ``group_id``, ``rank``, ``state`` (``"idle"``,
        ``"running"`` or ``"queued"``), ``method`` (the running or queued call, else
        ``None``), ``seconds`` (since it started, or since it was queued), ``stack``
        (the host thread's Python stack while running, else ``None``), ``last_error``
        (the last failure of that rank here, else ``None``), ``session``, ``seq`` and
        ``cancelled`` (the running call's task was cancelled; a sync method runs on).
        """
        records = []
        running = self._running
        with self._hosted_lock:
            hosted = dict(self._hosted)
        now = time.time()
        for (group_id, rank), h in hosted.items():
            record = {
                "group": h.group_name,
                "group_id": group_id,
                "rank": rank,
                "state": "idle",
                "method": None,
                "seconds": None,
                "stack": None,
                "last_error": self._last_error.get((group_id, rank)),
                "session": None,
                "seq": None,
                "cancelled": False,
            }
            if running is not None and (running[0].group_id, running[0].rank) == (group_id, rank):
                call, since, ident = running
                frame = sys._current_frames().get(ident)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else None
                task = h.rank_loop.current_task if h.rank_loop is not None else None
                if task is not None:
                    # An async call: the host thread only waits; where the coroutine is matters.
                    stack = _task_stack(task) or stack
                record.update(
                    state="running",
                    method=call.method,
                    seconds=now - since,
                    stack=stack,
                    session=call.session,
                    seq=call.seq,
                    cancelled=(call.session, call.seq) in self._cancelled_calls,
                )
            records.append(record)
        for call, since in list(self._queued.values()):
            records.append(
                {
                    "group": call.group_name,
                    "group_id": call.group_id,
                    "rank": call.rank,
                    "state": "queued",
                    "method": call.method,
                    "seconds": now - since,
                    "stack": None,
                    "last_error": None,
                    "session": call.session,
                    "seq": call.seq,
                    "cancelled": False,
                }
            )
        return records

    def _handle_metrics(self) -> dict:
        """Counters of the calls hosted here (:meth:`daskwg.metrics.CallMetrics.snapshot`),
        for the scheduler's ``/metrics``."""
        return self._metrics.snapshot()

    # ---- the host thread ---------------------------------------------------------------

    def _init_host_thread(self) -> None:
        self._host_loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._host_loop)

    def _ensure_host_loop(self) -> None:
        # Sync rank code may call asyncio.get_event_loop() (verl's tool parsers and reward
        # managers do) and expects the same loop on every call. asyncio.run() inside a
        # method unsets the thread's loop when it ends, so it is put back before each call.
        if self._host_loop is None or self._host_loop.is_closed():
            self._host_loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._host_loop)

    def _execute_counted(self, call: Call, payload: Any, lazy_values: list | None) -> Any:
        t0 = time.perf_counter()
        ok = False
        try:
            result = self._execute(call, payload, lazy_values)
            ok = True
        finally:
            self._metrics.record_call(call.group_name, call.method, ok, time.perf_counter() - t0)
        if call.method not in ("__init__", "__del__"):
            self._metrics.record_bytes(call.group_name, "in", payload_nbytes((payload, lazy_values)))
            self._metrics.record_bytes(call.group_name, "out", payload_nbytes(result))
        return result

    def _execute(self, call: Call, payload: Any, lazy_values: list | None) -> Any:
        _bind_worker(self.worker)
        t0 = time.perf_counter()
        self._queued.pop((call.session, call.seq), None)
        self._running = (call, time.time(), threading.get_ident())
        try:
            if call.method == "__del__":
                return self._destroy(call)
            self._ensure_host_loop()
            if call.method == "__init__":
                return self._create(call, payload)
            return self._invoke(call, payload, lazy_values)
        except RankError as exc:
            self._last_error[(call.group_id, call.rank)] = f"{call.method}: {exc.exception!r}"
            raise
        except BaseException as exc:  # noqa: BLE001
            self._last_error[(call.group_id, call.rank)] = (
                f"{call.method}: {type(exc).__name__}: {_safe_str(exc)}"
            )
            hint = _runtime_hint(exc)
            raise RankError(
                call.rank,
                self.address,
                call.method,
                traceback.format_exc(),
                _with_message(exc, hint) if hint else exc,
            ) from None
        finally:
            self._running = None
            _rank_thread.skip_signal_handlers = False
            logger.debug(
                "%s.%s rank %d (call %d) took %.3f s",
                call.group_name,
                call.method,
                call.rank,
                call.seq,
                time.perf_counter() - t0,
            )

    def _apply_env(self, env: dict) -> None:
        # Groups sharing this process each see their own rank environment: it is put
        # in place before every call (calls run one at a time on this thread).
        # Keys another group's env set and this one lacks (its worker_env) go back to
        # the process's own value, so no group sees another group's variables.
        if env is self._current_env:
            return
        for key in self._applied_env_keys - env.keys():
            original = self._original_env.get(key)
            if original is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = original
        for key in env.keys() - self._original_env.keys():
            self._original_env[key] = os.environ.get(key)
        os.environ.update(env)
        self._applied_env_keys = set(env)
        self._current_env = env

    def _create(self, call: Call, payload: dict) -> dict:
        key = (call.group_id, call.rank)
        with self._hosted_lock:
            if key in self._hosted:
                raise GroupBrokenError(f"rank {call.rank} of group {call.group_name!r} already exists here")
        env = dict(payload["env"])
        skip_signals = bool(payload.get("skip_signal_handlers", False))
        self._check_process_group(call, payload["world_size"], payload.get("check_process_group", True))
        self._current_env = None
        self._apply_env(env)
        if skip_signals:
            _install_signal_shim()
        _rank_thread.skip_signal_handlers = skip_signals
        cls_with_init = payload["cls"]
        try:
            instance = cls_with_init()
        finally:
            self._note_process_group(call, payload["world_size"])
        with self._hosted_lock:
            self._hosted[key] = _Hosted(
                instance=instance,
                env=env,
                owner=call.owner,
                detached=payload["detached"],
                group_name=call.group_name,
                world_size=payload["world_size"],
                skip_signal_handlers=skip_signals,
                check_process_group=bool(payload.get("check_process_group", True)),
            )
        return {"pid": os.getpid(), "worker_id": self.worker.id, "host": get_address_host(self.address)}

    def _destroy(self, call: Call) -> bool:
        with self._hosted_lock:
            hosted = self._hosted.get((call.group_id, call.rank))
            if hosted is None:
                return False
            # Only the owner (or a driver attached to a detached group, which calls as
            # the owner) may tear a group down.
            if hosted.owner != call.owner:
                raise PermissionError(
                    f"group {call.group_name!r} belongs to another driver; attach to it by name"
                )
            self._hosted.pop((call.group_id, call.rank))
        self._last_error.pop((call.group_id, call.rank), None)
        port = hosted.env.get("MASTER_PORT")
        if port is not None and call.rank == 0:
            self._reserved_ports.discard(int(port))
        hosted.close_loop(wait=True)
        del hosted
        self._drop_process_group(call.group_id)
        gc.collect()
        return True

    def _lookup(self, call: Call) -> _Hosted:
        with self._hosted_lock:
            hosted = self._hosted.get((call.group_id, call.rank))
        if hosted is None:
            raise GroupBrokenError(
                f"rank {call.rank} of group {call.group_name!r} is not hosted on {self.address}: "
                "the group was shut down, its driver left, or this worker restarted"
            )
        if hosted.owner != call.owner:
            raise PermissionError(
                f"group {call.group_name!r} belongs to another driver; attach to it by name"
            )
        return hosted

    def _invoke(self, call: Call, payload: tuple, lazy_values: list | None) -> Any:
        hosted = self._lookup(call)
        args, kwargs = payload
        if lazy_values is not None:
            args, kwargs = self._resolve_inputs(call, args, kwargs, lazy_values)
        self._check_process_group(call, hosted.world_size, hosted.check_process_group)
        self._apply_env(hosted.env)
        _rank_thread.skip_signal_handlers = hosted.skip_signal_handlers
        try:
            method = getattr(hosted.instance, call.method)
        except AttributeError:
            raise AttributeError(f"{type(hosted.instance).__name__} has no method {call.method!r}") from None
        try:
            result = method(*args, **kwargs)
            if inspect.isawaitable(result):
                if hosted.rank_loop is None:
                    hosted.rank_loop = _RankLoop(
                        f"daskwg-rank-{call.group_name}-r{call.rank}", hosted.skip_signal_handlers
                    )
                result = hosted.rank_loop.run(result)
        finally:
            self._note_process_group(call, hosted.world_size)
        return _snapshot(result, call, (payload[0], payload[1], args, kwargs))

    # ---- torch.distributed's one default process group per process ---------------------

    def _check_process_group(self, call: Call, world_size: int, enabled: bool) -> None:
        """Refuse a call whose group would silently use another group's default process
        group: torch allows one per process, groups on overlapping workers share
        processes, and a collective over the wrong group waits until it times out."""
        if not enabled or not (dist.is_available() and dist.is_initialized()):
            return
        owner = self._pg_owner
        if owner is not None and owner.group_id == call.group_id:
            return  # the group's own (whatever layout it chose)
        pg_rank, pg_size = dist.get_rank(), dist.get_world_size()
        if (pg_rank, pg_size) == (call.rank, world_size):
            return  # same layout: the group's collectives line up with it
        if owner is None:
            whose = "was initialised outside any worker-group call"
            fix = "destroy it there first"
        else:
            with self._hosted_lock:
                alive = any(gid == owner.group_id for gid, _ in self._hosted)
            whose = (
                f"belongs to rank {owner.rank} of group {owner.group_name!r} (world size {owner.world_size})"
                + ("" if alive else ", which was shut down without destroy_process_group()")
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

    def _drop_process_group(self, group_id: str) -> None:
        """Destroy the default process group that ranks of ``group_id`` initialised here,
        once the last of them is gone, as the end of a Ray actor's process takes its
        process group with it (verl's workers never destroy theirs). A group still hosted
        here with the same layout (which may be using it) inherits it instead. Runs on the
        host thread, so no call of this process is inside a collective; bounded by
        ``daskwg.shutdown-timeout``."""
        owner = self._pg_owner
        if owner is None or owner.group_id != group_id or not (dist.is_available() and dist.is_initialized()):
            return
        layout = (dist.get_rank(), dist.get_world_size())
        with self._hosted_lock:
            if any(gid == group_id for gid, _ in self._hosted):
                return
            heirs = [(key, h) for key, h in self._hosted.items() if (key[1], h.world_size) == layout]
        if heirs:
            (gid, rank), heir = heirs[0]
            self._pg_owner = _ProcessGroupOwner(gid, heir.group_name, rank, heir.world_size)
            return
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
        timeout = float(dask.config.get("daskwg.shutdown-timeout", 10))
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
        self._pg_owner = None
        logger.info(
            "destroyed the default process group of shut-down group %r (rank %d of %d) on %s",
            owner.group_name,
            owner.rank,
            owner.world_size,
            self.address,
        )

    def _note_process_group(self, call: Call, world_size: int) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            self._pg_owner = None
        elif self._pg_owner is None:
            self._pg_owner = _ProcessGroupOwner(call.group_id, call.group_name, call.rank, world_size)

    def _resolve_inputs(self, call: Call, args: tuple, kwargs: dict, lazy_values: list) -> tuple:
        """Build ``DataProtoFuture`` arguments from their parts; a failure here (parts
        that do not concatenate, say) is the producing call's, and is blamed on it."""
        current = None
        try:
            resolved_args = []
            for a in args:
                current = a
                resolved_args.append(_resolve(a, lazy_values, self.worker))
            resolved_kwargs = {}
            for k, v in kwargs.items():
                current = v
                resolved_kwargs[k] = _resolve(v, lazy_values, self.worker)
        except Exception as exc:  # noqa: BLE001
            source = getattr(current, "source", "") or "an earlier call"
            raise RankError(
                call.rank,
                self.address,
                f"{source}, whose output could not be built as the input of {call.method!r}",
                traceback.format_exc(),
                exc,
            ) from None
        return tuple(resolved_args), resolved_kwargs

    def _reserve_port(self, port: int | None) -> int:
        host = get_address_host(self.address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if port and port in self._reserved_ports:
            # Reserved ports are not bound until init_process_group, so bind() below
            # would not see that another group already has this one.
            raise OSError(f"MASTER_PORT {port} is already used by another worker group on {host}")
        for _ in range(64):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port or 0))
                except OSError as exc:
                    if port:
                        raise OSError(
                            f"MASTER_PORT {port} is already in use on {host}: {exc.strerror}"
                        ) from None
                    raise
                chosen = sock.getsockname()[1]
            if port or chosen not in self._reserved_ports:
                self._reserved_ports.add(chosen)
                return chosen
        raise OSError(f"could not find a free port on {host}")


def _bind_worker(worker: Any) -> None:
    """Let rank code call ``distributed.get_worker()`` as any Dask task can.

    Dask binds the worker to a task's thread through a context variable while the task
    runs; the host thread is not one of Dask's task threads, so bind it here. Every
    call and every coroutine on the rank's event loop then sees the hosting worker.
    """
    from distributed import worker as dask_worker

    cvar = getattr(dask_worker, "_worker_cvar", None)
    if cvar is not None and cvar.get(None) is not worker:
        cvar.set(worker)


def _resolve(value: Any, lazy_values: list, worker: Any) -> Any:
    if isinstance(value, LazyArg):
        values = lazy_values[value.index]
        if len(values) == 1:
            # A part produced on this worker arrives as the very object Dask keeps for
            # its future: a method that changes its argument in place would change the
            # future's value for every later reader. Several parts are concatenated,
            # which copies them anyway.
            only = values[0]
            values = [
                serialization.loads(only, copy=True)
                if isinstance(only, serialization.Packed)
                else copy.deepcopy(only)
            ]
        else:
            values = [serialization.loads(v) if isinstance(v, serialization.Packed) else v for v in values]
        with rows.fetching_on(worker):
            return value.transform(values)
    return value


def _snapshot(result: Any, call: Call, arguments: tuple) -> Any:
    """The result as it is at return time (:func:`daskwg.serialization.snapshot`), or
    a clear error now rather than inside Dask's comm layer later."""
    try:
        # Held by _invoke's local and this argument; the call's argument containers
        # are alive but change nothing.
        return serialization.snapshot(result, held=2, arguments=arguments)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"{call.group_name}.{call.method} on rank {call.rank} returned a "
            f"{type(result).__module__}.{type(result).__qualname__}, which cannot be serialised "
            f"({type(exc).__name__}: {exc}); return tensors, numpy arrays, DataProto or plain data"
        ) from None


def _allow_child_processes() -> None:
    """Let rank code start child processes when the worker's own configuration says
    ``distributed.worker.daemon: False`` but its nanny lives in another process that
    does not (``daskwg.local_cluster()`` passes the setting in the workers' config)."""
    process = multiprocessing.current_process()
    if process.daemon and dask.config.get("distributed.worker.daemon", default=True) is False:
        # The flag is what multiprocessing checks in this process before starting a child.
        process._config["daemon"] = False
