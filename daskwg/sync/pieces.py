"""What a sharded sync's pieces are, and where they land: the trainer's side of
:mod:`daskwg.sync.shards` (:func:`local_pieces`: a state dict's local shards and their place
in the full tensors, kept from one sync to the next while they lie where they lay) and the
rollout's (the slice of a parameter a piece fills, checked against the trainer's shape and
dtype, and where a parameter lies, which a delta sync checks).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Piece", "local_pieces"]

_lock = threading.Lock()


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

    # A state dict's DTensors share one mesh: its size and this rank's place in it are
    # asked once per mesh, not once per tensor.
    meshes: dict[int, tuple[int, int, int]] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            mesh, placements = value.device_mesh, value.placements
            known = meshes.get(id(mesh))
            if known is None:
                ndim = mesh.ndim
                known = meshes[id(mesh)] = (ndim, mesh.size(), mesh.get_local_rank() if ndim == 1 else -1)
            ndim, mesh_size, coordinate = known
            if ndim != 1 or not isinstance(placements[0], (Shard, Replicate)):
                raise ValueError(
                    f"{name}: a DTensor on a {ndim}-D mesh with placements {placements}; "
                    "the sharded sync takes Shard(0) or Replicate() on a 1-D mesh (FSDP2's fully_shard): "
                    "reshard it, or send value.full_tensor() as a plain tensor"
                )
            if isinstance(placements[0], Shard) and placements[0].dim != 0:
                raise ValueError(
                    f"{name}: sharded on dim {placements[0].dim}; the sharded sync takes Shard(0) "
                    "(a contiguous slice of the full tensor): redistribute to Shard(0) first"
                )
            with torch.no_grad():  # the local tensor itself, not an autograd op's output
                local = value.to_local()
            if isinstance(placements[0], Replicate):
                if coordinate != 0:
                    continue
                offset = 0
            elif type(placements[0]) is Shard and value.dim():
                # torch.chunk's split of dim 0, as Shard(0) lays it out on a 1-D mesh
                # (cheaper than the general offset computation below, every sync).
                _, first_row = Shard.local_shard_size_and_offset(value.shape[0], mesh_size, coordinate)
                offset = first_row * math.prod(value.shape[1:])
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


def _pieces_of(state_dict: Mapping[str, Any], member: Any, group_name: str) -> list[tuple[Piece, Any]]:
    """``list(local_pieces(state_dict, member.rank))``, or the pieces of this rank's last
    sync on ``group_name`` while ``state_dict`` lays its tensors out as then: the same
    names in the same order, each tensor of the same kind, shape, dtype and placements,
    its local data at the same address (an optimizer steps them in place). Finding a
    piece's layout again costs a DTensor's placements and offset per tensor, every sync;
    ``model.state_dict()`` gives new tensor objects each time (detached aliases), so they
    are compared by layout, not identity. A hit gives the new objects' local tensors."""
    import torch

    with _lock:
        cached = _sent_pieces.get(group_name)
    with torch.no_grad():  # the local tensors themselves, not autograd ops' outputs
        layout = [(name, _layout(value)) for name, value in state_dict.items()]
        if cached is not None and cached[0] is member and cached[1] == layout:
            locals_ = {name: _local(value) for name, value in state_dict.items()}
            return [(piece, locals_[piece.name]) for piece, _ in cached[2]]
        pieces = list(local_pieces(state_dict, member.rank))
    with _lock:
        _sent_pieces[group_name] = (member, layout, [(piece, None) for piece, _ in pieces])
    return pieces


def _layout(value: Any) -> tuple | None:
    """What a piece's layout depends on, of a state dict's value (``None``: not a tensor):
    its kind, global shape, dtype, a DTensor's mesh and placements, and where its (local)
    data is, its local shape and whether it is contiguous."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return None
    if isinstance(value, DTensor):
        local = value.to_local()
        spec = (id(value.device_mesh), value.placements)
    else:
        local, spec = value, None
    return (spec, value.shape, value.dtype, local.data_ptr(), local.shape, local.is_contiguous())


def _local(value: Any) -> Any:
    """A state dict value's local data as :func:`local_pieces` yields it."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().contiguous()


def _bytes(tensor: Any) -> Any:
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _check_kept(name: str, where: tuple, placed: dict, group_name: str) -> None:
    """A delta sync sent nothing for ``name``: this rank's tensor must still hold what the
    last sync left, so it must lie where it lay then (``placed``).

    Raises:
        ValueError: it moved or was replaced (a reload, ``load_state_dict(assign=True)``,
            ``.data = ...``): what the trainer did not send is not there.
    """
    if placed.get(name) != where:
        raise ValueError(
            f"{name}: the trainer sent only what changed (delta=True), but this rollout rank's "
            "tensor is not the one the last sync filled (it moved or was replaced): call "
            f"daskwg.sync.forget({group_name!r}) on every member of the collective, then sync "
            "again (the next sync sends everything)"
        )


def _where(tensor: Any) -> tuple:
    """Where a rollout tensor's elements are: what a layout's ranges depend on."""
    return tensor.data_ptr(), tensor.shape, tensor.dtype, tensor.device, tensor.is_contiguous()


def _target(params: Mapping[str, Any], piece: Piece) -> Any:
    """The slice of the rollout's tensor that ``piece`` fills (a flat view)."""
    full = _full(params, piece)
    return full.reshape(-1)[piece.offset : piece.offset + piece.numel]


def _full(params: Mapping[str, Any], piece: Piece, alias: bool = True) -> Any:
    """The rollout's whole tensor that ``piece`` is part of, checked against the trainer's
    shape and dtype: its ``.data`` (an alias that in-place copies may write, a parameter
    that requires grad included), or with ``alias=False`` the tensor itself (for its
    address and sizes only: no alias made, every piece of every sync).

    Raises:
        KeyError: ``params`` has no such name. ValueError: another shape or dtype, or not
            contiguous.
    """
    if piece.name not in params:
        raise KeyError(f"the trainer sent {piece.name!r}, which the rollout's parameters lack")
    full = params[piece.name].data if alias else params[piece.name]
    dtype = _DTYPE_NAMES.get(full.dtype) or _DTYPE_NAMES.setdefault(
        full.dtype, str(full.dtype).removeprefix("torch.")
    )
    if tuple(full.shape) != piece.shape or dtype != piece.dtype or not full.is_contiguous():
        raise ValueError(
            f"{piece.name}: the rollout holds a {'' if full.is_contiguous() else 'non-contiguous '}{dtype} "
            f"tensor of shape {tuple(full.shape)}, the trainer a {piece.dtype} one of shape {piece.shape}: "
            "build the rollout model with the trainer's config and dtype"
        )
    return full


#: torch dtype -> its name in a header ("float32").
_DTYPE_NAMES: dict[Any, str] = {}


# collective name -> (member, [(name, _layout)] of the state dict, its [(piece, None)])
_sent_pieces: dict[str, tuple[Any, list, list]] = {}
