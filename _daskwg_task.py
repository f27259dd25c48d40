"""The task function of daskwg's Dask-task path, importable without torch or daskwg.

The scheduler unpickles every task it is given. A task whose function were
``daskwg.plugin.run_call`` would make it import daskwg, and so torch. The function of
every daskwg task is :func:`run` instead, from this module of the standard library
alone; the daskwg function it runs travels as pickle bytes that only the worker opens.
It is a coroutine function, so Dask runs the task on the worker's event loop and a call
waiting for its turn on the rank holds no thread.
"""

from __future__ import annotations

import inspect
import pickle

__all__ = ["run"]


async def run(fn_pickle: bytes, *args):
    """``fn(*args)`` for ``fn = pickle.loads(fn_pickle)``, awaited if it is a coroutine.

    Args:
        fn_pickle: a pickled callable (daskwg's ``run_call`` bound to its call, say).
        *args: its arguments, as Dask resolved them on this worker.
    Returns:
        what ``fn`` returns.
    """
    result = pickle.loads(fn_pickle)(*args)
    if inspect.isawaitable(result):
        result = await result
    return result
