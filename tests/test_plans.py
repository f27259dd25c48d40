"""Step plans (daskwg.plan): a recorded step replayed with one message per worker gives what
the same calls made one by one give, with the same errors, on real 4-process clusters."""

from __future__ import annotations

import asyncio
import threading
import time

import dask
import pytest
import torch
from distributed import Client
from plan_workers import StepWorker

import daskwg
from daskwg import CallTimeoutError, DataProto, DataProtoFuture, GroupBrokenError, RankError, WorkerGroup
from daskwg.transport.owned import Owned
from daskwg.transport.streams import CallStreams

pytestmark = pytest.mark.timeout(120)

COMPILED = "one message per worker"


@pytest.fixture(scope="module")
def wg(cluster4):
    with Client(cluster4) as client, WorkerGroup(client, StepWorker, world_size=4) as group:
        yield group


def _batch(rows: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"prompts": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)}
    )


def _rl_step(wg, batch):
    out = wg.generate(batch)
    out = wg.reward(out)
    out = wg.advantage(out)
    return wg.update(out)


def _record_rl_step(wg, **options):
    with daskwg.plan("rl", **options) as step:
        step.output(_rl_step(wg, step.input("batch")))
    return step


def _equal(a: DataProto, b: DataProto) -> bool:
    return a.batch.keys() == b.batch.keys() and all(
        torch.equal(a.batch[k], b.batch[k]) for k in a.batch.keys()
    )


# ---------------------------------------------------------------- the same values


def test_an_rl_step_replayed_gives_the_losses_of_the_calls_made_one_by_one(wg, messages):
    step = _record_rl_step(wg)
    expected = _rl_step(wg, _batch(8))
    first = step.run(batch=_batch(8))
    assert step.route == "call by call (the first replay learns the rows of each stage)"
    messages["n"] = 0
    got = step.run(batch=_batch(8))
    assert step.route == COMPILED
    assert messages["n"] == 4  # one per worker, for 4 calls on 4 ranks
    assert _equal(got, expected) and _equal(first, expected)
    assert got.batch["loss"].shape == (8,)


def test_ragged_batches_replay_step_after_step(wg):
    step = _record_rl_step(wg)
    step.run(batch=_batch(4))
    for rows in (8, 12, 4, 16):
        assert _equal(step.run(batch=_batch(rows)), _rl_step(wg, _batch(rows))), rows
        assert step.route == COMPILED


def test_a_padded_batch_replays_call_by_call_with_the_same_losses(wg):
    step = _record_rl_step(wg)
    step.run(batch=_batch(8))
    got = step.run(batch=_batch(10))  # 10 rows on 4 ranks: padded to 12, unpadded after
    assert step.route.startswith("call by call") and "padded" in step.route
    expected = _rl_step(wg, _batch(10))
    assert len(got) == 10
    assert _equal(got, expected)


def test_a_step_with_a_blocking_call_learns_its_rows_even_when_replies_reach_the_driver_late(wg, monkeypatch):
    # The replies of the non-blocking calls settle 0.3 s late on the driver: the blocking
    # update has returned by then, and the next replay must still learn from the first.
    original = Owned.finished

    def late(self, *args, **kwargs):
        asyncio.get_running_loop().call_later(0.3, lambda: original(self, *args, **kwargs))

    monkeypatch.setattr(Owned, "finished", late)
    step = _record_rl_step(wg)
    step.run(batch=_batch(8))
    got = step.run(batch=_batch(10))
    assert step.route.startswith("call by call") and "padded" in step.route, step.route
    monkeypatch.undo()
    assert _equal(got, _rl_step(wg, _batch(10)))


def test_every_list_mode_replays_with_the_values_of_the_calls(wg):
    def calls(x):
        a = wg.scale(x, factor=3)  # ONE_TO_ALL: [3x + r]
        b = wg.add_rank(a)  # ALL_TO_ALL, rank by rank
        c = wg.tick(b)  # DP_COMPUTE, rank by rank
        return a, b, c, wg.only_rank_zero(x), wg.on_rank_zero(x)

    with daskwg.plan("modes") as step:
        step.output(*calls(step.input("x")))
    assert step.route is None
    got = step.run(x=5)
    assert step.route == COMPILED
    assert got == calls(5)
    assert got[2] == [16, 18, 20, 22]
    assert got[3] == (0, 5) and got[4] == (0, 50)


def test_proto_modes_with_functions_and_metrics_replay_as_the_calls_do(wg):
    def calls(batch):
        return wg.metric(batch), wg.apply(torch.neg, batch)

    with daskwg.plan("proto modes") as step:
        step.output(*calls(step.input("batch")))
    metrics, applied = step.run(batch=_batch(8))
    expected_metrics, expected_applied = calls(_batch(8))
    assert metrics == expected_metrics and len(metrics) == 4
    assert _equal(applied, expected_applied)


def test_non_blocking_outputs_come_back_as_futures(wg):
    with daskwg.plan("futures") as step:
        out = wg.reward(wg.generate(step.input("batch")))
        ticks = wg.tick_later(step.input("xs"))
        step.output(out, ticks)
    daskwg.get(step.run(batch=_batch(8), xs=[0, 0, 0, 0])[1])  # learns once its calls have run
    out, ticks = step.run(batch=_batch(8), xs=[1, 2, 3, 4])
    assert step.route == COMPILED
    assert isinstance(out, DataProtoFuture)
    assert daskwg.get(ticks) == [2, 3, 4, 5]
    assert _equal(out.get(), wg.reward(wg.generate(_batch(8))).get())


def test_a_step_recorded_with_compiled_false_makes_the_calls_one_by_one(wg, messages):
    step = _record_rl_step(wg, compiled=False)
    messages["n"] = 0
    got = step.run(batch=_batch(8))
    assert step.route == "call by call (recorded with compiled=False)"
    assert messages["n"] == 4 * 4
    assert _equal(got, _rl_step(wg, _batch(8)))


def test_a_call_reading_other_ranks_parts_replays_call_by_call(wg):
    with daskwg.plan("gather") as step:
        step.output(wg.only_rank_zero(wg.tick(step.input("xs"))))  # every rank gets every rank's part
    assert step.run(xs=[1, 2, 3, 4]) == wg.only_rank_zero(wg.tick([1, 2, 3, 4])) == (0, [2, 3, 4, 5])
    assert "reads more than its own rank's part" in step.route


def test_a_step_input_among_the_outputs_comes_back_as_given(wg):
    with daskwg.plan("echo") as step:
        x = step.input("x")
        step.output(wg.scale(x), x, "constant")
    assert step.run(x=7) == ([14, 15, 16, 17], 7, "constant")
    assert step.route == COMPILED


# ---------------------------------------------------------------- order and copies


def test_each_worker_runs_a_replay_in_the_order_of_the_calls_between_other_calls(wg):
    wg.history()
    with daskwg.plan("order") as step:
        x = step.input("x")
        wg.scale(x)
        wg.tick(wg.add_rank(wg.scale(x)))
    wg.note("before")
    step.run(x=1)
    wg.note("after")
    logs = wg.history()
    for rank, log in enumerate(logs):
        assert log == [
            "before",
            "scale 1",
            "scale 1",
            f"add_rank {2 + rank}",
            f"tick {2 + 2 * rank}",
            "after",
        ]


def test_a_part_changed_in_place_by_a_later_stage_leaves_the_earlier_output_as_it_was(wg):
    with daskwg.plan("in place") as step:
        first = wg.generate(step.input("batch"))
        step.output(first, wg.bump_in_place(first))
    first, bumped = step.run(batch=_batch(4))
    assert torch.equal(first.get().batch["prompts"], _batch(4).batch["prompts"])
    assert torch.equal(bumped.get().batch["prompts"], _batch(4).batch["prompts"] + 100.0)


def test_a_result_the_rank_keeps_is_not_changed_by_the_next_stage(wg):
    with daskwg.plan("kept") as step:
        wg.bump_in_place(wg.keep_and_return(step.input("batch")))
    step.run(batch=_batch(4)).get()
    assert wg.kept_prompts()[0] == _batch(4).batch["prompts"][:1].tolist()


# ---------------------------------------------------------------- errors


def test_a_stage_that_repeats_rows_replays_with_the_rows_it_learnt(wg):
    with daskwg.plan("samples") as step:
        step.output(wg.reward(wg.generate(wg.repeat_rows(step.input("batch")))))
    batch = _batch(8)
    batch.meta_info["n"] = 3
    step.run(batch=batch).get()
    got = step.run(batch=batch).get()
    assert step.route == COMPILED
    expected = wg.reward(wg.generate(wg.repeat_rows(batch))).get()
    assert len(got) == 24 and _equal(got, expected)


def test_a_stage_whose_rows_change_between_replays_fails_the_next_stage_with_what_to_do(wg):
    with daskwg.plan("rows") as step:
        step.output(wg.generate(wg.repeat_rows(step.input("batch"))))
    step.run(batch=_batch(8)).get()  # learns: one row out per row in
    doubled = _batch(8)
    doubled.meta_info["n"] = 2
    with pytest.raises(RankError) as info:
        step.run(batch=doubled).get()
    assert info.value.method == "generate"
    assert "returned 4 rows on rank" in str(info.value) and "earlier replays had 2" in str(info.value)
    assert "compiled=False" in str(info.value)
    # Recorded without the one-message route, the same step gives what the calls give.
    with daskwg.plan("rows", compiled=False) as step:
        step.output(wg.generate(wg.repeat_rows(step.input("batch"))))
    assert len(step.run(batch=doubled).get()) == 16


def test_ranks_returning_different_rows_keep_the_step_call_by_call(wg):
    with daskwg.plan("uneven ranks") as step:
        step.output(wg.generate(wg.drop_a_row_on_rank_one(step.input("batch"))))
    step.run(batch=_batch(8)).get()
    got = step.run(batch=_batch(8)).get()
    assert "returned [2, 1, 2, 2] rows on its ranks" in step.route
    assert len(got) == 7
    assert _equal(got, wg.generate(wg.drop_a_row_on_rank_one(_batch(8))).get())


def test_a_rank_that_raises_fails_the_replay_with_its_rank_error(wg):
    with daskwg.plan("failing") as step:
        step.output(wg.update(wg.advantage(wg.reward(wg.fail_on_rank(wg.generate(step.input("batch")))))))
    step.run(batch=_batch(8))  # the first replay, call by call
    failing = _batch(8)
    failing.meta_info["fail"] = True
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        step.run(batch=failing)
    assert step.route == COMPILED
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and info.value.method == "fail_on_rank"
    assert "stage failed on rank 1" in str(info.value)
    assert wg.tick([0, 0, 0, 0]) == [1, 1, 1, 1]  # the group goes on


def test_after_a_blocking_call_raises_the_rank_runs_none_of_the_steps_later_calls(wg):
    wg.history()
    with daskwg.plan("stop") as step:
        x = step.input("x")
        wg.note("first")
        wg.boom_on_rank_one(x)
        wg.note("after")
    with pytest.raises(RankError, match="boom 3") as info:
        step.run(x=3)
    assert step.route == COMPILED and info.value.rank == 1
    logs = wg.history()
    assert logs[1] == ["first"]  # as the calls one by one would stop at the failing call
    assert logs[0] == ["first", "after"]  # ranks on other workers ran their part, already sent


def test_an_input_that_cannot_be_pickled_raises_dispatch_error_before_anything_runs(wg):
    wg.history()
    with daskwg.plan("lock") as step:
        wg.note("ran")
        wg.add_rank(step.input("xs"))
    with pytest.raises(daskwg.DispatchError, match="cannot be pickled"):
        step.run(xs=[threading.Lock(), 1, 2, 3])
    assert wg.history() == [[]] * 4
    assert wg.tick([0, 0, 0, 0]) == [1, 1, 1, 1]  # nothing waits for the calls never sent


def test_a_deadline_during_a_replay_raises_call_timeout_error_naming_the_running_call(wg):
    with daskwg.plan("slow") as step:
        wg.scale(step.input("x"))
        step.output(wg.nap(3.0))
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError) as info, daskwg.deadline(0.5):
        step.run(x=1)
    assert time.monotonic() - t0 < 20
    assert "nap" in str(info.value)
    assert any("in nap" in stack for stack in info.value.stacks.values()), info.value.stacks
    assert wg.tick([0, 0, 0, 0]) == [1, 1, 1, 1]  # after the naps, the group goes on


def test_using_an_output_as_a_value_while_recording_says_to_keep_control_flow_between_replays(wg):
    with pytest.raises(TypeError, match="between replays"), daskwg.plan("control flow") as step:
        if wg.tick(step.input("xs")):
            pass


def test_replaying_with_a_missing_or_unknown_input_is_refused_before_anything_runs(wg):
    wg.history()
    with daskwg.plan("inputs") as step:
        wg.scale(step.input("x"))
    with pytest.raises(TypeError, match=r"missing \['x'\]; unknown \['y'\]"):
        step.run(y=1)
    assert wg.history() == [[]] * 4


def test_misused_steps_and_stand_ins_say_what_to_do(wg):
    with daskwg.plan("misuse") as step:
        out = wg.scale(step.input("x"))
        step.output(out)
        with pytest.raises(ValueError, match="outputs already"):
            step.output(out)
        with pytest.raises(RuntimeError, match="replay it after its with daskwg.plan"):
            step.run(x=1)
    with pytest.raises(daskwg.DispatchError, match="a PlanValue, a stand-in"):
        wg.scale(out)
    with pytest.raises(KeyError), daskwg.plan("broken") as broken:
        wg.scale(broken.input("x"))
        raise KeyError("inside the block")
    with pytest.raises(RuntimeError, match="ended with an exception: record the step again"):
        broken.run(x=1)


def test_recording_refuses_nesting_execute_calls_and_empty_steps(wg):
    with daskwg.plan("outer") as outer:
        wg.scale(outer.input("x"))
        with pytest.raises(RuntimeError, match="do not nest"), daskwg.plan("inner"):
            pass
    with daskwg.plan("execute") as step:
        wg.scale(step.input("x"))
        with pytest.raises(RuntimeError, match="execute_"):
            wg.execute_all_sync("scale", 1)
    with pytest.raises(ValueError, match="recorded no group call"), daskwg.plan("empty"):
        pass


# ---------------------------------------------------------------- losing and restarting


@pytest.mark.timeout(180)
def test_restarting_the_group_replays_the_plan_on_the_new_ranks_and_a_shut_down_one_is_refused():
    with (
        daskwg.local_cluster(n_workers=2, dashboard_address=":0", worker_dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        group = WorkerGroup(client, StepWorker, world_size=2)
        with daskwg.plan("restart") as step:
            step.output(group.tick(group.add_rank(step.input("xs"))), group.pid())
        ticks, pids = step.run(xs=[1, 1])
        assert ticks == [2, 3]
        group.restart()
        ticks, new_pids = step.run(xs=[1, 1])
        assert ticks == [2, 3] and step.route == COMPILED
        assert not set(pids) & set(new_pids)  # never the stale ranks
        group.shutdown()
        with pytest.raises(GroupBrokenError, match="shut down"):
            step.run(xs=[1, 1])


@pytest.mark.timeout(120)
def test_a_worker_lost_during_a_replay_raises_worker_lost(fresh_cluster4):
    _, client = fresh_cluster4
    group = WorkerGroup(client, StepWorker, world_size=4)
    with daskwg.plan("lost") as step:
        step.output(
            group.update(
                group.advantage(group.reward(group.die_on_rank_one(group.generate(step.input("batch")))))
            )
        )
    step.run(batch=_batch(8))
    dying = _batch(8)
    dying.meta_info["die"] = True
    t0 = time.monotonic()
    with pytest.raises(daskwg.WorkerLostError) as info:
        step.run(batch=dying)
    assert step.route == COMPILED
    assert time.monotonic() - t0 < 60
    assert info.value.rank == 1


@pytest.mark.timeout(120)
def test_a_small_output_comes_back_with_the_reply_and_a_larger_one_is_fetched_on_the_call_stream(
    wg, monkeypatch
):
    fetches = []
    original = CallStreams.request

    async def counting(self, address, server_id, message, *args, **kwargs):
        if message[0] == "fetch":
            fetches.append(message[2])
        return await original(self, address, server_id, message, *args, **kwargs)

    monkeypatch.setattr(CallStreams, "request", counting)
    with daskwg.plan("inline") as step:
        step.output(wg.reward(wg.generate(step.input("batch"))))
    step.run(batch=_batch(8)).get()  # learns the rows
    expected = wg.reward(wg.generate(_batch(8))).get()
    fetches.clear()
    out = step.run(batch=_batch(8))
    assert step.route == COMPILED
    assert _equal(out.get(), expected)
    assert fetches == []  # the 4 parts (tensors) came with the replies
    with dask.config.set({"daskwg.inline-results": 0}):
        out = step.run(batch=_batch(8))
        assert _equal(out.get(), expected)
    assert len(fetches) == 4  # one fetch message per part, on the call streams
