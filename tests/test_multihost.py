"""Many hosts for real (issue 20): a scheduler, workers and drivers on separate hosts made
of network namespaces (``multihost``), real TCP between them, link byte counters that
show which link a byte crossed, links taken down to partition a host.

The cluster: the scheduler on h0, two ``dask worker`` processes each on h1 and h2, the
driver on h3 (a process in that host, ``multihost_driver``), a second driver host h4.
Every host's ``/etc/hosts`` is the Debian default, where its own name resolves to
127.0.1.1. Measured figures are printed (``pytest -s``) and listed at the end of the
run; bounds are loose, timings never asserted.

Root only: elsewhere every test here is skipped with the reason.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from multihost import LinkBytes, MultiHost, unavailable_reason

MiB = 1 << 20
ROWS, COLS = 8192, 2048  # float32: the 64 MiB batch
BATCH = ROWS * COLS * 4
QUIET = 2 * MiB  # "no batch byte": heartbeats and task messages only, far below one batch
PARTITION_BOUND_S = 15.0  # the target is 10 s with default settings (measured 7-8 s); loosely
SHORT_TCP_TIMEOUT = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s"}  # the item 4 setting
EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "grpo.py")
ALL_WORKERS = ["h1-0", "h1-1", "h2-0", "h2-1"]

# Start-up and the partitions take minutes on a loaded 2-core machine; every wait inside
# has its own, shorter bound.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def can_build_hosts():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


# ------------------------------------------------------------------ the cluster


class Cluster:
    """The module's hosts, scheduler, workers and drivers."""

    def __init__(self, net: MultiHost, scheduler: str):
        self.net = net
        self.scheduler = scheduler
        self.driver = net.start_driver("h3", "multihost_driver.py", scheduler, name="h3-main")
        # Started now, so their start-up overlaps the workers'; used by the last tests.
        self.h4 = net.start_driver("h4", "multihost_driver.py", scheduler, name="h4", env=SHORT_TCP_TIMEOUT)
        self.spare = {
            "blocking": net.start_driver("h3", "multihost_driver.py", scheduler, name="h3-blocking"),
            "non-blocking": net.start_driver("h3", "multihost_driver.py", scheduler, name="h3-non-blocking"),
            "idle": net.start_driver("h3", "multihost_driver.py", scheduler, name="h3-idle"),
            "lost": net.start_driver(
                "h3", "multihost_driver.py", scheduler, name="h3-lost", env=SHORT_TCP_TIMEOUT
            ),
        }

    def measure(self, scenario: str, timeout: float = 120.0, **args) -> tuple[dict, dict[str, LinkBytes]]:
        """Run a ready/go/done scenario in the h3 driver: its result and the bytes each
        link carried during its measured step."""
        self.driver.start(scenario, **args)
        self.driver.expect("ready", timeout)
        before = self.net.counters()
        self.driver.signal("go")
        self.driver.expect("done", timeout)
        moved = self.net.counters_since(before)
        return self.driver.result(timeout), moved

    def healthy(self, timeout: float = 90.0) -> dict:
        """Wait until the four workers are in the cluster and answer; their process ids."""
        self.driver.call("wait_for_workers", timeout=timeout + 10, n=4, timeout_s=timeout)
        return self.driver.call("workers_respond", timeout=timeout)


@pytest.fixture(scope="module")
def cluster(can_build_hosts, figure, tmp_path_factory):
    with MultiHost(["h0", "h1", "h2", "h3", "h4"], log_dir=tmp_path_factory.mktemp("multihost-logs")) as net:
        t0 = time.perf_counter()
        scheduler = net.start_scheduler("h0")
        for host in ("h1", "h2"):
            net.start_workers(host, scheduler, nworkers=2)
        cluster = Cluster(net, scheduler)
        assert cluster.driver.call("wait_for_workers", timeout=180, n=4, timeout_s=170) == ALL_WORKERS
        # The first group on a worker imports torch and daskwg there: not any test's time.
        cluster.driver.call("layout", timeout=300, world_size=4)
        figure(f"cluster up in {time.perf_counter() - t0:.1f} s ({net.run_id}, logs in {net.log_dir})")
        yield cluster


def links(moved: dict[str, LinkBytes], *hosts: str) -> str:
    return "; ".join(f"{h} {moved[h]}" for h in hosts)


# ------------------------------------------------------------------ ranks and rendezvous


def test_ranks_are_contiguous_per_host_and_local_ranks_count_per_host(cluster):
    out = cluster.driver.call("layout", world_size=4)
    ranks = out["ranks"]
    assert [r["hostname"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2", "3"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r["LOCAL_WORLD_SIZE"] for r in ranks] == ["2", "2", "2", "2"]
    assert [w.split("//")[1].rsplit(":", 1)[0] for w in out["workers"]] == [
        cluster.net.address(h) for h in ("h1", "h1", "h2", "h2")
    ]


def test_master_addr_is_rank_zeros_host_for_every_rank(cluster):
    mixed = cluster.driver.call("layout", world_size=3, workers=["h2-0", "h2-1", "h1-1"])
    on_h2 = cluster.driver.call("layout", world_size=2, workers=["h2-0", "h2-1"])
    assert [r["hostname"] for r in mixed["ranks"]] == ["h1", "h2", "h2"]
    assert [r["LOCAL_WORLD_SIZE"] for r in mixed["ranks"]] == ["1", "2", "2"]
    assert {r["MASTER_ADDR"] for r in mixed["ranks"]} == {cluster.net.address("h1")}
    assert {r["MASTER_PORT"] for r in mixed["ranks"]} == {str(mixed["master"][1])}
    assert {r["MASTER_ADDR"] for r in on_h2["ranks"]} == {cluster.net.address("h2")}


def test_gloo_all_gathers_across_hosts_with_gloo_socket_ifname_set(cluster, figure):
    out = cluster.driver.call("gloo", world_size=4, worker_env={"GLOO_SOCKET_IFNAME": "eth0"})
    assert out["gathered"] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4, out
    slowest = max(r["seconds"] for r in out["ranks"])
    figure(f"gloo across h1, h2 with GLOO_SOCKET_IFNAME=eth0: rendezvous {slowest:.2f} s")


def test_gloo_all_gathers_across_hosts_where_host_names_resolve_to_their_addresses(cluster):
    with cluster.net.hosts_file_mode(["h1", "h2"], "cluster"):
        out = cluster.driver.call("gloo", world_size=4)
    addresses = [cluster.net.address(h) for h in ("h1", "h1", "h2", "h2")]
    assert [r["host_name_resolves_to"] for r in out["ranks"]] == addresses
    assert out["gathered"] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4, out


def test_gloo_all_gathers_across_hosts_where_host_names_resolve_to_127_0_1_1(cluster, figure):
    out = cluster.driver.call("gloo", world_size=4, timeout=180, timeout_s=5.0)
    if {r["host_name_resolves_to"] for r in out["ranks"]} != {"127.0.1.1"}:
        pytest.fail(f"precondition: every rank's host name resolves to 127.0.1.1: {out['ranks']}")
    failed = [r for r in out["ranks"] if not r["ok"]]
    if failed:
        first = min(failed, key=lambda r: r["seconds"])
        figure(
            f"gloo without GLOO_SOCKET_IFNAME, host names on 127.0.1.1: {len(failed)} of 4 ranks failed, "
            f"the first after {first['seconds']:.2f} s ({first['error'][:150]}), the last after "
            f"{max(r['seconds'] for r in failed):.1f} s",
        )
    assert out["gathered"] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4, out


# ------------------------------------------------------------------ where the bytes go


def test_blocking_call_result_goes_from_the_workers_to_the_driver_only(cluster, figure):
    out, moved = cluster.measure("blocking_result", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"blocking call, 64 MiB result: {links(moved, 'h0', 'h3')}")
    assert out["ok"]
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET
    assert BATCH <= moved["h3"].received < 1.1 * BATCH
    assert BATCH / 2 <= moved["h1"].sent < 0.55 * BATCH


def test_blocking_call_arguments_go_from_the_driver_to_the_workers_only(cluster, figure):
    out, moved = cluster.measure("blocking_arguments", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"blocking call, 64 MiB argument: {links(moved, 'h0', 'h3')}")
    assert out["rows"] == ROWS and out["ok"]
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET
    assert BATCH <= moved["h3"].sent < 1.1 * BATCH


def test_non_blocking_call_arguments_go_from_the_driver_to_the_workers_only(cluster, figure):
    out, moved = cluster.measure("non_blocking_arguments", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"non-blocking call, 64 MiB argument: {links(moved, 'h0', 'h3')}")
    assert out["rows"] == ROWS and out["ok"]
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET
    assert BATCH <= moved["h3"].sent < 1.1 * BATCH


def test_reshard_across_hosts_moves_rows_worker_to_worker_only(cluster, figure):
    out, moved = cluster.measure(
        "reshard", producers=["h1-0", "h1-1"], consumers=ALL_WORKERS, rows=ROWS, cols=COLS
    )
    figure(f"reshard 2 -> 4 ranks, 64 MiB made on h1: {links(moved, 'h0', 'h1', 'h2', 'h3')}")
    assert out["rows"] == [ROWS // 4] * 4 and out["first"] == [0, 2048, 4096, 6144] and out["ok"]
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET
    assert moved["h3"].sent < QUIET and moved["h3"].received < QUIET
    # The consumers on h2 fetch their half from h1; those on h1 read theirs locally.
    assert BATCH / 2 <= moved["h2"].received < 0.55 * BATCH


def test_chain_of_non_blocking_calls_keeps_the_batch_off_scheduler_and_driver_links(cluster, figure):
    out, moved = cluster.measure("chain", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"make -> echo_async -> summary of 64 MiB: {links(moved, 'h0', 'h3')}")
    assert out["rows"] == ROWS and out["ok"]
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET
    assert moved["h3"].sent < QUIET and moved["h3"].received < QUIET


def test_data_proto_future_get_goes_from_the_workers_to_the_driver_only(cluster, figure):
    out, moved = cluster.measure("future_get", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"DataProtoFuture.get() of 64 MiB: {links(moved, 'h0', 'h3')} in {out['seconds']:.2f} s")
    assert out["ok"]
    assert BATCH <= moved["h3"].received < 1.1 * BATCH
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET


def test_blocking_call_taking_a_future_returns_its_result_to_the_driver_only(cluster, figure):
    out, moved = cluster.measure("blocking_call_taking_future", workers=ALL_WORKERS, rows=ROWS, cols=COLS)
    figure(f"blocking call taking a future, 64 MiB result: {links(moved, 'h0', 'h3')}")
    assert out["ok"]
    assert BATCH <= moved["h3"].received < 1.1 * BATCH
    assert moved["h0"].sent < QUIET and moved["h0"].received < QUIET


# ------------------------------------------------------------------ groups across hosts


def test_detached_group_built_on_h3_is_reattached_from_h4(cluster, figure):
    workers = cluster.driver.call("detached_build", name="mh-detached", world_size=4, value=7)
    out = cluster.h4.call("detached_attach", name="mh-detached")
    figure(f"detached group reattached from h4 in {out['attach_s'] * 1000:.1f} ms")
    assert out["values"] == [7, 7, 7, 7]
    assert out["workers"] == workers
    assert out["hostnames"] == ["h1", "h1", "h2", "h2"]


def test_grpo_split_across_hosts_keeps_batches_off_the_scheduler_and_driver_hosts(cluster, tmp_path, figure):
    from test_grpo import number, short_run_args

    before = cluster.net.counters()
    done = cluster.net.run(
        "h3",
        [sys.executable, EXAMPLE, "--min-reward", "0", *short_run_args(tmp_path)]
        + ["--placement", "split", "--world-size", "2", "--rollout-world-size", "2"]
        + ["--scheduler", cluster.scheduler],
        timeout=540,
    )
    moved = cluster.net.counters_since(before)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    figure(
        f"GRPO split (rollout on h2, actor on h1), 4 steps: {links(moved, 'h0', 'h1', 'h2', 'h3')}; "
        f"driver bytes per step {number(done.stdout, 'driver bytes per step'):.0f}",
    )
    assert "actor on 2 ranks, rollout on 2 ranks, 4 Dask workers" in done.stdout
    assert "weights identical on all 4 ranks" in done.stdout
    assert number(done.stdout, "driver bytes per step") < number(done.stdout, "one step's responses")


def test_restart_of_a_cross_host_group_gives_fresh_processes_on_the_same_hosts(cluster, figure):
    out = cluster.driver.call("restart", timeout=240, world_size=4)
    figure(f"restart() of a 4-rank group on h1, h2: {out['seconds']:.1f} s")
    before, after = out["before"], out["after"]
    assert [r["hostname"] for r in after] == [r["hostname"] for r in before] == ["h1", "h1", "h2", "h2"]
    assert all(a["pid"] != b["pid"] for a, b in zip(after, before))
    assert out["gathered"] == [[0, 0, 1, 1, 2, 2, 3, 3]] * 4
    cluster.healthy()


# ------------------------------------------------------------------ a driver's link down


@pytest.fixture(scope="module")
def driver_link_outage(cluster, figure):
    """h4's driver builds a group on h1, loses its link until the scheduler has dropped
    its client (Dask's TCP timeout there, 30 s), gets it back and tries again."""
    h4 = cluster.h4
    h4.start("reconnect", workers=["h1-0", "h1-1"])
    client = h4.expect("ready", 120)["client"]
    cluster.net.link_down("h4")
    t_down = time.monotonic()
    dropped = False
    try:
        while not dropped and time.monotonic() - t_down < 60:
            time.sleep(1.0)
            dropped = client not in cluster.driver.call("clients")
        dropped_after = time.monotonic() - t_down
    finally:
        cluster.net.link_up("h4")
    h4.signal("healed")
    out = h4.result(180)
    figure(
        f"driver link down {dropped_after:.1f} s (until the scheduler dropped the client): "
        f"client {out['status']} again after {out['reconnect_s']:.1f} s under the same id "
        f"({out['client'] == client}); old group: {out['old_group']['type']}; new group: "
        f"{out['new_group']['type']} {out['new_group']['message'][:120]}",
    )
    yield out, client, dropped
    h4.close()


def test_driver_whose_link_was_down_builds_and_calls_groups_on_the_same_client(driver_link_outage):
    out, client, dropped = driver_link_outage
    if not dropped:
        pytest.fail("precondition: the scheduler dropped the client while its link was down")
    assert out["status"] == "running" and out["client"] == client
    assert out["new_group"]["type"] == "returned", out["new_group"]


# ------------------------------------------------------------------ a worker host's link down


@pytest.fixture(scope="module")
def worker_host_outage(cluster, figure, tmp_path_factory):
    """One partition of h2, seen by four drivers on h3 at once: a blocking call on it, a
    non-blocking call on it, a group idle on it, and (a driver whose Dask TCP timeout is
    12 s) a call queued there, then a new group once h2 is back. The link stays down 16 s;
    the drivers report what they saw within ``PARTITION_BOUND_S``."""
    flags = tmp_path_factory.mktemp("held")
    spare = cluster.spare
    # Groups that must exist before the held calls take the workers' threads.
    spare["idle"].start("partition_while_idle", workers=["h2-0"], idle_s=2.0, wait_s=PARTITION_BOUND_S)
    spare["lost"].start("lost_call_then_new_group", workers=["h2-1"], wait_s=20.0)
    spare["idle"].expect("started", 120)
    spare["lost"].expect("built", 120)
    held = {"blocking": ["h1-0", "h2-0"], "non-blocking": ["h1-1", "h2-1"]}
    for mode, workers in held.items():
        spare[mode].start(
            "partition_during_call",
            workers=workers,
            flag=str(flags / mode),
            wait_s=PARTITION_BOUND_S,
            mode=mode,
        )
    for mode in held:
        spare[mode].expect("started", 120)
    spare["lost"].signal("call")  # queued on h2-1 behind the non-blocking call's rank
    spare["lost"].expect("started", 30)
    cluster.net.link_down("h2")
    t_down = time.monotonic()
    try:
        for driver in spare.values():
            driver.signal("down", t=t_down)
        lost_first = spare["lost"].expect("detected", 40)
        time.sleep(max(t_down + 16.0 - time.monotonic(), 0))
    finally:
        cluster.net.link_up("h2")
    results = {
        name: spare[name].result(PARTITION_BOUND_S + 30) for name in ("blocking", "non-blocking", "idle")
    }
    for mode in held:
        (flags / mode).touch()  # release the held calls
    pids = cluster.healthy()
    spare["lost"].signal("healed")
    results["lost"] = spare["lost"].result(120)
    results["lost"]["first"] = lost_first
    for name in ("blocking", "non-blocking", "idle"):
        r = results[name]
        figure(
            f"h2 partitioned, {name} call: {r['type']} after {r['seconds']:.1f} s {r['message'][:120]}",
        )
    lost = results["lost"]
    figure(
        f"h2 partitioned 16 s, driver TCP timeout 12 s: {lost['first']['type']} after "
        f"{lost['first']['seconds']:.1f} s; workers still in the cluster ({sorted(pids)}); "
        f"new group: {lost['new_group']['type']} {lost['new_group']['message'][:120]}",
    )
    yield results
    for driver in spare.values():
        driver.close()


def test_partition_during_a_blocking_call_raises_worker_lost_error_within_the_bound(worker_host_outage):
    out = worker_host_outage["blocking"]
    assert out["type"] == "WorkerLostError" and out["seconds"] <= PARTITION_BOUND_S, out


def test_partition_during_a_non_blocking_call_raises_worker_lost_error_within_the_bound(worker_host_outage):
    out = worker_host_outage["non-blocking"]
    assert out["type"] == "WorkerLostError" and out["seconds"] <= PARTITION_BOUND_S, out


def test_partition_of_an_idle_group_fails_its_next_call_within_the_bound(worker_host_outage):
    out = worker_host_outage["idle"]
    assert out["type"] in ("WorkerLostError", "CallTimeoutError") and out["seconds"] <= PARTITION_BOUND_S, out


def test_partition_longer_than_the_drivers_tcp_timeout_loses_the_call(worker_host_outage):
    out = worker_host_outage["lost"]["first"]
    assert out["type"] == "WorkerLostError", out


def test_new_group_works_on_workers_that_came_back_from_a_partition(worker_host_outage):
    if worker_host_outage["lost"]["first"]["type"] != "WorkerLostError":
        pytest.fail(f"precondition: the driver lost its call to the partition: {worker_host_outage['lost']}")
    out = worker_host_outage["lost"]["new_group"]
    assert out["type"] == "returned", out
