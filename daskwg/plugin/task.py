"""The entry point of calls that come as Dask tasks: :func:`run_call`, which the task
function ``_daskwg_task.run`` imports by name (:data:`daskwg.wire.messages.RUN_CALL`)."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

from distributed import get_worker
from distributed.worker_state_machine import SecedeEvent

from ..errors import GroupBrokenError, RankError
from ..serialization import registration  # noqa: F401  (Dask keeps, sizes and sends the Packed results)
from ..wire import messages as wire
from ..wire.messages import Call
from .exceptions import shippable

__all__ = ["run_call"]


async def run_call(call: tuple, payload: tuple, lazy_values: list | None = None, task_key: Any = None) -> Any:
    """Run one task-path call on this worker's host; Dask keeps what it returns.

    Args:
        call: the :class:`~daskwg.wire.messages.Call`'s fields (``Call.to_wire()``).
        payload: ``(INLINE, header, buffers)`` (the arguments pickled once) or
            ``(SCATTERED, value)`` (sent straight to this worker beforehand).
        lazy_values: what Dask resolved for ``DataProtoFuture`` arguments before the task
            started (their parts, or their :class:`~daskwg.wire.messages.PartInfo`).
        task_key: this task's key.

    Returns:
        the call's result, snapshotted at return (a ``serialization.Packed``; its value on an
        in-process worker, see :meth:`~daskwg.plugin.results.ResultStore.for_dask`).

    Raises:
        RankError: the call failed on the rank.
        GroupBrokenError: this worker has no host plugin (it restarted).

    An ``async def`` task runs on the worker's event loop, so a call waiting for its turn
    holds no thread; it leaves Dask's count of executing tasks at once (as
    ``distributed.secede`` does for threads), so later calls, which Dask may start first,
    can take their places in the order.
    """
    call = Call.from_wire(call)
    worker = get_worker()
    host = worker.plugins.get(wire.PLUGIN_NAME)
    if host is None:
        raise GroupBrokenError("the daskwg plugin is not installed on this worker (it restarted?)")
    if task_key is not None:
        _leave_executing(worker, task_key)
    result = host.enqueue(call, _unwrap_payload(payload), lazy_values)
    try:
        return host.results.for_dask(await asyncio.wrap_future(result))
    except asyncio.CancelledError:
        if result.cancelled():
            return None  # skipped by cancel_call: Dask already dropped the task
        raise  # the worker is closing
    except RankError as exc:
        if host.calls.was_cancelled(call):
            return None  # its future was cancelled: Dask drops whatever the task gives
        # Dask keeps a failed task's exception and traceback while its future lives: they
        # must not hold the call's inputs (a batch) in their frames.
        error = shippable(exc).with_traceback(None)
        del exc, payload, lazy_values, result
        raise error from None
    finally:
        host.calls.forget_cancelled(call)


def _leave_executing(worker: Any, key: Any) -> None:
    # What distributed.secede tells the worker's state machine, for a task running on
    # the event loop (secede itself needs a thread of the worker's pool).
    worker.loop.add_callback(
        worker.handle_stimulus,
        SecedeEvent(key=key, compute_duration=0.0, stimulus_id=f"daskwg-secede-{time.time()}"),
    )


def _unwrap_payload(payload: tuple) -> Any:
    if payload[0] == wire.INLINE:
        _, header, buffers = payload
        return pickle.loads(header, buffers=buffers)
    return payload[1]
