"""What the driver knows of calls it stopped waiting for: :class:`CallWatch`."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .driver import Driver

__all__ = ["CallWatch"]


class CallWatch:
    """Tells when one call on one worker has finished, by polling the worker's
    ``daskwg_progress`` from the client's event loop. ``done()`` like a future."""

    def __init__(self, driver: Driver, address: str, seq: int, interval: float = 0.1):
        self._event = threading.Event()
        driver.client.loop.add_callback(self._poll, driver, address, seq, interval)

    def done(self) -> bool:
        return self._event.is_set()

    async def _poll(self, driver: Driver, address: str, seq: int, interval: float) -> None:
        try:
            while await driver.client.rpc(address).daskwg_progress(session=driver.session) < seq:
                await asyncio.sleep(interval)
                interval = min(interval * 1.5, 1.0)  # a stuck collective may take minutes
        except Exception:  # noqa: BLE001 - a worker that is gone runs nothing any more
            pass
        self._event.set()
