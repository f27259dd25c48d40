"""Shaping the exceptions rank code raises so that they reach the driver, with a hint
where the error comes from where rank code runs rather than from the code itself."""

from __future__ import annotations

import pickle

from ..errors import RankError


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 - a user __str__ that raises
        return f"<str() raised {type(inner).__name__}>"


def _shippable(exc: RankError) -> RankError:
    """``exc`` without the chained exceptions Python attached to it.

    Once Dask formatted a task's error in this process, tblib pickles every instance
    of that exception class with its ``__context__``/``__cause__`` (the user's original
    exception, which the driver may not be able to import): drop them, the RankError
    carries what the driver needs (type name, message, traceback text).
    """
    exc.__cause__ = None
    exc.__context__ = None
    exc.__suppress_context__ = True
    return exc


def _picklable_exception(exc: BaseException) -> BaseException | None:
    if isinstance(exc, RankError):
        return _shippable(exc)  # it carries its exception as bytes plus type name and message
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {_safe_str(exc)}")
    return exc


def _with_message(exc: BaseException, message: str) -> BaseException:
    """An exception of the same type as ``exc`` (where it can be built from a message)."""
    try:
        return _picklable_exception(type(exc)(message)) or RuntimeError(message)
    except Exception:  # noqa: BLE001
        return RuntimeError(message)


_DAEMONIC = "daemonic processes are not allowed to have children"
_SIGNAL_THREAD = "signal only works in main thread"


def _runtime_hint(exc: BaseException) -> str | None:
    """A message saying what to do, for errors that come from where rank code runs
    rather than from the code itself."""
    text = " ".join(_safe_str(e) for e in _exception_chain(exc))
    if _DAEMONIC in text:
        return (
            f"{_DAEMONIC}: this Dask worker process was started as a daemon (Dask's default for workers "
            "started by a nanny), so rank code cannot start child processes (DataLoader(num_workers>0), "
            "multiprocessing, inference engines). Start the workers with distributed.worker.daemon: False "
            "in the Dask configuration of their nanny, e.g. DASK_DISTRIBUTED__WORKER__DAEMON=False dask "
            "worker ...; daskwg.local_cluster() does this for its workers"
        )
    if _SIGNAL_THREAD in text:
        return (
            f"{_safe_str(exc)}: rank code runs on the worker's daskwg-host thread (async methods on the rank's event "
            "loop thread), not on the process's main thread, so it cannot install signal handlers. For "
            "constructors that only register SIGTERM/SIGINT handlers, build the group with "
            'dask.config.set({"daskwg.skip-signal-handlers": True}); for timeouts use the API\'s own '
            "(torch.distributed timeout=, asyncio.wait_for) instead of signal.alarm"
        )
    return None


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _picklable_error(exc: BaseException) -> BaseException:
    return _picklable_exception(exc) or RuntimeError(repr(exc))
