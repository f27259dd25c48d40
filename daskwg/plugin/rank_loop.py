"""Where a rank's ``async def`` methods run: an event loop of its own, in a thread of its
own, that keeps running between calls; and the ``signal.signal`` shim for rank code."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankLoop", "task_stack", "rank_thread", "install_signal_shim"]

logger = logging.getLogger(__name__)


class RankLoop:
    """The event loop a rank's ``async def`` methods run on, in a thread of its own.

    It runs between calls too, so tasks and servers a method starts keep serving after
    it returns (Ray's async-actor model, which verl's rollout servers rely on). The host
    thread hands each coroutine over and waits for it: a call still ends when its
    coroutine returns, so calls keep their order. The host thread of a named concurrency
    group hands its coroutines to the same loop, where they run beside the default group's
    (as a Ray async actor's concurrency groups share its event loop).
    """

    def __init__(self, name: str, skip_signal_handlers: bool):
        self.loop = asyncio.new_event_loop()
        # Concurrency group (None: the default one) -> the task of its async call running now.
        self._tasks: dict[str | None, asyncio.Task] = {}
        self._skip_signal_handlers = skip_signal_handlers
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        rank_thread.skip_signal_handlers = self._skip_signal_handlers
        try:
            self.loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(self.loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    # A task that ignores cancellation must not keep the thread forever.
                    self.loop.run_until_complete(asyncio.wait(tasks, timeout=_LOOP_CLOSE_TIMEOUT))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    @property
    def current_task(self) -> asyncio.Task | None:
        """The task of the default group's async call running now, else ``None``."""
        return self._tasks.get(None)

    def task_of(self, concurrency_group: str | None) -> asyncio.Task | None:
        """The task of ``concurrency_group``'s async call running now (status records,
        cancellation), else ``None``."""
        return self._tasks.get(concurrency_group)

    def run(
        self,
        awaitable: Any,
        concurrency_group: str | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Any:
        """Run ``awaitable`` on the loop as ``concurrency_group``'s call; block the calling
        thread (that group's host thread) until it finishes.

        ``cancelled``: whether the call was cancelled before its task existed (read once
        the task is registered, so a cancel that found no task to cancel is not lost).

        Raises:
            asyncio.CancelledError: the call was cancelled (before it began or at an ``await``).
        """
        return asyncio.run_coroutine_threadsafe(
            self._call(awaitable, concurrency_group, cancelled), self.loop
        ).result()

    async def _call(
        self, awaitable: Any, concurrency_group: str | None, cancelled: Callable[[], bool] | None
    ) -> Any:
        self._tasks[concurrency_group] = asyncio.current_task()
        try:
            if cancelled is not None and cancelled():
                if inspect.iscoroutine(awaitable):
                    awaitable.close()  # never awaited: no "was never awaited" warning
                raise asyncio.CancelledError
            return await awaitable
        finally:
            self._tasks.pop(concurrency_group, None)

    def close(self, wait: bool) -> None:
        """Stop the loop (its tasks are cancelled) and, if ``wait``, join the thread
        for a bounded time."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if wait:
            self._thread.join(2 * _LOOP_CLOSE_TIMEOUT)
            if self._thread.is_alive():
                logger.warning("the event loop thread %s did not stop; leaving it", self._thread.name)


def task_stack(task: asyncio.Task) -> str | None:
    """Where an async call's coroutine is, down the chain of awaited coroutines, as
    ``traceback.format_stack`` would say it (``Task.get_stack`` gives only the top)."""
    frames = []
    coro: Any = task.get_coro()
    while coro is not None and len(frames) < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "".join(traceback.format_list(frames)) if frames else None


#: Seconds a destroyed rank's loop gives its tasks to end after they are cancelled.
_LOOP_CLOSE_TIMEOUT = 5.0


#: Per-thread context of rank code: whether its group asked to skip signal handlers.
rank_thread = threading.local()


_original_signal = signal.signal


def _signal_from_rank(signalnum: Any, handler: Any) -> Any:
    """``signal.signal`` as rank code of a group built with ``daskwg.skip-signal-handlers``
    sees it: off the main thread, SIGTERM/SIGINT handlers are not installed (Python
    would refuse them) and the current handler is returned, as Ray's SGLang example
    does for engines that register them in their constructor."""
    if (
        getattr(rank_thread, "skip_signal_handlers", False)
        and signalnum in (signal.SIGTERM, signal.SIGINT)
        and threading.current_thread() is not threading.main_thread()
    ):
        logger.info(
            "not installing a handler for %s from rank code on thread %r (daskwg.skip-signal-handlers)",
            signal.Signals(signalnum).name,
            threading.current_thread().name,
        )
        return signal.getsignal(signalnum)
    return _original_signal(signalnum, handler)


def install_signal_shim() -> None:
    """Route ``signal.signal`` through the rank-code shim in this process (idempotent)."""
    if signal.signal is not _signal_from_rank:
        signal.signal = _signal_from_rank
