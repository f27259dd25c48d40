"""Which network interface torch.distributed's gloo and nccl use between hosts: the one
that carries this worker's Dask address (:func:`socket_ifname_env`).

Left to themselves, gloo and nccl bind the address the host's name resolves to, which on
many machines is a loopback address (Debian's ``/etc/hosts`` maps the host name to
127.0.1.1): ranks on other hosts then cannot connect. The interface that carries the
worker's Dask address is one the other hosts already reach.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

import psutil

__all__ = ["SOCKET_IFNAME_KEYS", "interface_of", "socket_ifname_env"]

logger = logging.getLogger(__name__)

#: The variables that name the interface of gloo's and nccl's sockets.
SOCKET_IFNAME_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(host: str) -> str | None:
    """The name of the local interface holding ``host``'s address (``"eth0"``, ``"lo"``),
    or ``None`` where no interface holds it (``host``: an IP address, or a name that
    resolves to one)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address.split("%")[0] in addresses:
                return name
    return None


def socket_ifname_env(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``{GLOO_SOCKET_IFNAME: name, NCCL_SOCKET_IFNAME: name}`` for the interface holding
    ``host`` (the worker's Dask address), without the variables ``environ`` (the worker
    process's own environment) already sets; ``{}`` where no interface holds it."""
    wanted = [key for key in SOCKET_IFNAME_KEYS if key not in environ]
    if not wanted:
        return {}
    name = interface_of(host)
    if name is None:
        logger.info(
            "no interface holds this worker's address %s: %s left unset (gloo and nccl pick their own)",
            host,
            " and ".join(wanted),
        )
        return {}
    return dict.fromkeys(wanted, name)
