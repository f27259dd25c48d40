"""Step plans: an RL step's group calls recorded once (``plan``) and replayed every step
(``StepPlan.run``) with one message per worker, which runs its part in one turn of its host
thread (``daskwg.plugin.planned``; the driver's side is ``daskwg.transport.planned``).

Recording: ``BoundGroup._call_registered`` hands every call made inside the ``with`` block to
the plan being recorded in this thread (``recording()``), which keeps it and returns a
``PlanValue``. Replaying: ``CompiledReplay`` cuts the step's inputs per rank as the calls' dispatch
functions do and sends every call at once, or, where a call needs more than its own rank's
part, ``StepPlan._run_calls`` makes the calls one by one through the ordinary path.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from ..config import Settings
from ..dispatch.register import Execute, RegisteredMethod
from ..transport.planned import PlanPath
from .recorded import Op, PlanValue, batch_rows, edge, no_edge, substitute, walk
from .replay import CompiledReplay

__all__ = ["PlanValue", "StepPlan", "plan", "recording"]

logger = logging.getLogger(__name__)

_RECORDING: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar("daskwg_plan", default=None)


def recording() -> StepPlan | None:
    """The plan being recorded in this thread (``None``: calls run as they are made)."""
    return _RECORDING.get()


class StepPlan:
    """A recorded step, made by [`daskwg.plan`][daskwg.plan]; replay it with
    [`run`][daskwg.StepPlan.run].

    Attributes:
        name: the plan's name (messages).
        compiled: replays may take the one-message route.
        route: how the last replay went: ``"one message per worker"``, or ``"call by call"``
            with the reason (``None`` before the first replay).
        replays: how many replays ran.
    """

    def __init__(self, name: str, compiled: bool = True):
        self.name = name
        self.compiled = compiled
        self.route: str | None = None
        self.replays = 0
        self._ops: list[Op] = []
        self._inputs: dict[str, int] = {}
        self._outputs: Any = None
        self._has_outputs = False
        self._recording = False
        self._static: str | None = "not recorded yet"
        #: ops whose outputs later calls read rank by rank as rows; op -> rows out per row in,
        #: learnt from a replay made call by call (``None``: not yet); that replay's parts.
        self._rows_producers: set[int] = set()
        self._ratios: dict[int, Fraction] | None = None
        self._learning: tuple[dict[int, Any], dict[int, int]] | None = None
        #: why the replays made call by call so far learnt no rows (``None``: none was made)
        self._unlearnt: str | None = None
        self._edges: dict[tuple[int, int], bool] = {}  # (call, reader) -> a rows edge

    def __repr__(self) -> str:
        return f"<StepPlan {self.name!r}: {self.calls} calls, inputs {sorted(self._inputs)}>"

    @property
    def calls(self) -> int:
        """How many group calls the step makes."""
        return sum(op.group is not None for op in self._ops)

    # ---- recording -------------------------------------------------------------------

    def input(self, name: str) -> PlanValue:
        """A step input, given to every replay as ``run(name=value)``.

        Raises:
            ValueError: the name is taken, or the step is not being recorded.
        """
        self._check_recording("input")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a step input needs a name usable as a keyword argument, got {name!r}")
        if name in self._inputs:
            raise ValueError(f"step {self.name!r} already has an input {name!r}")
        self._inputs[name] = len(self._ops)
        self._ops.append(Op(f"input {name!r}"))
        return PlanValue(self, self._inputs[name], f"input {name!r}")

    def output(self, *values: Any) -> None:
        """What every replay returns: one value, or a tuple of several (recorded calls'
        outputs, or anything else). Without it a replay returns the last call's output."""
        self._check_recording("output")
        if self._has_outputs:
            raise ValueError(
                f"step {self.name!r} has its outputs already: name them all in one step.output(...)"
            )
        self._check_values(values, "the outputs")
        self._outputs = values[0] if len(values) == 1 else tuple(values)
        self._has_outputs = True

    def _check_recording(self, what: str) -> None:
        if not self._recording:
            raise ValueError(f"step.{what}() is for the with daskwg.plan() block that records {self.name!r}")

    def _check_values(self, values: Any, where: str) -> None:
        for value in walk(values):
            if isinstance(value, PlanValue) and value._step is not self:
                raise ValueError(f"{where} hold {value._label} of another plan ({value._step.name!r})")

    def record(
        self, group: Any, method: str, registered: RegisteredMethod, args: tuple, kwargs: dict
    ) -> PlanValue:
        """Record a call of a registered method (``BoundGroup`` calls this while recording);
        returns the stand-in of its output.

        Raises:
            ValueError: an argument is a stand-in of another plan; the method is in a named
                concurrency group (a plan replays one order per worker, the default group's).
            GroupBrokenError, WorkerLostError: the group cannot be called now.
        """
        if registered.concurrency_group is not None:
            raise ValueError(
                f"{group._name}.{method} is in concurrency group {registered.concurrency_group!r}, which a step "
                f"plan cannot record (a plan replays the default group's order); call it outside "
                f"'with daskwg.plan(...)', e.g. from another thread while the step runs"
            )
        self._check_values((args, kwargs), f"the arguments of {group._name}.{method}")
        group._check_usable(method)
        label = f"the output of {group._name}.{method} (call {self.calls + 1} of step {self.name!r})"
        self._ops.append(Op(label, group, method, registered, args, dict(kwargs)))
        return PlanValue(self, len(self._ops) - 1, label)

    def __enter__(self) -> StepPlan:
        if _RECORDING.get() is not None:
            raise RuntimeError(f"step {_RECORDING.get().name!r} is being recorded; plans do not nest")
        if self._ops:
            raise RuntimeError(f"step {self.name!r} was recorded already; record another with daskwg.plan()")
        self._recording = True
        self._token = _RECORDING.set(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _RECORDING.reset(self._token)
        self._recording = False
        if exc_info[0] is not None:
            return
        if not self.calls:
            raise ValueError(f"step {self.name!r} recorded no group call")
        if not self._has_outputs:
            self._outputs = PlanValue(self, len(self._ops) - 1, self._ops[-1].label)
        self._static = None if self.compiled else "recorded with compiled=False"
        if self._static is None:
            self._static = self._check_static()

    # ---- replaying -------------------------------------------------------------------

    def run(self, **inputs: Any) -> Any:
        """Replay the step with these inputs; returns what [`output`][daskwg.StepPlan.output]
        named, as the calls return it: values for blocking calls, futures (a
        ``DataProtoFuture``; per-rank ``distributed.Future`` lists) for ``blocking=False`` ones.

        A step with any blocking call returns once every call of it has ended, as the calls
        one by one would; otherwise at once. ``route`` says how the replay went.

        Args:
            **inputs: one value per [`input`][daskwg.StepPlan.input] of the step, by name.

        Raises:
            TypeError: an input is missing or unknown (before anything runs).
            DispatchError: an argument cannot be cut per rank or pickled (before anything runs).
            RankError, WorkerLostError, GroupBrokenError, CallTimeoutError: as the calls fail.
        """
        if self._recording:
            raise RuntimeError(
                f"step {self.name!r} is being recorded: replay it after its with daskwg.plan() block"
            )
        if self._static == "not recorded yet":
            raise RuntimeError(
                f"the recording of step {self.name!r} ended with an exception: record the step again"
            )
        self.route = None
        missing = sorted(set(self._inputs) - set(inputs))
        unknown = sorted(set(inputs) - set(self._inputs))
        if missing or unknown:
            raise TypeError(
                f"step {self.name!r} takes the inputs {sorted(self._inputs)}: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {missing}" if missing else "",
                        f"unknown {unknown}" if unknown else "",
                    )
                    if part
                )
            )
        self.replays += 1
        reason = self._static
        if reason is None:
            for op in self._ops:
                if op.group is not None:
                    op.group._check_usable(op.method)
            if self._rows_producers and self._ratios is None:
                reason = self._learn()
        if reason is None:
            self.route = "one message per worker"
            result, reason = CompiledReplay(self, inputs).run()
            if reason is None:
                return result
        self.route = f"call by call ({reason})"
        values: dict[int, Any] = {}
        rows_in: dict[int, int | None] = {}
        learnable = self._static is None and self._ratios is None and self._learning is None
        if learnable:
            self._unlearnt = f"replay {self.replays}, made call by call to learn them, raised"
        result = self._run_calls(inputs, values, rows_in)
        if learnable:
            self._unlearnt = self._unlearnable(rows_in)
            if self._unlearnt is None:
                self._learning = ({i: values[i] for i in self._rows_producers}, rows_in)
        return result

    __call__ = run

    def _run_calls(self, inputs: dict, values: dict[int, Any], rows_in: dict[int, int | None]) -> Any:
        """The recorded calls one by one; ``values`` gets every op's value, ``rows_in`` the
        rows of the batches that rows-producing calls cut from the step's inputs (``None``:
        no batch among the arguments)."""
        for i, op in enumerate(self._ops):
            if op.group is None:
                values[i] = inputs[op.label[7:-1]]
                continue
            args = substitute(op.args, values)
            kwargs = substitute(op.kwargs, values)
            if i in self._value_producers():
                rows_in[i] = batch_rows((args, kwargs))
            values[i] = op.group._call_registered(op.method, op.registered, *args, **kwargs)
        return substitute(self._outputs, values)

    def _unlearnable(self, rows_in: dict[int, int | None]) -> str | None:
        """Why a replay made call by call whose rows-producing calls got ``rows_in`` rows
        cannot teach the rows of each stage (``None``: it can); makes ``rows_in`` rows per
        rank."""
        for i in sorted(rows_in):
            op = self._ops[i]
            rows, n = rows_in[i], op.group.world_size
            where = f"{op.group._name}.{op.method}"
            if rows is None:
                return f"replay {self.replays} gave {where} no batch (DataProto, TensorDict) to count rows of"
            if rows % n:
                return (
                    f"the batch of replay {self.replays} given to {where} had {rows} rows on {n} ranks, "
                    "and was padded"
                )
            rows_in[i] = rows // n
        return None

    def _value_producers(self) -> set[int]:
        """Rows-producing ops cut from the step's inputs (not reading an earlier call)."""
        return {i for i in self._rows_producers if not self._sources(self._ops[i])}

    def _sources(self, op: Op) -> list[int]:
        """The earlier calls whose outputs ``op`` reads."""
        return [
            v._index
            for v in walk((op.args, op.kwargs))
            if isinstance(v, PlanValue) and self._ops[v._index].group is not None
        ]

    def _learn(self) -> str | None:
        """Learn from the last replay made call by call how many rows each rows-producing
        call returns per row it gets (``None``: learnt, replays may take the one-message
        route; else why not yet)."""
        if self._learning is None:
            if self._unlearnt is None:
                return "the first replay learns the rows of each stage"
            return f"no replay has learnt the rows of each stage yet: {self._unlearnt}"
        outputs, rows_in = self._learning
        parts = {i: list(getattr(out, "futures", ())) for i, out in outputs.items()}
        some = self._ops[next(iter(parts))].group
        settings = Settings.current()
        if any(op.group is not None and op.registered.blocking for op in self._ops):
            # That replay returned once all its calls had ended on the workers; the replies
            # of its non-blocking calls may still be on their way to the driver.
            owned = some._transport.driver.owned
            records = [r for r in (owned.record(f) for fs in parts.values() for f in fs) if r]
            owned.wait(records, settings.status_timeout, every=True)
        if not all(f.done() for fs in parts.values() for f in fs):
            # Kept: a later replay learns from it once it has run.
            return "the replay that learns the rows of each stage is still running"
        self._learning = None
        try:
            rows = {
                i: PlanPath(some._transport.driver).part_rows(fs, settings.status_timeout)
                for i, fs in parts.items()
            }
        except Exception as exc:  # noqa: BLE001 - a failed call, a lost worker: learn next time
            self._unlearnt = f"learning them failed ({type(exc).__name__}: {exc})"
            return f"learning the rows of each stage failed ({type(exc).__name__}: {exc})"
        ratios: dict[int, Fraction] = {}
        rows_out: dict[int, int] = {}
        for i in sorted(rows):
            got = set(rows[i])
            where = f"{self._ops[i].group._name}.{self._ops[i].method}"
            if len(got) != 1:
                self._static = f"{where} returned {rows[i]} rows on its ranks"
                return self._static
            sources = self._sources(self._ops[i])
            before = rows_in[i] if not sources else rows_out[sources[0]]
            rows_out[i] = got.pop()
            if not before:
                self._unlearnt = f"{where} got no rows in the replay that was to teach them"
                return f"{where} got no rows"
            ratios[i] = Fraction(rows_out[i], before)
        self._ratios = ratios
        return None

    def _check_static(self) -> str | None:
        """Why no replay can take the one-message route (``None``: they may)."""
        kinds: dict[int, Any] = {}
        for i, op in enumerate(self._ops):
            if op.group is None:
                continue
            where = f"{op.group._name}.{op.method}"
            if getattr(op.group, "_transport", None) is None:
                return f"{where} is a call on a role group"
            if op.registered.execute_mode not in (Execute.ALL, Execute.RANK_ZERO):
                return f"{where} has execute mode {op.registered.execute_mode}"
            fns = op.group._dispatch_fns(op.registered)
            kinds[i] = fns
            stand_ins = [v for v in walk((op.args, op.kwargs)) if isinstance(v, PlanValue)]
            produced = [v for v in stand_ins if self._ops[v._index].group is not None]
            if not produced:
                continue
            top = [*op.args, *op.kwargs.values()]
            inside = [v for v in produced if not any(v is t for t in top)]
            if inside:
                return (
                    f"{where} gets {inside[0]._label} inside a list, tuple or dict: a replay hands a "
                    "rank its part of an earlier call's output only as a whole argument"
                )
            others = [t for t in top if not any(t is v for v in produced)]
            if others:
                what = (
                    others[0]._label if isinstance(others[0], PlanValue) else f"a {type(others[0]).__name__}"
                )
                return (
                    f"{where} mixes earlier calls' outputs with other arguments ({what}): a replay hands "
                    "a rank its part of earlier calls' outputs only when they are all of its arguments"
                )
            for value in produced:
                source = self._ops[value._index]
                if source.group is not op.group:
                    return f"{where} reads an output of another group ({source.group._name})"
                for call, who in (
                    (op, f"{where}, which reads {source.label},"),
                    (source, f"{source.group._name}.{source.method}, whose output {where} reads,"),
                ):
                    if call.registered.execute_mode == Execute.RANK_ZERO:
                        return (
                            f"{who} runs on rank 0 only (Execute.RANK_ZERO): a replay hands a rank its "
                            "part of an earlier call's output only between calls that run on every rank"
                        )
                how = edge(kinds[value._index], fns)
                if how is None:
                    return no_edge(where, source.label, kinds[value._index], fns)
                if how == "rows":
                    if source.registered.blocking:
                        return (
                            f"{where} reads the rows of {source.label}, a blocking call's: a plan learns "
                            "how many rows each rank's part has from a blocking=False call's futures"
                        )
                    self._rows_producers.add(value._index)
        return None


@contextlib.contextmanager
def plan(name: str = "step", *, compiled: bool = True) -> Iterator[StepPlan]:
    """Record a step: the registered-method calls made in the ``with`` block, on any groups
    of one client, are recorded, not run; each replay ([`StepPlan.run`][daskwg.StepPlan.run])
    makes them again, with one message per worker::

        with daskwg.plan("rl-step") as step:
            batch = step.input("batch")
            out = actor.reward(actor.generate(batch))   # recorded, not run
            step.output(actor.update(out))
        for data in loader:
            metrics = step.run(batch=data)             # one message per worker

    Inside the block calls return [`PlanValue`][daskwg.PlanValue] stand-ins. A replay gives
    what the same calls made one by one give: values, the order of calls on each worker,
    padding, the errors (``RankError``, ``WorkerLostError``, ``CallTimeoutError`` under
    [`daskwg.deadline`][daskwg.deadline] or ``@register(timeout=...)``). It runs each
    worker's part in one turn of its host thread, handing the output of one call to the
    next call of the same rank in that process, when every call is cut from the step's
    inputs on the driver or reads only its own rank's part of an earlier call of its group:
    a ``DP_COMPUTE``/``ALL_TO_ALL``/``ONE_TO_ALL`` output element by element in
    ``DP_COMPUTE``/``ALL_TO_ALL``, a ``DP_COMPUTE_PROTO`` output in ``DP_COMPUTE_PROTO``/
    ``DP_COMPUTE_METRIC`` (the first replay, made call by call, learns how many rows each
    such stage returns per row; a later replay whose rows differ fails with a
    ``RankError`` saying so). Otherwise (another group's output, every rank's parts, a
    padded batch, a future among the inputs, a role group) it makes the calls one by one;
    ``StepPlan.route`` says which and why. ``daskwg.verl``'s groups replay as native ones
    do, verl's ``DataProto`` and verl's ``ALL_TO_ALL`` rule (split when every argument is
    a list of ``world_size`` entries, else every rank gets all of them) included. A
    restarted group is replayed on its new ranks; a shut-down or broken one raises
    ``GroupBrokenError`` before anything is sent. Ray's Compiled Graphs (``InputNode``,
    ``bind``, ``experimental_compile``, ``execute``) are the same idea for actor calls.

    Args:
        name: the step's name, in messages.
        compiled: replays may take the one-message route (``False``: every replay makes the
            calls one by one, as the block would have).

    Returns:
        a context manager giving the [`StepPlan`][daskwg.StepPlan].

    Raises:
        RuntimeError: a plan is being recorded in this thread already (plans do not nest);
            an ``execute_*`` call inside the block.
        ValueError: the block recorded no group call.
    """
    step = StepPlan(name, compiled)
    with step:
        yield step
