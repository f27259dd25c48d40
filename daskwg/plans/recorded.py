"""What a recorded step plan (``daskwg.plan``) is made of: ``PlanValue``, the stand-in a
recorded call returns; ``Op``, one recorded call or step input; how a call reads an earlier
call's output rank by rank (``edge``); and walking the stand-ins in a call's arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from .. import foreign
from ..dispatch.modes import (
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_metric,
)
from ..dispatch.register import RegisteredMethod
from ..futures.future import rows_of

__all__ = ["Op", "PlanValue", "batch_rows", "edge", "substitute", "walk"]

#: Collect functions whose result is the list of per-rank outputs.
LIST_COLLECTS = (collect_all_to_all, collect_dp_compute)
#: Dispatch functions that hand rank ``r`` entry ``r`` of every argument.
LIST_DISPATCHES = (dispatch_dp_compute, dispatch_all_to_all)
#: Dispatch functions that cut batches into equal pieces of rows, one per rank.
ROWS_DISPATCHES = (dispatch_dp_compute_data_proto, dispatch_dp_compute_metric)


class PlanValue:
    """A stand-in, while a step is recorded ([`daskwg.plan`][daskwg.plan]), for a step input
    ([`StepPlan.input`][daskwg.StepPlan.input]) or for the output of a recorded call.

    Pass it to later calls of the step or to [`StepPlan.output`][daskwg.StepPlan.output]. It
    has no value until a replay, so using it as one (``if``, ``len``, iterating, ``.get()``,
    any attribute) raises ``TypeError``: control flow that depends on data stays in the driver,
    between replays.
    """

    __slots__ = ("_step", "_index", "_label")

    def __init__(self, step: Any, index: int, label: str):
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

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self._label} is a PlanValue, a stand-in inside the with daskwg.plan() block that recorded it: "
            "pass it to calls recorded in that block; replay the step with step.run(...) for values"
        )


@dataclasses.dataclass
class Op:
    """One recorded call, or a step input (``group`` ``None``)."""

    label: str
    group: Any = None
    method: str = ""
    registered: RegisteredMethod | None = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


def edge(source_fns: dict, fns: dict) -> str | None:
    """How a call reads an earlier call's output rank by rank: ``"list"``, ``"rows"``, or
    ``None`` (it needs other ranks' parts)."""
    if source_fns["collect_fn"] in LIST_COLLECTS and fns["dispatch_fn"] in LIST_DISPATCHES:
        return "list"
    if source_fns["collect_fn"] is collect_dp_compute_data_proto and fns["dispatch_fn"] in ROWS_DISPATCHES:
        return "rows"
    return None


def batch_rows(value: Any) -> int | None:
    """Rows of the first batch (``DataProto``, ``TensorDict``) among the arguments."""
    for item in walk(value):
        try:
            return len(item) if foreign.is_verl_dataproto(item) else rows_of(item)
        except TypeError:
            continue
    return None


def walk(value: Any, depth: int = 0) -> Iterator[Any]:
    """``value`` and what lists, tuples and dicts in it hold (4 levels deep)."""
    yield value
    if depth >= 4:
        return
    if type(value) in (list, tuple):
        for v in value:
            yield from walk(v, depth + 1)
    elif type(value) is dict:
        for v in value.values():
            yield from walk(v, depth + 1)


def substitute(value: Any, values: dict[int, Any], depth: int = 0) -> Any:
    """``value`` with each ``PlanValue`` replaced by this replay's value of it."""
    if isinstance(value, PlanValue):
        return values[value._index]
    if depth >= 4:
        return value
    if type(value) in (list, tuple):
        return type(value)(substitute(v, values, depth + 1) for v in value)
    if type(value) is dict:
        return {k: substitute(v, values, depth + 1) for k, v in value.items()}
    return value
