"""daskwg's scheduler plugins (besides the dashboard's): :class:`ReleaseOnClientExit`."""

from __future__ import annotations

import asyncio

from distributed.diagnostics.plugin import SchedulerPlugin

from ..wire.messages import Handler
from ..wire.records import ROOT, drop_client

__all__ = ["ReleaseOnClientExit"]


class ReleaseOnClientExit(SchedulerPlugin):
    """Scheduler plugin: when a driver's client leaves, tell every worker to destroy
    that driver's non-detached ranks, so a new driver can use the workers at once, and
    forget their groups' records (their names are scoped to that client: nobody else
    could reuse or drop them)."""

    name = "daskwg-release"
    idempotent = True

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def remove_client(self, scheduler, client: str) -> None:
        if client.startswith("fire-and-forget"):
            return
        drop_client(scheduler.get_metadata([ROOT], default=None), client)
        if not scheduler.workers:
            return
        asyncio.ensure_future(
            scheduler.broadcast(msg={"op": Handler.RELEASE, "client": client}, on_error="ignore")
        )
