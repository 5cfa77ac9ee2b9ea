"""Small distributed helpers shared by the trainer and the parallelisms."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from titanlike.models.common.dtensor import is_dtensor, local_part

# torch 2.13 renamed the differentiable all-gather and reduce-scatter (the old names warn at every call);
# the older torch of a GPU box has only the old names.
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
reduce_scatter_autograd = (getattr(funcol, "reduce_scatter_single_autograd", None)
                           or funcol.reduce_scatter_tensor_autograd)


@dataclass
class GradNorm:
    """The global gradient norm of a step (before clipping), and where it first went non-finite.

    total: the L2 norm over every gradient of every rank, the same value on every rank.
    nonfinite_at: a device tensor, so that locating a bad gradient costs no host read until someone
    asks (nonfinite_param): the position in `order` of a parameter of this rank whose local gradient
    (its shard under FSDP/TP) holds inf or nan, -1 when none does.
    order: parameter indices (in the order given to clip_grad_norm_) in the order they were measured.
    """

    total: torch.Tensor
    nonfinite_at: torch.Tensor
    order: list[int]
    factor: torch.Tensor | None = None  # scale=False: the multiplier the gradients still need

    def nonfinite_param(self) -> int | None:
        """Index of this rank's parameter whose gradient was non-finite, or None (reads the device)."""
        at = int(self.nonfinite_at)
        return None if at < 0 else self.order[at]


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, *, pp_mesh: DeviceMesh | None = None, exclude: frozenset[int] = frozenset(),
    prescale: torch.Tensor | float = 1.0, scale: bool = True,
) -> GradNorm:
    """Scale the gradients by `prescale`, clip them to a total L2 norm of max_norm over every
    parameter of every rank, and return that norm (of the scaled gradients, before clipping).
    scale=False leaves the gradients as they are and returns the multiplier in `factor`, for an
    optimizer that applies it in its own pass (fused AdamW's grad_scale: titanlike/train/step.py).

    prescale folds the step's one division of the gradients (by the global target count, or by the
    loss scale) into the clipping multiplication: one pass over the gradients instead of two.

    With FSDP/TP the grads are DTensors whose norm's full_tensor() already reduces over their
    mesh. Grads on different meshes (e.g. dense and expert parameters) cannot meet in one
    DTensor op, so each mesh's squared norm is taken apart and the squares are added. Pipeline
    stages hold disjoint parameters, so their squares are summed over the pp mesh too.
    exclude: ids of parameters whose gradient is a copy of one counted elsewhere (the last
    stage's copy of a tied embedding); they are clipped but not counted.

    The per-parameter norms come from one foreach kernel per (mesh, device, dtype) group, as in
    torch.nn.utils.get_total_norm; keeping their local parts also locates a non-finite gradient
    at no extra cost. Nothing is read back to the host.
    """
    params = list(parameters)
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.grad is not None and id(p) not in exclude:
            g = p.grad
            groups.setdefault((_mesh_of(g), g.device, g.dtype), []).append(i)
    total = torch.zeros((), device=device)
    local_norms = []
    for indices in groups.values():
        norms = torch.stack(torch._foreach_norm([params[i].grad for i in indices], 2.0))
        local_norms.append(local_part(norms).float().to(device))
        norm = torch.linalg.vector_norm(norms, 2.0)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        total = total + norm.float().to(device) ** 2
    if pp_mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    total = total.sqrt() * prescale
    nonfinite_at = torch.full((), -1, device=device)
    if local_norms:
        bad = ~torch.cat(local_norms).isfinite()
        nonfinite_at = torch.where(bad.any(), bad.int().argmax(), nonfinite_at)
    # torch's clip_grads_with_norm_ coefficient. A non-finite norm does not clip (clipping by it
    # would make every gradient nan); the step that follows is skipped anyway.
    clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    factor = torch.where(total.isfinite(), clip, torch.ones_like(clip)) * prescale
    order = [i for indices in groups.values() for i in indices]
    if not scale:
        return GradNorm(total, nonfinite_at, order, factor)
    scale_gradients(params, factor)
    return GradNorm(total, nonfinite_at, order)


@torch.no_grad()
def scale_gradients(parameters, factor: torch.Tensor | float) -> None:
    """Multiply every gradient by factor, in place (on the local shard of a DTensor gradient, which
    scales the whole tensor whatever its placement)."""
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    if grads:
        if isinstance(factor, torch.Tensor):
            # Gradients offloaded to the host (FSDP CPU offload) are scaled by a host copy.
            factor = factor.to(grads[0].device)
        torch._foreach_mul_(grads, factor)


def _mesh_of(t: torch.Tensor):
    return t.device_mesh if is_dtensor(t) else None


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """All-reduce SUM of a local tensor over a (possibly flattened) mesh; identity when mesh is None."""
    if mesh is None:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value


class _SumForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, mesh):
        return sum_over(value, mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_for_replicated_loss(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """All-reduce SUM over `mesh` whose backward passes the gradient through unchanged: for partial
    sums that every rank of the mesh completes and feeds into the same loss, which each rank then
    differentiates (each rank's own part gets the loss's gradient once). Identity when mesh is None."""
    return value if mesh is None else _SumForward.apply(value, mesh)


def first_rank_of(*meshes: DeviceMesh | None) -> bool:
    """Whether this rank is the first of each mesh given (None: a degree-1 dimension, always first).
    A value replicated over those meshes is counted once in a sum over all ranks by contributing it
    only where this is True."""
    return all(mesh is None or mesh.get_local_rank() == 0 for mesh in meshes)


def sum_over_world(value: torch.Tensor) -> torch.Tensor:
    """All-reduce SUM over every rank (the default group); identity in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
