"""Installing daskwg on a cluster: :func:`install_plugins`, which ``daskwg.group`` calls
before it builds a group.

It registers the worker side's :class:`~daskwg.plugin.HostPlugin` on every worker (and
every worker that joins later) and the scheduler plugins (releasing a departed driver's
ranks, the dashboard page and ``/metrics`` series). This is the one place that knows both
sides: the driver side (``daskwg.transport``) never imports the worker side.
"""

from __future__ import annotations

import logging
import weakref

from distributed import Client

from .dashboard import DashboardPlugin
from .plugin import HostPlugin
from .scheduler import ReleaseOnClientExit
from .wire import PLUGIN_NAME

__all__ = ["install_plugins"]

logger = logging.getLogger(__name__)

_installed: weakref.WeakSet[Client] = weakref.WeakSet()


def install_plugins(client: Client) -> None:
    """Register daskwg's worker and scheduler plugins through ``client``, once per client.

    The plugins are idempotent: registering them again (another driver, a restarted
    worker) reuses the instance each process already has.

    Raises:
        whatever ``client.register_plugin`` raises for the worker plugin (e.g. workers that
        cannot import daskwg). A scheduler that cannot is only logged: groups then work,
        but a driver that exits without ``shutdown()`` leaves its ranks until the workers
        restart.
    """
    if client in _installed:
        return
    client.register_plugin(HostPlugin(), name=PLUGIN_NAME)
    try:
        client.register_plugin(ReleaseOnClientExit(), name=ReleaseOnClientExit.name)
        client.register_plugin(DashboardPlugin(), name=DashboardPlugin.name)
    except Exception as exc:  # noqa: BLE001 - the scheduler may not have daskwg installed
        logger.warning(
            "could not install daskwg's scheduler plugin (%s): groups of a driver that "
            "exits without shutdown() stay on the workers until they restart",
            exc,
        )
    _installed.add(client)
