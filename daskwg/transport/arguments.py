"""Futures among a call's arguments: what the ranks get for them (:func:`extract_futures`),
and relayed broadcasts of values several ranks take whole (:func:`plan_relays`).

A group call may take a ``DataProtoFuture`` or a plain ``distributed.Future`` as an
argument, positional or keyword, or inside a list, tuple or dict argument (a list of
per-rank futures, say); each rank gets the value it stands for, as Ray resolves object refs
in actor-call arguments, and the bytes move worker to worker. Each one is replaced by a
:class:`daskwg.wire.messages.LazyArg` placeholder, and what stands for it travels beside the
arguments, per placeholder ``(kind, values)``:

* a result of one of this driver's non-blocking calls is a :class:`daskwg.wire.messages.ResultRef`,
  which the rank fetches from the worker holding it (no scheduler involved);
* any other Dask future (``client.submit``, ``client.scatter``) stays a future, which Dask
  resolves on the rank's worker: the call then goes as a Dask task (the task path). A
  row-addressable ``DataProtoFuture``'s parts of that kind go as the future of their
  :class:`~daskwg.wire.messages.PartInfo`, computed next to them.

A future nested deeper (inside another object, or in a container inside a container) is
refused in the driver by the argument packing (``daskwg.serialization.pickling``), saying what to
pass instead: a rank never meets a Dask future it cannot use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from distributed import Future

from ..errors import WorkerLostError
from ..futures.future import DataProtoFuture
from ..wire import messages as wire
from ..wire.memfiles import same_host
from ..wire.messages import LazyArg, ResultRef
from .driver import Driver

__all__ = ["extract_futures", "plan_relays", "ref_keys", "needs_dask", "source_of"]

#: Items of a list, tuple or dict argument searched for futures (larger ones are not, and a
#: future inside them is refused when the arguments are packed).
MAX_ITEMS = 1024


def source_of(driver: Driver, futures: Sequence[Any]) -> str:
    """``"group.method (ranks 0, 1)"``: the call that produced these futures."""
    known = [c for c in map(driver.call_of, futures) if c is not None]
    if not known:
        return ""
    ranks = ", ".join(str(c.rank) for c in known)
    return f"{known[0].group_name}.{known[0].method} (ranks {ranks})"


def result_ref(driver: Driver, future: Any, source: str = "") -> ResultRef | None:
    """The :class:`ResultRef` of one of ``driver``'s non-blocking results, else ``None``."""
    rec = driver.owned.record(future)
    if rec is None:
        return None
    call = rec.call
    return ResultRef(rec.key, rec.address, call.session, call.seq, call.rank, source, info=rec.info)


def extract_futures(payload: tuple, lazies: list, driver: Driver, part_info: Any, keep: list) -> tuple:
    """``payload`` (``(args, kwargs)``) with every future replaced by a placeholder.

    Args:
        lazies: receives ``(kind, values)`` per placeholder (the call's ``lazy_values``).
        driver: the driver whose results become :class:`ResultRef`\\ s.
        part_info: ``Future -> Future`` of a part's ``PartInfo`` (the task path's).
        keep: receives the futures the call reads, to keep alive until it ends.

    Raises:
        ValueError: a transformed future whose parts are not plainly concatenated.
        WorkerLostError: a future is a non-blocking call's result kept on a worker this
            driver knows is lost (it would only be cancelled once sent).
    """
    args, kwargs = payload

    def ref(future: Any, source: str) -> Any:
        return result_ref(driver, future, source) or future

    def data(value: DataProtoFuture) -> LazyArg:
        whole_part = len(value.futures) == 1 and not (value.ops or value.rows is not None or value.pad_size)
        if value.row_addressable and not whole_part:
            plan, parts = value.plan()
            source = source_of(driver, parts)
            keep.extend(parts)
            values = [result_ref(driver, p, source) or part_info(p) for p in parts]
            lazies.append((wire.ROWS, values))
            return LazyArg(len(lazies) - 1, wire.ROWS, plan, source)
        if value.ops or value.rows is not None:
            raise ValueError(
                "union/select/repeat/rename/chunk need a DataProtoFuture whose parts are concatenated "
                "(the default collect_fn) and no dispatch_fn"
            )
        source = source_of(driver, value.futures)
        keep.extend(value.futures)
        lazies.append((wire.PARTS, [ref(f, source) for f in value.futures]))
        return LazyArg(len(lazies) - 1, wire.PARTS, value.transform, source)

    def plain(future: Future) -> LazyArg:
        source = source_of(driver, [future])
        keep.append(future)
        lazies.append((wire.VALUE, [ref(future, source)]))
        return LazyArg(len(lazies) - 1, wire.VALUE, None, source)

    def swap(value: Any, top: bool) -> Any:
        if isinstance(value, DataProtoFuture):
            return data(value)
        if isinstance(value, Future):
            return plain(value)
        if not top:
            return value
        kind = type(value)
        if kind in (list, tuple) and len(value) <= MAX_ITEMS:
            items = [swap(v, False) for v in value]
            return kind(items) if any(a is not b for a, b in zip(items, value)) else value
        if kind is dict and len(value) <= MAX_ITEMS:
            items = {k: swap(v, False) for k, v in value.items()}
            return items if any(items[k] is not v for k, v in value.items()) else value
        return value

    try:
        swapped = tuple(swap(a, True) for a in args), {k: swap(v, True) for k, v in kwargs.items()}
        _check_held(driver, keep)
        return swapped
    finally:
        # swap calls itself through its closure: a cycle that would hold ``keep`` (the
        # call's input futures, and the results on the workers) until the next gc.
        swap = None  # noqa: F841


def _check_held(driver: Driver, futures: Sequence[Any]) -> None:
    """Raise a ``WorkerLostError`` naming the producing call for a result among ``futures``
    kept on a worker process this driver knows is lost."""
    for future in futures:
        call = driver.call_of(future)
        if call is None or call.worker_id not in driver.health.lost:
            continue
        slots = [
            t.ranks.slots[call.rank] for t in list(driver.transports) if t.ranks.group_id == call.group_id
        ]
        address = slots[0].address if slots else f"worker {call.worker_id}"
        raise WorkerLostError(
            call.rank,
            address,
            f"{call.group_name}.{call.method} (rank {call.rank}) kept its result there, which this call "
            f"reads ({driver.health.lost[call.worker_id]}); call {call.method!r} again for a new one",
            call.group_name,
        )


def needs_dask(lazies: Sequence[list]) -> bool:
    """Whether some call's inputs hold Dask futures that Dask must resolve (the task path)."""
    return any(isinstance(v, Future) for lz in lazies for _, values in lz for v in values)


def ref_keys(lazies: Sequence[list]) -> set[str]:
    """The keys of the whole results (``ResultRef``) that ``lazies`` (per rank, its
    ``(kind, values)`` list) take."""
    return {
        v.key
        for lz in lazies
        for kind, values in lz
        if kind != wire.ROWS
        for v in values
        if isinstance(v, ResultRef)
    }


def plan_relays(
    lazies: Sequence[list],
    addresses: Sequence[str],
    sizes: dict[str, int],
    relay_above: int,
    shared_memory: bool = False,
) -> None:
    """Route the consumers of every result that ranks on other workers take whole.

    With ``shared_memory`` (``daskwg.shared-memory``), a consumer on the producer's host
    maps it from the one shared-memory copy its worker makes (:attr:`ResultRef.shared`,
    ``daskwg.plugin.shared``); the others are chained. The parts of a ``DataProtoFuture``
    whose rows a rank reads are marked the same way when their worker is on the rank's
    host (:func:`daskwg.plugin.rows.evaluate_on_worker` maps those it reads much of).

    The first consumer (in rank order) fetches it from the producer's worker, every next
    one from the previous one's (:attr:`ResultRef.via`), each serving the next
    (:attr:`ResultRef.relays`): the producer sends it once whatever the number of
    consumers. Consumers on the producer's own worker read it there; results known to be
    at most ``relay_above`` bytes (``sizes``: key -> bytes of finished ones) are fetched
    by every consumer directly (a chain's hops would cost more than they save).

    Args:
        lazies: per rank, its ``(kind, values)`` list (changed in place).
        addresses: per rank, its worker.
        sizes: key -> bytes of the results known to have finished.
        relay_above: ``daskwg.relay-above`` (bytes).
        shared_memory: ``daskwg.shared-memory``.
    """
    chains: dict[str, list[tuple[list, int, str]]] = {}
    for lz, address in zip(lazies, addresses):
        for kind, values in lz:
            if kind == wire.ROWS:
                if shared_memory:  # parts of this host whose rows the rank reads: mapped
                    for i, v in enumerate(values):
                        if (
                            isinstance(v, ResultRef)
                            and v.address != address
                            and same_host(v.address, address)
                        ):
                            values[i] = replace(v, shared=True)
                continue
            for i, v in enumerate(values):
                if (
                    not isinstance(v, ResultRef)
                    or v.address == address
                    or sizes.get(v.key, relay_above + 1) <= relay_above
                ):
                    continue
                if shared_memory and same_host(v.address, address):
                    values[i] = replace(v, shared=True)
                    continue
                members = chains.setdefault(v.key, [])
                if all(a != address for _, _, a in members):
                    members.append((values, i, address))
    for members in chains.values():
        if len(members) < 2:
            continue
        previous = None
        for n, (values, i, address) in enumerate(members):
            values[i] = replace(values[i], via=previous, relays=1 if n < len(members) - 1 else 0)
            previous = address
