"""Call streams between processes of one host over Unix-domain sockets.

A driver's call stream to a worker of its own host (``daskwg.transport.streams``, served by
``daskwg.plugin.stream``) carries one message per call and one per reply. Over loopback TCP
each message goes through the kernel's TCP stack on both ends (18 µs of the sender's CPU for
a small one here, against 1.6 µs on a Unix-domain socket; a round trip 90 against 65 µs), a
cost every rank pays on every call. So each worker process also listens on an abstract
Unix-domain socket named after its Dask server id (:func:`listen`), and a driver opens its
call streams there first (:func:`connect`), over Dask's TCP comm (a ``TCP`` comm on the
Unix socket's tornado stream): the stream's frames, opening and shared-memory files are the
same; only the socket differs.

Where it applies: Linux; plain ``tcp://`` workers (with TLS the call streams stay on TLS);
a driver in the worker's network namespace (abstract socket names belong to one: a driver
on another host, or in another namespace of this one, never finds the name and connects
over TCP as before); and both ends of one user: each checks the other's credentials
(``SO_PEERCRED``; an abstract socket has no file permissions). The worker closes a
connection from another user's process; a driver finding a worker of another user there
connects over TCP instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import struct
import sys
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed.comm.core import Comm
from distributed.comm.tcp import MAX_BUFFER_SIZE, TCP
from tornado.iostream import IOStream
from tornado.netutil import add_accept_handler

from .messages import Handler

__all__ = ["connect", "is_local", "listen", "socket_name"]

logger = logging.getLogger(__name__)

#: Scheme of the comms' addresses (never dialled: the socket is found by its name).
SCHEME = "local"

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_refused: set[int] = set()  # users whose connections were refused


def socket_name(server_id: str) -> bytes:
    """The abstract socket name of the worker process whose Dask server id is ``server_id``."""
    return b"\0daskwg-stream-" + server_id.encode()


def is_local(comm: Any) -> bool:
    """Whether ``comm`` is a call stream on a Unix-domain socket (a peer of this host)."""
    return isinstance(comm, _LocalComm)


def _supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


class _LocalComm(TCP):
    """Dask's ``TCP`` comm on a Unix-domain socket's tornado stream, without the TCP socket
    options (keepalive and user timeout) it sets on a TCP one."""

    def __init__(self, stream: IOStream, local_addr: str, peer_addr: str):
        self._closed = False
        Comm.__init__(self, deserialize=True)
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self.stream = stream
        self._finalizer = weakref.finalize(self, self._get_finalizer())
        self._finalizer.atexit = False
        self._extra: dict = {}
        ref = weakref.ref(self)
        stream.set_close_callback(functools.partial(_closed, ref))


def _closed(ref: Any) -> None:
    comm = ref()
    if comm is not None:
        comm._closed = True


# ---- the worker's side


def listen(server_id: str, serve: Callable[[Any, dict | None], Awaitable[Any]]) -> Callable[[], None] | None:
    """Listen for call streams on this process's abstract socket (on the current event loop).

    Args:
        server_id: the worker's Dask server id (``Worker.id``).
        serve: ``serve(comm, files)``, what the ``daskwg_stream`` handler does with a stream
            opened over TCP (``files``: the opening's shared-memory probe).

    Returns:
        a function that stops listening; ``None`` where none can be made (not Linux, or the
        name is taken), when drivers connect over TCP only.
    """
    if not _supported():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(socket_name(server_id))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        logger.info("daskwg: no Unix-domain socket for call streams (%s); drivers connect over TCP", exc)
        return None
    here = f"{SCHEME}://{server_id}"

    def accepted(conn: socket.socket, _address: Any) -> None:
        peer = _peer_of_our_user(conn)
        if peer is None:
            conn.close()
            return
        comm = _LocalComm(IOStream(conn, max_buffer_size=MAX_BUFFER_SIZE), here, f"{SCHEME}://pid-{peer}")
        asyncio.ensure_future(_serve_one(comm, serve))

    stop = add_accept_handler(sock, accepted)

    def close() -> None:
        stop()
        sock.close()

    return close


def _credentials(sock: socket.socket) -> tuple[int, int] | None:
    """``(pid, uid)`` of the process at the other end of ``sock`` (for a connecting socket:
    the one that listens), or ``None`` if the kernel does not say."""
    try:
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return None
    return pid, uid


def _peer_of_our_user(conn: socket.socket) -> int | None:
    """The peer's pid if it runs as this process's user, else ``None`` (logged)."""
    credentials = _credentials(conn)
    if credentials is None:
        return None
    pid, uid = credentials
    if uid != os.getuid():
        # Once per user at warning level: any local user could flood the log otherwise.
        log = logger.debug if uid in _refused else logger.warning
        _refused.add(uid)
        log(
            "daskwg: refused a call stream from process %d of user %d (this worker runs as user %d)",
            pid,
            uid,
            os.getuid(),
        )
        return None
    return pid


async def _serve_one(comm: Any, serve: Callable[[Any, dict | None], Awaitable[Any]]) -> None:
    """Read the stream's opening (the ``{"op": "daskwg_stream"}`` message a TCP stream's
    opening is) and serve it until it closes."""
    timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
    try:
        opening = await asyncio.wait_for(comm.read(), timeout)
        if not isinstance(opening, dict) or opening.get("op") != Handler.STREAM:
            raise OSError(f"not a call stream's opening: {opening!r:.80}")
        await serve(comm, opening.get("files"))
    except Exception as exc:  # noqa: BLE001 - a broken or foreign connection: closed, nothing else
        logger.debug("daskwg: a call stream on the Unix-domain socket ended: %r", exc)
    finally:
        comm.abort()


# ---- the driver's side


async def connect(address: str, server_id: str | None) -> Any:
    """A comm to the worker process ``server_id`` (at ``address``) over its Unix-domain
    socket, or ``None`` when there is none to reach from here (then connect over TCP):
    another host, another network namespace, not a ``tcp://`` worker, a worker of another
    user (which would refuse the stream), or not Linux."""
    if server_id is None or not address.startswith("tcp://") or not _supported():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, socket_name(server_id))
    except OSError:
        sock.close()
        return None
    credentials = _credentials(sock)
    if credentials is None or credentials[1] != os.getuid():
        # A worker of another user refuses this process's streams: TCP, where Dask's own
        # security applies, reaches it.
        sock.close()
        return None
    return _LocalComm(
        IOStream(sock, max_buffer_size=MAX_BUFFER_SIZE), f"{SCHEME}://pid-{os.getpid()}", address
    )
