"""DTensors crossing processes: a rank's DTensor travels as its local shard and placement.

A ``torch.distributed.tensor.DTensor`` is one rank's piece of a tensor spread over a device
mesh whose process group lives in the rank's process. torch pickles it with its
``DeviceMesh``, which the driver (or another group's rank) cannot rebuild: it has no such
process group, so unpickling fails there, or a mesh is rebuilt that means nothing. Ray
behaves the same way (a DTensor in an object ref is an error or garbage on the reader).

daskwg's pickler (:mod:`daskwg.serialization.pickling`) sends every DTensor as a
:class:`LocalShard` instead: the rank's local tensor (its own bytes only, never the full
tensor) with the placements, the full tensor's shape and the piece's offset in it, and the
mesh's shape and this rank's coordinate. A sharded state dict (``model.state_dict()`` of an
FSDP2 model, ``get_model_state_dict(...)`` without ``full_state_dict``) therefore arrives as
a dict of ``LocalShard``; join the ranks' pieces with :func:`LocalShard.assemble`, or
return ``dtensor.full_tensor()`` from the rank where the full tensor is what you want.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LocalShard", "reduce_dtensor"]


@dataclass(frozen=True)
class LocalShard:
    """One rank's piece of a DTensor, as it arrives from another process.

    Attributes:
        local: the rank's local tensor (``DTensor.to_local()``), shape ``local_shape``.
        placements: the DTensor's placements (``Shard(dim)``, ``Replicate()``,
            ``Partial()``), one per mesh dimension.
        shape: the full tensor's shape.
        offset: where ``local`` starts in the full tensor, per dimension.
        mesh_shape: the device mesh's shape.
        mesh_coordinate: this rank's coordinate in the mesh (``None`` off the mesh).
        mesh_dim_names: the mesh's dimension names, or ``None``.
    """

    local: torch.Tensor
    placements: tuple
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_coordinate: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None = None

    def to_local(self) -> torch.Tensor:
        """The local tensor (``DTensor.to_local()``'s name)."""
        return self.local

    @staticmethod
    def assemble(pieces: Sequence[LocalShard]) -> torch.Tensor:
        """The full tensor from every rank's piece (``full_tensor()``, in the driver).

        Args:
            pieces: the ``LocalShard`` of each rank of the mesh, in any order; replicated
                pieces may repeat.

        Returns:
            a tensor of shape ``shape``, on the pieces' device.

        Raises:
            ValueError: no pieces, pieces of different tensors, a ``Partial`` placement
                (its pieces are summands: reduce them on the ranks first), or pieces that
                leave part of the tensor unfilled.
        """
        if not pieces:
            raise ValueError("assemble needs at least one LocalShard")
        first = pieces[0]
        if any(p.shape != first.shape or p.local.dtype != first.local.dtype for p in pieces):
            raise ValueError("assemble takes the pieces of one DTensor: their full shapes or dtypes differ")
        if any(type(p).__name__ == "Partial" for p in first.placements):
            raise ValueError(
                f"a DTensor with placements {first.placements} holds partial sums: call "
                "redistribute(placements=[Replicate()]) or full_tensor() on the ranks and return that"
            )
        full = torch.empty(first.shape, dtype=first.local.dtype, device=first.local.device)
        filled = torch.zeros(first.shape, dtype=torch.bool)
        for piece in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.local.shape))
            full[index] = piece.local
            filled[index] = True
        if not bool(filled.all()):
            raise ValueError(
                f"the {len(pieces)} pieces cover {int(filled.sum())} of {filled.numel()} elements of a "
                f"tensor of shape {tuple(first.shape)}: pass the piece of every rank of the mesh"
            )
        return full

    def __repr__(self) -> str:
        return (
            f"LocalShard(local={tuple(self.local.shape)} {self.local.dtype}, placements={self.placements}, "
            f"shape={self.shape}, offset={self.offset}, mesh_coordinate={self.mesh_coordinate})"
        )


def _rebuild(local: torch.Tensor, placements: tuple, *rest: Any) -> LocalShard:
    return LocalShard(local, placements, *rest)


def reduce_dtensor(obj: Any) -> Any:
    """``reducer_override`` for a DTensor (``NotImplemented`` for anything else): the
    :class:`LocalShard` of it, whose ``local`` the pickler then encodes as any tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return NotImplemented
    if not isinstance(obj, DTensor):
        return NotImplemented
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = obj.device_mesh
    _, offset = compute_local_shape_and_global_offset(obj.shape, mesh, obj.placements)
    coordinate = mesh.get_coordinate()
    names = getattr(mesh, "mesh_dim_names", None)
    local = obj.to_local().detach()
    return _rebuild, (
        local,
        tuple(obj.placements),
        tuple(obj.shape),
        tuple(int(o) for o in offset),
        tuple(mesh.shape),
        None if coordinate is None else tuple(coordinate),
        None if names is None else tuple(names),
    )
