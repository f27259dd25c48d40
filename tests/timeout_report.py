"""pytest plugin: a test that passes its timeout fails with the other threads' stacks in
its own failure report, under its name.

pytest-timeout's ``signal`` method writes those stacks to the terminal the moment the
alarm fires, which under ``-q`` lands between the progress dots with no test name (the
failure report comes only at the end). This plugin keeps pytest-timeout's settings,
markers and methods, and replaces only where the ``signal`` method's dump goes, and puts
the test's id before the ``thread`` method's dump (which ends the process before any
report), through the plugin's own hook for alternative timers (``pytest_timeout_set_timer``).
``timeout_func_only`` would not help: it moves when the timer starts, not where the dump
goes, and would leave fixtures (cluster start-up) unbounded.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback

import pytest
from pytest_timeout import is_debugging, timeout_timer


def _other_threads_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident != here:
            parts.append(f"--- thread {names.get(ident, '<unknown>')} ({ident}) ---\n")
            parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


def _thread_timer(item, settings) -> bool:
    """pytest-timeout's ``thread`` method (also where ``signal`` cannot be used: off the
    main thread), with the test's id written first: that method dumps the stacks to the
    terminal and ends the process (``os._exit``) before any report, under a bare "Timeout"
    title, so nothing else would say which test it was."""

    def on_timeout() -> None:
        if not settings.disable_debugger_detection and is_debugging():
            return
        terminal = item.config.get_terminal_writer()
        terminal.line()
        terminal.sep("+", f"Timeout >{settings.timeout:g}s in {item.nodeid}")
        terminal.flush()
        timeout_timer(item, settings)

    timer = threading.Timer(settings.timeout, on_timeout)
    timer.name = f"pytest_timeout {item.nodeid}"

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return _thread_timer(item, settings)

    def on_timeout(signum, frame):
        __tracebackhide__ = True
        if not settings.disable_debugger_detection and is_debugging():
            return  # as pytest-timeout: never interrupt a debugging session
        stacks = _other_threads_stacks()
        pytest.fail(
            f"Timeout >{settings.timeout:g}s in {item.nodeid}\n"
            + (f"stacks of the other threads when it fired:\n{stacks}" if stacks else "")
        )

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
