"""This rank's part of a tensor that tensor or expert parallelism may have made a DTensor, for model
code that runs with and without parallelism. torch.distributed.tensor is imported at the first call,
not with the model code: it costs about 0.6 s of CPU at every start, `train.py --help` included
(docs/performance.md), and only a parallelized model holds DTensors."""

from __future__ import annotations

import torch


def is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """t's shard on this rank when t is a DTensor, else t itself (None stays None)."""
    return t.to_local() if is_dtensor(t) else t


def local_rows(p: torch.Tensor) -> slice:
    """The global rows (dim 0) of p that this rank holds: all of them unless p is a DTensor (FSDP2
    and tensor parallelism shard rows alike)."""
    if not is_dtensor(p):
        return slice(0, p.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[0], offset[0] + shape[0])


def local_part_in_place(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t's shard on this rank, set into zeros of t's whole size along dim at the shard's offset (the
    other dimensions stay this rank's): a bias added to partial sums that ranks holding different
    slices of dim add up, so that the sum holds it once. t itself when it is not a DTensor."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    after = t.shape[dim] - offset[dim] - shape[dim]
    pad = [0, 0] * (local.ndim - 1 - dim % local.ndim) + [offset[dim], after]
    return torch.nn.functional.pad(local, pad)


@torch.no_grad()
def scale_rows_(p: torch.Tensor | None, factor: torch.Tensor) -> None:
    """Multiply each row of p in place by factor (one entry per global row), on this rank's shard."""
    if p is None:
        return
    local = local_part(p)
    f = factor[local_rows(p)].to(device=local.device, dtype=local.dtype)
    local.mul_(f.view(-1, *[1] * (local.ndim - 1)))


__all__ = ["is_dtensor", "local_part", "local_part_in_place", "local_rows", "scale_rows_"]
