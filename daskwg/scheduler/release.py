"""daskwg's scheduler plugins (besides the dashboard's): :class:`ReleaseOnClientExit`."""

from __future__ import annotations

import asyncio

from distributed.diagnostics.plugin import SchedulerPlugin

from ..wire.messages import Handler

__all__ = ["ReleaseOnClientExit"]


class ReleaseOnClientExit(SchedulerPlugin):
    """Scheduler plugin: when a driver's client leaves, tell every worker to destroy
    that driver's non-detached ranks, so a new driver can use the workers at once."""

    name = "daskwg-release"
    idempotent = True

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def remove_client(self, scheduler, client: str) -> None:
        if client.startswith("fire-and-forget") or not scheduler.workers:
            return
        asyncio.ensure_future(
            scheduler.broadcast(msg={"op": Handler.RELEASE, "client": client}, on_error="ignore")
        )
