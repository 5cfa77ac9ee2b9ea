"""QK-clip (MuonClip, the Kimi K2 report): keep attention logits below a threshold by rescaling the
query and key projections of the heads that exceeded it.

The attentions it clips implement a small protocol (`ClippedAttention`): the shared multi-head
attention (models/common/attention.py) and DeepSeek-V3's multi-head latent attention
(models/deepseek_v3/attention.py). During each training forward every clipped attention raises its
`logit_max`, a device tensor of its query heads' largest logit q.k / sqrt(head_dim), in place: no
host sync. After the optimizer step, `QKClip.apply` reduces them over the ranks that saw other
tokens (data parallel and context parallel: one all-reduce MAX of every layer's heads together) and
over tensor parallelism (each tp rank holds its own heads: a second MAX fills in the others), and
hands each attention gamma_h = tau / m_h for the heads h whose max m_h exceeded tau (1 for the
others), which it applies to its own projections by its rule: for the shared attention the query
rows of h and the rows of its key head take square roots (a key head shared by a group of query heads
follows the group's smallest gamma); for MLA q_nope and k_nope take square roots, q_rope the whole
gamma, the shared RoPE key nothing. On the step's own batch the scaled logits are then
gamma_h x m_h <= tau (exactly, before rounding; RoPE is a rotation and commutes). plan_job refuses
QK-clip for a model with no such attention (train/plan.py), and for QK-norm, which undoes any
scaling of the projections. The scaling acts on each rank's local rows of the weights (FSDP2 and TP
shards alike), from their global offsets; a step the optimizer skipped (non-finite) scales nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlike.models import protocol
from titanlike.models.common.dtensor import local_part


class ClippedAttention(Protocol):
    """What QK-clip needs of an attention module: the `logit_max` buffer its training forward raises
    when set (None: off), whether it normalises q and k after their projections, and the rescaling
    of its own parameters' local rows given every query head's gamma."""

    logit_max: torch.Tensor | None
    has_qk_norm: bool

    def qk_clip_heads(self) -> int | None:
        """The query heads over all tensor-parallel ranks, or None where the forward records no logits."""

    def scale_qk_heads_(self, gamma: torch.Tensor) -> None:
        """Rescale the heads by gamma (heads,) in place (1: unchanged)."""


def clipped_attentions(model: nn.Module) -> list[tuple[str, ClippedAttention]]:
    """(block key, attention) of the attention layers QK-clip measures and rescales: the modules
    implementing ClippedAttention whose forward records logits."""
    return [(key, m) for key, block in model.layers.items() for m in block.modules()
            if protocol.qk_clip_heads(m) is not None]


def validate_qk_clip(model: nn.Module, *, cp: int) -> None:
    """Plan-time rules of optimizer.qk_clip_threshold against the model (on the meta device)."""
    found = clipped_attentions(model)
    if not found:
        raise ValueError("optimizer.qk_clip_threshold rescales the heads of the shared multi-head attention "
                         "(models/common/attention.py) or DeepSeek-V3's multi-head latent attention, and this "
                         "model has neither")
    if any(m.has_qk_norm for _, m in found):
        raise ValueError("optimizer.qk_clip_threshold cannot bound this model's logits: its QK-norm normalises q "
                         "and k after the projections it would scale, and already keeps the logits bounded")
    if cp > 1:
        raise ValueError("optimizer.qk_clip_threshold does not run with context parallelism (a rank's attention "
                         "sees the other ranks' keys only inside its kernel); set context_parallel_degree 1")


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
        self.heads = []  # query heads of each layer, over all tp ranks
        for _, m in self.layers:
            heads = m.qk_clip_heads()
            self.heads.append(heads)
            device = local_part(next(m.parameters())).device
            m.logit_max = torch.full((heads // tp,), float("-inf"), device=device)

    @torch.no_grad()
    def apply(self, finite: torch.Tensor) -> torch.Tensor:
        """Rescale the heads over the threshold (none where `finite` is False), start the next step's
        maxima, and return each layer's largest logit (len(self.layers),) for the metrics."""
        maxes = []
        for heads, (_, m) in zip(self.heads, self.layers):
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
        for g, (_, m) in zip(gamma.split(self.heads), self.layers):
            m.scale_qk_heads_(g)
        return torch.stack([x.max() for x in flat.split(self.heads)])

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
