"""One replay of a step plan on the one-message route (``daskwg.plan``): ``CompiledReplay``
cuts the step's inputs per rank as the calls' dispatch functions do, hands each call that
reads an earlier one's output its own rank's part (a ``daskwg.wire.messages.Slot``), sends every
call at once (``daskwg.transport.planned``) and collects the step's outputs as the calls
collect them.
"""

from __future__ import annotations

from typing import Any

from distributed import Future

from ..config import Settings
from ..deadlines import current_limit
from ..dispatch.calling import collect, cut
from ..dispatch.register import Execute
from ..futures.future import DataProtoFuture
from ..serialization import pickling as serialization
from ..transport.planned import PlanEntry, PlanPath
from ..wire.messages import Slot
from .recorded import PlanValue, batch_rows, edge, substitute, walk

__all__ = ["CompiledReplay"]


class CompiledReplay:
    """One replay on the one-message route."""

    def __init__(self, step: Any, inputs: dict):
        self.step = step
        self.inputs = inputs
        self.placed: dict[int, tuple[list[int], int]] = {}
        #: rows per rank of each rows-producing call's batch, and of its output, this replay
        self.rows_in: dict[int, int | None] = {}
        self.rows_out: dict[int, int] = {}
        self._fns: dict[int, dict] = {}  # op -> its dispatch functions, this replay

    def run(self) -> tuple[Any, str | None]:
        """``(outputs, None)``, or ``(None, reason)`` when this replay cannot take the route
        (nothing was sent then)."""
        step = self.step
        settings = Settings.current()
        blocking = any(op.group is not None and op.registered.blocking for op in step._ops)
        outputs = {
            v._index for v in walk(step._outputs) if isinstance(v, PlanValue) and step._ops[v._index].group
        }
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
            fns = self._dispatch_fns(i)
            top = [*op.args, *op.kwargs.values()]
            fed = bool(top) and all(isinstance(v, PlanValue) and v._index in placed for v in top)
            if fed:
                for v in top:
                    source_entries, pad = placed[v._index]
                    if pad:
                        source = step._ops[v._index]
                        rows = "row" if pad == 1 else "rows"
                        return None, (
                            f"the batch given to {source.group._name}.{source.method} was padded this "
                            f"time ({pad} {rows} of padding to cut it into {source.group.world_size} equal "
                            f"parts), and {op.group._name}.{op.method} reads its output"
                        )
                payloads = [
                    (
                        tuple(self._slot(a, r, i) for a in op.args),
                        {k: self._slot(v, r, i) for k, v in op.kwargs.items()},
                    )
                    for r in ranks
                ]
                pad = 0
                if i in step._rows_producers:
                    self.rows_in[i] = self.rows_out[top[0]._index]
            else:
                args, kwargs = substitute(op.args, values), substitute(op.kwargs, values)
                if any(isinstance(v, (Future, DataProtoFuture)) for v in walk((args, kwargs))):
                    return None, f"an argument of {op.group._name}.{op.method} is a future"
                payloads, pad = cut(op.group, op.method, fns, args, kwargs, ranks)
                if i in step._rows_producers:
                    self.rows_in[i] = batch_rows(payloads[0])
            if i in step._rows_producers:
                out = (self.rows_in[i] or 0) * step._ratios[i]
                if out.denominator != 1 or not out:
                    return None, f"{op.group._name}.{op.method} would return {out} rows per rank"
                self.rows_out[i] = int(out)
            number = next(driver.call_numbers)
            first = len(entries)
            if i not in outputs:
                result = "none"
            else:
                result = "return" if op.registered.blocking else "keep"
            for r, payload in zip(ranks, payloads):
                entries.append(
                    PlanEntry(transport, r, op.method, number, payload, result, op.registered.blocking)
                )
            placed[i] = (list(range(first, len(entries))), pad)
            timeouts.append(op.registered.timeout)
        wait = None
        if blocking:
            seconds = sum(timeouts) if all(t is not None for t in timeouts) else None
            wait = (current_limit(seconds, settings.call_timeout), step.name)
        replay = PlanPath(driver).send(entries, settings, wait)
        for i in outputs:
            indices, pad = placed[i]
            if step._ops[i].registered.blocking:
                parts = [serialization.loads(replay.values[j]) for j in indices]
            else:
                parts = [replay.futures[j] for j in indices]
            op = step._ops[i]
            ranks = [0] if op.registered.execute_mode == Execute.RANK_ZERO else list(range(len(parts)))
            values[i] = collect(op.group, op.method, op.registered, self._dispatch_fns(i), parts, ranks, pad)
            del parts
        return substitute(step._outputs, values), None

    def _dispatch_fns(self, i: int) -> dict:
        fns = self._fns.get(i)
        if fns is None:
            op = self.step._ops[i]
            fns = self._fns[i] = op.group._dispatch_fns(op.registered)
        return fns

    def _slot(self, value: PlanValue, rank: int, reader: int) -> Slot:
        """Rank ``rank``'s part of an earlier call's output for the call ``reader`` (its
        entries are in rank order)."""
        source = value._index
        rows = self.step._edges.get((source, reader))
        if rows is None:  # the same for every replay: the step's calls do not change
            rows = self.step._edges[source, reader] = (
                edge(self._dispatch_fns(source), self._dispatch_fns(reader)) == "rows"
            )
        return Slot(self.placed[source][0][rank], self.rows_out[source] if rows else 0)
