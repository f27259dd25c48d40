"""One rank hosted in this worker: :class:`HostedRank` (the user's instance, its
environment, running a call on it: awaiting ``async def`` methods on the rank's own loop,
snapshotting the result) and :class:`ProcessEnv`, which gives every group sharing the
process its own environment. Arguments are built by ``daskwg.plugin.inputs``.

Everything here runs on the host thread (``daskwg-host_0``), one call at a time.

``strip_padding`` is :func:`daskwg.futures.padding.strip` (the padding rule's own), named
here for the host, which takes a ``STRIP`` piece's padding rows off the rank's output.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import collective
from ..futures.padding import strip as strip_padding
from ..serialization import pickling as serialization
from ..serialization import snapshots
from ..wire.messages import Call
from .rank_loop import RankLoop

__all__ = ["HostedRank", "ProcessEnv", "apply_membership", "strip_padding", "snapshot"]

#: The Worker attributes (verl's and daskwg's) that follow a new membership, and their types.
_MEMBERSHIP_ATTRS = {
    "_world_size": ("WORLD_SIZE", int),
    "_local_rank": ("LOCAL_RANK", int),
    "_local_world_size": ("LOCAL_WORLD_SIZE", int),
    "_master_addr": ("MASTER_ADDR", str),
    "_master_port": ("MASTER_PORT", str),
}


def apply_membership(instance: Any, env: dict) -> None:
    """Make a surviving rank's Worker attributes (and its colocated roles') say what the
    new ``env`` says (``wg.heal()``, ``wg.resize()``): ``world_size``, the rendezvous."""
    workers = [instance, *getattr(instance, "fused_worker_dict", {}).values()]
    for worker in workers:
        state = getattr(worker, "__dict__", {})
        for attr, (key, kind) in _MEMBERSHIP_ATTRS.items():
            if attr in state and key in env:
                state[attr] = kind(env[key])


class ProcessEnv:
    """``os.environ`` as each hosted group must see it.

    Groups sharing this process each see their own rank environment: it is put in
    place before every call (calls run one at a time on the host thread). Keys another
    group's env set and this one lacks (its ``worker_env``) go back to the process's own
    value, so no group sees another group's variables.

    One process has one environment, so only one Dask worker of a process may host ranks
    (:meth:`claim`): the workers of ``LocalCluster(processes=False)`` run their calls on
    threads of their own, at the same time. A worker in the driver's own process puts the
    variables in place for each call only (:meth:`restore` after it), so the driver's
    environment is left as it was.
    """

    #: The ProcessEnv of every worker of this process whose ranks hold the environment.
    _claimed: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(self) -> None:
        self._current: dict | None = None
        self._applied: set[str] = set()
        self._original: dict[str, str | None] = {}

    def claim(self, worker: str, what: str) -> None:
        """Take this process's environment for the ranks of ``worker`` (its address), about
        to host ``what`` (a rank, for the message).

        Raises:
            ValueError: another Dask worker of this process hosts ranks.
        """
        others = [env for env in self._claimed if env is not self]
        if others:
            raise ValueError(
                f"{what} cannot be hosted on {worker}: another Dask worker of this process (pid "
                f"{os.getpid()}) hosts ranks, and the two would share one os.environ (RANK, MASTER_PORT, "
                "worker_env). Start the workers as processes (daskwg.local_cluster() without "
                "processes=False, or dask worker with a nanny), or host ranks on one worker per process"
            )
        self._claimed.add(self)

    def release(self) -> None:
        """This worker hosts no rank any more."""
        self._claimed.discard(self)

    def apply(self, env: dict, *, force: bool = False) -> None:
        """Make ``os.environ`` hold ``env`` on top of the process's own variables
        (``force``: even if ``env`` is the one applied last)."""
        if env is self._current and not force:
            return
        for key in self._applied - env.keys():
            original = self._original.get(key)
            if original is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = original
        for key in env.keys() - self._original.keys():
            self._original[key] = os.environ.get(key)
        os.environ.update(env)
        self._applied = set(env)
        self._current = env

    def restore(self) -> None:
        """Give every variable :meth:`apply` set back its value from before (or unset it)."""
        for key in self._applied:
            original = self._original.get(key)
            if original is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = original
        self._applied = set()
        self._original = {}
        self._current = None


@dataclass
class HostedRank:
    """A rank of a group, hosted here.

    Attributes:
        instance: the user's Worker object.
        env: the rank's environment (``RANK``, ``WORLD_SIZE``, ..., ``worker_env``).
        owner: the client id of the driver that owns it.
        detached: whether it outlives its driver.
        group_name: its group's name.
        world_size: its group's size.
        skip_signal_handlers: rank code may "install" SIGTERM/SIGINT handlers off the main thread.
        check_process_group: refuse calls while another group's default process group is here.
        rank_loop: the event loop of its ``async def`` methods, once one ran.
        scoped_env: its environment is in place during its calls only (a worker in the
            driver's own process).
    """

    instance: Any
    env: dict
    owner: str
    detached: bool
    group_name: str
    world_size: int
    skip_signal_handlers: bool = False
    check_process_group: bool = True
    rank_loop: RankLoop | None = None
    scoped_env: bool = False

    def close_loop(self, wait: bool) -> None:
        """Stop the rank's event loop (its tasks are cancelled); ``wait``: join its thread."""
        if self.rank_loop is not None:
            self.rank_loop.close(wait)
            self.rank_loop = None

    def call(self, call: Call, args: tuple, kwargs: dict, cancelled: Callable[[], bool] | None = None) -> Any:
        """``instance.<call.method>(*args, **kwargs)``, an ``async def`` method awaited on the
        rank's own event loop (started on first use). ``cancelled``: whether the call was
        cancelled as it started (an ``async def`` method's coroutine then never runs).

        Raises:
            AttributeError: the instance has no such method.
            Exception: whatever the method raises.
        """
        if call.method in collective.RANK_CALLS:  # joining or leaving a collective
            return collective.rank_call(call.method, call.group_id, *args, **kwargs)
        try:
            method = getattr(self.instance, call.method)
        except AttributeError:
            raise AttributeError(f"{type(self.instance).__name__} has no method {call.method!r}") from None
        result = method(*args, **kwargs)
        if inspect.isawaitable(result):
            rank_loop = self._loop(call)
            result = rank_loop.run(result, call.concurrency_group, cancelled)
        return result

    def _loop(self, call: Call) -> RankLoop:
        # Host threads of several concurrency groups may ask at once: one loop per rank.
        with _LOOP_LOCK:
            if self.rank_loop is None:
                self.rank_loop = RankLoop(
                    f"daskwg-rank-{call.group_name}-r{call.rank}", self.skip_signal_handlers
                )
            return self.rank_loop


#: Guards the start of a rank's event loop (:meth:`HostedRank._loop`).
_LOOP_LOCK = threading.Lock()


def snapshot(result: Any, call: Call, arguments: tuple) -> serialization.Packed:
    """The result as it is at return time (:func:`daskwg.serialization.snapshots.snapshot`), or
    a clear error now rather than inside Dask's comm layer later.

    ``result`` must be held by exactly one variable of the caller besides this
    function's argument (the reference count tells what the rank still holds);
    ``arguments``: the call's argument containers where they are still alive (the task
    path), which refer to values without the rank holding them.

    Raises:
        TypeError: the result cannot be serialised (the message names the call).
    """
    try:
        # Held by the caller's local and this argument; the call's argument containers
        # are alive but change nothing.
        return snapshots.snapshot(result, held=2, arguments=arguments)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"{call.group_name}.{call.method} on rank {call.rank} returned a "
            f"{type(result).__module__}.{type(result).__qualname__}, which cannot be serialised "
            f"({type(exc).__name__}: {exc}); return tensors, numpy arrays, DataProto or plain data"
        ) from None
