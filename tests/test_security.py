"""Security and multi-driver behaviour on real clusters: TLS, IPv6, two drivers on one
cluster, and drivers that exit or die without ``shutdown()``."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import CLICluster, process_cluster, wait_for_workers
from distributed import Client
from distributed.security import Security
from workers import AddWorker, CollectiveWorker

from daskwg import ClassWithInitArgs, RankError, WorkerGroup
from daskwg.serialization import pickling as serialization
from daskwg.transport import Driver as _Driver
from daskwg.wire import local_link
from daskwg.wire.messages import Call, CallMessage, Reply

TESTS_DIR = os.path.dirname(__file__)


def _hosted_group_names(client: Client) -> dict[str, set[str]]:
    def names(dask_worker):
        host = dask_worker.plugins.get("daskwg")
        return {name for name, _, _ in host.hosted_ranks()} if host is not None else set()

    return client.run(names)


def _wait_until_released(client: Client, name: str, timeout: float = 30) -> dict[str, set[str]]:
    """Poll the workers until no rank of group ``name`` is hosted (or ``timeout`` s pass)."""
    deadline = time.monotonic() + timeout
    while True:
        hosted = _hosted_group_names(client)
        if not any(name in groups for groups in hosted.values()) or time.monotonic() > deadline:
            return hosted
        time.sleep(0.2)


# ---- TLS ------------------------------------------------------------------------------


def _temporary_security() -> Security:
    pytest.importorskip("cryptography", reason="Security.temporary() needs the cryptography package")
    return Security.temporary()


@pytest.fixture(scope="module")
def tls_cluster():
    security = _temporary_security()
    with process_cluster(2, security=security, protocol="tls://") as cluster:
        yield cluster, security


def test_a_group_calls_over_both_paths_on_a_tls_cluster(tls_cluster):
    cluster, security = tls_cluster
    with Client(cluster.scheduler_address, security=security, timeout=30) as client:
        wait_for_workers(client, 2)
        with WorkerGroup(client, ClassWithInitArgs(AddWorker, x=10), world_size=2) as wg:
            assert all(address.startswith("tls://") for address in wg.workers)
            # Blocking: straight to the workers over the direct comm path.
            assert wg.foo(x=1, y=2) == [13, 13]
            # Non-blocking: Dask tasks pinned to the workers.
            futures = wg.record(7)
            assert client.gather(futures) == [7, 7]
            assert wg.get_log() == [[7], [7]]
            # The call streams stay on TLS: none went over a Unix-domain socket.
            driver = _Driver.of(client)
            streams = [*driver.streams._streams.values(), *driver.channel().streams._streams.values()]
            assert streams and not any(local_link.is_local(s.frames.comm) for s in streams)
            assert all(s.frames.comm.peer_address.startswith("tls://") for s in streams)
            # ...and the workers offer none: nothing bypasses the cluster's certificates.
            listening = client.run(
                lambda dask_worker: dask_worker.plugins["daskwg"]._stop_listening is not None
            )
            assert listening == {w: False for w in wg.workers}


@pytest.mark.parametrize(
    ("scheme", "credentials", "error", "message"),
    [
        ("tls", "none", TypeError, "TLS expects a `ssl_context`"),
        ("tls", "another-ca", OSError, "TLS certificate does not match"),
        ("tcp", "none", OSError, None),
    ],
)
def test_a_client_without_the_cluster_credentials_cannot_connect(
    tls_cluster, scheme, credentials, error, message
):
    """No TLS context, a certificate from another CA, or plain TCP to the TLS port: the
    connection fails within the client's timeout."""
    cluster, _ = tls_cluster
    security = _temporary_security() if credentials == "another-ca" else None
    address = cluster.scheduler_address.replace("tls://", f"{scheme}://")
    with pytest.raises(error, match=message):
        Client(address, security=security, timeout=5)
    # The half-built Client is closed by its __del__, which takes a lock all of Dask's
    # loop runners share: let it run now rather than when gc strikes inside a later
    # client's start (a deadlock until the test timeout).
    gc.collect()


def test_a_group_calls_over_both_paths_on_a_tls_cli_cluster(tmp_path):
    security = _temporary_security()
    files = {
        "ca": security.tls_ca_file,
        "cert": security.tls_scheduler_cert,
        "key": security.tls_scheduler_key,
    }
    paths = {}
    for kind, pem in files.items():
        paths[kind] = tmp_path / f"{kind}.pem"
        paths[kind].write_text(pem)
    tls_args = [
        "--tls-ca-file",
        str(paths["ca"]),
        "--tls-cert",
        str(paths["cert"]),
        "--tls-key",
        str(paths["key"]),
    ]
    cluster = CLICluster(2, extra_scheduler=tls_args, extra_worker=tls_args, protocol="tls")
    try:
        client_security = Security(
            tls_ca_file=str(paths["ca"]),
            tls_client_cert=str(paths["cert"]),
            tls_client_key=str(paths["key"]),
            require_encryption=True,
        )
        with Client(cluster.address, security=client_security, timeout=30) as client:
            wait_for_workers(client, 2)
            with WorkerGroup(client, AddWorker, world_size=2) as wg:
                assert wg.foo(x=1, y=2) == [5, 5]
                assert client.gather(wg.record(3)) == [3, 3]
    finally:
        cluster.close()


# ---- IPv6 -----------------------------------------------------------------------------


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def ipv6_client():
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (cannot bind ::1)")
    # LocalCluster wants the literal in brackets, as in an address; MASTER_ADDR must not have them.
    with process_cluster(2, host="[::1]") as cluster, Client(cluster) as client:
        wait_for_workers(client, 2)
        yield client


def test_master_addr_on_an_ipv6_cluster_is_the_bare_literal(ipv6_client):
    with WorkerGroup(ipv6_client, AddWorker, world_size=2) as wg:
        assert all(address.startswith("tcp://[::1]:") for address in wg.workers)
        envs = wg.environment()
        assert [env["MASTER_ADDR"] for env in envs] == ["::1", "::1"]
        assert wg.master_addr_port[0] == "::1"
        assert wg.foo(x=1, y=2) == [5, 5]


def test_gloo_all_gather_rendezvous_over_ipv6(ipv6_client):
    with WorkerGroup(ipv6_client, CollectiveWorker, world_size=2) as wg:
        assert wg.init_process_group() == [True, True]
        assert wg.all_gather_rank() == [[0, 0, 1, 1], [0, 0, 1, 1]]
        wg.destroy()


def test_a_master_port_held_on_ipv4_is_refused_for_an_ipv6_group(ipv6_client):
    # The CI failure behind this: a port free on ::1 but held on 0.0.0.0 was reserved, and
    # rank 0's TCPStore (listening on every address) failed with EADDRINUSE.
    with socket.socket(socket.AF_INET) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"MASTER_PORT {port} is already in use on ::1"):
            WorkerGroup(ipv6_client, AddWorker, world_size=2, master_port=port)


# ---- two drivers on one cluster -------------------------------------------------------


def test_two_drivers_each_reach_their_own_group_on_the_same_workers(cluster4):
    with Client(cluster4) as first, Client(cluster4) as second:
        workers = sorted(first.scheduler_info()["workers"])[:2]
        with (
            WorkerGroup(first, ClassWithInitArgs(AddWorker, x=10), workers=workers) as one,
            WorkerGroup(second, ClassWithInitArgs(AddWorker, x=20), workers=workers) as two,
        ):
            assert one.workers == two.workers
            assert one.pid() == two.pid()
            assert one.foo(x=1, y=2) == [13, 13]
            assert two.foo(x=1, y=2) == [23, 23]
            first.gather(one.record(1))
            second.gather(two.record(2))
            assert one.get_log() == [[1], [1]]
            assert two.get_log() == [[2], [2]]


def test_a_group_name_in_use_by_another_connected_driver_is_that_drivers_own(cluster4):
    # Names of non-detached groups are scoped to their client (issue 44), as Dask's keys are;
    # tests/test_two_jobs.py holds the rest of the rule.
    with Client(cluster4) as first, Client(cluster4) as second:
        with WorkerGroup(first, ClassWithInitArgs(AddWorker, x=10), world_size=1, name="shared-name") as one:
            with WorkerGroup(second, AddWorker, world_size=1, name="shared-name") as two:
                assert one.foo(x=1, y=2) == [13]
                assert two.foo(x=1, y=2) == [5]


def test_a_second_driver_has_no_handle_on_a_non_detached_group(cluster4):
    with Client(cluster4) as first, Client(cluster4) as second:
        with WorkerGroup(first, AddWorker, world_size=2, name="private") as wg:
            with pytest.raises(ValueError, match="no detached group named 'private'"):
                WorkerGroup.attach(second, "private")
            assert wg.foo(x=1, y=2) == [5, 5]


def _send_as(client: Client, wg: WorkerGroup, method: str) -> dict:
    """Send one raw call of ``method`` into rank 0 of ``wg`` as ``client``'s driver, the
    way :class:`WorkerGroup` sends blocking calls (a ``CallMessage`` on the driver's call
    stream to that worker); returns the worker's reply as ``{"status", "exception"}``."""
    driver = _Driver.of(client)
    slot = wg._slots[0]
    (seq,) = driver.sequencer.take_seqs([slot.server_id])
    call = Call(
        session=driver.sequencer.session,
        seq=seq,
        group_id=wg._group_id,
        group_name=wg.name,
        rank=0,
        method=method,
        owner=client.id,
        worker_id=slot.server_id,
    )

    payload = serialization.dumps(((), {}))

    async def send():
        message = CallMessage(call, payload.header).to_wire()
        return await driver.streams.request(slot.address, slot.server_id, message, payload.buffers)

    reply, _ = client.sync(send)
    reply = Reply.from_wire(reply)
    return {"status": reply.status, "exception": None if reply.error is None else pickle.loads(reply.error)}


@pytest.mark.parametrize("method", ["pid", "__del__"])
def test_the_workers_refuse_a_call_from_a_driver_that_does_not_own_the_group(cluster4, method):
    with Client(cluster4) as first, Client(cluster4) as second:
        with WorkerGroup(first, AddWorker, world_size=2) as wg:
            reply = _send_as(second, wg, method)
            assert reply["status"] == "error"
            error = reply["exception"]
            assert isinstance(error, RankError)
            assert isinstance(error.exception, PermissionError)
            assert "belongs to another driver" in str(error.exception)
            # The owner's group is untouched.
            assert wg.foo(x=1, y=2) == [5, 5]


def test_a_second_driver_attaches_to_a_detached_group_and_uses_it(cluster4):
    with Client(cluster4) as first, Client(cluster4) as second:
        wg = WorkerGroup(first, AddWorker, world_size=2, name="shared-detached", detached=True)
        try:
            first.gather(wg.record(1))
            attached = WorkerGroup.attach(second, "shared-detached")
            assert attached.workers == wg.workers
            assert attached.get_log() == [[1], [1]]
            second.gather(attached.record(2))
            assert wg.get_log() == [[1, 2], [1, 2]]
            attached.shutdown()
            assert not any("shared-detached" in groups for groups in _hosted_group_names(first).values())
        finally:
            wg.shutdown()


# ---- a driver that exits or dies without shutdown() ------------------------------------

_DRIVER = textwrap.dedent(
    """
    import sys, time
    from distributed import Client
    from daskwg import WorkerGroup
    from workers import AddWorker

    address, name, mode = sys.argv[1:]
    client = Client(address, timeout=30)
    wg = WorkerGroup(client, AddWorker, world_size=2, name=name)
    print(wg.foo(x=1, y=2), flush=True)
    if mode == "hang":
        time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def cli_cluster2():
    cluster = CLICluster(2)
    try:
        with Client(cluster.address, timeout=30) as client:
            wait_for_workers(client, 2)
            yield cluster, client
    finally:
        cluster.close()


def _start_driver(address: str, name: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", _DRIVER, address, name, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(90)
def test_a_driver_that_exits_without_shutdown_frees_its_ranks(cli_cluster2):
    cluster, client = cli_cluster2
    driver = _start_driver(cluster.address, "exits", "exit")
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 0, err
    assert out.strip() == "[5, 5]"
    hosted = _wait_until_released(client, "exits")
    assert not any("exits" in groups for groups in hosted.values()), hosted
    with WorkerGroup(client, AddWorker, world_size=2) as wg:
        assert wg.foo(x=1, y=2) == [5, 5]


@pytest.mark.timeout(90)
def test_a_sigkilled_driver_frees_its_ranks(cli_cluster2):
    cluster, client = cli_cluster2
    driver = _start_driver(cluster.address, "killed", "hang")
    try:
        assert driver.stdout.readline().strip() == "[5, 5]", (
            driver.stderr.read() if driver.poll() is not None else ""
        )
        assert all("killed" in groups for groups in _hosted_group_names(client).values())
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    hosted = _wait_until_released(client, "killed")
    assert not any("killed" in groups for groups in hosted.values()), hosted
    with WorkerGroup(client, AddWorker, world_size=2) as wg:
        assert wg.foo(x=1, y=2) == [5, 5]
