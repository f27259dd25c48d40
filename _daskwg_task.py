"""The task function of daskwg's Dask-task path, importable without torch or daskwg.

The scheduler unpickles every task it is given. A task whose function were a daskwg
function would make it import daskwg, and so torch. The function of every daskwg task
is :func:`run` instead, from this module of the standard library alone: it names the
daskwg function to run as a ``"module:function"`` string that only the worker imports,
and every argument is plain data (or a Dask future, which Dask resolves on the worker).
It is a coroutine function, so Dask runs the task on the worker's event loop and a call
waiting for its turn on the rank holds no thread.

The module is also the Dask preload (:func:`dask_setup`) of the worker processes
``daskwg.local_cluster()`` starts: it must not import torch either, since it runs before
the worker registers with its scheduler. Imported there, it keeps Dask's INFO records
silenced as ``LocalCluster`` means them to be, also where they would reach the root
logger's handlers (:func:`_silence_propagated_logs`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import multiprocessing
import signal
import threading

__all__ = ["run", "finalize", "dask_setup"]


async def run(target: str, *args):
    """``fn(*args)`` for the function ``target`` names, awaited if it returns an awaitable.

    Args:
        target: ``"module:function"``, e.g. ``"daskwg.plugin.task:run_call"``.
        *args: its arguments, as Dask resolved them on this worker.
    Returns:
        what ``fn`` returns.
    Raises:
        ImportError, AttributeError: ``target`` does not name a function here.
    """
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def dask_setup(worker) -> None:
    """Dask's preload hook (``preload=["_daskwg_task"]``): the worker process ignores SIGINT.

    The worker processes of a local cluster are in the driver's process group, so a
    Ctrl-C in the driver's terminal reaches them too and kills them (their next calls
    would raise ``WorkerLostError``). As Ray's workers do, they let the driver alone
    handle it: the driver gets its ``KeyboardInterrupt``, the ranks and their state stay.
    The Nanny still stops them (through its stop queue, or SIGTERM).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _silence_propagated_logs(level: int = logging.WARNING) -> None:
    """In a worker process of a local cluster: hold Dask's records under ``level``, as
    ``LocalCluster``'s ``silence_logs`` (default ``logging.WARN``) means to, also when they
    go to the root logger's handlers. Dask silences the ``StreamHandler`` it gives the
    ``distributed`` logger, and gives it none when the root logger has handlers as
    ``distributed`` is first imported: a driver script with ``import verl`` at its top
    (``logging.basicConfig`` in ``verl/__init__.py``), which the worker processes import
    again as they start (multiprocessing's spawn), would have every worker write some 20
    INFO lines. Where Dask's handler is there, Dask's own silencing applies: nothing changes."""
    logger = logging.getLogger("distributed")
    if (
        any(isinstance(h, logging.StreamHandler) for h in logger.handlers)
        or logger.getEffectiveLevel() >= level
    ):
        return
    logger.setLevel(level)


# A Nanny's worker process imports its preloads as its Worker starts: before it logs
# that it started (dask_setup runs after).
if multiprocessing.current_process().name.startswith("Dask Worker process"):
    _silence_propagated_logs()


def finalize(parts, target: str, *args):
    """``fn(parts, *args)`` for the function ``target`` names: the task that finishes a
    daskwg object computed by Dask (a ``DataProtoFuture``'s ``__dask_postcompute__``),
    ``parts`` being the values of its keys.

    Raises:
        ImportError, AttributeError: ``target`` does not name a function here.
    """
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(parts, *args)
