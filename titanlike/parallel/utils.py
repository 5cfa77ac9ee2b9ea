"""Small distributed helpers shared by the trainer and the parallelisms."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, *, pp_mesh: DeviceMesh | None = None, foreach: bool | None = None
) -> torch.Tensor:
    """Clip gradients to a total L2 norm over every parameter of every rank; return that norm.

    With FSDP/TP the grads are DTensors and torch's norm is a DTensor whose
    full_tensor() already reduces over their meshes. Pipeline stages hold
    disjoint parameters, so their squared norms are summed over the pp mesh too.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_mesh is not None:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for p in parameters if p.grad is not None],
                                         max_norm, total, foreach=foreach)
    return total


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """All-reduce SUM of a local tensor over a (possibly flattened) mesh; identity when mesh is None."""
    if mesh is None:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value
