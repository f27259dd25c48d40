"""A driver thread's own event loop and connection pool: :class:`Channel`; Ctrl-C held off
while that thread writes a call (:class:`HeldInterrupt`)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Mapping
from typing import Any

from distributed.core import ConnectionPool

from .streams import CallStreams

__all__ = ["Channel", "HeldInterrupt"]


class Channel:
    """A private event loop and Dask ``ConnectionPool`` owned by one driver thread.

    Blocking direct calls run this loop in the calling thread itself
    (``loop.run_until_complete``) instead of handing the work to the client's loop
    thread and waiting for it (``client.sync``): two thread switches less per call,
    which is most of a small call's cost on a busy machine. Calls go on the thread's
    own call streams (:attr:`streams`); other requests (status reports) on its own
    ``ConnectionPool`` (:attr:`pool`). Comms are Dask's own, with the client's connection
    arguments (TLS included).
    """

    def __init__(self, connection_args: dict, epochs: Mapping[str, int] | None = None):
        self.loop = asyncio.new_event_loop()
        self.pool = ConnectionPool(limit=256, connection_args=connection_args)
        self.streams = CallStreams(connection_args, epochs)
        self.loop.run_until_complete(self.pool.start())

    def run(self, coro: Any, *, fresh: bool = True) -> Any:
        """Run ``coro`` on this loop; ``fresh=False``: it uses only :attr:`streams`, which
        never reuse a closed connection, so the loop need not look at the pool's first."""
        return self.loop.run_until_complete(self._fresh(coro) if fresh else coro)

    @staticmethod
    async def _fresh(coro: Any) -> Any:
        # The loop sat idle since the last call: let it first see the connections that
        # closed meanwhile (a worker that died or restarted), so the pool does not hand
        # one of them out again.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return await coro

    def __del__(self) -> None:
        # The thread that owned this channel ended (its threading.local went away):
        # close its connections now rather than leave "dangling stream" warnings.
        try:
            self.streams.abort_all()
            for comms in (*self.pool.available.values(), *self.pool.occupied.values()):
                for comm in list(comms):
                    comm.abort()
            # Let the tasks still on the loop (its streams' readers) end before it closes,
            # instead of asyncio's "Task was destroyed but it is pending".
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if self.loop.is_running():
                return
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop runs in this thread: finish here
                _finish(self.loop, tasks)
            else:
                # Collected on a thread running another loop (the client's): this loop
                # cannot run here.
                threading.Thread(target=_finish, args=(self.loop, tasks), daemon=True).start()
        except Exception:  # noqa: BLE001 - best effort at garbage collection
            pass


def _finish(loop: asyncio.AbstractEventLoop, tasks: set) -> None:
    """Let ``tasks`` (cancelled) end on ``loop``, for up to a second, and close it."""
    try:
        if tasks:
            wait = asyncio.wait(tasks, timeout=1.0)
            try:
                loop.run_until_complete(wait)
            finally:
                wait.close()  # never left un-awaited, whatever happened
        loop.close()
    except Exception:  # noqa: BLE001 - best effort at garbage collection
        pass


class HeldInterrupt:
    """Ctrl-C (SIGINT) held off from when a blocking call takes its places in the workers'
    order until its messages are written, when the calling thread writes them itself (its
    :class:`Channel`): a ``KeyboardInterrupt`` in between would leave a place no message
    fills, and every later call on those workers would wait behind it (or a half-written
    message would go out with the thread's next call). Held only in the main thread (where
    Python runs signal handlers), and only where SIGINT has a Python handler (its own, which
    raises ``KeyboardInterrupt``, or the program's): a Ctrl-C that came meanwhile goes to
    that handler in :meth:`release`, once the call is on its way; the call then runs, as an
    interrupted call that was sent does (docs/failure-model.md). Other signals whose
    handlers raise are not held.
    """

    def __init__(self) -> None:
        self._came = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread() and callable(
            signal.getsignal(signal.SIGINT)
        ):
            self._previous = signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self._came = True

    def release(self) -> None:
        """SIGINT as before (idempotent); a SIGINT that came while held goes to its handler now.

        Raises:
            KeyboardInterrupt: one came while held (Python's handler), or what the
                program's handler raises.
        """
        previous = self._previous
        if previous is None:
            return
        signal.signal(signal.SIGINT, previous)
        self._previous = None
        if self._came:
            self._came = False
            previous(signal.SIGINT, None)
