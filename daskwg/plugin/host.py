"""The worker side's Dask ``WorkerPlugin``: :class:`HostPlugin`, which hosts the ranks of
worker groups in every Dask worker process (registered once per cluster under the name
``"daskwg"``; every group and every driver share the one instance per worker).

It is a router and a life cycle: it installs the comm handlers (:class:`daskwg.wire.messages.Handler`),
builds and destroys :class:`~daskwg.plugin.rank.HostedRank` objects, and hands every call
to one dedicated thread, in the order the driver issued it. Calls arrive on two paths,
both carrying a per-driver sequence number for this worker:

* a message on a driver's call stream (``Handler.STREAM``, :mod:`daskwg.plugin.stream`):
  blocking and non-blocking calls (:mod:`daskwg.plugin.direct`) and step plans
  (:mod:`daskwg.plugin.planned`);
* a Dask task pinned to this worker running :func:`daskwg.plugin.task.run_call`, used
  whenever an argument is a Dask future (the task path).

The :class:`~daskwg.plugin.sequencer.Sequencer` releases calls to the thread strictly by
sequence number, so the two paths cannot overtake each other, and Dask's
last-in-first-out start of near-simultaneous tasks cannot reorder collectives.

Concurrency groups (``@register(concurrency_group=...)``, Ray's term): the calls of a
named group are numbered in an order of their own and run on a host thread of their own
(``daskwg-host-<group>_0``, started on the group's first call), so a ``"control"`` call
runs while a call of the default group is still running; its ``async def`` methods run on
the same rank event loop as the default group's, beside the running coroutine.

Threads: handlers run on the worker's event loop; calls run on the host thread
(``daskwg-host_0``, sync methods and ``__init__``; it has a current asyncio loop of its
own), on the host threads of named concurrency groups (each with its own current loop)
and on each rank's own event loop thread (``async def`` methods). The table of
hosted ranks and the table of queued calls are shared between them: each has a lock,
and both are only ever iterated over under it or as a copy taken under it.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask.config
from distributed import worker as dask_worker
from distributed.comm.addressing import get_address_host
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin

from ..config import Settings
from ..errors import CallCancelledError, GroupBrokenError, RankError, VersionMismatchError, safe_str
from ..serialization import registration  # noqa: F401  (tensors, DataProtos, Packed results: daskwg's frames and sizeof)
from ..wire import local_link
from ..wire import messages as wire
from ..wire.messages import PLUGIN_NAME, Call, Handler
from . import rows, stream
from .calls import CallTable, status_records
from .direct import DirectCalls
from .exceptions import earlier_process_error, rank_error
from .inputs import Inputs
from .interfaces import socket_ifname_env
from .leader import HostLeader
from .metrics import CallMetrics, payload_nbytes
from .planned import PlanRunner
from .ports import reserve_port
from .process_group import ProcessGroups
from .rank import HostedRank, ProcessEnv, apply_membership, snapshot, strip_padding
from .rank_loop import install_signal_shim, rank_thread
from .results import ResultStore
from .sequencer import Sequencer

__all__ = ["HostPlugin"]

logger = logging.getLogger(__name__)


class HostPlugin(WorkerPlugin):
    """Hosts worker-group ranks inside a Dask worker (a ``distributed.WorkerPlugin``).

    Registered by :func:`daskwg.groups.install.install_plugins` with ``client.register_plugin``;
    idempotent, so every group and every driver share the one instance per worker.
    """

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker) -> None:
        """Dask's plugin hook: start the host thread and install the comm handlers."""
        self.worker = worker
        self.address = worker.address
        self._hosted: dict[tuple[str, int], HostedRank] = {}
        self._hosted_lock = threading.Lock()
        # Each host thread's own current asyncio loop (see _ensure_host_loop).
        self._host_loops = threading.local()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="daskwg-host", initializer=self._init_host_thread
        )
        #: named concurrency group -> the one thread its calls run on (the default group's
        #: is ``_executor``); started on a group's first call, under ``_hosted_lock``.
        self._group_executors: dict[str, ThreadPoolExecutor] = {}
        self._sequencer = Sequencer(self._executor_for)
        self._process_groups = ProcessGroups(self.address, self._is_hosted)
        self._env = ProcessEnv()
        # Under every rank's own variables: worker_env and the process's environment win.
        self._socket_env = socket_ifname_env(get_address_host(self.address), os.environ)
        _allow_child_processes()
        _quiet_closing_heartbeat(worker)
        self._reserved_ports: set[int] = set()
        # What the host thread is doing, for daskwg_status (the driver's wg.status(),
        # deadline reports, the dashboard) and daskwg_cancel.
        self.calls = CallTable()
        self._last_error: dict[tuple[str, int], str] = {}
        self._metrics = CallMetrics()
        #: results of non-blocking calls, kept here under keys their driver owns.
        self.results = ResultStore(worker, self._sequencer.seen)
        #: the ``DataProtoFuture`` inputs of calls, fetched from other workers.
        self.inputs = Inputs(worker, self.results)
        self._plans = PlanRunner(self)
        self.direct = DirectCalls(self)
        #: the streams this worker hands a driver's calls on by, as its host's leader.
        self.leader = HostLeader(worker.id, worker.connection_args)
        self.results.install()
        handlers = {
            Handler.STREAM: self._handle_stream,
            Handler.SKIP: self._handle_skip,
            Handler.CANCEL: self._handle_cancel,
            Handler.RESERVE_PORT: self._handle_reserve_port,
            Handler.RELEASE: self._handle_release,
            Handler.MEMORY: self._handle_memory,
            Handler.PROGRESS: self._handle_progress,
            Handler.STATUS: self._handle_status,
            Handler.METRICS: self._handle_metrics,
        }
        worker.handlers.update(handlers)
        rows.install(worker, self.results.get)
        # Drivers of this host open their call streams on a Unix-domain socket.
        # Not on a TLS cluster: its streams stay on TLS, with its certificates.
        self._stop_listening = (
            local_link.listen(worker.id, self._handle_stream) if self.address.startswith("tcp://") else None
        )

    def teardown(self, worker) -> None:
        """Dask's plugin hook (worker closing): drop the hosted ranks, stop the thread."""
        with self._hosted_lock:
            hosted = list(self._hosted.values())
            self._hosted.clear()
        for h in hosted:
            h.close_loop(wait=False)
        self._env.release()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._hosted_lock:
            group_executors = list(self._group_executors.values())
        for executor in group_executors:
            executor.shutdown(wait=False, cancel_futures=True)
        self.inputs.shared.close()
        leader = getattr(self, "leader", None)
        if leader is not None:
            leader.close()
        stop_listening = getattr(self, "_stop_listening", None)
        if stop_listening is not None:
            stop_listening()
        if multiprocessing.current_process().name.startswith(_NANNY_CHILD):
            atexit.register(_end_process)  # the last registered runs first
            register_early = getattr(threading, "_register_atexit", None)
            if self.calls.running_calls() and register_early is not None:
                # A rank's call still runs (a thread cannot be interrupted): the interpreter
                # would join its host thread before any atexit handler (concurrent.futures
                # registers that join here), keeping the process until the call ends.
                register_early(_end_process)

    def hosted_ranks(self) -> list[tuple[str, str, int]]:
        """``(group name, group id, rank)`` of every rank hosted here, sorted."""
        with self._hosted_lock:
            return sorted((h.group_name, gid, rank) for (gid, rank), h in self._hosted.items())

    def _is_hosted(self, group_id: str) -> bool:
        with self._hosted_lock:
            return any(gid == group_id for gid, _ in self._hosted)

    # ---- entry points ----------------------------------------------------------------

    def enqueue(
        self, call: Call, payload: Any, lazy_values: list | None = None, *, boxed: bool = False
    ) -> ConcurrentFuture:
        """Queue ``call`` for the host thread; returns a future of its (snapshotted) result.

        Args:
            call: the call.
            payload: ``(args, kwargs)``, or a life-cycle call's raw payload.
            lazy_values: what stands for the call's ``LazyArg``\\ s (see ``daskwg.plugin.inputs``).
            boxed: ``payload`` is a one-item list holding the only reference to the
                arguments, which the host thread takes out: once the method returned they
                are gone, so a result that shares their tensors is snapshotted without a copy.
        """
        if call.worker_id is not None and call.worker_id != self.worker.id:
            # Meant for the process this one replaced: its sequence numbers count on
            # from the old process, so queuing it would wait forever, and its group's
            # ranks are gone. Refused before it takes a place in the order.
            failed: ConcurrentFuture = ConcurrentFuture()
            failed.set_exception(earlier_process_error(call, self.address))
            return failed
        self.calls.queue(call)
        box = payload if boxed else [payload]
        del payload
        result = self.take_turn(call, lambda: self.execute(call, box, lazy_values, boxed))
        if result.done():  # refused at once: it never takes a place in the order
            self.calls.dequeue(call)
        else:
            self.calls.track(call, result)
        return result

    def take_turn(self, call: Call, run: Callable[[], Any], span: int = 1) -> ConcurrentFuture:
        """Run ``run`` on the host thread of ``call``'s concurrency group once every earlier
        call of ``call.session`` here has run (:meth:`Sequencer.submit
        <daskwg.plugin.sequencer.Sequencer.submit>`); a call of a detached rank's outlives
        its driver's release.

        Args:
            call: gives the place, ``(call.session, call.seq)``, and the rank.
            run: what runs there (e.g. :meth:`execute` of the call).
            span: places it takes, from ``call.seq`` on (a step plan's calls run as one item).

        Returns:
            a future of what ``run`` returns; done at once if the place was refused (its
            driver left, or the number came twice).
        """
        with self._hosted_lock:
            hosted = self._hosted.get((call.group_id, call.rank))
        detached = hosted is not None and hosted.detached
        return self._sequencer.submit(call.session, call.seq, run, outlives=detached, span=span)

    def skip(self, call: Call) -> None:
        """Give up ``call``'s place in its driver's order here: it never runs (its arguments
        did not unpickle), and the calls after it need not wait for it."""
        self._sequencer.skip(call.session, call.seq)

    # ---- comm handlers ---------------------------------------------------------------

    async def _handle_stream(self, comm: Any, files: dict | None = None) -> Any:
        """A driver's call stream (:func:`daskwg.plugin.stream.serve`)."""
        return await stream.serve(
            comm,
            self.direct.start,
            self.results.free,
            self._plans.start,
            self.results.packed,
            files,
            self.leader,
        )

    def _handle_cancel(self, session: str, seqs: list[int]) -> list[str]:
        """Cancel calls ``seqs`` of driver ``session`` (their futures were cancelled), as
        :meth:`CallTable.cancel` says; a call not here yet is skipped. Returns per call
        ``"skipped"``, ``"interrupted"``, ``"running"`` or ``"done"``."""
        outcomes = []
        for seq in seqs:
            entry = self.calls.unfinished(session, seq)
            if entry is None:
                self._sequencer.cancel(session, seq)
                outcomes.append("skipped")
                continue
            call, result = entry
            with self._hosted_lock:
                hosted = self._hosted.get((call.group_id, call.rank))
            outcomes.append(self.calls.cancel(call, result, hosted.rank_loop if hosted is not None else None))
        return outcomes

    def _handle_progress(self, session: str) -> int:
        """The sequence number of the last call of driver ``session`` that finished here
        (-1 if none): the driver polls it to learn when a call it stopped waiting for
        (a straggler of a failed call) has returned."""
        return self._sequencer.progress.get(session, -1)

    def _handle_skip(self, session: str, seqs: list[int]) -> None:
        """Give up the places of calls ``seqs`` of driver ``session`` (they never come)."""
        for seq in seqs:
            self._sequencer.skip(session, seq)

    def _handle_reserve_port(self, port: int | None = None) -> int:
        """Reserve a ``MASTER_PORT`` on this host: ``port``, or a free one."""
        return reserve_port(self.address, self._reserved_ports, port)

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
        self.calls.forget_session(client)
        self.results.forget_session(client)
        if keys:
            logger.info("released %d rank(s) of driver %s", len(keys), client)
            gc.collect()
        return len(keys)

    def _handle_memory(self) -> dict:
        """This worker's memory figures, for messages about a paused worker: ``memory``
        (process bytes), ``memory_limit`` (bytes or ``None``), ``pause`` (the fraction
        of ``memory_limit`` above which it pauses, or ``False``)."""
        manager, monitor = self.worker.memory_manager, self.worker.monitor
        pause = manager.memory_pause_fraction
        return {"memory": monitor.get_process_memory(), "memory_limit": manager.memory_limit, "pause": pause}

    def _handle_status(self) -> list[dict]:
        """One :func:`~daskwg.wire.messages.status_record` per rank hosted here (``"idle"`` or
        ``"running"``, the running call with its stack) and one per call queued for a rank."""
        with self._hosted_lock:
            hosted = dict(self._hosted)
        return status_records(self.calls, hosted, self._last_error)

    def _handle_metrics(self) -> dict:
        """Counters of the calls hosted here (:meth:`daskwg.plugin.metrics.CallMetrics.snapshot`),
        for the scheduler's ``/metrics``."""
        return self._metrics.snapshot()

    # ---- the host thread ---------------------------------------------------------------

    def _executor_for(self, session: str) -> ThreadPoolExecutor:
        """The host thread the calls of ``session`` run on: the default group's, or the
        thread of the concurrency group the session numbers (started on its first call)."""
        group = wire.concurrency_group_of(session)
        if group is None:
            return self._executor
        with self._hosted_lock:
            executor = self._group_executors.get(group)
            if executor is None:
                executor = self._group_executors[group] = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=f"daskwg-host-{group}",
                    initializer=self._init_host_thread,
                )
            return executor

    def _init_host_thread(self) -> None:
        self._host_loops.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._host_loops.loop)

    def _ensure_host_loop(self) -> None:
        # Sync rank code may call asyncio.get_event_loop() (verl's tool parsers and reward
        # managers do) and expects the same loop on every call. asyncio.run() inside a
        # method unsets the thread's loop when it ends, so it is put back before each call.
        # One loop per host thread: a loop runs in one thread at a time.
        loop = getattr(self._host_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = self._host_loops.loop = asyncio.new_event_loop()
        # The policy's record of this thread's loop, read without get_event_loop()'s
        # side effects; any other policy is simply told again.
        if getattr(getattr(asyncio.get_event_loop_policy(), "_local", None), "_loop", None) is not loop:
            asyncio.set_event_loop(loop)

    def execute(self, call: Call, box: list, lazy_values: list | None, boxed: bool) -> Any:
        """Run one call on this host thread, counted in the call metrics; what :meth:`enqueue`
        queues and a step plan runs per call (``daskwg.plugin.planned``).

        Args:
            call: the call.
            box: a one-item list holding ``(args, kwargs)`` (or a life-cycle call's raw payload).
            lazy_values: what stands for the call's ``LazyArg``\\ s, or ``None``.
            boxed: the box holds the only reference to the arguments (see :meth:`enqueue`).

        Returns:
            the result's snapshot (``daskwg.plugin.rank.snapshot``), or a life-cycle call's value.

        Raises:
            RankError: the method raised (shaped for the driver).
            GroupBrokenError: the rank is not hosted here.
            VersionMismatchError: the driver speaks another wire format (``__init__``).
        """
        t0 = time.perf_counter()
        ok = False
        try:
            result = self._execute(call, box, lazy_values, boxed)
            ok = True
        finally:
            self._metrics.record_call(call.group_name, call.method, ok, time.perf_counter() - t0)
        if call.method not in ("__init__", "__del__"):
            self._metrics.record_bytes(call.group_name, "out", payload_nbytes(result))
        return result

    def _execute(self, call: Call, box: list, lazy_values: list | None, boxed: bool) -> Any:
        _bind_worker(self.worker)
        t0 = time.perf_counter()
        self.calls.start(call)
        try:
            if self.calls.was_cancelled(call):
                # Cancelled as its host thread took it (CallTable.cancel): it does not begin.
                raise CallCancelledError(call.method, call.rank)
            if call.method == "__del__":
                return self._destroy(call)
            self._ensure_host_loop()
            if call.method == "__init__":
                return self._create(call, box[0])
            if call.method == "__rejoin__":
                return self._rejoin(call, box[0])
            return self._invoke(call, box, lazy_values, boxed)
        except RankError as exc:
            self._last_error[(call.group_id, call.rank)] = f"{call.method}: {exc.exception!r}"
            raise
        except (GroupBrokenError, VersionMismatchError):
            # The rank is gone (shut down by another driver, released, restarted), or
            # this worker cannot serve the driver: the group's error, not the method's;
            # it reaches the driver as itself (``except GroupBrokenError`` catches it).
            raise
        except BaseException as exc:  # noqa: BLE001
            self._last_error[(call.group_id, call.rank)] = (
                f"{call.method}: {type(exc).__name__}: {safe_str(exc)}"
            )
            raise rank_error(call, self.address, exc) from None
        finally:
            self.calls.finish(call)
            rank_thread.skip_signal_handlers = False
            logger.debug(
                "%s.%s rank %d (call %d) took %.3f s",
                call.group_name,
                call.method,
                call.rank,
                call.seq,
                time.perf_counter() - t0,
            )

    def _create(self, call: Call, payload: dict) -> None:
        key = (call.group_id, call.rank)
        with self._hosted_lock:
            if key in self._hosted:
                raise GroupBrokenError(f"rank {call.rank} of group {call.group_name!r} already exists here")
        wire.check_format(payload, call)
        env = {**self._socket_env, **payload["env"]}
        skip_signals = bool(payload.get("skip_signal_handlers", False))
        check_pg = bool(payload.get("check_process_group", True))
        scoped = bool(payload.get("scoped_env", False))
        self._process_groups.check(call, payload["world_size"], check_pg)
        self._env.claim(self.address, f"rank {call.rank} of group {call.group_name!r}")
        self._env.apply(env, force=True)
        if skip_signals:
            install_signal_shim()
        rank_thread.skip_signal_handlers = skip_signals
        try:
            instance = payload["cls"]()
        except BaseException:
            self._release_env_if_idle()
            raise
        finally:
            self._process_groups.note(call, payload["world_size"])
            if scoped:
                self._env.restore()
        with self._hosted_lock:
            self._hosted[key] = HostedRank(
                instance=instance,
                env=env,
                owner=call.owner,
                detached=payload["detached"],
                group_name=call.group_name,
                world_size=payload["world_size"],
                skip_signal_handlers=skip_signals,
                check_process_group=check_pg,
                scoped_env=scoped,
            )

    def _rejoin(self, call: Call, payload: dict) -> bool:
        """A surviving rank takes its group's new membership (``wg.heal()``, ``wg.resize()``):
        the new environment (rendezvous, ``WORLD_SIZE``) and world size, its Worker
        attributes, and no default process group of its group any more."""
        hosted = self._lookup(call)
        old_port = hosted.env.get("MASTER_PORT")
        hosted.env = {**hosted.env, **payload["env"]}
        hosted.world_size = payload["world_size"]
        if call.rank == 0 and old_port is not None and old_port != hosted.env.get("MASTER_PORT"):
            self._reserved_ports.discard(int(old_port))
        backend = self._process_groups.backend_of(call.group_id)
        self._process_groups.leave(call.group_id, Settings.current().shutdown_timeout)
        self._env.apply(hosted.env, force=True)
        apply_membership(hosted.instance, hosted.env)
        reinit = payload.get("reinit_timeout")
        if backend is not None and reinit is not None:
            # A class without on_membership_change: its default process group comes back on
            # the new rendezvous, met by the new ranks' __init__ (groups/heal.py).
            self._process_groups.init_again(call, hosted.world_size, backend, reinit)
        return True

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
        self._release_env_if_idle()
        gc.collect()
        return True

    def _release_env_if_idle(self) -> None:
        # Another worker of this process may host ranks once this one hosts none.
        with self._hosted_lock:
            idle = not self._hosted
        if idle:
            self._env.release()

    def _drop_process_group(self, group_id: str) -> None:
        with self._hosted_lock:
            hosted = dict(self._hosted)
        self._process_groups.drop(group_id, hosted, Settings.current().shutdown_timeout)

    def _lookup(self, call: Call) -> HostedRank:
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

    def _invoke(self, call: Call, box: list, lazy_values: list | None, boxed: bool) -> Any:
        hosted = self._lookup(call)
        payload = box.pop() if boxed else box[0]
        args, kwargs = payload
        padding = 0
        if lazy_values is not None:
            args, kwargs, padding = self.inputs.resolve(call, args, kwargs, lazy_values)
        self._metrics.record_bytes(call.group_name, "in", payload_nbytes((args, kwargs)))
        self._process_groups.check(call, hosted.world_size, hosted.check_process_group)
        self._env.apply(hosted.env)
        rank_thread.skip_signal_handlers = hosted.skip_signal_handlers
        try:
            result = strip_padding(
                hosted.call(call, args, kwargs, lambda: self.calls.was_cancelled(call)), padding
            )
        finally:
            self._process_groups.note(call, hosted.world_size)
            if hosted.scoped_env:
                self._env.restore()
        if boxed:
            # The arguments are gone now, unless the rank kept them: what the result
            # shares with them is the rank's own.
            del payload, args, kwargs
            return getattr(box, "pack", snapshot)(result, call, ())  # a step plan's hand-off
        return snapshot(result, call, (payload[0], payload[1], args, kwargs))


class _ClosingHeartbeatFilter(logging.Filter):
    """Drops Dask's "Failed to communicate with scheduler during heartbeat." ERROR (with its
    ``CommClosedError`` traceback) of a worker that is closing.

    ``Worker.close`` stops its heartbeat only after its plugins' teardowns, and then closes its
    connection pool, which aborts a heartbeat still waiting for the scheduler's answer; the
    heartbeat logs that as an error (``distributed.worker.Worker.heartbeat``), and a cluster's
    clean close prints it now and then, one traceback per worker. A heartbeat that fails
    while the worker runs is logged as before."""

    def __init__(self) -> None:
        super().__init__()
        self.workers: weakref.WeakSet = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Failed to communicate with scheduler during heartbeat"):
            return True
        return not any(w.status in _CLOSING for w in list(self.workers))


_CLOSING = {Status.closing, Status.closing_gracefully, Status.closed}
_heartbeat_filter = _ClosingHeartbeatFilter()


def _quiet_closing_heartbeat(worker: Any) -> None:
    """Install :class:`_ClosingHeartbeatFilter` for ``worker`` (once per process)."""
    dask_logger = logging.getLogger(dask_worker.__name__)
    if _heartbeat_filter not in dask_logger.filters:
        dask_logger.addFilter(_heartbeat_filter)
    _heartbeat_filter.workers.add(worker)


#: The name a Nanny gives the worker process it starts (``distributed.nanny.WorkerProcess``).
_NANNY_CHILD = "Dask Worker process"


def _end_process() -> None:
    """End a Nanny's worker process once its Python-level close is done (an ``atexit``
    handler registered as the worker closes, so it runs before the others).

    Past that point the interpreter's own teardown of a process that imported torch
    takes 1.7-7.7 s on a loaded 2-core machine (measured: the other threads were joined
    and every ``atexit`` handler had run within 0.4 s of the plugin's teardown), longer
    than the 4 s a Nanny waits before it logs "Worker process still alive after 4.0
    seconds, killing" and kills it, and a kill that then takes longer than 5 s to be
    reaped fails the cluster's close with a ``TimeoutError``. What the skipped teardown
    would do the kill skips too; the finalizers Python runs at exit
    (``weakref.finalize``, e.g. temporary directories) and logging's flush run here."""
    weakref.finalize._exitfunc()
    logging.shutdown()
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except Exception:  # noqa: BLE001, S110 - a closed stream: nothing left to write
            pass
    os._exit(0)


def _bind_worker(worker: Any) -> None:
    """Let rank code call ``distributed.get_worker()`` as any Dask task can.

    Dask binds the worker to a task's thread through a context variable while the task
    runs; the host thread is not one of Dask's task threads, so bind it here. Every
    call and every coroutine on the rank's event loop then sees the hosting worker.
    """
    if _WORKER_CVAR is not None and _WORKER_CVAR.get(None) is not worker:
        _WORKER_CVAR.set(worker)


# The context variable distributed.get_worker() reads (private to distributed: if a release
# drops it, ranks see no bound worker outside Dask's own task threads, as before binding).
_WORKER_CVAR = getattr(dask_worker, "_worker_cvar", None)


def _allow_child_processes() -> None:
    """Let rank code start child processes when the worker's own configuration says
    ``distributed.worker.daemon: False`` but its nanny lives in another process that
    does not (``daskwg.local_cluster()`` passes the setting in the workers' config)."""
    process = multiprocessing.current_process()
    if process.daemon and dask.config.get("distributed.worker.daemon", default=True) is False:
        # The flag is what multiprocessing checks in this process before starting a child.
        process._config["daemon"] = False
