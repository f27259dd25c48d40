"""Sharded weight sync: trainer ranks send their own FSDP shards to the rollout ranks.

After every update an RL job moves the trainer's weights to its rollout ranks. verl's FSDP
workers gather the full state dict first (``get_model_state_dict(full_state_dict=True)``)
and send it from trainer rank 0; here every trainer rank sends only what it holds: the
local tensors of its DTensors (FSDP2's ``fully_shard`` parameters, ``Shard(0)`` on a 1-D
mesh) with where they sit in the full tensor, and each rollout rank writes the pieces of
every trainer rank straight into its own parameters. No rank materialises the full model
to send it, and no byte passes through the driver.

The sync runs on a daskwg collective (:func:`daskwg.create_collective_group`) whose members
are the trainer ranks (collective ranks ``0..senders-1``) and then the rollout ranks. It
takes one of two routes, the same on every member (found on the first sync of a collective
by two small collectives, see ``_route``):

**Same host** (every member on one host, a gloo collective, and each rollout rank allowed to
read the trainer ranks' memory: :mod:`daskwg.sync.peer_memory`). Each trainer rank sends
every rollout rank a header (JSON: per entry its name, dtype, full shape, flat element
offset of the piece in the full tensor, element count, whether it changed, and where its
bytes are in the trainer's memory) and waits for each rollout rank's acknowledgement; each
rollout rank takes the headers of all trainer ranks at once and copies each piece straight
from the trainer's memory into its slice of its parameters (``process_vm_readv``, as MPI's
CMA does). One copy per byte received, no buffer on either side, nothing on a socket but
the headers: a trainer rank's memory does not grow at all, and its shard "leaves" it once
per rollout rank only as memory reads on the host.

**Chain** (anything else: ranks on several hosts, NCCL, ``same_host=False``). Trainer rank
``i``'s stream goes along a chain of the rollout ranks: ``i`` sends it to the first one,
each forwards what it received to the next while it copies it into its parameters, so the
shard leaves its trainer rank once whatever the number of rollout ranks (as the chain
broadcast of :mod:`daskwg.collective` does for one source). Each stream is:

1. the header (without addresses) and the bucket size;
2. the bytes of the changed entries, back to back, cut into buckets of ``bucket_bytes``.

A trainer rank packs one bucket at a time into one buffer and waits until it left before
packing the next, so its memory grows by one bucket whatever the model's size; a rollout
rank receives into one buffer of a bucket. The trainer ranks' streams are received one
after another, so a sync takes about the time of one transfer of the whole model through a
rollout rank's link, plus a bucket per rollout rank along the chain.

With ``delta=True`` a trainer rank keeps a copy of the shard it last sent and sends only the
entries that differ from it (a frozen layer, an embedding no gradient touched): the header
says which, and :func:`shard_digest` / :func:`assembled_digests` prove that the rollout's
weights equal the trainer's, as a full sync would leave them.

Rank code::

    # trainer rank (a member of the collective "weights", collective ranks 0..T-1)
    daskwg.sync.send_shards(model.state_dict(), "weights", senders=T)
    # rollout rank (collective ranks T..)
    daskwg.sync.receive_shards(dict(model.named_parameters()), "weights", senders=T)
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import collective
from . import peer_memory, pieces
from .pieces import (
    Piece,
    _bytes,
    _check_kept,
    _full,
    _pieces_of,
    _target,
    _where,
    local_pieces,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SyncReport",
    "assembled_digests",
    "forget",
    "local_pieces",
    "receive_shards",
    "send_shards",
    "shard_digest",
]

#: Bytes of one bucket when none is given: a few chunks of the chain broadcast, small next
#: to a model, large enough that a bucket's round trip costs little next to its transfer.
DEFAULT_BUCKET_BYTES = 16 << 20

_HEADER_TAG, _BUCKET_TAG, _ACK_TAG = 0, 2, 3


@dataclass
class SyncReport:
    """What one rank did in one sync.

    Attributes:
        sent_bytes: payload bytes this rank sent (headers, its own buckets and, on a
            rollout rank, what it forwarded along the chain).
        shard_bytes: bytes of this rank's pieces (trainer) or of the pieces it received
            (rollout), changed or not.
        changed_bytes: bytes of the pieces that travelled (all of them unless ``delta``).
        buckets: buckets sent (trainer) or received (rollout); 0 on the same-host route.
        route: ``"same-host"`` (each rollout rank read the pieces from the trainer ranks'
            memory) or ``"chain"`` (the pieces travelled on the collective's sockets).
    """

    sent_bytes: int = 0
    shard_bytes: int = 0
    changed_bytes: int = 0
    buckets: int = 0
    route: str = "chain"


_lock = threading.Lock()
_previous: dict[str, dict[str, Any]] = {}  # collective name -> piece name -> last sent copy
_received: dict[str, dict[int, list[Piece]]] = {}  # collective name -> trainer rank -> pieces
# collective name -> (the member it was found for, same_host asked, trainer pids or None)
_routes: dict[str, tuple[Any, bool, list[int] | None]] = {}
# same-host route: collective name -> (member, the header this trainer rank sent last)
_lent: dict[str, tuple[Any, bytes]] = {}
# same-host route: collective name -> (member, trainer rank -> the header it sent last)
_kept: dict[str, tuple[Any, dict[int, dict]]] = {}
# rollout ranks: collective name -> (member, tensor name -> _where() at the last sync)
_placed: dict[str, tuple[Any, dict[str, tuple]]] = {}
# same-host route: collective name -> (member, trainer rank -> its _Layout here)
_layouts: dict[str, tuple[Any, dict[int, Any]]] = {}


def _device(member: Any) -> Any:
    """Where this member's send and receive buffers live: NCCL moves CUDA tensors only."""
    import torch

    return (
        torch.device("cuda", torch.cuda.current_device()) if member.backend == "nccl" else torch.device("cpu")
    )


def _chain(member: Any, senders: int, source: int) -> tuple[int | None, int | None]:
    """(where this member receives stream ``source`` from, where it forwards it to)."""
    me, size = member.rank, member.spec.world_size
    if me < senders:
        return None, (senders if me == source else None)
    previous = source if me == senders else me - 1
    return previous, (me + 1 if me + 1 < size else None)


def _check_senders(member: Any, senders: int) -> None:
    if not 0 < senders < member.spec.world_size:
        raise ValueError(
            f"senders={senders}: collective {member.spec.name!r} has {member.spec.world_size} members; the "
            "trainer ranks are collective ranks 0..senders-1 and at least one rollout rank follows them"
        )


def send_shards(
    state_dict: Mapping[str, Any],
    group_name: str,
    *,
    senders: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    delta: bool = False,
    same_host: bool = True,
) -> SyncReport:
    """Send this trainer rank's pieces of ``state_dict`` to every rollout rank of collective
    ``group_name`` (run :func:`receive_shards` on the rollout ranks at the same time).

    Args:
        state_dict: name -> tensor or DTensor, the same names on every trainer rank
            (``model.state_dict()`` of an FSDP2 model).
        group_name: a collective whose ranks ``0..senders-1`` are the trainer ranks.
        senders: number of trainer ranks.
        bucket_bytes: bytes packed and sent at a time; this rank's memory grows by one
            bucket.
        delta: send only the pieces that changed since this rank's last sync on
            ``group_name`` (keeps a copy of this rank's shard for the comparison).
        same_host: take the same-host route where it works (see the module's header);
            ``False`` keeps the pieces on the collective's sockets. Pass the same value on
            every member of the collective, every sync.

    Returns:
        a :class:`SyncReport`.

    Raises:
        ValueError: not a member, ``senders`` out of range, this rank is not a trainer
            rank, ``bucket_bytes`` below 1, or an unsupported DTensor (:func:`local_pieces`);
            RuntimeError: a member failed or the collective's timeout passed.
    """
    import torch

    member = collective._member(group_name)
    _check_senders(member, senders)
    if member.rank >= senders:
        raise ValueError(
            f"collective rank {member.rank} is a rollout rank (senders={senders}): call receive_shards there"
        )
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    pieces = _pieces_of(state_dict, member, group_name)
    with _lock:
        previous = _previous.setdefault(group_name, {}) if delta else None
    changed = [
        previous is None or piece.name not in previous or not torch.equal(previous[piece.name], local)
        for piece, local in pieces
    ]
    report = SyncReport(shard_bytes=sum(local.nbytes for _, local in pieces))
    report.changed_bytes = sum(local.nbytes for (_, local), c in zip(pieces, changed) if c)
    header = {
        "bucket": bucket_bytes,
        "pieces": [
            [p.name, p.dtype, list(p.shape), p.offset, p.numel, c] for (p, _), c in zip(pieces, changed)
        ],
    }
    if _route(member, senders, same_host) is not None:
        _lend_shard(member, senders, header, pieces, changed, report)
        if previous is not None:
            for (piece, local), c in zip(pieces, changed):
                if c:
                    previous[piece.name] = local.clone()
        return report
    _, following = _chain(member, senders, member.rank)
    report.sent_bytes += _send_header(member, header, following)
    bucket = torch.empty(
        min(bucket_bytes, max(report.changed_bytes, 1)), dtype=torch.uint8, device=_device(member)
    )
    filled = 0
    for (piece, local), c in zip(pieces, changed):
        if not c:
            continue
        flat = _bytes(local)
        start = 0
        while start < flat.numel():
            take = min(flat.numel() - start, bucket.numel() - filled)
            bucket[filled : filled + take].copy_(flat[start : start + take])
            filled, start = filled + take, start + take
            if filled == bucket.numel():
                _send(member, bucket, following, _BUCKET_TAG)
                report.sent_bytes, report.buckets, filled = report.sent_bytes + filled, report.buckets + 1, 0
        if previous is not None:
            previous[piece.name] = local.clone()
    if filled:
        _send(member, bucket[:filled], following, _BUCKET_TAG)
        report.sent_bytes, report.buckets = report.sent_bytes + filled, report.buckets + 1
    return report


def receive_shards(
    params: Mapping[str, Any], group_name: str, *, senders: int, same_host: bool = True
) -> SyncReport:
    """Receive every trainer rank's pieces into ``params``, in place, forwarding each
    stream to the next rollout rank of the chain.

    Args:
        params: name -> the rollout model's full, contiguous tensor of that name
            (``dict(model.named_parameters())``, or ``model.state_dict()``); each must have
            the trainer's shape and dtype.
        group_name: the collective of :func:`send_shards`.
        senders: number of trainer ranks.
        same_host: as :func:`send_shards`'s (the same value on every member).

    Returns:
        a :class:`SyncReport` (``shard_bytes``: bytes of all pieces received).

    Raises:
        KeyError: a trainer sent a name ``params`` lacks; ValueError: not a member, a
            trainer rank, or a tensor of another shape or dtype than the trainer's, or not
            contiguous; RuntimeError: a member failed or the timeout passed.
    """
    import torch

    member = collective._member(group_name)
    _check_senders(member, senders)
    if member.rank < senders:
        raise ValueError(
            f"collective rank {member.rank} is a trainer rank (senders={senders}): call send_shards there"
        )
    report = SyncReport()
    received: dict[int, list[Piece]] = {}
    pids = _route(member, senders, same_host)
    if pids is not None:
        _read_shards(member, params, pids, received, report)
        with _lock:
            _received[group_name] = received
        return report
    with _lock:
        placed = _placed.get(group_name)
    placed = dict(placed[1]) if placed is not None and placed[0] is member else {}
    moved: ValueError | None = None  # raised once every stream has been taken
    for source in range(senders):
        previous, following = _chain(member, senders, source)
        header = _receive_header(member, previous)
        if following is not None:
            report.sent_bytes += _send_header(member, header, following)
        pieces, targets = [], []
        for name, dtype, shape, offset, numel, changed in header["pieces"]:
            piece = Piece(name, dtype, tuple(shape), offset, numel)
            target = _target(params, piece)
            pieces.append(piece)
            report.shard_bytes += target.nbytes
            where = _where(_full(params, piece, alias=False))
            if changed:
                targets.append(_bytes(target))
            elif moved is None:
                try:
                    _check_kept(name, where, placed, group_name)
                except ValueError as exc:
                    moved = exc
            placed[name] = where
        received[source] = pieces
        total = sum(t.numel() for t in targets)
        report.changed_bytes += total
        bucket = torch.empty(min(header["bucket"], max(total, 1)), dtype=torch.uint8, device=_device(member))
        writes = _writes(targets)
        for start in range(0, total, bucket.numel()):
            chunk = bucket[: min(bucket.numel(), total - start)]
            collective._wait(member, member.group.recv([chunk], previous, _BUCKET_TAG), "weight sync")
            # Forward the chunk while copying it into the parameters.
            sending = member.group.send([chunk], following, _BUCKET_TAG) if following is not None else None
            writes(chunk)
            if sending is not None:
                collective._wait(member, sending, "weight sync")
                report.sent_bytes += chunk.numel()
            report.buckets += 1
    with _lock:
        _received[group_name] = received
        _placed[group_name] = (member, placed)
    if moved is not None:
        raise moved
    return report


def _route(member: Any, senders: int, same_host: bool) -> list[int] | None:
    """The trainer ranks' pids where this sync takes the same-host route, else ``None``.

    Found once per collective (and ``same_host``), by every member in the same two small
    collectives: an all-gather of each member's :class:`~daskwg.sync.peer_memory.Probe` and
    whether it asks for the route (``same_host`` and a gloo collective: NCCL members hold
    their tensors on GPUs), then an all-reduce (MIN) of whether every rollout rank could read
    every trainer rank's probe. So all members take the same route, and the chain is kept
    wherever one member is on another host, in another pid namespace, or may not read the
    trainers' memory.
    """
    import torch
    import torch.distributed as dist

    with _lock:
        cached = _routes.get(member.spec.name)
    if cached is not None and cached[0] is member and cached[1] == same_host:
        return cached[2]
    probe = peer_memory.local_probe()
    wants = same_host and member.backend == "gloo"
    mine = torch.tensor([probe.pid, probe.address, probe.token, int(wants)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(member.spec.world_size)]
    collective._wait(member, member.group.allgather([everyone], [mine]), "weight sync")
    able = all(int(e[3]) for e in everyone)
    if able and member.rank >= senders:
        able = all(
            peer_memory.can_read(peer_memory.Probe(*(int(v) for v in everyone[s][:3])))
            for s in range(senders)
        )
    agreed = torch.tensor([int(able)], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    collective._wait(member, member.group.allreduce([agreed], options), "weight sync")
    pids = [int(everyone[s][0]) for s in range(senders)] if int(agreed) else None
    with _lock:
        _routes[member.spec.name] = (member, same_host, pids)
    return pids


def _lend_shard(
    member: Any, senders: int, header: dict, pieces: list, changed: list[bool], report: SyncReport
) -> None:
    """The trainer's side of the same-host route: tell every rollout rank where the changed
    pieces are in this process's memory, and hold them unchanged until each one has read
    them (its acknowledgement)."""
    import torch

    report.route = "same-host"
    # A rollout rank reads host memory: a piece on a GPU is staged on the host (a copy of it).
    locals_ = [local if local.device.type == "cpu" else local.cpu() for _, local in pieces]
    header = {**header, "addresses": [t.data_ptr() if c else 0 for t, c in zip(locals_, changed)]}
    rollouts = range(senders, member.spec.world_size)
    text = json.dumps(header).encode()
    with _lock:
        last = _lent.pop(member.spec.name, None)
    # One message per rollout rank says "ready": the header's length, or 0 where the header
    # is the one this rank sent last time (the same tensors at the same addresses, as an
    # optimizer leaves them): the rollout rank kept it, so a sync costs one message each way.
    fresh = last is None or last[0] is not member or last[1] != text
    ready = torch.tensor([len(text) if fresh else 0], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    works: list = [_Keep(ready, payload)]
    for rank in rollouts:
        works.append(member.group.send([ready], rank, _HEADER_TAG))
        report.sent_bytes += ready.nbytes
        if fresh:
            works.append(member.group.send([payload], rank, _HEADER_TAG + 1))
            report.sent_bytes += payload.numel()
    acks = [torch.zeros(1, dtype=torch.int64) for _ in rollouts]
    works += [member.group.recv([ack], rank, _ACK_TAG) for ack, rank in zip(acks, rollouts)]
    for work in reversed(works):
        collective._wait(member, work, "weight sync")
    del locals_
    failed = [rank for ack, rank in zip(acks, rollouts) if int(ack) != 1]
    if failed:
        # Every message of this sync was exchanged: the collective serves the next one.
        raise RuntimeError(
            f"weight sync on collective {member.spec.name!r}: rollout rank(s) {failed} could not "
            "take it (their own errors say why); this trainer rank's shards are unchanged, and "
            "the next sync sends them again"
        )
    with _lock:
        _lent[member.spec.name] = (member, text)


def _read_shards(member: Any, params: Mapping[str, Any], pids: list[int], received: dict, report) -> None:
    """The rollout's side of the same-host route: take every trainer rank's header (all
    posted at once), copy each changed piece from that trainer's memory straight into its
    slice of ``params``, then acknowledge to every trainer rank."""
    import torch

    report.route = "same-host"
    senders = len(pids)
    with _lock:
        cached = _layouts.get(member.spec.name)
        placed = _placed.get(member.spec.name)
    layouts = cached[1] if cached is not None and cached[0] is member else {}
    placed = placed[1] if placed is not None and placed[0] is member else {}
    error: BaseException | None = None
    try:
        # Every trainer rank's header arrives before anything here may fail: a failure
        # below is acknowledged as one, and the collective stays in step for the next sync.
        headers = _receive_lent(member, senders)
        for source, header in enumerate(headers):
            layout = layouts.get(source)
            if layout is None or layout.header is not header or not layout.holds(params):
                layout = layouts[source] = _Layout.of(header, params, source, placed, member.spec.name)
                for name, where in layout.targets.items():
                    placed[name] = where
            report.shard_bytes += layout.shard_bytes
            report.changed_bytes += layout.changed_bytes
            for address, full, offset, numel in layout.staged:  # pieces not in host memory
                target = full.data.reshape(-1)[offset : offset + numel]
                staged = torch.empty(target.shape, dtype=target.dtype)
                peer_memory.read_into(pids[source], address, staged.data_ptr(), staged.nbytes)
                target.copy_(staged)
            # One system call for the trainer rank's pieces, not one per piece.
            peer_memory.read_many(pids[source], layout.ranges)
            received[source] = layout.pieces
    except Exception as exc:  # noqa: BLE001 - raised below, once the trainers know
        error = exc
        layouts.clear()
    with _lock:
        _layouts[member.spec.name] = (member, layouts)
        _placed[member.spec.name] = (member, placed)
    done = torch.tensor([0 if error else 1], dtype=torch.int64)
    try:
        works = [member.group.send([done], source, _ACK_TAG) for source in range(senders)]
        for work in works:
            collective._wait(member, work, "weight sync")
    except Exception:
        if error is None:
            raise
    if error is not None:
        raise error


class _Layout:
    """Where one trainer rank's header puts its pieces in this rollout rank's parameters:
    the ranges one ``process_vm_readv`` copies (``(address there, address here, bytes)``),
    checked once per header. A trainer rank whose tensors stay where they were sends no new
    header (the rollout rank keeps the last one, the same object), and while the parameters
    it fills lie where they lay (address, shape, dtype, device: ``model.state_dict()``
    gives new alias objects each time, so not by identity), its layout is this one again."""

    __slots__ = ("header", "pieces", "ranges", "staged", "targets", "shard_bytes", "changed_bytes")

    def __init__(self, header: dict) -> None:
        self.header = header
        self.pieces: list[Piece] = []
        self.ranges: list[tuple[int, int, int]] = []
        self.staged: list[tuple] = []  # (address there, tensor, offset, numel): not on the host
        self.targets: dict[str, tuple] = {}  # name -> _where() of the tensor it was checked with
        self.shard_bytes = self.changed_bytes = 0

    @classmethod
    def of(
        cls, header: dict, params: Mapping[str, Any], source: int, placed: dict, group_name: str
    ) -> _Layout:
        """The layout of ``header`` (trainer rank ``source``'s) in ``params``; ``placed``:
        where each tensor lay at this rank's last sync (:func:`_where`).

        Raises:
            KeyError, ValueError: as :func:`_full`, a piece that does not fit its tensor, or
                (:func:`_check_kept`) a piece the trainer did not send whose tensor moved.
        """
        layout = cls(header)
        for (name, dtype, shape, offset, numel, changed), address in zip(
            header["pieces"], header["addresses"]
        ):
            piece = Piece(name, dtype, tuple(shape), offset, numel)
            full = _full(params, piece, alias=False)
            if offset < 0 or numel < 0 or offset + numel > full.numel():
                # Written through raw addresses: never past the parameter's end.
                raise ValueError(
                    f"{name}: trainer rank {source} sent elements {offset}..{offset + numel} of a "
                    f"tensor of {full.numel()}; its shard does not fit the full shape {tuple(shape)}"
                )
            layout.pieces.append(piece)
            layout.targets[name] = _where(full)
            nbytes = numel * full.element_size()
            layout.shard_bytes += nbytes
            if not changed:
                _check_kept(name, layout.targets[name], placed, group_name)
                continue
            layout.changed_bytes += nbytes
            if full.device.type == "cpu":
                # Into the parameter's own memory, where the piece's elements are.
                layout.ranges.append((address, full.data_ptr() + offset * full.element_size(), nbytes))
            else:
                layout.staged.append((address, full, offset, numel))
        return layout

    def holds(self, params: Mapping[str, Any]) -> bool:
        """Whether ``params``' tensors lie where those this layout was checked with did."""
        for name, where in self.targets.items():
            now = params.get(name)
            if now is None or _where(now) != where:
                return False
        return True


def _receive_lent(member: Any, senders: int) -> list[dict]:
    """Every trainer rank's "ready" message (all posted at once) and, where it says the
    header changed, the header; else the one kept from that rank's last sync."""
    import torch

    readies = [torch.zeros(1, dtype=torch.int64) for _ in range(senders)]
    for work in [member.group.recv([r], source, _HEADER_TAG) for source, r in enumerate(readies)]:
        collective._wait(member, work, "weight sync")
    with _lock:
        kept = _kept.get(member.spec.name)
    headers = dict(kept[1]) if kept is not None and kept[0] is member else {}
    payloads = {source: torch.empty(int(r), dtype=torch.uint8) for source, r in enumerate(readies) if int(r)}
    for work in [member.group.recv([p], source, _HEADER_TAG + 1) for source, p in payloads.items()]:
        collective._wait(member, work, "weight sync")
    for source, payload in payloads.items():
        headers[source] = json.loads(payload.numpy().tobytes())
    missing = [source for source in range(senders) if source not in headers]
    if missing:
        raise RuntimeError(
            f"weight sync on collective {member.spec.name!r}: trainer ranks {missing} sent no header "
            "and this rank kept none from their last sync; call daskwg.sync.forget on every member"
        )
    with _lock:
        _kept[member.spec.name] = (member, headers)
    return [headers[source] for source in range(senders)]


def _writes(targets: list[Any]) -> Any:
    """A function that copies each next chunk of the stream into ``targets`` (flat byte
    views, in stream order), pieces straddling chunks included."""
    state = {"target": 0, "at": 0}

    def write(chunk: Any) -> None:
        used = 0
        while used < chunk.numel():
            target = targets[state["target"]]
            take = min(chunk.numel() - used, target.numel() - state["at"])
            target[state["at"] : state["at"] + take].copy_(chunk[used : used + take])
            used, state["at"] = used + take, state["at"] + take
            if state["at"] == target.numel():
                state["target"], state["at"] = state["target"] + 1, 0

    return write


def _send_header(member: Any, header: dict, following: int | None) -> int:
    if following is None:
        return 0
    sent, works = _post_header(member, header, following)
    for work in works:
        collective._wait(member, work, "weight sync")
    return sent


def _post_header(member: Any, header: dict, to: int) -> tuple[int, list]:
    """Start sending ``header`` to collective rank ``to``: (bytes, the works to wait for)."""
    import torch

    payload = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(_device(member))
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=_device(member))
    works = [
        member.group.send([length], to, _HEADER_TAG),
        member.group.send([payload], to, _HEADER_TAG + 1),
    ]
    # gloo sends from the tensors' memory until the works finish: keep them alive with them.
    works.append(_Keep(length, payload))
    return 8 + payload.numel(), works


class _Keep:
    """A finished 'work' that holds buffers alive until it is waited for."""

    def __init__(self, *buffers: Any) -> None:
        self.buffers = buffers

    def wait(self, *_: Any) -> bool:
        self.buffers = ()
        return True


def _receive_header(member: Any, previous: int) -> dict:
    import torch

    length = torch.zeros(1, dtype=torch.int64, device=_device(member))
    collective._wait(member, member.group.recv([length], previous, _HEADER_TAG), "weight sync")
    payload = torch.empty(int(length), dtype=torch.uint8, device=_device(member))
    collective._wait(member, member.group.recv([payload], previous, _HEADER_TAG + 1), "weight sync")
    return json.loads(payload.cpu().numpy().tobytes())


def _send(member: Any, tensor: Any, to: int | None, tag: int) -> None:
    if to is not None:
        collective._wait(member, member.group.send([tensor], to, tag), "weight sync")


def shard_digest(state_dict: Mapping[str, Any], sender: int) -> str:
    """sha256 (hex) of trainer rank ``sender``'s pieces of ``state_dict``, in the order
    :func:`send_shards` sends them. Equals the rollout's ``assembled_digests(...)[sender]``
    exactly when the rollout holds these pieces bit for bit."""
    digest = hashlib.sha256()
    for piece, local in local_pieces(state_dict, sender):
        digest.update(piece.name.encode())
        digest.update(_bytes(local.cpu()).numpy().tobytes())
    return digest.hexdigest()


def assembled_digests(params: Mapping[str, Any], group_name: str) -> list[str]:
    """sha256 (hex) per trainer rank of the slices of ``params`` that its pieces filled in
    the last :func:`receive_shards` on ``group_name`` (compare with each trainer rank's
    :func:`shard_digest`).

    Raises:
        ValueError: no sync was received on ``group_name`` in this process.
    """
    with _lock:
        received = _received.get(group_name)
    if received is None:
        raise ValueError(f"no weights were received on collective {group_name!r} here yet")
    digests = []
    for source in sorted(received):
        digest = hashlib.sha256()
        for piece in received[source]:
            digest.update(piece.name.encode())
            digest.update(_bytes(_target(params, piece).cpu()).numpy().tobytes())
        digests.append(digest.hexdigest())
    return digests


def forget(group_name: str) -> None:
    """Drop what this process keeps for collective ``group_name`` (delta copies, manifests,
    the route found, the headers sent and kept): call it on every member of the collective
    at once, as a rank that forgot the headers it kept cannot take a sync whose trainer
    ranks did not."""
    with _lock:
        for kept in (_previous, _received, _routes, _lent, _kept, _layouts, _placed):
            kept.pop(group_name, None)
    with pieces._lock:
        pieces._sent_pieces.pop(group_name, None)
