"""Step plans: an RL step's group calls recorded once (:func:`plan`) and replayed every step
(:meth:`StepPlan.run`) with one message per worker.

An RL step makes the same group calls every time (generate, reward, advantage, log-prob,
ref log-prob, update). Recorded as a plan, a replay costs the driver one message per worker
instead of one per call and rank; each worker runs its part in the driver's order in one
turn of its host thread, handing the output of one call to the next call of the same rank
in its own process (``daskwg.plugin.planned``). Ray's Compiled Graphs
(``InputNode``/``bind``/``experimental_compile``/``execute``) are the same idea for actor
calls; here the recording is of the ordinary calls, as a verl trainer makes them::

    with daskwg.plan("rl-step") as step:
        batch = step.input("batch")
        out = actor.generate(batch)       # recorded, not run
        out = actor.reward(out)
        step.output(actor.update(out))
    for data in loader:
        loss = step.run(batch=data).get() # one message per worker

Inside the ``with`` block calls return :class:`PlanValue`\\ s (stand-ins for their outputs)
and nothing runs. A replay gives what the same calls made one by one give (values, order on
each worker, padding, errors); it takes the one-message route (:attr:`StepPlan.route`)
when every call can be cut on the driver or reads only its own rank's part of an earlier
call's output (a ``DP_COMPUTE``/``ALL_TO_ALL``/``ONE_TO_ALL`` list element by element into
``DP_COMPUTE``/``ALL_TO_ALL``, a ``DP_COMPUTE_PROTO`` output into ``DP_COMPUTE_PROTO`` with the
same rows); otherwise, and for steps recorded with ``compiled=False``, it makes the
recorded calls one by one. Data-dependent control flow stays in the driver, between replays.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from distributed import Future

from . import serialization
from .config import Settings
from .deadlines import current_limit
from .decorator import Execute, RegisteredMethod
from .dispatch import (
    PADDING_SIZE_KEY,
    RankOutputs,
    check_per_rank,
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
)
from .errors import DispatchError
from .futures import DataProtoFuture
from .protocol import unpad_rows
from .transport.planned import PlanEntry, PlanPath
from .wire import Slot

__all__ = ["PlanValue", "StepPlan", "plan", "recording"]

logger = logging.getLogger(__name__)

_RECORDING: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar("daskwg_plan", default=None)

#: Collect functions whose result is the list of per-rank outputs.
_LIST_COLLECTS = (collect_all_to_all, collect_dp_compute)
#: Dispatch functions that hand rank ``r`` entry ``r`` of every argument.
_LIST_DISPATCHES = (dispatch_dp_compute, dispatch_all_to_all)


def recording() -> StepPlan | None:
    """The plan being recorded in this thread (``None``: calls run as they are made)."""
    return _RECORDING.get()


class PlanValue:
    """A stand-in, while a step is recorded, for a step input (:meth:`StepPlan.input`) or
    for the output of a recorded call. Pass it to later calls of the step or to
    :meth:`StepPlan.output`; it has no value until a replay, so using it as one (``if``,
    ``len``, iterating, ``.get()``) raises ``TypeError``.
    """

    __slots__ = ("_step", "_index", "_label")

    def __init__(self, step: StepPlan, index: int, label: str):
        self._step = step
        self._index = index
        self._label = label

    def _no_value(self, what: str) -> TypeError:
        return TypeError(
            f"{what} needs the value of {self._label}, which a step plan only has when it is replayed: "
            "keep control flow that depends on data between replays (step.run(...) returns the outputs)"
        )

    def __bool__(self) -> bool:
        raise self._no_value("a condition")

    def __len__(self) -> int:
        raise self._no_value("len()")

    def __iter__(self) -> Iterator[Any]:
        raise self._no_value("iterating")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._no_value(f"{name!r}")

    def __repr__(self) -> str:
        return f"<PlanValue {self._label} of {self._step!r}>"


@dataclasses.dataclass
class _Op:
    """One recorded call, or a step input (``group`` ``None``)."""

    label: str
    group: Any = None
    method: str = ""
    registered: RegisteredMethod | None = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


class StepPlan:
    """A recorded step (see the module docstring); made by :func:`plan`.

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
        self._ops: list[_Op] = []
        self._inputs: dict[str, int] = {}
        self._outputs: Any = None
        self._has_outputs = False
        self._recording = False
        self._static: str | None = "not recorded yet"

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
        self._ops.append(_Op(f"input {name!r}"))
        return PlanValue(self, self._inputs[name], f"input {name!r}")

    def output(self, *values: Any) -> None:
        """What every replay returns: one value, or a tuple of several (recorded calls'
        outputs, or anything else). Without it a replay returns the last call's output."""
        self._check_recording("output")
        self._check_values(values, "the outputs")
        self._outputs = values[0] if len(values) == 1 else tuple(values)
        self._has_outputs = True

    def _check_recording(self, what: str) -> None:
        if not self._recording:
            raise ValueError(f"step.{what}() is for the with daskwg.plan() block that records {self.name!r}")

    def _check_values(self, values: Any, where: str) -> None:
        for value in _walk(values):
            if isinstance(value, PlanValue) and value._step is not self:
                raise ValueError(f"{where} hold {value._label} of another plan ({value._step.name!r})")

    def record(
        self, group: Any, method: str, registered: RegisteredMethod, args: tuple, kwargs: dict
    ) -> PlanValue:
        """Record a call of a registered method (``BoundGroup`` calls this while recording);
        returns the stand-in of its output.

        Raises:
            ValueError: an argument is a stand-in of another plan.
            GroupBrokenError, WorkerLostError: the group cannot be called now.
        """
        self._check_values((args, kwargs), f"the arguments of {group._name}.{method}")
        group._check_usable(method)
        label = f"the output of {group._name}.{method} (call {self.calls + 1} of step {self.name!r})"
        self._ops.append(_Op(label, group, method, registered, args, dict(kwargs)))
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
        """Replay the step with these inputs; returns what :meth:`output` named, as the calls
        return it: values for blocking calls, futures (a ``DataProtoFuture``; per-rank
        ``distributed.Future`` lists) for ``blocking=False`` ones.

        A step with any blocking call returns once every call of it has ended, as the calls
        one by one would; otherwise at once.

        Raises:
            TypeError: an input is missing or unknown (before anything runs).
            DispatchError: an argument cannot be cut per rank or pickled (before anything runs).
            RankError, WorkerLostError, GroupBrokenError, CallTimeoutError: as the calls fail.
        """
        if self._recording or self._static == "not recorded yet":
            raise RuntimeError(f"step {self.name!r} is run after its with daskwg.plan() block")
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
            result, reason = _Compiled(self, inputs).run()
            if reason is None:
                self.route = "one message per worker"
                return result
        self.route = f"call by call ({reason})"
        return self._run_calls(inputs)

    __call__ = run

    def _run_calls(self, inputs: dict) -> Any:
        values: dict[int, Any] = {}
        for i, op in enumerate(self._ops):
            if op.group is None:
                values[i] = inputs[op.label[7:-1]]
                continue
            args = _substitute(op.args, values)
            kwargs = _substitute(op.kwargs, values)
            values[i] = op.group._call_registered(op.method, op.registered, *args, **kwargs)
        return _substitute(self._outputs, values)

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
            stand_ins = [v for v in _walk((op.args, op.kwargs)) if isinstance(v, PlanValue)]
            produced = [v for v in stand_ins if self._ops[v._index].group is not None]
            if not produced:
                continue
            top = [*op.args, *op.kwargs.values()]
            if len(produced) != len(top) or any(v is not t for v, t in zip(produced, top)):
                return f"{where} mixes earlier calls' outputs with other arguments"
            for value in produced:
                source = self._ops[value._index]
                if source.group is not op.group:
                    return f"{where} reads an output of another group ({source.group._name})"
                if Execute.RANK_ZERO in (op.registered.execute_mode, source.registered.execute_mode):
                    return f"{where} or the call before it runs on rank 0 only"
                if _edge(kinds[value._index], fns) is None:
                    return f"{where} reads more than its own rank's part of {source.label}"
        return None


def _edge(source_fns: dict, fns: dict) -> str | None:
    """How a call reads an earlier call's output rank by rank: ``"list"``, ``"rows"``, or
    ``None`` (it needs other ranks' parts)."""
    if source_fns["collect_fn"] in _LIST_COLLECTS and fns["dispatch_fn"] in _LIST_DISPATCHES:
        return "list"
    if (
        source_fns["collect_fn"] is collect_dp_compute_data_proto
        and fns["dispatch_fn"] is dispatch_dp_compute_data_proto
    ):
        return "rows"
    return None


class _Compiled:
    """One replay on the one-message route."""

    def __init__(self, step: StepPlan, inputs: dict):
        self.step = step
        self.inputs = inputs
        self.placed: dict[int, tuple[list[int], int]] = {}

    def run(self) -> tuple[Any, str | None]:
        """``(outputs, None)``, or ``(None, reason)`` when this replay cannot take the route
        (nothing was sent then)."""
        step = self.step
        settings = Settings.current()
        blocking = any(op.group is not None and op.registered.blocking for op in step._ops)
        outputs = {v._index for v in _walk(step._outputs) if isinstance(v, PlanValue)}
        entries: list[PlanEntry] = []
        placed = self.placed = {}  # op -> (its entries, in rank order), its padding
        values: dict[int, Any] = {}
        timeouts = []
        driver = None
        for i, op in enumerate(step._ops):
            if op.group is None:
                values[i] = self.inputs[op.label[7:-1]]
                continue
            transport = op.group._transport
            driver = transport.driver
            n = op.group.world_size
            ranks = [0] if op.registered.execute_mode == Execute.RANK_ZERO else list(range(n))
            fns = op.group._dispatch_fns(op.registered)
            top = [*op.args, *op.kwargs.values()]
            fed = bool(top) and all(isinstance(v, PlanValue) and v._index in placed for v in top)
            if fed:
                for v in top:
                    source_entries, pad = placed[v._index]
                    if pad:
                        return None, f"{step._ops[v._index].label} was padded this time"
                payloads = [
                    (
                        tuple(self._slot(a, r, fns) for a in op.args),
                        {k: self._slot(v, r, fns) for k, v in op.kwargs.items()},
                    )
                    for r in ranks
                ]
                pad = 0
            else:
                args, kwargs = _substitute(op.args, values), _substitute(op.kwargs, values)
                if any(isinstance(v, (Future, DataProtoFuture)) for v in _walk((args, kwargs))):
                    return None, f"an argument of {op.group._name}.{op.method} is a future"
                payloads, pad = _dispatch(op, fns, args, kwargs, ranks)
            number = next(driver.call_numbers)
            first = len(entries)
            if i not in outputs:
                result = "none"
            else:
                result = "return" if op.registered.blocking else "keep"
            for r, payload in zip(ranks, payloads):
                entries.append(PlanEntry(transport, r, op.method, number, payload, result))
            placed[i] = (list(range(first, len(entries))), pad)
            timeouts.append(op.registered.timeout)
        replay = PlanPath(driver).send(entries, settings)
        if blocking:
            replay.blocking = True
            limit = current_limit(
                sum(timeouts) if all(t is not None for t in timeouts) else None, settings.call_timeout
            )
            replay.wait(limit, settings, step.name)
        for i in outputs:
            indices, pad = placed[i]
            if step._ops[i].registered.blocking:
                parts = [serialization.loads(replay.values[j]) for j in indices]
            else:
                parts = [replay.futures[j] for j in indices]
            values[i] = _collect(step._ops[i], parts, pad)
        return _substitute(step._outputs, values), None

    def _slot(self, value: PlanValue, rank: int, fns: dict) -> Slot:
        """Rank ``rank``'s part of an earlier call's output (its entries are in rank order)."""
        source = self.step._ops[value._index]
        rows = _edge(source.group._dispatch_fns(source.registered), fns) == "rows"
        return Slot(self.placed[value._index][0][rank], rows)


def _dispatch(op: _Op, fns: dict, args: tuple, kwargs: dict, ranks: list[int]) -> tuple[list, int]:
    """The call's per-rank ``(args, kwargs)`` and padding, cut as the call made alone cuts them
    (``BoundGroup._call_registered``)."""
    group = op.group
    try:
        d_args, d_kwargs = fns["dispatch_fn"](group, *args, **kwargs)
    except DispatchError:
        raise
    except (TypeError, ValueError, IndexError) as exc:
        raise DispatchError(f"{group._name}.{op.method}: {exc}") from exc
    d_kwargs = dict(d_kwargs)
    pad = d_kwargs.pop(PADDING_SIZE_KEY, 0) or 0
    check_per_rank(f"the dispatch function of {group._name}.{op.method}", group.world_size, d_args, d_kwargs)
    return [(tuple(a[r] for a in d_args), {k: v[r] for k, v in d_kwargs.items()}) for r in ranks], pad


def _collect(op: _Op, parts: list, pad: int) -> Any:
    """The call's result from its ranks' parts, as ``BoundGroup._call_registered`` collects it."""
    group = op.group
    outputs = RankOutputs(parts, method=op.method, ranks=list(range(len(parts))))
    if op.registered.execute_mode == Execute.RANK_ZERO:
        return outputs[0]
    result = group._dispatch_fns(op.registered)["collect_fn"](group, outputs)
    if result is outputs:
        result = list(result)
    if isinstance(result, DataProtoFuture):
        result = dataclasses.replace(result, gather=group._gather_any)
    return unpad_rows(result, pad)


def _walk(value: Any, depth: int = 0) -> Iterator[Any]:
    """``value`` and what lists, tuples and dicts in it hold (4 levels deep)."""
    yield value
    if depth >= 4:
        return
    if type(value) in (list, tuple):
        for v in value:
            yield from _walk(v, depth + 1)
    elif type(value) is dict:
        for v in value.values():
            yield from _walk(v, depth + 1)


def _substitute(value: Any, values: dict[int, Any], depth: int = 0) -> Any:
    """``value`` with each :class:`PlanValue` replaced by this replay's value of it."""
    if isinstance(value, PlanValue):
        return values[value._index]
    if depth >= 4:
        return value
    if type(value) in (list, tuple):
        return type(value)(_substitute(v, values, depth + 1) for v in value)
    if type(value) is dict:
        return {k: _substitute(v, values, depth + 1) for k, v in value.items()}
    return value


@contextlib.contextmanager
def plan(name: str = "step", *, compiled: bool = True) -> Iterator[StepPlan]:
    """Record a step: the registered-method calls made in the ``with`` block, on any groups
    of one client, are recorded instead of run (see the module docstring).

    Args:
        name: the step's name, in messages.
        compiled: replays may take the one-message route (``False``: every replay makes the
            calls one by one, as the block would have).
    Returns:
        a context manager giving the :class:`StepPlan`; replay it with ``step.run(**inputs)``.
    Raises:
        RuntimeError: a plan is being recorded in this thread already.
        ValueError: the block recorded no group call.
    """
    step = StepPlan(name, compiled)
    with step:
        yield step
