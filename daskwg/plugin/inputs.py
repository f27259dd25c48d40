"""Building a call's arguments on its rank: :class:`Inputs`.

A ``DataProtoFuture`` or a plain future among a call's arguments (top level, or inside
lists, tuples and dicts) arrives as a :class:`daskwg.wire.messages.LazyArg` placeholder; what stands
for it comes beside the arguments (the call's ``lazy_values``): per placeholder, one entry
per part, each a :class:`daskwg.wire.messages.ResultRef` (a result of a non-blocking call, which the
rank fetches itself, worker to worker) or what Dask resolved on the worker (the task path,
for futures no group call made).

On the direct path the fetches start when the call arrives (:meth:`Inputs.prefetch`, on the
worker's event loop), while earlier calls still run on the host thread, as Dask gathers a
task's dependencies before it runs; the host thread then only waits for them
(:meth:`Inputs.resolve`). A whole value fetched from another worker is used in place (its
memory is the receive buffer, nobody else's); one held on this worker is copied once, so
the rank may change its argument without changing the stored result; a relayed one is used
in place once the next consumer has it (``daskwg.plugin.relay``); one held by another worker
of this host is mapped copy-on-write from the shared-memory file its worker wrote it into
(``daskwg.plugin.shared``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
import traceback
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.utils import sync

from ..errors import DispatchError, RankError, WorkerGroupError, WorkerLostError
from ..futures.interpreter import argument_rows, length_check, padding_of
from ..futures.pieces import check_lengths
from ..serialization import pickling as serialization
from ..wire import messages as wire
from ..wire.messages import Call, Handler, LazyArg, PartInfo, ResultRef
from . import rows
from .relay import Relays
from .results import ResultStore
from .shared import SharedResults, attach

__all__ = ["Inputs"]

#: How deep arguments are searched for placeholders (lists, tuples, dicts inside each other).
_DEPTH = 4


class _Fetched:
    """The outcome of one fetch started on the event loop, taken once by the host thread
    (which then holds the only reference: a snapshot of a result that returns the argument
    sees it as the rank's own)."""

    __slots__ = ("ref", "_event", "_value", "_error")

    def __init__(self, ref: ResultRef) -> None:
        self.ref = ref
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def settle(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._error = WorkerGroupError("the worker closed while fetching a call's input")
        elif task.exception() is not None:
            self._error = task.exception()
        else:
            self._value = task.result()
        self._event.set()

    def known(self, value: Any) -> None:
        """Settled already with ``value`` (nothing to fetch)."""
        self._value = value
        self._event.set()

    def take(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        value, self._value = self._value, None
        return value


class Inputs:
    """Fetches and builds the inputs of this worker's calls.

    Args:
        worker: the Dask worker.
        store: its :class:`~daskwg.plugin.results.ResultStore`.

    Builds and installs the worker's :class:`~daskwg.plugin.relay.Relays` (``relays``) and
    :class:`~daskwg.plugin.shared.SharedResults` (``shared``), which serve its results on.
    """

    def __init__(self, worker: Any, store: ResultStore):
        self.worker = worker
        self.store = store
        self.relays = Relays(worker, store)
        self.shared = SharedResults(worker, store)
        self.relays.install()
        self.shared.install()

    # ---- on the event loop, when a call arrives --------------------------------------

    def prefetch(self, refs: list[tuple[str, list]], relay_wait: float) -> list[list]:
        """Start fetching what ``refs`` (per placeholder ``(kind, values)``) stand for; returns
        the call's ``lazy_values``, each :class:`ResultRef` replaced by its pending fetch."""
        return [
            [self._start(kind, v, relay_wait) if isinstance(v, ResultRef) else v for v in values]
            for kind, values in refs
        ]

    def _start(self, kind: str, ref: ResultRef, relay_wait: float) -> _Fetched | _Local:
        if ref.address == self.worker.address and ref.via is None:
            return _Local(kind, ref, relay_wait)  # read on the host thread when the call runs
        fetched = _Fetched(ref)
        if kind == wire.ROWS and ref.info is not None:
            fetched.known(ref.info)  # the driver had it from the producing call's reply
            return fetched
        coro = self.info(ref) if kind == wire.ROWS else self.value(ref, relay_wait)
        asyncio.ensure_future(coro).add_done_callback(fetched.settle)
        return fetched

    async def value(self, ref: ResultRef, relay_wait: float = 10.0) -> Any:
        """The value of ``ref``, in memory of this rank's own.

        Raises:
            Exception: the producing call's error if it failed.
            WorkerLostError: the worker holding it cannot be reached.
            GroupBrokenError: it was released.
        """
        if ref.address == self.worker.address and ref.via is None:
            return _own_copy(await self.store.wait(ref))
        if ref.via is not None or ref.relays:
            return await self.relays.fetch(ref, relay_wait)
        if ref.shared:
            response = await self._ask(ref, Handler.SHARED)
            if response["status"] == "OK":
                return response["data"]
            try:
                return attach(response)
            except OSError:
                pass  # not this process's to open (another PID namespace): over the comm
        response = await self._ask(ref, Handler.FETCH)
        return response["data"]

    async def info(self, ref: ResultRef) -> PartInfo:
        """The :class:`~daskwg.wire.messages.PartInfo` of the ``DataProtoFuture`` part ``ref``."""
        if ref.info is not None:
            return ref.info
        if ref.address == self.worker.address:
            return rows.part_info_of(await self.store.wait(ref), ref.key, ref.address)
        return (await self._ask(ref, Handler.PART_INFO))["info"]

    async def _ask(self, ref: ResultRef, handler: str, **extra: Any) -> dict:
        try:
            response = await getattr(self.worker.rpc(ref.address), handler)(
                key=ref.key, session=ref.session, seq=ref.seq, source=ref.source, **extra
            )
        except (OSError, CommClosedError) as exc:
            raise WorkerLostError(
                ref.rank, ref.address, f"fetching the result of {ref.source or ref.key} failed: {exc}"
            ) from None
        if response["status"] == "error":
            raise response["exception"]
        return response

    # ---- on the host thread, when the call runs --------------------------------------

    def resolve(self, call: Call, args: tuple, kwargs: dict, lazy_values: list) -> tuple[tuple, dict, int]:
        """``(args, kwargs, padding)`` with every placeholder replaced by the value it stands
        for. ``padding``: the rows of padding that end this rank's piece of a future cut by
        ``DP_COMPUTE_PROTO`` (:data:`daskwg.futures.padding.STRIP`), which
        :func:`daskwg.futures.padding.strip` takes off the rank's output.

        Raises:
            RankError: the producing call's own error when it failed; else one naming the
                producing call and ``call``'s method (parts that do not concatenate, say).
            WorkerLostError: a worker holding an input is gone.
        """
        current: list[Any] = [None, 0]  # the placeholder being built, the padding
        try:
            self._check_lengths(args, kwargs, lazy_values)
            resolved = tuple(self._walk(a, lazy_values, current, 0) for a in args)
            resolved_kwargs = {k: self._walk(v, lazy_values, current, 0) for k, v in kwargs.items()}
        except _FetchFailed as failed:
            raise failed.error from None  # the producer's own error, a lost worker, a released result
        except DispatchError as exc:  # the call's own arguments, whoever produced them
            raise RankError(
                call.rank, self.worker.address, call.method, traceback.format_exc(), exc
            ) from None
        except Exception as exc:  # noqa: BLE001 - building the input from its parts failed
            source = getattr(current[0], "source", "") or "an earlier call"
            raise RankError(
                call.rank,
                self.worker.address,
                f"{source}, whose output could not be built as the input of {call.method!r}",
                traceback.format_exc(),
                exc,
            ) from None
        return resolved, resolved_kwargs, current[1]

    def _check_lengths(self, args: tuple, kwargs: dict, lazy_values: list) -> None:
        """Refuse batch arguments of different lengths before a row is fetched: the
        ``DataProtoFuture`` arguments whose rows the driver did not know carry a ``check``
        (``daskwg.futures.plan.LengthCheck``); their rows come from their parts' ``PartInfo``.

        Raises:
            DispatchError: naming every batch argument and its rows.
        """
        checked = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, LazyArg) and value.kind == wire.ROWS:
                check = length_check(value.spec)
                if check is not None:
                    checked.append((value, check))
        if not checked:
            return
        arguments = list(checked[0][1].known)
        for lazy, check in checked:
            values = lazy_values[lazy.index]
            infos = [self._info(values, i) for i in range(len(values))]
            arguments.append((check.label, argument_rows(lazy.spec, [info.rows for info in infos])))
        check_lengths(arguments)

    def _info(self, values: list, i: int) -> PartInfo:
        """The ``PartInfo`` of part ``i`` of a ``ROWS`` placeholder's ``values``, left there for
        building the argument after (a fetched one re-armed, a fetched ref kept as fetched)."""
        value = values[i]
        if isinstance(value, _Fetched):
            info = self._take(wire.ROWS, value)
            value.known(info)
            return info
        if isinstance(value, ResultRef):
            info = self._take(wire.ROWS, value)
            values[i] = fetched = _Fetched(value)
            fetched.known(info)
            return info
        return self._take(wire.ROWS, value)

    def _walk(self, value: Any, lazy_values: list, current: list, depth: int) -> Any:
        if isinstance(value, LazyArg):
            current[0] = value
            return self._build(value, lazy_values[value.index], current)
        if depth >= _DEPTH:
            return value
        if type(value) in (list, tuple):
            return type(value)(self._walk(v, lazy_values, current, depth + 1) for v in value)
        if type(value) is dict:
            return {k: self._walk(v, lazy_values, current, depth + 1) for k, v in value.items()}
        return value

    def _build(self, lazy: LazyArg, values: list, current: list) -> Any:
        fetched = [self._take(lazy.kind, v) for v in values]
        if lazy.kind == wire.ROWS:
            current[1] = max(current[1], padding_of(lazy.spec, [info.rows for info in fetched]))
            refs = [v if isinstance(v, ResultRef) else getattr(v, "ref", None) for v in values]
            shared = {n: ref for n, ref in enumerate(refs) if ref is not None and ref.shared}
            mapped = functools.partial(self._mapped, shared) if shared else None
            write = functools.partial(self._write_rows, shared) if shared else None
            return rows.evaluate_on_worker(lazy.spec, fetched, self.worker, self.store.get, mapped, write)
        if len(fetched) == 1 and not isinstance(values[0], (_Fetched, _Local, ResultRef)):
            # Resolved by Dask (the task path): a part produced on this worker arrives as
            # the very object Dask keeps for its future, which a method that changes its
            # argument in place would change for every later reader.
            fetched = [_own_copy(fetched[0])]
        else:
            fetched = [serialization.loads(v) if isinstance(v, serialization.Packed) else v for v in fetched]
        if lazy.kind == wire.VALUE:
            return fetched[0]
        return lazy.spec(fetched)

    def _take(self, kind: str, value: Any) -> Any:
        try:
            if isinstance(value, _Fetched):
                return value.take()
            if isinstance(value, _Local):
                return self._local(value)
            if isinstance(value, ResultRef):  # a task-path call: fetched now
                coro = self.info(value) if kind == wire.ROWS else self.value(value)
                return sync(self.worker.loop, lambda: coro)
        except WorkerGroupError as exc:
            raise _FetchFailed(exc) from None
        return value

    def _mapped(self, refs: dict[int, ResultRef], parts: list[int]) -> list[Any]:
        """On the host thread: each of ``parts`` of a ``DataProtoFuture`` whose worker is on
        this host, mapped copy-on-write from the shared-memory file that worker writes it
        into (all asked for at once); ``None`` for one that is small or cannot be mapped
        here: its rows come over the comm.

        Raises:
            GroupBrokenError: a part was released. WorkerLostError: its worker is gone.
        """
        asked = [refs.get(part) for part in parts]

        async def ask_all() -> list:
            return await asyncio.gather(
                *(self._ask(ref, Handler.SHARED, finished=True) for ref in asked if ref is not None)
            )

        try:
            responses = iter(sync(self.worker.loop, ask_all) if any(asked) else ())
        except WorkerGroupError as exc:
            raise _FetchFailed(exc) from None
        out = []
        for ref in asked:
            response = next(responses) if ref is not None else None
            if response is None or response["status"] != "shared":
                out.append(None)
                continue
            try:
                out.append(attach(response))
            except Exception:  # noqa: BLE001 - another PID namespace, /proc hidden: over the comm
                out.append(None)
        return out

    def _write_rows(self, refs: dict[int, ResultRef], asks: list[tuple]) -> list[dict]:
        """On the host thread: ``daskwg_write_rows`` of each ``(part, start, stop, target)``,
        asked at once; returns once every producer answered (``{"status": "unavailable"}``
        for a part not of this host).

        Raises:
            GroupBrokenError: a part was released. WorkerLostError: its worker is gone.
        """

        async def ask(part: int, start: int, stop: int, target: dict) -> dict:
            ref = refs.get(part)
            if ref is None:
                return {"status": "unavailable"}
            return await self._ask(ref, Handler.WRITE_ROWS, start=start, stop=stop, target=target)

        async def ask_all() -> list:
            return await asyncio.gather(*(ask(*a) for a in asks), return_exceptions=True)

        answers = sync(self.worker.loop, ask_all)
        for answer in answers:
            if isinstance(answer, WorkerGroupError):
                raise _FetchFailed(answer)
            if isinstance(answer, BaseException):
                raise answer
        return answers

    def _local(self, local: _Local) -> Any:
        # A result kept on this worker: the call that makes it ran earlier on this host
        # thread when the same driver sent it first (a chain of calls), so it is read here
        # with no task on the loop; anything else (pending, in Dask's data) the loop fetches.
        ref = local.ref
        found, stored = self.store.kept(ref.key)
        if not found:
            coro = self.info(ref) if local.kind == wire.ROWS else self.value(ref, local.relay_wait)
            return sync(self.worker.loop, lambda: coro)
        if isinstance(stored, BaseException):
            raise stored
        if local.kind == wire.ROWS:
            return rows.part_info_of(stored, ref.key, ref.address)
        return _own_copy(stored)


class _Local:
    """A result kept on this worker that a call reads: taken on the host thread."""

    __slots__ = ("kind", "ref", "relay_wait")

    def __init__(self, kind: str, ref: ResultRef, relay_wait: float) -> None:
        self.kind, self.ref, self.relay_wait = kind, ref, relay_wait


class _FetchFailed(Exception):
    """Fetching a part failed with ``error`` (raised as it is, not blamed on building)."""

    def __init__(self, error: WorkerGroupError) -> None:
        super().__init__(error)
        self.error = error


def _own_copy(stored: Any) -> Any:
    """A value of this rank's own from a stored one (a ``Packed``, or what Dask holds)."""
    if isinstance(stored, serialization.Packed):
        return serialization.loads(stored, copy=True)
    try:
        return serialization.loads(serialization.dumps(stored), copy=True)
    except Exception:  # noqa: BLE001 - objects this pickler cannot take
        return copy.deepcopy(stored)
