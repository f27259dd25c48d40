"""The wire: the records and names the driver side and the worker side share.

The driver side (``daskwg.transport``) sends what is defined here and the worker side
(``daskwg.plugin``) receives it; neither imports the other, both stand on this module.
Everything a Dask task carries is plain Python data (tuples, strings, bytes): the
scheduler unpickles every task it is given and must not need torch or daskwg for it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import VersionMismatchError

__all__ = [
    "WIRE_FORMAT",
    "PLUGIN_NAME",
    "RANK_ENV_KEYS",
    "HANDLERS",
    "RUN_CALL",
    "PART_INFO",
    "INLINE",
    "SCATTERED",
    "ROWS",
    "PARTS",
    "VALUE",
    "Call",
    "Slot",
    "LazyArg",
    "PartInfo",
    "ResultRef",
    "task_key",
    "status_record",
    "session_id",
    "of_client",
    "client_of",
    "DEFAULT_CONCURRENCY_GROUP",
    "group_session",
    "concurrency_group_of",
    "check_format",
    "call_message",
    "plan_message",
    "fetch_message",
    "reply_message",
]

#: The version of what crosses between the driver and the workers (the records and names
#: below, the handlers' arguments and answers). Raise it with any change a worker of the
#: previous release could misread; the ``__init__`` call of every group carries the
#: driver's, and a worker with another refuses to build the rank.
WIRE_FORMAT = 6

#: The name the host plugin is registered under on every worker (``worker.plugins[...]``).
PLUGIN_NAME = "daskwg"

#: Environment variables daskwg owns on every rank; ``worker_env`` may not set them.
RANK_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: The comm handlers the host plugin installs on every worker, and what each answers:
#: ``daskwg_call`` runs a call (the direct path); ``daskwg_skip`` gives up calls' places
#: in the order; ``daskwg_cancel`` cancels calls; ``daskwg_reserve_port`` reserves a
#: ``MASTER_PORT``; ``daskwg_release`` destroys a departed driver's ranks;
#: ``daskwg_memory`` the worker's memory figures; ``daskwg_progress`` the last finished
#: call of a driver; ``daskwg_status`` the status records; ``daskwg_metrics`` the call
#: counters; ``daskwg_rows`` rows of a stored ``DataProtoFuture`` part; ``daskwg_write_rows``
#: writes such rows into a consumer's shared-memory file; ``daskwg_fetch``
#: a stored result (waiting for it); ``daskwg_part_info`` a stored part's :class:`PartInfo`;
#: ``daskwg_free`` drops stored results the driver let go of; ``daskwg_relay`` streams a
#: stored or relayed result to the next consumer of a broadcast; ``daskwg_stream`` opens a
#: driver's call stream (non-blocking calls and their replies on one comm).
HANDLERS = (
    "daskwg_call",
    "daskwg_skip",
    "daskwg_cancel",
    "daskwg_reserve_port",
    "daskwg_release",
    "daskwg_memory",
    "daskwg_progress",
    "daskwg_status",
    "daskwg_metrics",
    "daskwg_rows",
    "daskwg_write_rows",
    "daskwg_fetch",
    "daskwg_part_info",
    "daskwg_free",
    "daskwg_relay",
    "daskwg_stream",
)

#: ``"module:function"`` the task of a task-path call runs on the worker (``_daskwg_task.run``
#: imports it there by name, so the driver side never imports the worker side).
RUN_CALL = "daskwg.plugin.task:run_call"
#: ``"module:function"`` of the task that reports a ``DataProtoFuture`` part's :class:`PartInfo`.
PART_INFO = "daskwg.plugin.rows:part_info"

#: How a task-path call's arguments travel: ``(INLINE, header, buffers)`` (one pickle, its
#: buffers as bytes) inside the task, or ``(SCATTERED, value)`` sent beforehand straight to
#: the rank's worker and resolved there by Dask.
INLINE = "inline"
SCATTERED = "scattered"

#: :class:`LazyArg` kinds: ``ROWS``, the rank fetches its rows of the parts itself (``spec``
#: is the future's plan, the resolved values are the parts' :class:`PartInfo`); ``PARTS``,
#: the parts themselves (``spec(values)`` builds the argument); ``VALUE``, a plain future's
#: value is the argument (``spec`` unused). Each resolved value is either what Dask resolved
#: on the worker (the task path) or a :class:`ResultRef` the rank resolves itself.
ROWS = "rows"
PARTS = "parts"
VALUE = "value"


@dataclass(frozen=True)
class Call:
    """One call into one rank, as the driver sends it.

    Attributes:
        session: id of the issuing driver's session (:func:`session_id`: its Dask client
            id, with a suffix after each reconnection); sequence numbers count per session
            and worker.
        seq: this call's position in the session's order on this worker.
        group_id: unique id of the group.
        group_name: readable group name (for messages).
        rank: the rank called.
        method: the method name, or ``"__init__"`` / ``"__del__"`` for the life-cycle
            calls that build and destroy the rank object.
        owner: client id that owns the group.
        worker_id: id of the worker process the call is meant for (``Worker.id``);
            a restarted worker (same name, maybe same address) has a new one.
        concurrency_group: the method's ``@register(concurrency_group=...)`` (Ray's concurrency
            groups), ``None`` for the default group. Calls of one group run one at a time, in
            the driver's order, on a thread of that group; groups do not wait for each other.
            ``session`` is then :func:`group_session`'s, so that ``seq`` counts per group.
    """

    session: str
    seq: int
    group_id: str
    group_name: str
    rank: int
    method: str
    owner: str
    worker_id: str | None = None
    concurrency_group: str | None = None

    def to_wire(self) -> tuple:
        """The fields as a plain tuple (what messages and tasks carry); ``Call(*t)`` rebuilds it."""
        # Not dataclasses.astuple: it deep-copies every field, on every call of every rank.
        return (
            self.session,
            self.seq,
            self.group_id,
            self.group_name,
            self.rank,
            self.method,
            self.owner,
            self.worker_id,
            self.concurrency_group,
        )


@dataclass(frozen=True)
class LazyArg:
    """Placeholder, inside a call's arguments, for an argument that is a ``DataProtoFuture``.

    What it stands for travels in a separate list that Dask resolves on the worker (the
    call's ``lazy_values``), moving data worker to worker; the rank builds the argument
    from ``lazy_values[index]`` as ``kind`` says (:data:`ROWS` or :data:`PARTS`).

    Attributes:
        index: position in ``lazy_values``.
        kind: :data:`ROWS` or :data:`PARTS`.
        spec: the plan (``ROWS``) or the ``values -> argument`` function (``PARTS``).
        source: the producing call, e.g. ``"gen.generate (ranks 0, 1)"``: blamed if building fails.
    """

    index: int
    kind: str
    spec: Callable[[list], Any] | tuple
    source: str = ""


@dataclass(frozen=True)
class PartInfo:
    """Where one part of a ``DataProtoFuture`` is and what a consumer must know of it.

    Attributes:
        address: the Dask worker holding it.
        key: its Dask key there.
        rows: its number of rows (padding included).
        meta_info: its ``meta_info`` (``None`` for a TensorDict part).
        dataproto_class: ``"module:qualname"`` of the part's class when it is a DataProto
            other than daskwg's (verl's ``"verl.protocol:DataProto"``); a consumer gets that
            class back where it is loaded.
        columns: its batch's columns, ``((key, dtype name, trailing shape, device), ...)``,
            where it is a ``DataProto`` of dense CPU tensors only
            (:func:`daskwg.plugin.gathered.columns_of`); ``None`` otherwise.
    """

    address: str
    key: str
    rows: int
    meta_info: dict | None
    dataproto_class: str | None = None
    columns: tuple | None = None


def session_id(client_id: str, epoch: int) -> str:
    """The session of a driver's client ``client_id`` after ``epoch`` reconnections: the
    client id itself at first, ``"<client id>#<epoch>"`` after. A reconnected client keeps
    its id, but the workers released its ranks and forgot its order when the scheduler
    dropped it: its later calls number afresh in a session the workers have not seen."""
    return client_id if epoch == 0 else f"{client_id}#{epoch}"


def client_of(session: str) -> str:
    """The client id of the driver whose calls carry ``session`` (:func:`session_id`, or a
    concurrency group's: :func:`group_session`)."""
    return session.partition(_GROUP_SEPARATOR)[0].partition("#")[0]


def of_client(session: str, client_id: str) -> bool:
    """Whether ``session`` is one of client ``client_id``'s (:func:`session_id`, or a
    concurrency group's of one: :func:`group_session`)."""
    return (
        session == client_id
        or session.startswith(client_id + "#")
        or session.startswith(client_id + _GROUP_SEPARATOR)
    )


#: The name ``@register(concurrency_group=...)`` also accepts for the default group (as ``None``).
DEFAULT_CONCURRENCY_GROUP = "default"

# Between a driver session and a concurrency group's name in :func:`group_session`: neither
# a client id nor a session suffix holds it, and a group name (an identifier) cannot.
_GROUP_SEPARATOR = "/"


def group_session(session: str, concurrency_group: str | None) -> str:
    """The session the calls of ``concurrency_group`` of driver session ``session`` are
    numbered in: ``session`` itself for the default group (``None``), else
    ``"<session>/<group>"``. Every worker-side record keyed by ``(session, seq)`` (the
    order, progress, skipped places, results' readiness) then keeps the groups apart."""
    return session if concurrency_group is None else f"{session}{_GROUP_SEPARATOR}{concurrency_group}"


def concurrency_group_of(session: str) -> str | None:
    """The concurrency group whose calls count in ``session`` (:func:`group_session`);
    ``None``: the default group."""
    _, sep, group = session.partition(_GROUP_SEPARATOR)
    return group if sep else None


@dataclass(frozen=True)
class ResultRef:
    """A result of a non-blocking call, stored on its rank's worker under a key the driver
    owns: what a consuming rank (or the driver) needs to fetch it there, worker to worker.

    Attributes:
        key: the result's key (a Dask key the scheduler learns once the result exists).
        address: the worker holding it (the producing rank's).
        session: the producing call's driver session, with ``seq`` its place in that
            worker's order: a fetch that arrives before the call tells "not yet" from "gone".
        seq: see ``session``.
        rank: the producing rank.
        source: the producing call, e.g. ``"gen.generate (rank 0)"``: blamed if building fails.
        via: fetch it from this worker instead (the previous consumer of a relayed broadcast),
            falling back to ``address`` if that fails; ``None``: from ``address``.
        relays: how many consumers fetch it from this consumer's worker next (a relay chain:
            0 or 1); the rank uses its copy in place once they have it.
        shared: the holding worker is on this consumer's host: map it from the shared-memory
            file that worker writes it into (``daskwg.plugin.shared``), falling back to
            fetching it over the comm.
        info: the result's :class:`PartInfo` where the driver had it from the call's reply
            (a finished batch): a consuming rank then need not ask for it.
    """

    key: str
    address: str
    session: str
    seq: int
    rank: int = -1
    source: str = ""
    via: str | None = None
    relays: int = 0
    shared: bool = False
    info: PartInfo | None = field(default=None, compare=False)


def call_message(
    call: Call, header: bytes, key: str | None, inline: int, relay_wait: float, refs: bytes | None
) -> tuple:
    """One call on a call stream (``daskwg.wire.frames``), the arguments' buffers beside it:
    ``("call", id, call fields, arguments' pickle header, key, inline, relay_wait, refs)``.

    ``key``: where a non-blocking call's result stays (``None``: a blocking call, whose
    reply carries the result); ``inline``: bytes up to which a kept result comes back too;
    ``relay_wait``: ``daskwg.relay-wait``; ``refs``: the pickled ``(kind, values)`` of each
    ``LazyArg`` (``None``: none). The id is the stream's to set.
    """
    return ("call", 0, call.to_wire(), header, key, inline, relay_wait, refs)


@dataclass(frozen=True)
class Slot:
    """In a step plan's arguments (``daskwg.plan``): the output of the ``index``-th call of
    the same ``("plan", ...)`` message, on the same rank, handed over in the worker's process.

    Attributes:
        index: the producing call's position in the message.
        rows: for a ``DP_COMPUTE_PROTO`` call reading a ``DP_COMPUTE_PROTO`` output, the rows
            that output must have on every rank (``0``: no check): the rank's own part is what
            the call without a plan gets exactly when every rank's part has as many rows.
    """

    index: int
    rows: int = 0


def plan_message(entries: list[tuple], header: bytes, inline: int) -> tuple:
    """One replay of a step plan on one worker, on its call stream, the arguments' buffers
    beside it: ``("plan", id, entries, arguments' pickle header, inline)``.

    ``entries``: per call, in the driver's order, ``(call fields, key, result, uses, stop)``:
    ``key`` the call's future (``None``: none), ``result`` ``"keep"`` (it stays on the worker
    under ``key``; up to ``inline`` bytes, tensors included, it comes back too: the step's
    outputs are what the replay returns), ``"return"`` (it comes back with the reply) or ``"none"``, ``uses`` how
    many later calls of the message read it (:class:`Slot`), ``stop`` whether the message's
    later calls are not run if this one fails (a blocking method's); the
    arguments: the pickled list of every call's ``(args, kwargs)``. The reply's header is the
    pickled list of per call ``(status, nbytes, error, result header, result buffer count)``,
    the results' buffers beside it, in order. The id is the stream's to set.
    """
    return ("plan", 0, entries, header, inline)


def fetch_message(key: str, session: str, seq: int, source: str) -> tuple:
    """A driver's request, on a call stream, for the value of a kept result:
    ``("fetch", id, key, session, seq, source)`` (call ``seq`` of driver ``session`` makes
    it; ``source`` names that call in errors). Its :func:`reply_message` carries the value's
    pickle header and buffers (``"OK"``), or the pickled error (``"error"``). The id is the
    stream's to set."""
    return ("fetch", 0, key, session, seq, source)


def reply_message(
    cid: int,
    status: str,
    nbytes: int | None,
    error: bytes | None,
    header: bytes | None,
    info: bytes | None = None,
) -> tuple:
    """The reply to call ``cid`` on a call stream, the result's buffers beside it:
    ``("reply", id, status, nbytes, error, result header, info)``: ``status`` is ``"OK"``,
    ``"error"`` (``error``: the pickled exception) or ``"cancelled"``; ``nbytes`` the kept
    result's size; ``header``: the result's pickle header when the result comes with it;
    ``info``: a kept batch's pickled :class:`PartInfo` (``None``: not a batch, or it came
    back itself)."""
    return ("reply", cid, status, nbytes, error, header, info)


def task_key(group_name: str, method: str, call_number: int, rank: int, group_id: str) -> str:
    """The Dask key of a task-path call: ``"<group>.<method>-<call>-r<rank>-<id8>"``, as the
    dashboard shows it (the group's name, its method, the driver's call number, the rank
    and the first 8 hex digits of the group id, which keeps keys of equally named groups apart)."""
    return f"{group_name}.{method}-{call_number}-r{rank}-{group_id[:8]}"


def status_record(
    group_name: str,
    group_id: str,
    rank: int,
    state: str,
    call: Call | None = None,
    seconds: float | None = None,
    stack: str | None = None,
    last_error: str | None = None,
    cancelled: bool = False,
    departed: bool = False,
) -> dict:
    """One record of a worker's ``daskwg_status`` answer (what ``daskwg.transport.failure.forensics`` reads).

    Returns:
        ``{"group", "group_id", "rank", "state", "method", "seconds", "stack",
        "last_error", "session", "seq", "cancelled", "concurrency_group", "client",
        "departed"}``: ``state`` is ``"idle"``, ``"running"`` or ``"queued"``; ``method``,
        ``session``, ``seq``, ``concurrency_group`` and ``client`` (the id of the client of
        the driver that sent it) are the running or queued call's (``None`` when idle, and
        ``concurrency_group`` for the default group); ``seconds`` since it started or was
        queued; ``departed``: the call's driver left while it ran (its client disconnected).
    """
    return {
        "group": group_name,
        "group_id": group_id,
        "rank": rank,
        "state": state,
        "method": None if call is None else call.method,
        "seconds": seconds,
        "stack": stack,
        "last_error": last_error,
        "session": None if call is None else call.session,
        "seq": None if call is None else call.seq,
        "cancelled": cancelled,
        "concurrency_group": None if call is None else call.concurrency_group,
        "client": None if call is None else client_of(call.session),
        "departed": departed,
    }


def check_format(payload: dict, call: Call) -> None:
    """Refuse to build a rank for a driver that speaks another wire format than
    :data:`WIRE_FORMAT` (``payload``: the ``__init__`` call's, with the driver's ``"wire"``
    and ``"daskwg"`` version).

    Raises:
        VersionMismatchError: naming both formats and both daskwg versions.
    """
    theirs = payload.get("wire")
    if theirs == WIRE_FORMAT:
        return
    try:
        mine = importlib.metadata.version("daskwg")
    except importlib.metadata.PackageNotFoundError:
        mine = None
    raise VersionMismatchError(
        f"cannot build rank {call.rank} of group {call.group_name!r}: the driver speaks daskwg wire format "
        f"{theirs} (daskwg {payload.get('daskwg')}), this worker wire format {WIRE_FORMAT} (daskwg {mine}); "
        "install the same daskwg wheel in the driver's and every worker's environment"
    )
