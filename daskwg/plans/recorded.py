"""What a recorded step plan (``daskwg.plan``) is made of: ``PlanValue``, the stand-in a
recorded call returns; ``Op``, one recorded call or step input; how a call reads an earlier
call's output rank by rank (``edge``); and walking the stand-ins in a call's arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from .. import foreign
from ..dispatch.modes import (
    collect_all_to_all,
    collect_dp_compute,
    collect_dp_compute_data_proto,
    collect_rank_zero,
    dispatch_all_to_all,
    dispatch_dp_compute,
    dispatch_dp_compute_data_proto,
    dispatch_dp_compute_metric,
    dispatch_one_to_all,
    split_or_broadcast,
)
from ..dispatch.register import RegisteredMethod
from ..futures.future import rows_of

__all__ = [
    "Op",
    "PlanValue",
    "batch_rows",
    "collect_kind",
    "dispatch_kind",
    "edge",
    "no_edge",
    "substitute",
    "walk",
]

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


def collect_kind(fns: dict) -> str | None:
    """What a call's collected output is: ``"list"`` (one output per rank, in rank order),
    ``"rows"`` (every rank's batch concatenated), ``"rank zero"`` (rank 0's output only), or
    ``None`` (a collect function plans do not know: a mode of ``register_dispatch_mode``, a
    mesh's). A collect function wrapped with ``functools.wraps`` (``daskwg.verl``'s groups
    wrap every one) is the one it wraps."""
    fn = inspect.unwrap(fns["collect_fn"])
    if fn in LIST_COLLECTS:
        return "list"
    if fn is collect_dp_compute_data_proto:
        return "rows"
    if fn is collect_rank_zero:
        return "rank zero"
    return None


def dispatch_kind(fns: dict) -> str | None:
    """How a call hands its arguments to its ranks: ``"list"`` (rank ``r`` gets entry ``r``),
    ``"rows"`` (equal pieces of rows), ``"whole"`` (every rank all of it), ``"list or whole"``
    (verl's ``ALL_TO_ALL`` rule, ``split_or_broadcast``: entry ``r`` when every argument is
    a list of ``world_size`` entries, else all of it), or ``None`` (a dispatch function plans
    do not know)."""
    fn = inspect.unwrap(fns["dispatch_fn"])
    if fn in LIST_DISPATCHES:
        return "list"
    if fn in ROWS_DISPATCHES:
        return "rows"
    if fn is dispatch_one_to_all:
        return "whole"
    if fn is split_or_broadcast:
        return "list or whole"
    return None


def edge(source_fns: dict, fns: dict) -> str | None:
    """How a call reads an earlier call's output rank by rank: ``"list"``, ``"rows"``, or
    ``None`` (it needs other ranks' parts, or plans cannot tell). A ``"list or whole"``
    reader reads a list output entry by entry only when every argument it gets is one: the
    caller checks that."""
    source, reader = collect_kind(source_fns), dispatch_kind(fns)
    if source == "list" and reader in ("list", "list or whole"):
        return "list"
    if source == "rows" and reader == "rows":
        return "rows"
    return None


def no_edge(where: str, label: str, source_fns: dict, fns: dict) -> str:
    """Why the call ``where`` cannot read ``label``, the output of an earlier call, rank by
    rank (``edge`` gave ``None``): what each side's functions do."""
    source, reader = collect_kind(source_fns), dispatch_kind(fns)
    if reader is None or source is None:
        fn = inspect.unwrap(fns["dispatch_fn"] if reader is None else source_fns["collect_fn"])
        if isinstance(fn, functools.partial):  # a mesh's: dispatch_nd_compute_dataproto('actor')
            name = f"{getattr(fn.func, '__qualname__', fn.func)}({', '.join(map(repr, fn.args))})"
        else:
            name = getattr(fn, "__qualname__", repr(fn))
        side = "dispatch function" if reader is None else "collect function of the call that made it"
        return (
            f"{where} reads {label} through a {side} step plans do not know ({name}), so a replay "
            "cannot tell which part of it each rank reads"
        )
    if reader in ("whole", "list or whole"):
        why = (
            "verl's ALL_TO_ALL gives every rank all of its arguments unless every one is a list of "
            "world_size entries"
            if reader == "list or whole"
            else "its dispatch mode gives every rank all of its arguments"
        )
        return f"{where} reads more than its own rank's part of {label} ({why})"
    if source == "rank zero":
        return (
            f"{where} reads more than its own rank's part of {label} (the call that made it collects "
            "rank 0's output only)"
        )
    if source == "list":
        return (
            f"{where} cuts {label}, a list of one output per rank, into pieces of rows: a rank reads "
            "other ranks' outputs, not its own"
        )
    return (
        f"{where} hands rank r entry r of {label}, a batch of every rank's rows: a rank reads other "
        "ranks' rows, not its own"
    )


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
