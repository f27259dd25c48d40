"""The multi-host harness itself (``multihost``): hosts in network namespaces on a bridge,
their host names and hosts files, links down and up, bandwidth caps, byte counters, and
the clean-up of what a killed run left. Root only: elsewhere every test is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from multihost import PREFIX, MultiHost, cleanup_stale, unavailable_reason

MiB = 1 << 20


@pytest.fixture(scope="module")
def can_build_hosts():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = int(c.recv(32).decode())
    c.sendall(b"x" * n)
    c.close()
"""

FETCH = """
import socket, sys
c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[3]))
c.sendall(sys.argv[2].encode())
got = 0
while chunk := c.recv(1 << 16):
    got += len(chunk)
print(got)
"""


@pytest.fixture(scope="module")
def small_net(can_build_hosts):
    """Three bare hosts, h0 serving N bytes to whoever connects on port 9000."""
    with MultiHost(["h0", "h1", "h2"], subnet="10.200.21") as net:
        server = net.popen("h0", [sys.executable, "-c", SERVE, net.address("h0")])
        deadline = time.monotonic() + 30
        while not net.listening("h0", 9000):
            assert server.poll() is None and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.1)
        yield net


def fetch(net: MultiHost, host: str, n: int, timeout: float = 5.0) -> int | None:
    """Bytes ``host`` got asking h0 for ``n``; ``None`` where it could not connect in time."""
    done = net.run(host, [sys.executable, "-c", FETCH, net.address("h0"), str(n), str(timeout)], timeout=30)
    return int(done.stdout) if done.returncode == 0 else None


def test_hosts_talk_over_the_bridge_and_the_root_namespace_gets_no_address(small_net):
    assert fetch(small_net, "h1", 1000) == 1000
    root = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    assert "10.200.21." not in root
    assert all(f" {h}@" not in root and f" {h}:" not in root for h in ("br0", "h0", "h1", "h2"))


def test_each_host_has_its_own_host_name_and_a_hosts_file_with_it_on_127_0_1_1(small_net):
    name = small_net.run("h1", ["hostname"], timeout=10).stdout.strip()
    resolved = small_net.run("h1", ["getent", "hosts", "h1"], timeout=10).stdout.split()
    assert name == "h1"
    assert resolved[0] == "127.0.1.1"


def test_a_hosts_file_rewritten_in_place_reaches_running_processes(small_net):
    lookup = "import socket, sys; sys.stdin.readline(); print(socket.gethostbyname('h1'))"
    proc = small_net.popen("h1", [sys.executable, "-c", lookup], stdin=-1, stdout=-1, text=True)
    with small_net.hosts_file_mode(["h1"], "cluster"):
        out, _ = proc.communicate("\n", timeout=30)
    assert out.strip() == small_net.address("h1")
    after = small_net.run("h1", ["getent", "hosts", "h1"], timeout=10).stdout.split()
    assert after[0] == "127.0.1.1"


def test_link_counters_count_what_each_host_sent_and_received(small_net):
    before = small_net.counters()
    assert fetch(small_net, "h1", 4 * MiB) == 4 * MiB
    moved = small_net.counters_since(before)
    assert 4 * MiB <= moved["h0"].sent < 5 * MiB
    assert 4 * MiB <= moved["h1"].received < 5 * MiB
    assert moved["h2"].received < 64 * 1024  # only broadcasts reach the third host


def test_link_down_cuts_a_host_off_and_link_up_puts_it_back(small_net):
    small_net.link_down("h2")
    try:
        assert not small_net.is_link_up("h2")
        assert fetch(small_net, "h2", 10, timeout=1.0) is None
    finally:
        small_net.link_up("h2")
    assert fetch(small_net, "h2", 10) == 10


def test_bandwidth_cap_is_a_tbf_on_both_ends_of_the_link_until_removed(small_net):
    small_net.limit_bandwidth("h1", "200mbit")
    try:
        assert small_net.qdiscs("h1") == ["tbf", "tbf"]
        assert fetch(small_net, "h1", 1 * MiB) == 1 * MiB
    finally:
        small_net.unlimit_bandwidth("h1")
    assert "tbf" not in small_net.qdiscs("h1")


def test_stop_is_idempotent_and_removes_every_namespace(can_build_hosts):
    net = MultiHost(["h0"], subnet="10.200.22").start()
    names = [net.hub, net.hosts["h0"].netns]
    net.stop()
    net.stop()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(name in listed for name in names)
    assert not os.path.exists(f"/etc/netns/{names[1]}")


def test_namespaces_left_by_a_killed_run_are_removed_with_their_processes(can_build_hosts):
    prefix = f"{PREFIX}-selftest"
    stale = f"{prefix}-999999999-0a0a0a-h0"  # above any pid_max: its owner cannot be alive
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    os.makedirs(f"/etc/netns/{stale}", exist_ok=True)
    leftover = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    try:
        deadline = time.monotonic() + 20
        while not subprocess.run(
            ["ip", "netns", "pids", stale], capture_output=True, text=True
        ).stdout.strip():
            assert time.monotonic() < deadline, "the leftover process did not enter its namespace"
            time.sleep(0.05)
        with MultiHost(["h0"], subnet="10.200.24", prefix=prefix) as live:  # start() cleans up
            assert leftover.wait(timeout=20) == -9
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert stale not in listed
            assert live.hosts["h0"].netns in listed
            assert not os.path.exists(f"/etc/netns/{stale}")
            assert cleanup_stale(prefix) == []  # a live run's namespaces stay
    finally:
        leftover.kill()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)
