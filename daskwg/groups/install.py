"""Installing daskwg on a cluster: :func:`install_plugins`, which ``daskwg.groups.group`` calls
before it builds a group.

It registers the worker side's :class:`~daskwg.plugin.HostPlugin` on every worker (and
every worker that joins later) and the scheduler plugins (releasing a departed driver's
ranks, the dashboard page and ``/metrics`` series). This is the one place that knows both
sides: the driver side (``daskwg.transport``) never imports the worker side.

Before that, :func:`check_versions` compares the daskwg and torch versions of the driver
and the group's workers (the wire format is compared by every worker when a rank is
built: ``HostPlugin``'s ``__init__`` call).
"""

from __future__ import annotations

import importlib.metadata
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from distributed import Client

from ..errors import VersionMismatchError
from ..plugin import HostPlugin
from ..scheduler.dashboard import DashboardPlugin
from ..scheduler.release import ReleaseOnClientExit
from ..wire.messages import PLUGIN_NAME

__all__ = ["install_plugins", "check_versions", "version_of", "version_problems"]

logger = logging.getLogger(__name__)

_installed: weakref.WeakSet[Client] = weakref.WeakSet()
#: per client, the worker processes (server ids) whose versions were found compatible.
_checked: weakref.WeakKeyDictionary[Client, set[str]] = weakref.WeakKeyDictionary()

#: The distributions whose versions the driver and the workers must agree on.
PACKAGES = ("daskwg", "torch")


def version_of(package: str) -> str | None:
    """The installed version of ``package`` (its distribution's metadata), ``None`` if it
    is not installed as a distribution."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str, parts: int) -> tuple:
    head = version.split("+")[0].split(".")[:parts]
    return tuple(int(p) if p.isdigit() else p for p in head)


def version_problems(driver: dict[str, str | None], worker: dict[str, str | None]) -> list[str]:
    """What keeps a worker with ``worker``'s versions from serving this driver:
    ``["daskwg 0.0.9 there, 0.1.0 here", ...]`` (empty: they can work together).

    daskwg must be the same ``major.minor`` release on both sides (its calls' format may
    change between them; the wire format is checked too when a rank is built), torch the
    same major version (tensors travel as torch's bytes and dtypes). A version that is
    unknown on either side (not installed as a distribution) is not compared.
    """
    problems = []
    for package, parts in (("daskwg", 2), ("torch", 1)):
        here, there = driver.get(package), worker.get(package)
        if here and there and _release(here, parts) != _release(there, parts):
            problems.append(f"{package} {there} there, {here} here")
    return problems


def check_versions(client: Client, slots: Sequence[Any]) -> None:
    """Refuse workers whose daskwg or torch cannot work with this driver's, before a
    group is built on them (once per worker process and client).

    The versions come from each worker's installed distributions
    (``importlib.metadata``, through ``client.run``), which any worker can report,
    whatever daskwg it runs. A worker that does not answer is left to the build,
    which reports it.

    Raises:
        VersionMismatchError: naming each worker and both versions.
    """
    checked = _checked.setdefault(client, set())
    todo = [s for s in slots if s.server_id not in checked]
    if not todo:
        return
    addresses = [s.address for s in todo]
    here = {p: version_of(p) for p in PACKAGES}
    there: dict[str, dict[str, Any]] = {a: {} for a in addresses}
    for package in PACKAGES:
        answers = client.run(importlib.metadata.version, package, workers=addresses, on_error="return")
        for address, answer in answers.items():
            there.setdefault(address, {})[package] = None if isinstance(answer, BaseException) else answer
    refused = {a: version_problems(here, v) for a, v in there.items()}
    refused = {a: p for a, p in refused.items() if p}
    if refused:
        listed = "; ".join(f"{address}: {', '.join(p)}" for address, p in sorted(refused.items()))
        raise VersionMismatchError(
            f"the driver (daskwg {here['daskwg']}, torch {here['torch']}) cannot use worker(s) whose versions "
            f"differ: {listed}. Install the same daskwg wheel (and the same torch) in the driver's and every "
            "worker's environment, then restart those workers"
        )
    checked.update(s.server_id for s in todo)


def install_plugins(client: Client) -> None:
    """Register daskwg's worker and scheduler plugins through ``client``, once per client.

    The plugins are idempotent: registering them again (another driver, a restarted
    worker) reuses the instance each process already has.

    Raises:
        Exception: whatever ``client.register_plugin`` raises for the worker plugin (e.g.
            workers that cannot import daskwg). A scheduler that cannot is only logged:
            groups then work, but a driver that exits without ``shutdown()`` leaves its
            ranks until the workers restart.
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
