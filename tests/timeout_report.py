"""pytest plugin: a test that passes its timeout fails with the other threads' stacks in
its own failure report, under its name.

pytest-timeout's ``signal`` method writes those stacks to the terminal the moment the
alarm fires, which under ``-q`` lands between the progress dots with no test name (the
failure report comes only at the end). This plugin keeps pytest-timeout's settings,
markers and ``thread`` method, and replaces only where the ``signal`` method's dump goes,
through the plugin's own hook for alternative timers (``pytest_timeout_set_timer``).
``timeout_func_only`` would not help: it moves when the timer starts, not where the dump
goes, and would leave fixtures (cluster start-up) unbounded.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback

import pytest
from pytest_timeout import is_debugging


def _other_threads_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident != here:
            parts.append(f"--- thread {names.get(ident, '<unknown>')} ({ident}) ---\n")
            parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer (its thread method names the test itself)

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
