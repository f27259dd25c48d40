"""Physical floors of this machine, measured in the same run as the benchmarks.

Every function returns a list of samples in seconds (one per repetition, after a
warm-up). Nothing here uses daskwg or Ray: these are the costs any system pays on
this machine for moving bytes between processes and for a round trip to 4 peers.

* ``memcpy_warm`` / ``memcpy_fresh_torch`` / ``memcpy_fresh_numpy``: one copy of
  ``nbytes`` into an already touched buffer, into a fresh ``torch.empty`` (4 KiB pages
  faulted in by the copy) and into a fresh ``numpy.empty`` (numpy asks the kernel for
  huge pages on large allocations).
* ``tcp_transfer``: ``nbytes`` sent by a peer process over one loopback TCP
  connection, received with ``recv_into`` into a warm buffer (the loopback
  throughput) or into a fresh ``torch.empty`` (one point-to-point transfer of a new
  value, which is what a received tensor costs).
* ``tcp_chain``: ``nbytes`` sent through a chain of peer processes, each forwarding
  every 4 MiB as it arrives (a pipelined relay; the last peer acks).
* ``socket_rtt``: 8 bytes sent to each of ``peers`` echo processes, then their 8
  bytes back (``TCP_NODELAY``): the least a call to ``peers`` ranks can cost.
* ``dask_rpc``: a round trip of Dask's own comm (``ConnectionPool``, the driver's
  private event loop, as daskwg's blocking calls use it) to a trivial handler on every
  worker of a ``LocalCluster``, and (interleaved with it) the same with the handler
  passing through a one-thread executor and back: the hop daskwg's contract puts
  between a worker's event loop and rank code.
"""

from __future__ import annotations

import multiprocessing
import socket
import time

MB = 1 << 20
_CTX = multiprocessing.get_context("spawn")


def _repeat(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------- memory


def memcpy_warm(nbytes: int, reps: int) -> list[float]:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    return _repeat(lambda: dst.copy_(src), reps)


def memcpy_fresh_torch(nbytes: int, reps: int) -> list[float]:
    import torch

    src = torch.ones(nbytes // 4)
    return _repeat(lambda: torch.empty_like(src).copy_(src), reps)


def memcpy_fresh_numpy(nbytes: int, reps: int) -> list[float]:
    import numpy as np

    src = np.ones(nbytes // 4, dtype=np.float32)

    def once():
        dst = np.empty_like(src)
        np.copyto(dst, src)

    return _repeat(once, reps)


# ----------------------------------------------------------------------- sockets


def _listener() -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k


def _sender(port: int, nbytes: int) -> None:
    """Peer: on every ``g`` byte received, send ``nbytes`` from one warm buffer."""
    sock = _connect(port)
    buf = bytearray(b"\1" * nbytes)
    while sock.recv(1) == b"g":
        sock.sendall(buf)
    sock.close()


def _echo(port: int) -> None:
    """Peer: echo every 8 bytes back until the connection closes."""
    sock = _connect(port)
    buf = bytearray(8)
    view = memoryview(buf)
    try:
        while True:
            _recv_exact(sock, view)
            sock.sendall(buf)
    except ConnectionError:
        pass
    sock.close()


def _peers(target, n: int, *args) -> tuple[list, list[socket.socket], socket.socket]:
    server = _listener()
    port = server.getsockname()[1]
    procs = [_CTX.Process(target=target, args=(port, *args), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    socks = []
    server.settimeout(120)
    for _ in range(n):
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    return procs, socks, server


def _close(procs: list, socks: list[socket.socket], server: socket.socket) -> None:
    for sock in socks:
        sock.close()
    server.close()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def tcp_transfer(nbytes: int, reps: int, fresh: bool) -> list[float]:
    import torch

    procs, (sock,), server = _peers(_sender, 1, nbytes)
    warm = torch.ones(nbytes, dtype=torch.uint8)

    def once():
        dst = torch.empty(nbytes, dtype=torch.uint8) if fresh else warm
        sock.sendall(b"g")
        _recv_exact(sock, memoryview(dst.numpy()))

    try:
        return _repeat(once, reps)
    finally:
        sock.sendall(b"q")
        _close(procs, [sock], server)


def _chain_link(queue, downstream: int | None, ack: int | None, nbytes: int, chunk: int) -> None:
    """Peer of :func:`tcp_chain`: receive ``nbytes`` per repetition chunk by chunk into a
    fresh buffer, forwarding each chunk downstream as it arrives; the last link acks."""
    import numpy as np

    server = _listener()
    queue.put(server.getsockname()[1])
    upstream, _ = server.accept()
    out = _connect(downstream) if downstream is not None else None
    back = _connect(ack) if ack is not None else None
    try:
        while True:
            dst = memoryview(np.empty(nbytes, dtype=np.uint8))
            for start in range(0, nbytes, chunk):
                piece = dst[start : min(start + chunk, nbytes)]
                _recv_exact(upstream, piece)
                if out is not None:
                    out.sendall(piece)
            if back is not None:
                back.sendall(b"d")
    except ConnectionError:
        pass
    for sock in (upstream, out, back, server):
        if sock is not None:
            sock.close()


def tcp_chain(nbytes: int, hops: int, reps: int, chunk: int = 4 * MB) -> list[float]:
    """``nbytes`` from this process through a chain of ``hops`` peer processes, each
    receiving it into a fresh buffer and forwarding every ``chunk`` as it arrives: the
    least a relayed or chained broadcast to ``hops`` receivers costs on this machine
    (each byte crosses loopback ``hops`` times, on the machine's cores)."""
    acks = _listener()
    queue = _CTX.Queue()
    procs, downstream = [], None
    for i in reversed(range(hops)):
        ack = acks.getsockname()[1] if i == hops - 1 else None
        proc = _CTX.Process(target=_chain_link, args=(queue, downstream, ack, nbytes, chunk), daemon=True)
        proc.start()
        procs.append(proc)
        downstream = queue.get(timeout=120)
    head = _connect(downstream)
    acks.settimeout(120)
    back, _ = acks.accept()
    buf = bytearray(b"\1" * nbytes)
    done = bytearray(1)

    def once():
        head.sendall(buf)
        _recv_exact(back, memoryview(done))

    try:
        return _repeat(once, reps)
    finally:
        _close(procs, [head, back], acks)


def socket_rtt(peers: int, reps: int) -> list[float]:
    procs, socks, server = _peers(_echo, peers)
    msg = b"12345678"
    buf = memoryview(bytearray(8))

    def once():
        for sock in socks:
            sock.sendall(msg)
        for sock in socks:
            _recv_exact(sock, buf)

    try:
        return _repeat(once, reps)
    finally:
        _close(procs, socks, server)


# ----------------------------------------------------------------------- Dask comm


def _install_handlers(dask_worker) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(1, thread_name_prefix="floor-hop")

    def ping():
        return None

    async def hop():
        await asyncio.wrap_future(executor.submit(int))

    dask_worker.handlers["floor_ping"] = ping
    dask_worker.handlers["floor_hop"] = hop


def dask_rpc(n_workers: int, reps: int) -> dict[str, list[float]]:
    """``{"rpc": samples, "rpc+hop": samples}`` on a fresh ``LocalCluster(n_workers)``."""
    import asyncio

    import dask
    from distributed import Client, LocalCluster
    from distributed.core import ConnectionPool

    dask.config.set({"distributed.logging.distributed": "error"})
    with (
        LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(n_workers)
        client.run(_install_handlers)
        addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
        loop = asyncio.new_event_loop()
        pool = ConnectionPool(limit=64)
        loop.run_until_complete(pool.start())

        async def round_trip(op: str) -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(getattr(pool(a), op)() for a in addresses))
            return time.perf_counter() - t0

        # Interleaved, so that both see the same machine (a busy neighbour hits both).
        ops = {"rpc": "floor_ping", "rpc+hop": "floor_hop"}
        out: dict[str, list[float]] = {k: [] for k in ops}
        try:
            for rep in range(reps + 20):
                for key, op in ops.items():
                    elapsed = loop.run_until_complete(round_trip(op))
                    if rep >= 20:
                        out[key].append(elapsed)
            return out
        finally:
            loop.run_until_complete(pool.close())
            loop.close()
