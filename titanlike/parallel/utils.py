"""Small distributed helpers shared by the trainer and the parallelisms."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, *, pp_mesh: DeviceMesh | None = None, exclude: frozenset[int] = frozenset(),
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients to a total L2 norm over every parameter of every rank; return that norm.

    With FSDP/TP the grads are DTensors whose norm's full_tensor() already reduces over their
    mesh. Grads on different meshes (e.g. dense and expert parameters) cannot meet in one
    DTensor op, so each mesh's squared norm is taken apart and the squares are added. Pipeline
    stages hold disjoint parameters, so their squares are summed over the pp mesh too.
    exclude: ids of parameters whose gradient is a copy of one counted elsewhere (the last
    stage's copy of a tied embedding); they are clipped but not counted.
    """
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if id(p) not in exclude:
            by_mesh.setdefault(_mesh_of(p.grad), []).append(p.grad)
    total = torch.zeros((), device=params[0].grad.device if params else "cpu")
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.float() ** 2
    if pp_mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total.sqrt()
    clip_by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        clip_by_mesh.setdefault(_mesh_of(p.grad), []).append(p)
    # A non-finite norm leaves the gradients as they are (clipping by it would make every one of
    # them nan and hide which parameter went bad); the caller decides to stop or skip the step.
    clip_by = torch.where(total.isfinite(), total, torch.zeros_like(total))
    for group in clip_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, clip_by, foreach=foreach)
    return total


@torch.no_grad()
def scale_gradients(parameters, factor: torch.Tensor | float) -> None:
    """Multiply every gradient by factor, in place (on the local shard of a DTensor gradient, which
    scales the whole tensor whatever its placement)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if grads:
        if isinstance(factor, torch.Tensor):
            # Gradients offloaded to the host (FSDP CPU offload) are scaled by a host copy.
            factor = factor.to(grads[0].device)
        torch._foreach_mul_(grads, factor)


def _mesh_of(t: torch.Tensor):
    return t.device_mesh if isinstance(t, DTensor) else None


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """All-reduce SUM of a local tensor over a (possibly flattened) mesh; identity when mesh is None."""
    if mesh is None:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value
