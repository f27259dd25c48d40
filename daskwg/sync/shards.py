"""Sharded weight sync: trainer ranks send their own FSDP shards to the rollout ranks.

After every update an RL job moves the trainer's weights to its rollout ranks. verl's FSDP
workers gather the full state dict first (``get_model_state_dict(full_state_dict=True)``)
and send it from trainer rank 0; here every trainer rank sends only what it holds: the
local tensors of its DTensors (FSDP2's ``fully_shard`` parameters, ``Shard(0)`` on a 1-D
mesh) with where they sit in the full tensor, and each rollout rank writes the pieces of
every trainer rank straight into its own parameters. No rank materialises the full model
to send it, and no byte passes through the driver.

The route is a daskwg collective (:func:`daskwg.create_collective_group`) whose members
are the trainer ranks (collective ranks ``0..senders-1``) and then the rollout ranks.
Trainer rank ``i``'s stream goes along a chain of the rollout ranks: ``i`` sends it to the
first one, each forwards what it received to the next while it copies it into its
parameters, so the shard leaves its trainer rank once whatever the number of rollout
ranks (as the chain broadcast of :mod:`daskwg.collective` does for one source). Each
stream is:

1. a header (JSON): the bucket size, and per entry its name, dtype, full shape, flat
   element offset of the piece in the full tensor, element count and whether it changed;
2. the bytes of the changed entries, back to back, cut into buckets of ``bucket_bytes``.

A trainer rank packs one bucket at a time into one buffer and waits until it left before
packing the next, so its memory grows by one bucket whatever the model's size; a rollout
rank receives into one buffer of a bucket. With ``delta=True`` a trainer rank keeps a
copy of the shard it last sent and sends only the entries that differ from it (a frozen
layer, an embedding no gradient touched): the header says which, and
:func:`shard_digest` / :func:`assembled_digests` prove that the rollout's weights equal
the trainer's, as a full sync would leave them.

The trainer ranks' streams are received one after another, so a sync takes about the time
of one transfer of the whole model through a rollout rank's link, plus a bucket per
rollout rank along the chain.

Rank code::

    # trainer rank (a member of the collective "weights", collective ranks 0..T-1)
    daskwg.sync.send_shards(model.state_dict(), "weights", senders=T)
    # rollout rank (collective ranks T..)
    daskwg.sync.receive_shards(dict(model.named_parameters()), "weights", senders=T)
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .. import collective

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

_HEADER_TAG, _BUCKET_TAG = 0, 2


@dataclass(frozen=True)
class Piece:
    """One tensor of a trainer rank's state dict as it travels: the rank's piece of it.

    Attributes:
        name: the state-dict key.
        dtype: torch dtype name, e.g. ``"float32"``.
        shape: the full tensor's shape.
        offset: flat element offset of the piece in the full (contiguous) tensor.
        numel: elements of the piece.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass
class SyncReport:
    """What one rank did in one sync.

    Attributes:
        sent_bytes: payload bytes this rank sent (headers, its own buckets and, on a
            rollout rank, what it forwarded along the chain).
        shard_bytes: bytes of this rank's pieces (trainer) or of the pieces it received
            (rollout), changed or not.
        changed_bytes: bytes of the pieces that travelled (all of them unless ``delta``).
        buckets: buckets sent (trainer) or received (rollout).
    """

    sent_bytes: int = 0
    shard_bytes: int = 0
    changed_bytes: int = 0
    buckets: int = 0


_lock = threading.Lock()
_previous: dict[str, dict[str, Any]] = {}  # collective name -> piece name -> last sent copy
_received: dict[str, dict[int, list[Piece]]] = {}  # collective name -> trainer rank -> pieces


def local_pieces(state_dict: Mapping[str, Any], sender: int) -> Iterator[tuple[Piece, Any]]:
    """The pieces trainer rank ``sender`` sends for ``state_dict``, with their local tensors.

    A DTensor sharded on dim 0 of a 1-D mesh (FSDP2's ``fully_shard``) gives its local
    shard; a replicated DTensor is sent by mesh coordinate 0 only, a plain tensor by
    ``sender`` 0 only (every trainer rank holds the same one).

    Args:
        state_dict: name -> ``torch.Tensor`` or ``DTensor`` (``model.state_dict()`` of an
            FSDP2 model).
        sender: this rank's collective rank among the trainer ranks.

    Yields:
        ``(Piece, tensor)``: the tensor is the local data, contiguous, on its device.

    Raises:
        ValueError: a DTensor on a mesh of more than one dimension, or sharded otherwise
            than on dim 0 (call ``full_tensor()`` on it, or shard it with ``Shard(0)``).
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            mesh, placements = value.device_mesh, value.placements
            if mesh.ndim != 1 or not isinstance(placements[0], (Shard, Replicate)):
                raise ValueError(
                    f"{name}: a DTensor on a {mesh.ndim}-D mesh with placements {placements}; "
                    "the sharded sync takes Shard(0) or Replicate() on a 1-D mesh (FSDP2's fully_shard): "
                    "reshard it, or send value.full_tensor() as a plain tensor"
                )
            if isinstance(placements[0], Shard) and placements[0].dim != 0:
                raise ValueError(
                    f"{name}: sharded on dim {placements[0].dim}; the sharded sync takes Shard(0) "
                    "(a contiguous slice of the full tensor): redistribute to Shard(0) first"
                )
            local = value.to_local()
            if isinstance(placements[0], Replicate):
                if mesh.get_local_rank() != 0:
                    continue
                offset = 0
            else:
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                _, global_offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
                row = math.prod(value.shape[1:]) if value.dim() else 1
                offset = (global_offset[0] if value.dim() else 0) * row
            shape = tuple(value.shape)
        else:
            if sender != 0:
                continue
            local, offset, shape = value, 0, tuple(value.shape)
        local = local.detach().contiguous()
        yield Piece(name, str(local.dtype).removeprefix("torch."), shape, offset, local.numel()), local


def _bytes(tensor: Any) -> Any:
    import torch

    return tensor.reshape(-1).view(torch.uint8)


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
    pieces = list(local_pieces(state_dict, member.rank))
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


def receive_shards(params: Mapping[str, Any], group_name: str, *, senders: int) -> SyncReport:
    """Receive every trainer rank's pieces into ``params``, in place, forwarding each
    stream to the next rollout rank of the chain.

    Args:
        params: name -> the rollout model's full, contiguous tensor of that name
            (``dict(model.named_parameters())``, or ``model.state_dict()``); each must have
            the trainer's shape and dtype.
        group_name: the collective of :func:`send_shards`.
        senders: number of trainer ranks.

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
            if changed:
                targets.append(_bytes(target))
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
    return report


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


def _target(params: Mapping[str, Any], piece: Piece) -> Any:
    """The slice of the rollout's tensor that ``piece`` fills (a flat view)."""
    if piece.name not in params:
        raise KeyError(f"the trainer sent {piece.name!r}, which the rollout's parameters lack")
    full = params[piece.name].data
    dtype = str(full.dtype).removeprefix("torch.")
    if tuple(full.shape) != piece.shape or dtype != piece.dtype or not full.is_contiguous():
        raise ValueError(
            f"{piece.name}: the rollout holds a {'' if full.is_contiguous() else 'non-contiguous '}{dtype} "
            f"tensor of shape {tuple(full.shape)}, the trainer a {piece.dtype} one of shape {piece.shape}: "
            "build the rollout model with the trainer's config and dtype"
        )
    return full.reshape(-1)[piece.offset : piece.offset + piece.numel]


def _send_header(member: Any, header: dict, following: int | None) -> int:
    import torch

    if following is None:
        return 0
    payload = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(_device(member))
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=_device(member))
    _send(member, length, following, _HEADER_TAG)
    _send(member, payload, following, _HEADER_TAG + 1)
    return 8 + payload.numel()


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
    """Drop what this process keeps for collective ``group_name`` (delta copies, manifests)."""
    with _lock:
        _previous.pop(group_name, None)
        _received.pop(group_name, None)
