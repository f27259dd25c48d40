"""Call streams to workers of the driver's own host go over Unix-domain sockets
(``daskwg.wire.local_link``): on a real process cluster, every stream the driver opens (its
client loop's and its calling thread's) is one, with shared-memory files agreed; a
process of another user is refused; and a worker with no such socket is reached over
TCP as before."""

from __future__ import annotations

import asyncio
import os
import subprocess
import textwrap
import threading

import pytest
import torch
from workers import PathWorker

import daskwg
from daskwg import DataProto, WorkerGroup
from daskwg.transport import Driver
from daskwg.wire import local_link

pytestmark = pytest.mark.timeout(120)


def _streams(client) -> list:
    driver = Driver.of(client)
    return [*driver.streams._streams.values(), *driver.channel().streams._streams.values()]


def test_call_streams_to_workers_of_this_host_are_unix_domain_sockets_with_shared_files(client4):
    with WorkerGroup(client4, PathWorker, world_size=4) as wg:
        assert wg.nap(0) == [0] * 4  # blocking: this thread's streams
        data = DataProto.from_dict({"x": torch.arange(8)})
        assert wg.double(wg.make(data)).get().batch["x"].tolist() == [(i + 1) * 2 for i in range(8)]
        streams = _streams(client4)
        assert len(streams) == 8  # 4 workers, from the client's loop and from this thread
        assert all(local_link.is_local(s.frames.comm) for s in streams)
        assert all(s.frames.files is not None for s in streams)
        peers = {s.frames.comm.peer_address for s in streams}
        assert peers == set(wg.workers)


def test_a_worker_without_its_unix_domain_socket_is_reached_over_tcp(fresh_cluster4):
    cluster, client = fresh_cluster4

    def stop_listening(dask_worker):
        dask_worker.plugins["daskwg"]._stop_listening()

    with WorkerGroup(client, PathWorker, world_size=2) as wg:
        client.run(stop_listening, workers=[wg.workers[1]])
        found = {}

        def call_from_a_new_thread():
            # A thread's first call opens its streams: the worker that stopped listening gets TCP.
            found["values"] = wg.nap(0)
            found["local"] = {
                s.frames.comm.peer_address: local_link.is_local(s.frames.comm)
                for s in Driver.of(client).channel().streams._streams.values()
            }

        thread = threading.Thread(target=call_from_a_new_thread)
        thread.start()
        thread.join(60)
        assert found["values"] == [0, 0]
        assert found["local"] == {wg.workers[0]: True, wg.workers[1]: False}
        assert daskwg.get(wg.nap_async(0)) == [0, 0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another user")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system Python to run as another user")
def test_a_process_of_another_user_is_refused_and_the_worker_keeps_serving(client4):
    with WorkerGroup(client4, PathWorker, world_size=1) as wg:
        (worker,) = wg.workers
        server = client4.run(lambda dask_worker: dask_worker.id, workers=[worker])[worker]
        # Nothing is sent: an accepted stream would wait for its opening (30 s), a refused
        # one is closed at once.
        probe = textwrap.dedent(
            f"""
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect({local_link.socket_name(server)!r})
            try:
                print("closed" if s.recv(100) == b"" else "answered")
            except ConnectionResetError:
                print("closed")
            except TimeoutError:
                print("open")
            """
        )
        out = subprocess.run(
            ["/usr/bin/python3", "-c", probe], user=65534, capture_output=True, text=True, timeout=30
        )
        assert out.stdout.strip() == "closed", out.stderr
        assert wg.nap(0) == [0]
        assert daskwg.get(wg.nap_async(0)) == [0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to listen as another user")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no system Python to run as another user")
def test_a_driver_does_not_use_the_socket_of_a_worker_of_another_user():
    # Such a worker would refuse the stream: the driver goes to TCP instead of failing.
    server_id = f"test-other-user-{os.getpid()}"
    listener = textwrap.dedent(
        f"""
        import socket, sys, time
        s = socket.socket(socket.AF_UNIX)
        s.bind({local_link.socket_name(server_id)!r})
        s.listen(8)
        print("listening", flush=True)
        time.sleep(30)
        """
    )
    other = subprocess.Popen(
        ["/usr/bin/python3", "-c", listener], user=65534, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "listening"
        assert asyncio.run(local_link.connect("tcp://127.0.0.1:1", server_id)) is None
        assert asyncio.run(local_link.connect("tls://127.0.0.1:1", server_id)) is None
    finally:
        other.kill()
        other.wait(10)
    # Our own user's listener is used.
    served = asyncio.run(_connect_to_own_listener())
    assert served


async def _connect_to_own_listener() -> bool:
    stop = local_link.listen(f"test-own-user-{os.getpid()}", lambda comm, files: asyncio.sleep(0))
    try:
        comm = await local_link.connect("tcp://127.0.0.1:1", f"test-own-user-{os.getpid()}")
        ok = comm is not None and local_link.is_local(comm)
        if comm is not None:
            comm.abort()
        return ok
    finally:
        stop()
