"""Concurrency groups (``@register(concurrency_group=...)``, Ray's term): a control method
reaches a running call of the default group, calls keep their order within a group, and
bad names are refused at decoration time. Real worker processes; every wait is bounded."""

from __future__ import annotations

import time

import pytest
from concurrency_workers import Rollout

import daskwg
from daskwg import Dispatch, WorkerGroup, register
from daskwg.dispatch.register import get_registered_method

#: Seconds a control call may take here; a control call that waited for the running
#: generate (2000 steps of 0.05 s) would pass it and fail with CallTimeoutError.
CONTROL_S = 20.0


def _until(what, predicate, seconds: float = 30.0):
    end = time.monotonic() + seconds
    while True:
        value = what()
        if predicate(value):
            return value
        assert time.monotonic() < end, value
        time.sleep(0.05)


def _running_generate(wg: WorkerGroup) -> None:
    """Wait (bounded) until every rank's generate has taken a step, asking through a control call."""
    with daskwg.deadline(CONTROL_S):
        _until(wg.get_progress, lambda steps: all(s > 0 for s in steps))


@pytest.mark.timeout(120)
def test_a_control_method_stops_a_running_async_generate(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        futures = wg.generate(2000)
        _running_generate(wg)
        with daskwg.deadline(CONTROL_S):
            wg.abort()
            steps = daskwg.get(futures)
        assert all(0 < s < 2000 for s in steps), steps


@pytest.mark.timeout(120)
def test_a_control_method_stops_a_running_sync_generate(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        futures = wg.generate_sync(2000)
        _running_generate(wg)
        with daskwg.deadline(CONTROL_S):
            wg.abort_sync()
            steps = daskwg.get(futures)
        assert all(0 < s < 2000 for s in steps), steps


@pytest.mark.timeout(120)
def test_control_calls_run_one_at_a_time_in_the_drivers_order(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        futures = wg.generate(2000)
        _running_generate(wg)
        with daskwg.deadline(CONTROL_S):
            for i in range(20):
                wg.record(i)
            logs = wg.get_log()
            most = wg.most_at_once()
            wg.abort()
            daskwg.get(futures)
        assert logs == [list(range(20))] * 2
        assert [m["control"] for m in most] == [1, 1]


@pytest.mark.timeout(120)
def test_default_calls_still_run_one_at_a_time_in_order_beside_control_calls(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        with daskwg.deadline(CONTROL_S):
            for i in range(4):
                wg.busy(i, 0.2)
                wg.get_progress()
            daskwg.get(wg.busy(4, 0.0))
            most = wg.most_at_once()
            logs = wg.get_log()
        assert [m["default"] for m in most] == [1, 1]
        assert logs == [[0, 1, 2, 3, 4]] * 2


@pytest.mark.timeout(120)
def test_a_control_call_runs_when_nothing_else_does(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        with daskwg.deadline(CONTROL_S):
            assert wg.get_progress() == [0, 0]
            assert daskwg.get(wg.generate(3)) == [3, 3]
            assert wg.get_progress() == [3, 3]


@pytest.mark.timeout(120)
def test_status_shows_a_control_call_running_beside_the_default_one(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        futures = wg.generate(2000)
        _running_generate(wg)
        held = wg.hold(60.0)
        status = _until(
            wg.status,
            lambda records: all(
                r["method"] == "generate" and [c["method"] for c in r["concurrent"]] == ["hold"]
                for r in records
            ),
        )
        with daskwg.deadline(CONTROL_S):
            wg.release()
            assert daskwg.get(held) == [True, True]
            daskwg.get(futures)
        assert all(r["state"] == "running" and r["concurrency_group"] is None for r in status)
        assert all(r["concurrent"][0]["concurrency_group"] == "control" for r in status)


@pytest.mark.timeout(120)
def test_a_step_plan_refuses_a_control_method(client4):
    with WorkerGroup(client4, Rollout, world_size=2) as wg:
        with pytest.raises(ValueError, match="concurrency group 'control'"):
            with daskwg.plan("step"):
                wg.abort()


@pytest.mark.parametrize(
    "name, error",
    [
        ("not a name", ValueError),
        ("", ValueError),
        ("1st", ValueError),
        (3, TypeError),
        (b"control", TypeError),
    ],
)
def test_a_bad_concurrency_group_name_is_refused_at_decoration_time(name, error):
    with pytest.raises(error, match="concurrency_group must be"):
        register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=name)


@pytest.mark.parametrize("name", [None, "default"])
def test_none_and_default_name_the_default_group(name):
    @register(concurrency_group=name)
    def method(self):
        return None

    assert get_registered_method(method).concurrency_group is None
