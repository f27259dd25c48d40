"""A driver's call stream to this worker: the ``daskwg_stream`` handler (:func:`serve`).

Non-blocking calls come to a worker on one long-lived Dask comm per driver (opened by
``daskwg.transport.streams``), as Dask's own scheduler and workers talk on batched
streams: no connection per call, however many calls wait in the worker's queue. Each
message is one call (``{"op": "call", "key", ...}``, the arguments of the host's
``daskwg_call`` handler); each reply carries the call's key, in the order calls finish.

Everything here runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.core import Status
from distributed.protocol import to_serialize

__all__ = ["serve"]

logger = logging.getLogger(__name__)


async def serve(comm: Any, handle_call: Callable[..., Awaitable[dict]]) -> Any:
    """Serve one call stream until the driver closes it.

    Args:
        comm: the stream's comm (the handler's first argument).
        handle_call: the host's ``daskwg_call`` handler: ``(**message) -> reply``.
    Returns:
        ``Status.dont_reply`` (replies go out as calls finish).
    """
    # Messages here are known: no need for Dask to size each one to decide whether to
    # (de)serialise it on a thread; large arguments are frames it does not copy anyway.
    comm.allow_offload = False
    lock = asyncio.Lock()
    while True:
        try:
            message = await comm.read()
        except (CommClosedError, OSError):
            break
        op = message.pop("op", "call")
        if op != "call":
            logger.warning("daskwg call stream: unknown message %r ignored", op)
            continue
        asyncio.ensure_future(_one(comm, lock, message, handle_call))
    return Status.dont_reply


async def _one(
    comm: Any, lock: asyncio.Lock, message: dict, handle_call: Callable[..., Awaitable[dict]]
) -> None:
    key = message["key"]
    try:
        reply = await handle_call(**message)
    except asyncio.CancelledError:
        return  # the worker is closing: the driver sees the stream close
    except Exception as exc:  # noqa: BLE001 - the handler answers its own errors; this is a defect
        logger.exception("daskwg call stream: the call %s failed outside its handler", key)
        error = RuntimeError(f"daskwg's host failed to run the call: {exc!r}")
        reply = {"status": "error", "exception": to_serialize(error)}
    reply["key"] = key
    async with lock:
        try:
            await comm.write(reply)
        except (CommClosedError, OSError):
            pass  # the driver is gone; its results stay until it is released
