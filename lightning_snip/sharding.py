"""FSDP2's DTensors seen from a statistics round: sharded or not, whole or this rank's part."""

from __future__ import annotations

import torch


def is_sharded(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or optimizer state sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (a collective: every rank must call it in the same
    order), anything else as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_part(full: torch.Tensor, like) -> torch.Tensor:
    """The part of ``full`` (a whole-parameter-shaped tensor of this rank) that this rank's shard of
    ``like`` (a DTensor) holds; ``full`` itself when ``like`` is not sharded."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def from_local_parts(local: torch.Tensor, like) -> torch.Tensor:
    """The whole tensor whose shards (one per rank, as ``like`` is sharded) are every rank's
    ``local``: one all-gather. ``local`` itself when ``like`` is not sharded."""
    if not is_sharded(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.contiguous(), like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride()).full_tensor()


def all_reduce_sum(values: torch.Tensor, like) -> torch.Tensor:
    """``values`` summed over the ranks that shard ``like`` (unchanged when it is not sharded)."""
    if not is_sharded(like):
        return values
    import torch.distributed as dist

    out = values.clone()
    dist.all_reduce(out, group=like.device_mesh.get_group())
    return out
