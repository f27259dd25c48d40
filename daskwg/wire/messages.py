"""The wire: the records and names the driver side and the worker side share.

The driver side (``daskwg.transport``) sends what is defined here and the worker side
(``daskwg.plugin``) receives it; neither imports the other, both stand on this module.
Everything a Dask task carries is plain Python data (tuples, strings, bytes): the
scheduler unpickles every task it is given and must not need torch or daskwg for it.

A call stream's messages and replies are records here (:class:`CallMessage`,
:class:`PlanMessage`, :class:`FetchMessage`, :class:`FreeMessage`, :class:`Reply`), each
with one ``to_wire()`` (a plain tuple: its kind, the stream's id, then the fields) and one
``from_wire()``; comm handlers are named by :class:`Handler`'s constants on both ends.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import VersionMismatchError

__all__ = [
    "WIRE_FORMAT",
    "PLUGIN_NAME",
    "RANK_ENV_KEYS",
    "Handler",
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
    "CallMessage",
    "PlanMessage",
    "FetchMessage",
    "FreeMessage",
    "FanoutMessage",
    "FANOUT",
    "LOST",
    "Reply",
]

#: The version of what crosses between the driver and the workers (the records and names
#: below, the handlers' arguments and answers). Raise it with any change a worker of the
#: previous release could misread; the ``__init__`` call of every group carries the
#: driver's, and a worker with another refuses to build the rank.
WIRE_FORMAT = 7

#: The name the host plugin is registered under on every worker (``worker.plugins[...]``).
PLUGIN_NAME = "daskwg"

#: Environment variables daskwg owns on every rank; ``worker_env`` may not set them.
RANK_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Handler:
    """The names of the comm handlers (Dask's ``op``\\ s) the host plugin and its parts
    install on every worker (``worker.handlers[...]``), and under which the driver, the
    scheduler and other workers reach them (``{"op": name, ...}`` on a comm, or Dask's
    ``rpc(address).<name>(...)``, written ``getattr(rpc(address), name)(...)``).

    Plain ``str`` class attributes, not an ``Enum``: they go into Dask's msgpack messages
    as they are. Every one is in :data:`HANDLERS`; each is defined once, here, and never
    typed by hand elsewhere (``tests/test_architecture.py`` checks both).
    """

    #: A driver's call stream (``daskwg.plugin.stream``): blocking and non-blocking calls,
    #: step plans, fetches and frees, with their replies, on one comm.
    STREAM: Final = "daskwg_stream"
    #: Gives up calls' places in a driver's order (``session``, ``seqs``): they never come.
    SKIP: Final = "daskwg_skip"
    #: Cancels calls (``session``, ``seqs``); answers per call what became of it.
    CANCEL: Final = "daskwg_cancel"
    #: Reserves a ``MASTER_PORT`` on the worker's host (``port``, or ``None``: any free one).
    RESERVE_PORT: Final = "daskwg_reserve_port"
    #: Destroys a departed driver's non-detached ranks (``client``; the scheduler sends it).
    RELEASE: Final = "daskwg_release"
    #: The worker's memory figures (``memory``, ``memory_limit``, ``pause``).
    MEMORY: Final = "daskwg_memory"
    #: The last finished call of a driver ``session`` (its sequence number, or -1).
    PROGRESS: Final = "daskwg_progress"
    #: The status records (:func:`status_record`) of the ranks and queued calls hosted there.
    STATUS: Final = "daskwg_status"
    #: The hosted calls' counters (for the scheduler's ``/metrics``).
    METRICS: Final = "daskwg_metrics"
    #: Rows of a stored ``DataProtoFuture`` part (``daskwg.plugin.rows``).
    ROWS: Final = "daskwg_rows"
    #: Writes such rows into a consumer's shared-memory file (``daskwg.plugin.gathered``).
    WRITE_ROWS: Final = "daskwg_write_rows"
    #: A stored result, waiting for it to exist (``daskwg.plugin.results``).
    FETCH: Final = "daskwg_fetch"
    #: A stored part's :class:`PartInfo`.
    PART_INFO: Final = "daskwg_part_info"
    #: Drops stored results the driver let go of.
    FREE: Final = "daskwg_free"
    #: Tells the scheduler of stored results (their keys become Dask keys there).
    PUBLISH: Final = "daskwg_publish"
    #: Streams a stored or relayed result to the next consumer of a broadcast
    #: (``daskwg.plugin.relay``).
    RELAY: Final = "daskwg_relay"
    #: A stored result through a shared-memory file, for a consumer on the same host
    #: (``daskwg.plugin.shared``).
    SHARED: Final = "daskwg_shared"


#: Every :class:`Handler` name: what the worker side installs, and all the driver side,
#: the scheduler and other workers may send.
HANDLERS: tuple[str, ...] = tuple(v for k, v in vars(Handler).items() if k.isupper())

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

    @classmethod
    def from_wire(cls, fields: tuple | list) -> Call:
        """The call :meth:`to_wire` gave ``fields`` of."""
        return cls(*fields)


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


@dataclass(frozen=True, slots=True)
class CallMessage:
    """One call on a call stream (``daskwg.wire.frames``), the arguments' buffers beside it.

    On the wire (:meth:`to_wire`): ``("call", cid, call fields, header, key, inline,
    relay_wait, refs)``, a plain tuple (no dict to build or read per call).

    Attributes:
        call: the :class:`Call`.
        header: the arguments' pickle header (``daskwg.serialization.pickling.dumps``).
        key: where a non-blocking call's result stays (``None``: a blocking call, whose
            reply carries the result).
        inline: bytes up to which a kept result comes back too.
        relay_wait: ``daskwg.relay-wait`` (seconds), for relayed inputs.
        refs: the pickled ``(kind, values)`` of each ``LazyArg`` (``None``: none).
        cid: the call's id on its stream: ``0`` as the driver builds it, the stream's own
            as the worker reads it (``daskwg.transport.streams`` sets it as it writes).
    """

    call: Call
    header: bytes
    key: str | None = None
    inline: int = 0
    relay_wait: float = 10.0
    refs: bytes | None = None
    cid: int = 0

    def to_wire(self) -> tuple:
        """The message as the stream carries it; :meth:`from_wire` reads it back."""
        return (
            "call",
            self.cid,
            self.call.to_wire(),
            self.header,
            self.key,
            self.inline,
            self.relay_wait,
            self.refs,
        )

    @classmethod
    def from_wire(cls, message: tuple) -> CallMessage:
        """The record of a ``("call", ...)`` message (:meth:`to_wire`)."""
        _, cid, call, header, key, inline, relay_wait, refs = message
        return cls(Call.from_wire(call), header, key, inline, relay_wait, refs, cid)


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


@dataclass(frozen=True, slots=True)
class PlanMessage:
    """One replay of a step plan on one worker, on its call stream, the arguments' buffers
    beside it. On the wire (:meth:`to_wire`): ``("plan", cid, entries, header, inline)``.

    Attributes:
        entries: per call, in the driver's order, ``(call fields, key, result, uses, stop)``:
            ``key`` the call's future (``None``: none), ``result`` ``"keep"`` (it stays on the
            worker under ``key``; up to ``inline`` bytes, tensors included, it comes back too:
            the step's outputs are what the replay returns), ``"return"`` (it comes back with
            the reply) or ``"none"``, ``uses`` how many later calls of the message read it
            (:class:`Slot`), ``stop`` whether the message's later calls are not run if this
            one fails (a blocking method's).
        header: the pickle header of the list of every call's ``(args, kwargs)``.
        inline: see ``entries``.
        cid: the stream's id of the message (see :class:`CallMessage`).

    Its :class:`Reply` has ``status`` ``"plan"`` and as ``header`` the pickled list of per
    call ``(status, nbytes, error, result header, result buffer count)``, the results'
    buffers beside it, in order.
    """

    entries: list[tuple]
    header: bytes
    inline: int
    cid: int = 0

    def to_wire(self) -> tuple:
        """The message as the stream carries it; :meth:`from_wire` reads it back."""
        return ("plan", self.cid, self.entries, self.header, self.inline)

    @classmethod
    def from_wire(cls, message: tuple) -> PlanMessage:
        """The record of a ``("plan", ...)`` message (:meth:`to_wire`)."""
        _, cid, entries, header, inline = message
        return cls(entries, header, inline, cid)


@dataclass(frozen=True, slots=True)
class FetchMessage:
    """A driver's request, on a call stream, for the value of a kept result. On the wire
    (:meth:`to_wire`): ``("fetch", cid, key, session, seq, source)``. Its :class:`Reply`
    carries the value's pickle header and buffers (``"OK"``), or the pickled error
    (``"error"``).

    Attributes:
        key: the result's key.
        session: the driver session of the call that makes it, with ``seq`` its place there.
        seq: see ``session``.
        source: that call, e.g. ``"gen.generate"``, named in errors.
        cid: the stream's id of the message (see :class:`CallMessage`).
    """

    key: str
    session: str
    seq: int
    source: str
    cid: int = 0

    def to_wire(self) -> tuple:
        """The message as the stream carries it; :meth:`from_wire` reads it back."""
        return ("fetch", self.cid, self.key, self.session, self.seq, self.source)

    @classmethod
    def from_wire(cls, message: tuple) -> FetchMessage:
        """The record of a ``("fetch", ...)`` message (:meth:`to_wire`)."""
        _, cid, key, session, seq, source = message
        return cls(key, session, seq, source, cid)


@dataclass(frozen=True, slots=True)
class FreeMessage:
    """A driver's word, on a call stream, that it let go of kept results before the
    scheduler heard of them: the worker drops them. On the wire: ``("free", 0, keys)``;
    it has no reply.

    Attributes:
        keys: the results' keys.
    """

    keys: list[str]

    def to_wire(self) -> tuple:
        """The message as the stream carries it; :meth:`from_wire` reads it back."""
        return ("free", 0, self.keys)

    @classmethod
    def from_wire(cls, message: tuple) -> FreeMessage:
        """The record of a ``("free", ...)`` message (:meth:`to_wire`)."""
        return cls(list(message[2]))


#: The status of a host leader's :class:`Reply` to a :class:`FanoutMessage`: its ``header``
#: is the pickled list of ``(member index, (status, nbytes, error, header, info), number of
#: buffers)`` of the members' answers it carries, their buffers beside it in that order. A
#: leader may answer one message several times (a member's error at once, the rest when all
#: ended): the driver keeps the message's reply handler until every member has answered.
FANOUT = "fanout"
#: A member's status in a :data:`FANOUT` reply when the leader's stream to its worker closed
#: before it answered (the worker is gone): its ``error`` is the reason, as text.
LOST = "lost"


@dataclass(frozen=True, slots=True)
class FanoutMessage:
    """Calls to several ranks of one host, sent to one worker of that host (the host
    leader, ``daskwg.plugin.leader``), which hands each to its rank's worker over that host's
    own call streams (Unix-domain sockets) and answers for all of them (Monarch's meshes send
    to a host once the same way). On the wire (:meth:`to_wire`): ``("fanout", cid, members,
    headers, counts)``, the payloads' buffers beside it, payload after payload.

    Attributes:
        members: per call, ``(address, server_id, call fields, payload index, key, inline,
            relay_wait)``: the worker process it is meant for, the :class:`Call`
            (:meth:`Call.to_wire`), which payload holds its arguments, and
            :class:`CallMessage`'s ``key``, ``inline`` and ``relay_wait``.
        headers: the distinct payloads' pickle headers (a ``ONE_TO_ALL`` call's one payload
            travels once for the whole host).
        counts: per payload, how many of the message's buffers are its.
        cid: the stream's id of the message (see :class:`CallMessage`).

    Its replies have ``status`` :data:`FANOUT`.
    """

    members: list[tuple]
    headers: list[bytes]
    counts: list[int]
    cid: int = 0

    def to_wire(self) -> tuple:
        """The message as the stream carries it; :meth:`from_wire` reads it back."""
        return ("fanout", self.cid, self.members, self.headers, self.counts)

    @classmethod
    def from_wire(cls, message: tuple) -> FanoutMessage:
        """The record of a ``("fanout", ...)`` message (:meth:`to_wire`)."""
        _, cid, members, headers, counts = message
        return cls(members, headers, counts, cid)


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to message ``cid`` on a call stream, the result's buffers beside it. On
    the wire (:meth:`to_wire`): ``("reply", cid, status, nbytes, error, header, info)``.

    Attributes:
        cid: the answered message's id on the stream.
        status: ``"OK"``, ``"error"`` (``error``: the pickled exception), ``"cancelled"``,
            ``"plan"`` for a :class:`PlanMessage`'s, or :data:`FANOUT` for a
            :class:`FanoutMessage`'s.
        nbytes: the kept result's size in bytes (``None``: not known).
        error: the pickled exception of a failed call.
        header: the result's pickle header when the result comes with the reply.
        info: a kept batch's pickled :class:`PartInfo` (``None``: not a batch, or it came
            back itself).
    """

    cid: int
    status: str
    nbytes: int | None = None
    error: bytes | None = None
    header: bytes | None = None
    info: bytes | None = None

    def to_wire(self) -> tuple:
        """The reply as the stream carries it; :meth:`from_wire` reads it back."""
        return ("reply", self.cid, self.status, self.nbytes, self.error, self.header, self.info)

    @classmethod
    def from_wire(cls, message: tuple) -> Reply:
        """The record of a ``("reply", ...)`` message (:meth:`to_wire`)."""
        _, cid, status, nbytes, error, header, info = message
        return cls(cid, status, nbytes, error, header, info)


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
