"""Reserving a group's ``MASTER_PORT`` on rank 0's host: :func:`reserve_port`."""

from __future__ import annotations

import socket

from distributed.comm.addressing import get_address_host

__all__ = ["reserve_port"]


def reserve_port(address: str, reserved: set[int], port: int | None) -> int:
    """A port on the host of the worker at ``address`` for a group's rendezvous: ``port``,
    or a free one; added to ``reserved`` (the ports this worker gave out and that are not
    bound until ``init_process_group``).

    Raises:
        OSError: ``port`` is in use there or already reserved; no free port was found.
    """
    host = get_address_host(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port and port in reserved:
        # Reserved ports are not bound until init_process_group, so bind() below
        # would not see that another group already has this one.
        raise OSError(f"MASTER_PORT {port} is already used by another worker group on {host}")
    for _ in range(64):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port or 0))
            except OSError as exc:
                if port:
                    raise OSError(f"MASTER_PORT {port} is already in use on {host}: {exc.strerror}") from None
                raise
            chosen = sock.getsockname()[1]
        if port or chosen not in reserved:
            reserved.add(chosen)
            return chosen
    raise OSError(f"could not find a free port on {host}")
