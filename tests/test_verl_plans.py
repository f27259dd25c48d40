"""Step plans (daskwg.plan) on verl-shaped groups: a worker written as a verl user writes it
(verl's own ``Worker``, ``register``, ``Dispatch``, ``DataProto``; ``verl_plan_workers.py``)
replays with one message per worker on ``daskwg.verl.RayWorkerGroup`` exactly as on a native
``WorkerGroup``, verl's ALL_TO_ALL rule and verl's DataProto included, with the values of the
calls made one by one; and a replay that goes call by call says the true reason in
``StepPlan.route``. Real processes: 2 ranks of the shared 4-worker cluster."""

from __future__ import annotations

import pytest
import torch
import verl
from distributed import Client
from verl_plan_workers import VerlStepWorker, batch

import daskwg
from daskwg import ClassWithInitArgs, DispatchError, WorkerGroup
from daskwg.verl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

pytestmark = pytest.mark.timeout(120)

COMPILED = "one message per worker"


@pytest.fixture(scope="module")
def groups(cluster4):
    """A native group and a verl-shaped one of the same verl-written class, 2 ranks each."""
    with Client(cluster4) as client:
        native = WorkerGroup(client, ClassWithInitArgs(VerlStepWorker), world_size=2)
        ray = RayWorkerGroup(
            RayResourcePool([2], use_gpu=False, client=client),
            RayClassWithInitArgs(cls=VerlStepWorker),
            client=client,
        )
        try:
            yield {"native": native, "verl": ray}
        finally:
            ray.shutdown()
            native.shutdown()


@pytest.fixture(params=["native", "verl"])
def wg(request, groups):
    return groups[request.param]


@pytest.fixture
def ray_wg(groups):
    return groups["verl"]


def _equal(a: verl.DataProto, b: verl.DataProto) -> bool:
    return (
        type(a) is type(b) is verl.DataProto
        and a.batch.keys() == b.batch.keys()
        and all(torch.equal(a.batch[k], b.batch[k]) for k in a.batch.keys())
    )


def _produce_then_step(wg):
    with daskwg.plan("rl") as step:
        step.output(wg.step(wg.produce(step.input("data"))))
    return step


# ---------------------------------------------------------------- one message per worker


def test_a_non_blocking_proto_stage_feeding_a_proto_stage_replays_in_one_message_per_worker(wg, messages):
    step = _produce_then_step(wg)
    expected = wg.step(wg.produce(batch(10)))
    first = step.run(data=batch(10))
    assert step.route == "call by call (the first replay learns the rows of each stage)"
    messages["n"] = 0
    got = step.run(data=batch(10))
    assert step.route == COMPILED
    assert messages["n"] == 2  # one per worker, for 2 calls on 2 ranks
    assert _equal(got, expected) and _equal(first, expected)


def test_ragged_verl_batches_replay_in_one_message_per_worker_step_after_step(wg):
    step = _produce_then_step(wg)
    step.run(data=batch(4))
    for rows in (10, 6, 2):
        assert _equal(step.run(data=batch(rows)), wg.step(wg.produce(batch(rows)))), rows
        assert step.route == COMPILED


def test_a_metric_stage_reads_each_ranks_rows_of_a_verl_dataproto_output(wg, messages):
    with daskwg.plan("metric") as step:
        step.output(wg.rows_and_sum(wg.produce(step.input("data"))))
    step.run(data=batch(10))
    expected = wg.rows_and_sum(wg.produce(batch(10)))
    messages["n"] = 0
    assert step.run(data=batch(10)) == expected == [(5, 20.0), (5, 75.0)]
    assert step.route == COMPILED and messages["n"] == 2


def test_non_blocking_stages_replay_to_a_future_that_is_verl_s_on_a_verl_group(wg, messages):
    with daskwg.plan("futures") as step:
        step.output(wg.pass_on(wg.produce(step.input("data"))))
    step.run(data=batch(10)).get()
    messages["n"] = 0
    got = step.run(data=batch(10))
    assert step.route == COMPILED and messages["n"] == 2
    assert isinstance(got, daskwg.DataProtoFuture)
    assert isinstance(got, verl.protocol.DataProtoFuture) is (type(wg) is RayWorkerGroup)
    assert _equal(got.get(), wg.pass_on(wg.produce(batch(10))).get())


def test_list_modes_chain_blocking_one_to_all_all_to_all_and_dp_compute_in_one_message_per_worker(
    wg, messages
):
    def calls(x):
        return wg.tick(wg.add(wg.seed(x)))  # ALL_TO_ALL splits the list ONE_TO_ALL returns

    with daskwg.plan("lists") as step:
        step.output(calls(step.input("x")))
    expected = calls(3)
    messages["n"] = 0
    assert step.run(x=3) == expected == [301, 303]
    assert step.route == COMPILED and messages["n"] == 2


def test_a_non_blocking_one_to_all_feeding_all_to_all_replays_in_one_message_per_worker(wg, messages):
    with daskwg.plan("later") as step:
        step.output(wg.add(wg.seed_later(step.input("x"))))
    expected = wg.add(wg.seed_later(3))
    messages["n"] = 0
    assert step.run(x=3) == expected == [300, 302]
    assert step.route == COMPILED and messages["n"] == 2


def test_non_blocking_all_to_all_outputs_feed_all_to_all_in_one_message_per_worker(wg, messages):
    with daskwg.plan("later") as step:
        out = wg.add_later(step.input("x"), y=step.input("y"))
        step.output(wg.add(out, y=wg.add_later(out)))
    messages["n"] = 0
    assert step.run(x=[1, 2], y=[3, 4]) == [8, 16]
    assert step.route == COMPILED and messages["n"] == 2
    out = wg.add_later([1, 2], y=[3, 4])
    assert wg.add(out, y=wg.add_later(out)) == [8, 16]


def test_verl_all_to_all_splits_or_broadcasts_step_inputs_as_the_calls_do_in_one_message_per_worker(
    ray_wg, messages
):
    with daskwg.plan("verl-rule") as step:
        step.output(ray_wg.add(ray_wg.add(step.input("x"), y=step.input("y"))))
    messages["n"] = 0
    split = step.run(x=[1, 2], y=[3, 4])
    assert step.route == COMPILED
    broadcast = step.run(x=1, y=2)
    assert step.route == COMPILED and messages["n"] == 4
    assert split == ray_wg.add(ray_wg.add([1, 2], y=[3, 4])) == [4, 8]
    assert broadcast == ray_wg.add(ray_wg.add(1, y=2)) == [3, 5]


# ---------------------------------------------------------------- the true reason


def test_a_padded_first_replay_says_no_replay_has_learnt_the_rows_yet_and_a_later_one_learns(wg):
    step = _produce_then_step(wg)
    step.run(data=batch(9))
    assert step.route == "call by call (the first replay learns the rows of each stage)"
    got = step.run(data=batch(10))
    assert step.route == (
        "call by call (no replay has learnt the rows of each stage yet: the batch of replay 1 given to "
        f"{wg.name}.produce had 9 rows on 2 ranks, and was padded)"
    )
    assert _equal(got, wg.step(wg.produce(batch(10))))
    step.run(data=batch(10))
    assert step.route == COMPILED


def test_a_first_replay_that_raised_says_so_on_the_next(wg):
    step = _produce_then_step(wg)
    with pytest.raises(daskwg.RankError):
        step.run(data=daskwg.DataProto.from_dict({"prompts": torch.arange(10.0)}))  # produce wants verl's
    step.run(data=batch(10))
    assert step.route == (
        "call by call (no replay has learnt the rows of each stage yet: replay 1, made call by call to "
        "learn them, raised)"
    )


def test_a_padded_batch_after_learning_names_the_call_whose_batch_was_padded(wg):
    step = _produce_then_step(wg)
    step.run(data=batch(10))
    assert _equal(step.run(data=batch(9)), wg.step(wg.produce(batch(9))))
    assert step.route == (
        f"call by call (the batch given to {wg.name}.produce was padded this time (1 row of padding to cut "
        f"it into 2 equal parts), and {wg.name}.step reads its output)"
    )


def test_a_blocking_proto_stage_feeding_a_proto_stage_says_rows_are_learnt_from_non_blocking_calls(wg):
    with daskwg.plan("blocking") as step:
        step.output(wg.step(wg.produce_now(step.input("data"))))
    assert _equal(step.run(data=batch(10)), wg.step(wg.produce_now(batch(10))))
    assert (
        "a blocking call's: a plan learns how many rows each rank's part has from a blocking=False"
        in step.route
    )


def test_verl_all_to_all_reading_a_batch_says_every_rank_gets_all_of_it(ray_wg):
    with daskwg.plan("broadcast") as step:
        step.output(ray_wg.rows(ray_wg.produce(step.input("data"))))
    assert step.run(data=batch(10)) == ray_wg.rows(ray_wg.produce(batch(10))) == [10, 10]
    assert step.route.startswith(f"call by call ({ray_wg.name}.rows reads more than its own rank's part of")
    assert step.route.endswith(
        "(verl's ALL_TO_ALL gives every rank all of its arguments unless every one is a list of world_size "
        "entries))"
    )


def test_one_to_all_reading_a_list_output_says_every_rank_gets_all_of_it(wg):
    with daskwg.plan("whole") as step:
        step.output(wg.total(wg.seed(step.input("x"))))
    assert step.run(x=1) == wg.total(wg.seed(1)) == [201.0, 201.0]
    assert step.route.endswith("(its dispatch mode gives every rank all of its arguments))")


def test_a_proto_stage_read_by_a_list_mode_says_a_rank_reads_other_ranks_rows(wg):
    with daskwg.plan("mismatch") as step:
        step.output(wg.tick(wg.produce(step.input("data"))))
    with pytest.raises(DispatchError):
        step.run(data=batch(10))  # as wg.tick(wg.produce(batch(10))) does
    assert "hands rank r entry r of the output of" in step.route


def test_a_mesh_dispatch_reading_an_earlier_output_says_plans_do_not_know_its_function(wg):
    with daskwg.plan("mesh") as step:
        step.output(wg.step_on_mesh(wg.produce(step.input("data"))))
    assert _equal(step.run(data=batch(10)), wg.step_on_mesh(wg.produce(batch(10))))
    assert (
        f"{wg.name}.step_on_mesh reads the output of {wg.name}.produce (call 1 of step 'mesh') through a "
        "dispatch function step plans do not know (dispatch_nd_compute_dataproto('train'))"
    ) in step.route


def test_an_output_mixed_with_another_argument_names_that_argument(wg):
    with daskwg.plan("mixed") as step:
        step.output(wg.add(wg.seed(step.input("x")), y=[5, 6]))
    assert step.run(x=1) == wg.add(wg.seed(1), y=[5, 6]) == [105, 108]
    assert f"{wg.name}.add mixes earlier calls' outputs with other arguments (a list)" in step.route


def test_an_output_inside_a_list_says_so(wg):
    with daskwg.plan("nested") as step:
        step.output(wg.echo([wg.seed(step.input("x"))]))
    assert step.run(x=1) == wg.echo([wg.seed(1)]) == [[[100, 101]]] * 2
    assert (
        f"{wg.name}.echo gets the output of {wg.name}.seed (call 1 of step 'nested') inside a list"
        in step.route
    )


def test_reading_another_groups_output_names_that_group(groups):
    native, ray = groups["native"], groups["verl"]
    with daskwg.plan("two groups") as step:
        step.output(native.step(ray.produce(step.input("data"))))
    assert _equal(step.run(data=batch(10)), native.step(ray.produce(batch(10))))
    assert step.route == f"call by call ({native.name}.step reads an output of another group ({ray.name}))"


def test_a_rank_zero_call_reading_an_output_says_it_runs_on_rank_zero_only(wg):
    with daskwg.plan("rank zero") as step:
        step.output(wg.on_rank_zero(wg.seed(step.input("x"))))
    # verl's ALL_TO_ALL with Execute.RANK_ZERO: rank 0 gets the arguments as given
    assert step.run(x=1) == wg.on_rank_zero(wg.seed(1)) == (0, [100, 101])
    assert f"{wg.name}.on_rank_zero, which reads the output of {wg.name}.seed" in step.route
    assert "runs on rank 0 only (Execute.RANK_ZERO)" in step.route


def test_a_future_among_the_inputs_says_which_call_gets_it(wg):
    step = _produce_then_step(wg)
    step.run(data=batch(10))
    future = wg.pass_on(batch(10))
    assert _equal(step.run(data=future), wg.step(wg.produce(future)))
    assert step.route == f"call by call (an argument of {wg.name}.produce is a future)"


def test_a_step_recorded_with_compiled_false_says_so(wg, messages):
    with daskwg.plan("plain", compiled=False) as step:
        step.output(wg.add(wg.seed(step.input("x"))))
    messages["n"] = 0
    assert step.run(x=3) == [300, 302]
    assert step.route == "call by call (recorded with compiled=False)"
    assert messages["n"] == 4
