"""QK-clip (MuonClip, the Kimi K2 report): keep attention logits below a threshold by rescaling the
query and key projections of the heads that exceeded it.

During each training forward every clipped attention (models/common/attention.py) raises its
`logit_max`, a device tensor of its query heads' largest logit q.k / sqrt(head_dim), in place: no
host sync. After the optimizer step, `QKClip.apply` reduces them over the ranks that saw other
tokens (data parallel and context parallel: one all-reduce MAX of every layer's heads together) and
over tensor parallelism (each tp rank holds its own heads: a second MAX fills in the others), and
for a head h whose max m_h exceeded tau, with gamma_h = tau / m_h:
  - the query rows of h (weight and bias) are multiplied by sqrt(gamma_h);
  - the key rows of a key head g shared by the query heads G (grouped-query attention) are
    multiplied by sqrt(min over G of gamma_h): the group's largest logit decides, so every head of
    the group ends at or under tau; a head of the group that stayed under it shrinks by at most
    the square root of the group's factor.
On the step's own batch the scaled logits are gamma_h x m_h <= tau (exactly, before rounding; RoPE
is a rotation and commutes). Kimi K2's MLA rule (only the per-head q_nope / k_nope parts get the
square root, q_rope the whole factor, the shared rope key untouched) has no counterpart here: plan_job
refuses QK-clip for a model without this attention (train/plan.py), and for QK-norm, which undoes any
scaling of the projections. The scaling acts on each rank's local rows of the weights (FSDP2 and TP
shards alike), from their global offsets; a step the optimizer skipped (non-finite) scales nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titanlike.models.common.attention import Attention


def clipped_attentions(model: nn.Module) -> list[tuple[str, Attention]]:
    """(block key, attention) of the attention layers QK-clip measures and rescales: the shared
    Attention running its own forward (subclasses with another forward do not record logits)."""
    return [(key, m) for key, block in model.layers.items() for m in block.modules()
            if isinstance(m, Attention) and type(m).forward is Attention.forward]


def validate_qk_clip(model: nn.Module, *, cp: int) -> None:
    """Plan-time rules of optimizer.qk_clip_threshold against the model (on the meta device)."""
    found = clipped_attentions(model)
    if not found:
        raise ValueError("optimizer.qk_clip_threshold rescales the heads of the shared multi-head attention "
                         "(models/common/attention.py) and this model has none (multi-head latent attention, as "
                         "DeepSeek-V3's, is not covered)")
    if any(m.q_norm is not None for _, m in found):
        raise ValueError("optimizer.qk_clip_threshold cannot bound this model's logits: its QK-norm normalises q "
                         "and k after the projections it would scale, and already keeps the logits bounded")
    if cp > 1:
        raise ValueError("optimizer.qk_clip_threshold does not run with context parallelism (a rank's attention "
                         "sees the other ranks' keys only inside its kernel); set context_parallel_degree 1")


def _rows(p: torch.Tensor) -> slice:
    """The global rows (dim 0) of a parameter this rank holds."""
    if not isinstance(p, DTensor):
        return slice(0, p.shape[0])
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[0], offset[0] + shape[0])


class QKClip:
    """See the module docstring. Built by the trainer after the weights are on the device; `apply` is
    called by the training step after each optimizer step.

    data_mesh: the ranks holding the same heads and other tokens (ParallelDims' "loss" mesh), tp_mesh:
    the ranks holding other heads; None where absent."""

    def __init__(self, model_parts: list[nn.Module], threshold: float, *, data_mesh=None, tp_mesh=None):
        self.threshold = threshold
        self.layers = [(int(key), m) for part in model_parts for key, m in clipped_attentions(part)]
        self.data_group = data_mesh.get_group() if data_mesh is not None else None
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        tp, self.tp_rank = (tp_mesh.size(), tp_mesh.get_local_rank()) if tp_mesh is not None else (1, 0)
        self.heads = []  # (query heads, key heads) of each layer, over all tp ranks
        for _, m in self.layers:
            heads, kv_heads = m.wq.weight.shape[0] // m.head_dim, m.wk.weight.shape[0] // m.head_dim
            self.heads.append((heads, kv_heads))
            local = m.wq.weight.to_local() if isinstance(m.wq.weight, DTensor) else m.wq.weight
            m.logit_max = torch.full((heads // tp,), float("-inf"), device=local.device)

    @torch.no_grad()
    def apply(self, finite: torch.Tensor) -> torch.Tensor:
        """Rescale the heads over the threshold (none where `finite` is False), start the next step's
        maxima, and return each layer's largest logit (len(self.layers),) for the metrics."""
        maxes = []
        for (heads, _), (_, m) in zip(self.heads, self.layers):
            local = m.logit_max.numel()
            full = torch.full((heads,), float("-inf"), device=m.logit_max.device)
            full[self.tp_rank * local:(self.tp_rank + 1) * local] = m.logit_max
            maxes.append(full)
            m.logit_max.fill_(float("-inf"))
        if not maxes:
            return finite.new_zeros(0, dtype=torch.float32)
        flat = torch.cat(maxes)
        for group in (self.data_group, self.tp_group):
            if group is not None:
                dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        # gamma = tau / max where the max exceeded tau (1 elsewhere, and on a skipped step).
        gamma = torch.where((flat > self.threshold) & finite.to(flat.device),
                            self.threshold / flat, torch.ones_like(flat))
        start = 0
        for (heads, kv_heads), (_, m) in zip(self.heads, self.layers):
            g = gamma[start:start + heads]
            start += heads
            q_factor = g.sqrt().repeat_interleave(m.head_dim)
            k_factor = g.view(kv_heads, -1).amin(1).sqrt().repeat_interleave(m.head_dim)
            for linear, factor in ((m.wq, q_factor), (m.wk, k_factor)):
                for p in (linear.weight, linear.bias):
                    if p is not None:
                        local = p.to_local() if isinstance(p, DTensor) else p
                        f = factor[_rows(p)].to(local.dtype)
                        local.mul_(f.view(-1, *[1] * (local.ndim - 1)))
        return torch.stack([x.max() for x in flat.split([heads for heads, _ in self.heads])])

    def summary(self, max_logits: torch.Tensor, num_layers: int) -> dict[str, float]:
        """The metrics of a log step: attention/layer{i}/max_logit of every clipped layer and their
        largest, attention/max_logit. One all-reduce MAX over every rank (pipeline stages hold other
        layers), so every rank calls it, on log steps only."""
        table = torch.full((num_layers,), float("-inf"), device=max_logits.device)
        if self.layers:
            table[torch.tensor([i for i, _ in self.layers], device=table.device)] = max_logits
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        values = table.tolist()
        out = {f"attention/layer{i}/max_logit": v for i, v in enumerate(values) if v != float("-inf")}
        return out | ({"attention/max_logit": max(out.values())} if out else {})
