"""Shaping what rank code raises so that it reaches the driver: a picklable exception of
the same type where one can be built, and a hint that says what to do where the error
comes from where rank code runs (a daemonic worker, a thread that is not the main one)
rather than from the code itself."""

from __future__ import annotations

import pickle
import traceback

from ..errors import GroupBrokenError, RankError, safe_str
from ..wire.messages import Call

__all__ = ["shippable", "picklable", "rank_error", "unpickling_error", "earlier_process_error"]

_DAEMONIC = "daemonic processes are not allowed to have children"
_SIGNAL_THREAD = "signal only works in main thread"


def shippable(exc: RankError) -> RankError:
    """``exc`` without the chained exceptions Python attached to it.

    Once Dask formatted a task's error in this process, tblib pickles every instance
    of that exception class with its ``__context__``/``__cause__`` (the user's original
    exception, which the driver may not be able to import): drop them, the RankError
    carries what the driver needs (type name, message, traceback text).
    """
    exc.__cause__ = None
    exc.__context__ = None
    exc.__suppress_context__ = True
    if exc.exception is not None:
        # Its traceback is text already (remote_traceback); the frames would keep the
        # method's locals (its batch) alive for as long as Dask keeps the error.
        exc.exception.__traceback__ = None
    return exc


def picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its type and message
    (a :class:`RankError` carries its exception as bytes and always does)."""
    if isinstance(exc, RankError):
        return shippable(exc)
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {safe_str(exc)}")
    return exc


def with_message(exc: BaseException, message: str) -> BaseException:
    """An exception of the same type as ``exc`` with ``message`` (where the type can be
    built from a message), else a ``RuntimeError``."""
    try:
        return picklable(type(exc)(message))
    except Exception:  # noqa: BLE001
        return RuntimeError(message)


def rank_error(call: Call, address: str, exc: BaseException) -> RankError:
    """The :class:`RankError` of ``call`` failing with ``exc`` (being handled now: its
    traceback is formatted here), with :func:`runtime_hint`'s advice where one applies."""
    hint = runtime_hint(exc)
    return RankError(
        call.rank, address, call.method, traceback.format_exc(), with_message(exc, hint) if hint else exc
    )


def unpickling_error(call: Call, address: str, exc: BaseException) -> RankError:
    """The :class:`RankError` of ``call`` whose arguments could not be unpickled on this
    worker (``exc``, being handled now), saying what to install where."""
    hint = (
        f"the arguments of {call.method!r} could not be unpickled on this worker: {exc}; the workers "
        "must be able to import every class and function sent to them (install its module there)"
    )
    return RankError(call.rank, address, call.method, traceback.format_exc(), with_message(exc, hint))


def earlier_process_error(call: Call, address: str) -> GroupBrokenError:
    """The error of ``call`` sent to the worker process that the one at ``address``
    replaced (a restart): its ranks are gone with it."""
    return GroupBrokenError(
        f"rank {call.rank} of group {call.group_name!r} was on an earlier process of the worker at "
        f"{address}, which restarted; its ranks are gone: build a new group"
    )


def runtime_hint(exc: BaseException) -> str | None:
    """A message saying what to do, for errors that come from where rank code runs
    rather than from the code itself (``None`` for any other error)."""
    text = " ".join(safe_str(e) for e in _exception_chain(exc))
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
            f"{safe_str(exc)}: rank code runs on the worker's daskwg-host thread (async methods on the rank's event "
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
