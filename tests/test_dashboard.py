"""The <dashboard>/daskwg page and the daskwg_* series on the scheduler's /metrics, fetched
over HTTP from a LocalCluster's dashboard while calls run."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from workers import AddWorker

from daskwg import ClassWithInitArgs, DataProto, WorkerGroup
from daskwg.plugin.metrics import CallMetrics, payload_nbytes
from daskwg.scheduler.dashboard import render_html
from daskwg.scheduler.metrics import merge


def dashboard_root(client) -> str:
    """``http://host:port`` of the scheduler's HTTP server (the Dask dashboard's)."""
    info = client.scheduler_info()
    host = info["address"].split("://", 1)[1].rsplit(":", 1)[0]
    return f"http://{host}:{info['services']['dashboard']}"


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def wait_for(check, timeout: float = 30.0, interval: float = 0.2):
    """Call ``check()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s; last value: {last!r}")


def group_json(root: str, name: str) -> dict | None:
    snapshot = json.loads(fetch(f"{root}/daskwg/json"))
    return next((g for g in snapshot["groups"] if g["name"] == name), None)


@pytest.fixture
def group(client4):
    name = f"dash-{uuid.uuid4().hex[:6]}"
    with WorkerGroup(client4, ClassWithInitArgs(AddWorker), world_size=2, name=name) as wg:
        yield wg, name, dashboard_root(client4)


def test_page_shows_a_running_non_blocking_call(group):
    wg, name, root = group
    futures = wg.record(7, delay=3.0)  # blocking=False: Dask tasks
    page = wait_for(lambda: page if "record" in (page := fetch(f"{root}/daskwg")) else None)
    assert name in page
    assert "running" in page
    assert "http-equiv='refresh'" in page
    assert [f.result(timeout=60) for f in futures] == [7, 7]


def test_blocking_call_shows_as_running_with_its_elapsed_time(group):
    wg, name, root = group
    worker = threading.Thread(target=wg.execute_all_sync, args=("record", 1), kwargs={"delay": 3.0})
    worker.start()
    try:
        ranks = wait_for(
            lambda: [r for r in (group_json(root, name) or {"ranks": []})["ranks"] if r["state"] == "running"]
        )
        assert ranks[0]["method"] == "record"
        assert ranks[0]["seconds"] >= 0
        assert ranks[0]["worker"] in wg.workers
        assert "time.sleep(delay)" in ranks[0]["stack"]
    finally:
        worker.join(timeout=60)


def test_page_lists_every_rank_with_its_worker_and_last_error(group):
    wg, name, root = group
    with pytest.raises(Exception, match="boom-dashboard"):
        wg.fail_on(1, "boom-dashboard")
    record = wait_for(lambda: group_json(root, name))
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert [r["worker"] for r in record["ranks"]] == wg.workers
    assert [r["state"] for r in record["ranks"]] == ["idle", "idle"]
    assert record["ranks"][0]["last_error"] is None
    assert "boom-dashboard" in record["ranks"][1]["last_error"]
    assert "boom-dashboard" in fetch(f"{root}/daskwg")


def test_shut_down_group_leaves_the_page(client4):
    name = f"dash-{uuid.uuid4().hex[:6]}"
    root = dashboard_root(client4)
    wg = WorkerGroup(client4, AddWorker, world_size=2, name=name)
    assert group_json(root, name) is not None
    wg.shutdown()
    assert group_json(root, name) is None


def _series(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(180)
def test_metrics_has_daskwg_series(group):
    wg, name, root = group
    batch = DataProto.from_dict({"a": torch.zeros(8, 4, dtype=torch.float32)})
    wg.add_rank(batch)  # 4 rows of 16 bytes to each rank, and back
    wg.foo(1, 2)
    with pytest.raises(Exception, match="metric-boom"):
        wg.fail_on(0, "metric-boom")

    def scraped():
        text = fetch(f"{root}/metrics")
        done = _series(text, "daskwg_calls_total", group=name, method="fail_on", outcome="error")
        return text if done else None

    text = wait_for(scraped, timeout=60, interval=1.0)
    assert _series(text, "daskwg_calls_total", group=name, method="foo", outcome="ok") == 2
    assert _series(text, "daskwg_calls_total", group=name, method="add_rank", outcome="ok") == 2
    assert _series(text, "daskwg_calls_total", group=name, method="fail_on", outcome="error") == 1
    assert _series(text, "daskwg_calls_total", group=name, method="fail_on", outcome="ok") == 1
    assert _series(text, "daskwg_call_duration_seconds_count", group=name, method="foo") == 2
    assert _series(text, "daskwg_call_duration_seconds_bucket", group=name, method="foo", le="+Inf") == 2
    assert _series(text, "daskwg_ranks", group=name, state="idle") == 2
    assert _series(text, "daskwg_bytes_total", group=name, direction="in") == 8 * 4 * 4
    assert _series(text, "daskwg_bytes_total", group=name, direction="out") == 8 * 4 * 4


def test_page_escapes_names_and_errors():
    snapshot = {
        "time": 0.0,
        "unresponsive": [],
        "groups": [
            {
                "name": "<script>g</script>",
                "group_id": "abc",
                "owner": None,
                "detached": False,
                "world_size": 1,
                "ranks": [
                    {
                        "rank": 0,
                        "worker": "tcp://127.0.0.1:1",
                        "state": "idle",
                        "method": None,
                        "seconds": None,
                        "stack": None,
                        "last_error": "f: ValueError: <b>",
                        "queued": [],
                    }
                ],
            }
        ],
    }
    page = render_html(snapshot, refresh=0)
    assert "<script>g" not in page and "&lt;script&gt;g" in page
    assert "ValueError: &lt;b&gt;" in page
    assert "http-equiv" not in page


def test_payload_nbytes_counts_tensor_and_array_bytes():
    batch = DataProto.from_dict({"x": torch.zeros(5, 3, dtype=torch.bfloat16)})
    assert payload_nbytes(batch) == 5 * 3 * 2
    assert payload_nbytes(((torch.zeros(10)[:4],), {"n": 3})) == 4 * 4
    assert payload_nbytes("text") == 0
    # Every kind the walk tells by exact type, and the duck-typed ones it falls back to.
    nested = TensorDict({"a": torch.zeros(4, 2), "inner": TensorDict({"b": torch.zeros(4)}, [4])}, [4])
    assert payload_nbytes(nested) == 4 * 2 * 4 + 4 * 4
    assert payload_nbytes(DataProto(batch=nested, non_tensor_batch={"s": np.zeros(4)})) == 48 + 32
    assert payload_nbytes([1, 2.0, None, True, b"x", {"k": np.zeros(3, dtype=np.int16)}]) == 6

    class VerlLike:  # verl's DataProto: told by its attributes
        def __init__(self):
            self.batch, self.non_tensor_batch = nested, {}

    assert payload_nbytes((VerlLike(),)) == 48
    assert payload_nbytes(torch.zeros(3, 3).to_sparse()) == 0


def test_worker_counters_add_up_over_workers():
    one, two = CallMetrics(), CallMetrics()
    one.record_call("g", "m", True, 0.002)
    two.record_call("g", "m", False, 20.0)
    two.record_bytes("g", "in", 100)
    merged = merge([one.snapshot(), two.snapshot()])
    assert merged["calls"] == {("g", "m", "ok"): 1, ("g", "m", "error"): 1}
    counts, total = merged["durations"][("g", "m")]
    assert sum(counts) == 2 and total == pytest.approx(20.002)
    assert counts[1] == 1  # 2 ms falls in the (1 ms, 5 ms] bucket
    assert merged["bytes"] == {("g", "in"): 100}
