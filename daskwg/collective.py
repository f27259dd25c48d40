"""Collectives across worker groups: a torch process group over ranks of several groups.

torch allows one default process group per process, and every daskwg group owns its own
(``init_process_group`` in rank code). Weight sync from trainer ranks to rollout ranks, as
verl's checkpoint engine, OpenRLHF and slime do it, needs a process group that spans both
roles next to them. The driver declares one (:func:`create_collective_group`, the shape of
``ray.util.collective.create_collective_group``): daskwg reserves the rendezvous on the
first member's host and every member rank joins, in its worker's call order. Rank code then
uses it by name, with ``ray.util.collective``'s rank-side names (:func:`allreduce`,
:func:`broadcast`, :func:`allgather`, :func:`barrier`, :func:`get_rank`,
:func:`get_collective_group_size`), or takes the torch process group itself
(:func:`get_group`) for any ``torch.distributed`` call with ``group=``.

The process group is not the default group: it is built straight from a ``TCPStore``
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` where every member has a GPU), so it
works next to each group's own default group. It is destroyed with
:meth:`CollectiveGroup.destroy`, and on each member when that member's group is shut down
or its driver leaves. Each collective operation waits at most the collective's ``timeout``:
a member that died or left makes the others' operations raise (a ``RankError`` on the
driver, naming the collective) instead of hanging, and the dead member's own call gives a
``WorkerLostError``.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .wire.messages import Handler

__all__ = [
    "CollectiveGroup",
    "CollectiveSpec",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "create_collective_group",
    "get_collective_group_size",
    "get_group",
    "get_rank",
]

#: The method names of the calls that join and leave a collective on a rank (handled by
#: the host, never looked up on the user's class).
CHECK, JOIN, LEAVE = "__collective_check__", "__collective_join__", "__collective_leave__"
RANK_CALLS = (CHECK, JOIN, LEAVE)

DEFAULT_TIMEOUT = 300.0
_names = itertools.count()


@dataclass(frozen=True)
class CollectiveSpec:
    """What every member needs to join one collective.

    Attributes:
        name: the collective's name (rank code finds it by this name).
        world_size: number of members.
        master_addr: host of member 0's worker, where the ``TCPStore`` listens.
        master_port: the port reserved there.
        backend: ``"gloo"``, ``"nccl"``, or ``None`` (nccl where the member has a GPU, else gloo).
        timeout: seconds each collective operation (and joining) may take.
    """

    name: str
    world_size: int
    master_addr: str
    master_port: int
    backend: str | None
    timeout: float


# ---- the driver's side ------------------------------------------------------------


class CollectiveGroup:
    """A collective over ranks of one or more worker groups, made by
    [`create_collective_group`][daskwg.create_collective_group].

    Attributes:
        name: what rank code passes as ``group_name``.
        world_size: number of members.
        members: ``(group name, group rank)`` of each member, by collective rank.
        backend: what the driver asked for (``None``: per member, nccl with a GPU, else gloo).
    """

    def __init__(self, spec: CollectiveSpec, members: list[tuple[Any, int]]):
        self.name = spec.name
        self.world_size = spec.world_size
        self.backend = spec.backend
        self.spec = spec
        self.members = [(wg.name, rank) for wg, rank in members]
        self._groups = [(weakref.ref(wg), rank) for wg, rank in members]
        self.destroyed = False

    def destroy(self) -> None:
        """Destroy the process group on every member still there (idempotent). Members on
        groups that were shut down, restarted or broken destroyed theirs already."""
        if self.destroyed:
            return
        self.destroyed = True
        by_group: dict[int, tuple[Any, list[int]]] = {}
        for ref, rank in self._groups:
            wg = ref()
            if wg is not None and _usable(wg):
                by_group.setdefault(id(wg), (wg, []))[1].append(rank)
        for wg, ranks in by_group.values():
            try:
                wg._deliver(LEAVE, ranks, [((self.name,), {})] * len(ranks), blocking=True, check=False)
            except Exception:  # noqa: BLE001 - a member that is gone has nothing left to destroy
                pass

    def __enter__(self) -> CollectiveGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "live"
        return f"<CollectiveGroup {self.name!r} world_size={self.world_size} {state}>"


def _usable(wg: Any) -> bool:
    return not (getattr(wg, "_closed", False) or wg.is_broken)


def create_collective_group(
    members: Sequence[Any],
    name: str | None = None,
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> CollectiveGroup:
    """Declare a collective over ranks of several worker groups; every member joins before
    this returns (``ray.util.collective.create_collective_group``'s shape).

    Args:
        members: in collective-rank order, each a ``WorkerGroup`` (all its ranks) or a
            ``(WorkerGroup, ranks)`` pair (``ranks``: an int or a list of group ranks), e.g.
            ``[(trainer, [0]), rollout]``: trainer rank 0 is collective rank 0, the rollout
            ranks follow.
        name: what rank code passes as ``group_name`` (default: a fresh one); unique among
            the collectives alive on the members' workers.
        backend: ``"gloo"``, ``"nccl"``, or ``None`` (each member: nccl where torch sees a
            GPU, else gloo; mixed placements should name one).
        timeout: seconds joining and each collective operation may take before they raise.

    Returns:
        the [`CollectiveGroup`][daskwg.CollectiveGroup] (a context manager that destroys it on exit).

    Raises:
        TypeError: a member is not a worker group, or ``(group, ranks)`` pair.
        ValueError: no members, a rank out of range or named twice, two members on one
            worker process (one process can be one member: a GPU is one NCCL rank), a bad
            backend or timeout.
        RankError: wrapping a ``ValueError``: the name is already in use on a member's
            worker, or ``backend="nccl"`` where a member has no GPU (checked on every
            member before any joins).
        GroupBrokenError: a member group was shut down or is broken.
        RankError, WorkerLostError, CallTimeoutError: as joining failed on a member (the
            members that joined leave again).
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    flat = _members(members)
    addresses: dict[str, tuple[str, int]] = {}
    for wg, rank in flat:
        address = wg.workers[rank]
        if address in addresses:
            other = addresses[address]
            raise ValueError(
                f"{wg.name} rank {rank} and {other[0]} rank {other[1]} are both on worker {address}: "
                "a collective takes one member per worker process; pick ranks on different workers"
            )
        addresses[address] = (wg.name, rank)
    first, first_rank = flat[0]
    client = first._client
    port = client.sync(_reserve_port, client, first.workers[first_rank])
    spec = CollectiveSpec(
        name=name if name is not None else f"collective-{next(_names)}",
        world_size=len(flat),
        master_addr=first._slots[first_rank].host,
        master_port=port,
        backend=backend,
        timeout=float(timeout),
    )
    collective = CollectiveGroup(spec, flat)
    # Every member first says it can join (the name is free there), so that no member
    # waits in the rendezvous for one that refused.
    _on_members(flat, CHECK, spec)
    try:
        _on_members(flat, JOIN, spec)
    except BaseException:
        collective.destroy()
        raise
    return collective


def _on_members(flat: list[tuple[Any, int]], method: str, spec: CollectiveSpec) -> None:
    """Run ``method`` on every member at once (non-blocking calls), then wait for all."""
    futures = []
    for wg, ranks in _by_group(flat):
        payloads = [((spec, flat.index((wg, r))), {}) for r in ranks]
        futures.append((wg, wg._deliver(method, ranks, payloads, blocking=False)))
    for wg, group_futures in futures:
        wg._gather_any(group_futures)


def _members(members: Sequence[Any]) -> list[tuple[Any, int]]:
    if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
        raise ValueError("members must be a non-empty list of worker groups or (group, ranks) pairs")
    flat: list[tuple[Any, int]] = []
    for member in members:
        if isinstance(member, tuple) and len(member) == 2:
            wg, ranks = member
            ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        else:
            wg, ranks = member, None
        if not hasattr(wg, "_deliver") or not hasattr(wg, "world_size"):
            raise TypeError(
                f"a collective member must be a WorkerGroup or a (WorkerGroup, ranks) pair, got {member!r}"
            )
        if getattr(wg, "_closed", False) or wg.is_broken:
            from .errors import GroupBrokenError

            raise GroupBrokenError(f"group {wg.name!r} is shut down or broken: it cannot join a collective")
        for rank in range(wg.world_size) if ranks is None else ranks:
            if not isinstance(rank, int) or not 0 <= rank < wg.world_size:
                raise ValueError(f"rank {rank!r} of group {wg.name!r} is out of range 0..{wg.world_size - 1}")
            if (wg, rank) in flat:
                raise ValueError(f"{wg.name} rank {rank} is named twice among the collective's members")
            flat.append((wg, rank))
    return flat


def _by_group(flat: list[tuple[Any, int]]) -> list[tuple[Any, list[int]]]:
    groups: dict[int, tuple[Any, list[int]]] = {}
    for wg, rank in flat:
        groups.setdefault(id(wg), (wg, []))[1].append(rank)
    return list(groups.values())


async def _reserve_port(client: Any, address: str) -> int:
    return await getattr(client.rpc(address), Handler.RESERVE_PORT)(port=None)


# ---- the ranks' side ----------------------------------------------------------------


@dataclass
class _Member:
    spec: CollectiveSpec
    rank: int
    group_id: str
    store: Any
    group: Any
    backend: str = "gloo"


_lock = threading.Lock()
_joined: dict[str, _Member] = {}


def rank_call(method: str, group_id: str, *args: Any) -> None:
    """Run a check, join or leave call on this rank (the host calls it for :data:`RANK_CALLS`)."""
    if method == CHECK:
        _check(args[0].name, args[0].backend)
    elif method == JOIN:
        _join(group_id, *args)
    else:
        _leave(*args)


def _check(name: str, backend: str | None = None) -> None:
    with _lock:
        if name in _joined:
            raise ValueError(
                f"a collective named {name!r} already exists in this worker process: "
                "destroy it first, or pick another name"
            )
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL")):
            raise ValueError(
                "backend='nccl' needs a GPU and NCCL on every member; this worker has none: use 'gloo'"
            )


def _join(group_id: str, spec: CollectiveSpec, rank: int) -> None:
    import torch
    import torch.distributed as dist

    _check(spec.name)
    timeout = datetime.timedelta(seconds=spec.timeout)
    backend = spec.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"daskwg-collective/{spec.name}/", store)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    with _lock:
        _joined[spec.name] = _Member(spec, rank, group_id, store, group, backend)


def _leave(name: str) -> None:
    with _lock:
        member = _joined.pop(name, None)
    if member is not None:
        _destroy(member)


def forget_group(group_id: str) -> None:
    """Destroy the collectives a rank of ``group_id`` joined in this process (its group
    was shut down, or its driver left)."""
    with _lock:
        gone = [n for n, m in _joined.items() if m.group_id == group_id]
        members = [_joined.pop(n) for n in gone]
    for member in members:
        _destroy(member)


def _destroy(member: _Member) -> None:
    shutdown = getattr(member.group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass
    member.group = member.store = None


def _member(group_name: str) -> _Member:
    with _lock:
        member = _joined.get(group_name)
    if member is None:
        raise ValueError(
            f"this rank is not a member of a collective named {group_name!r} "
            f"(members here: {sorted(_joined) or 'none'}); create it in the driver with "
            "daskwg.create_collective_group([...], name=...)"
        )
    return member


def get_group(group_name: str) -> Any:
    """The torch process group of collective ``group_name``, for any ``torch.distributed``
    call that takes ``group=`` (called in rank code).

    Args:
        group_name: the collective's name, as given to
            [`create_collective_group`][daskwg.collective.create_collective_group].

    Returns:
        a ``torch.distributed.ProcessGroup`` (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)
        whose ranks are the collective ranks, not the group's own ranks.

    Raises:
        ValueError: this rank is not a member of such a collective (the message lists the
            ones it is a member of).
    """
    return _member(group_name).group


def get_rank(group_name: str) -> int:
    """This rank's rank in collective ``group_name``, as ``ray.util.collective.get_rank``
    (called in rank code).

    Args:
        group_name: the collective's name.

    Returns:
        the collective rank, ``0 .. get_collective_group_size(group_name) - 1``: the
        member's position in ``create_collective_group``'s list, groups expanded rank by rank.

    Raises:
        ValueError: this rank is not a member of such a collective.
    """
    return _member(group_name).rank


def get_collective_group_size(group_name: str) -> int:
    """The number of members of collective ``group_name``, as
    ``ray.util.collective.get_collective_group_size`` (called in rank code).

    Args:
        group_name: the collective's name.

    Returns:
        the number of member ranks.

    Raises:
        ValueError: this rank is not a member of such a collective.
    """
    return _member(group_name).spec.world_size


def _agree(member: _Member, what: str, tensor: Any, *extra: Any) -> None:
    """Check that every member called ``what`` with the same shape, dtype and arguments
    (one small all-gather first): gloo gives wrong values, or aborts the process, when they
    differ. Raises ``ValueError`` on every member, naming this member's call."""
    import zlib

    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    mine = f"{what} {tensor.dtype} {tuple(tensor.shape)} {extra}"
    code = torch.tensor([zlib.crc32(mine.encode())], dtype=torch.int64)
    codes = [torch.empty_like(code) for _ in range(member.spec.world_size)]
    _wait(member, member.group.allgather([codes], [code]), what)
    differ = [r for r, c in enumerate(codes) if int(c) != int(codes[0])]
    if differ:
        raise ValueError(
            f"{what} on collective {member.spec.name!r}: members called it differently (collective ranks "
            f"{differ} differ from rank 0); this member (rank {member.rank}) called {mine}: every member "
            "must pass a tensor of the same shape and dtype, and the same src_rank / op"
        )


def _contiguous(tensor: Any, run: Any) -> Any:
    """Run ``run`` on ``tensor``, or on a contiguous copy copied back (gloo reads and writes
    a tensor's storage as if it were contiguous)."""
    if tensor.is_contiguous():
        return run(tensor)
    dense = tensor.contiguous()
    result = run(dense)
    tensor.copy_(dense)
    return result


def _wait(member: _Member, work: Any, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=member.spec.timeout))
    except Exception as exc:  # noqa: BLE001 - gloo's and nccl's errors are RuntimeErrors
        raise RuntimeError(
            f"{what} on collective {member.spec.name!r} (rank {member.rank} of {member.spec.world_size}) "
            f"failed: a member died, left, or did not join in {member.spec.timeout:g} s: {exc}"
        ) from None


def allreduce(tensor: Any, group_name: str, op: Any = None) -> Any:
    """Reduce ``tensor`` in place over the collective's members (default op: sum).

    Args:
        tensor: a ``torch.Tensor`` of the same shape and dtype on every member.
        group_name: the collective's name.
        op: a ``torch.distributed.ReduceOp`` (default ``SUM``).

    Returns:
        ``tensor``, holding the reduction.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: not a member, or members passed different shapes, dtypes or ops.
        RuntimeError: a member failed, left, or the collective's ``timeout`` passed.
    """
    import torch.distributed as dist

    member = _member(group_name)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM if op is None else op
    _agree(member, "allreduce", tensor, "SUM" if op is None else getattr(op, "name", repr(op)))
    _contiguous(tensor, lambda t: _wait(member, member.group.allreduce([t], options), "allreduce"))
    return tensor


def broadcast(tensor: Any, src_rank: int, group_name: str) -> Any:
    """Send ``tensor`` from collective rank ``src_rank`` to every member, in place.

    Args:
        tensor: a ``torch.Tensor``; same shape and dtype on every member (the others' is
            overwritten).
        src_rank: the collective rank that sends.
        group_name: the collective's name.

    Returns:
        ``tensor``.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: not a member, ``src_rank`` out of range, or members passed different
            shapes, dtypes or ``src_rank``.
        RuntimeError: a member failed, left, or the collective's ``timeout`` passed.
    """
    import torch
    import torch.distributed as dist

    member = _member(group_name)
    if not 0 <= src_rank < member.spec.world_size:
        raise ValueError(f"src_rank {src_rank} is out of range 0..{member.spec.world_size - 1}")
    _agree(member, "broadcast", tensor, src_rank)
    if member.backend == "gloo" and tensor.nbytes >= CHAIN_ABOVE:
        _contiguous(tensor, lambda t: _chain_broadcast(member, t.view(-1).view(torch.uint8), src_rank))
        return tensor
    options = dist.BroadcastOptions()
    options.rootRank = src_rank
    _contiguous(tensor, lambda t: _wait(member, member.group.broadcast([t], options), "broadcast"))
    return tensor


#: Bytes from which gloo broadcasts go along a chain of the members, in chunks of
#: :data:`CHAIN_CHUNK` bytes: gloo's own broadcast sends the whole tensor from the source
#: to every member (the source's egress would be ``world_size - 1`` times the tensor); along
#: the chain each member forwards chunk ``k`` while it receives chunk ``k + 1``, so the source
#: sends it once and the time approaches one transfer plus a chunk per member.
CHAIN_ABOVE = 1 << 20
CHAIN_CHUNK = 4 << 20


def _chain_broadcast(member: _Member, flat: Any, src_rank: int) -> None:
    size = member.spec.world_size
    position = (member.rank - src_rank) % size
    previous = (member.rank - 1) % size if position else None
    following = (member.rank + 1) % size if position < size - 1 else None
    sends = []
    for tag, start in enumerate(range(0, flat.numel(), CHAIN_CHUNK)):
        chunk = flat[start : start + CHAIN_CHUNK]
        if previous is not None:
            _wait(member, member.group.recv([chunk], previous, tag), "broadcast")
        if following is not None:
            sends.append(member.group.send([chunk], following, tag))
    for work in sends:
        _wait(member, work, "broadcast")


def allgather(tensor: Any, group_name: str) -> list:
    """Every member's ``tensor``, in collective-rank order, as
    ``ray.util.collective.allgather`` (which fills a list given to it) returns them.

    Args:
        tensor: a ``torch.Tensor`` of the same shape and dtype on every member.
        group_name: the collective's name.

    Returns:
        a list of ``get_collective_group_size(group_name)`` new tensors shaped as
        ``tensor``; entry ``r`` is collective rank ``r``'s.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.
        ValueError: not a member, or members passed different shapes or dtypes.
        RuntimeError: a member failed, left, or the collective's ``timeout`` passed.
    """
    import torch

    member = _member(group_name)
    _agree(member, "allgather", tensor)
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(member.spec.world_size)]
    _wait(member, member.group.allgather([out], [tensor]), "allgather")
    return out


def barrier(group_name: str) -> None:
    """Wait until every member of collective ``group_name`` reached this barrier, as
    ``ray.util.collective.barrier``.

    Args:
        group_name: the collective's name.

    Raises:
        ValueError: this rank is not a member of such a collective.
        RuntimeError: a member failed, left, or the collective's ``timeout`` passed.
    """
    import torch

    # An all-reduce of one element: gloo's barrier() takes no timeout of its own.
    allreduce(torch.zeros(1), group_name)
