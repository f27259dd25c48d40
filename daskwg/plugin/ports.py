"""Reserving a group's ``MASTER_PORT`` on rank 0's host: :func:`reserve_port`."""

from __future__ import annotations

import errno
import random
import socket

import dask.config
from distributed.comm.addressing import get_address_host

__all__ = ["port_range", "reserve_port"]

#: Where the kernel's ephemeral range is read (the ports it gives connections and port-0 binds).
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def port_range() -> tuple[int, int]:
    """The ports (first, last, inclusive) free ``MASTER_PORT``\\ s are drawn from on this host.

    ``daskwg.master-port-range`` (``"first:last"``, as Dask's ``--worker-port``), read on
    the worker; by default the 10000 ports below the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``, 32768-60999 on Linux). A port the kernel hands out
    itself could be taken by any connection's own end between this reservation and rank 0's
    ``init_process_group`` binding it (``EADDRINUSE``); a port below that range only by a
    server asking for it by number.

    Raises:
        ValueError: the setting is not ``"first:last"`` with 1 <= first <= last <= 65535.
    """
    value = dask.config.get("daskwg.master-port-range", None)
    if value is None:
        try:
            with open(EPHEMERAL_RANGE) as f:
                ephemeral = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral = 32768
        return max(1024, ephemeral - 10000), max(1024, ephemeral - 1)
    try:
        first, last = (int(part) for part in str(value).split(":"))
    except ValueError:
        first = last = 0
    if not 1 <= first <= last <= 65535:
        raise ValueError(
            f"daskwg.master-port-range must be 'first:last' with 1 <= first <= last <= 65535, "
            f"got {value!r}; e.g. '29500:29600'"
        )
    return first, last


def _bindable(host: str, port: int) -> OSError | None:
    """Whether a server could listen on ``port`` here: on ``host`` and on every address of
    both families (``torch.distributed.TCPStore`` listens on all of them). ``None`` if so,
    else the error of the bind that failed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addresses = [(family, host), (socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        addresses.append((socket.AF_INET6, "::"))
    for family, address in addresses:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address, port))
        except OSError as exc:
            if address in ("0.0.0.0", "::") and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # this host has no address of that family
            return exc
    return None


def reserve_port(address: str, reserved: set[int], port: int | None) -> int:
    """A port on the host of the worker at ``address`` for a group's rendezvous: ``port``,
    or a free one of :func:`port_range`; added to ``reserved`` (the ports this worker gave
    out and that are not bound until ``init_process_group``).

    A port counts as free when nothing is bound to it on any address of either family, as
    ``TCPStore``'s listening socket needs (a port free on ``::1`` but held on ``0.0.0.0``
    would fail there with ``EADDRINUSE``).

    Raises:
        OSError: ``port`` is in use there or already reserved; no free port was found in
            64 tries.
        ValueError: ``daskwg.master-port-range`` is malformed.
    """
    host = get_address_host(address)
    if port:
        if port in reserved:
            # Reserved ports are not bound until init_process_group, so a bind would not
            # see that another group already has this one.
            raise OSError(f"MASTER_PORT {port} is already used by another worker group on {host}")
        error = _bindable(host, port)
        if error is not None:
            raise OSError(f"MASTER_PORT {port} is already in use on {host}: {error.strerror}")
        reserved.add(port)
        return port
    first, last = port_range()
    for _ in range(64):
        chosen = random.randint(first, last)
        if chosen not in reserved and _bindable(host, chosen) is None:
            reserved.add(chosen)
            return chosen
    raise OSError(
        f"could not find a free port on {host} in {first}:{last} (daskwg.master-port-range) "
        "after 64 tries; widen the range or pass master_port="
    )
