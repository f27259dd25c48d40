"""The task function of the Dask-task path on the worker: :func:`run_call`."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

from distributed import get_worker
from distributed.worker_state_machine import SecedeEvent

from ..errors import GroupBrokenError, RankError
from ..wire import PLUGIN_NAME, Call
from .exceptions import _shippable

__all__ = ["run_call"]


async def run_call(call: Call, payload: Any, lazy_values: list | None = None, task_key: Any = None) -> Any:
    """The task function of the Dask-task path: run ``call`` on this worker's host.

    ``payload`` is ``("inline", pickle bytes)`` or ``("scattered", value)`` (sent
    straight to this worker beforehand, see ``daskwg.transport``). ``lazy_values``
    are what Dask resolved for ``DataProtoFuture`` arguments before the task started
    (their parts, or their :class:`daskwg.parts.PartInfo`). An ``async def`` task runs
    on the worker's event loop, so a call waiting for its turn holds no thread; it
    leaves Dask's count of executing tasks at once (as ``distributed.secede`` does for
    threads), so later calls, which Dask may start first, can take their places in the
    order.
    """
    worker = get_worker()
    host = worker.plugins.get(PLUGIN_NAME)
    if host is None:
        raise GroupBrokenError("the daskwg plugin is not installed on this worker (it restarted?)")
    if task_key is not None:
        _leave_executing(worker, task_key)
    payload = _unwrap_payload(payload)
    result = host.enqueue(call, payload, lazy_values)
    try:
        return await asyncio.wrap_future(result)
    except asyncio.CancelledError:
        if result.cancelled():
            return None  # skipped by cancel_call: Dask already dropped the task
        raise  # the worker is closing
    except RankError as exc:
        if (call.session, call.seq) in host._cancelled_calls:
            return None  # its future was cancelled: Dask drops whatever the task gives
        raise _shippable(exc) from None
    finally:
        host._cancelled_calls.discard((call.session, call.seq))


def _leave_executing(worker: Any, key: Any) -> None:
    # What distributed.secede tells the worker's state machine, for a task running on
    # the event loop (secede itself needs a thread of the worker's pool).
    worker.loop.add_callback(
        worker.handle_stimulus,
        SecedeEvent(key=key, compute_duration=0.0, stimulus_id=f"daskwg-secede-{time.time()}"),
    )


def _unwrap_payload(payload: tuple) -> Any:
    kind, value = payload
    return pickle.loads(value) if kind == "inline" else value
