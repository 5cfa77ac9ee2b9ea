"""Normalization layers of the decoder families: RMSNorm (Llama) and LayerNorm with bias (GPT-2)."""

from __future__ import annotations

import torch.nn as nn

from titanlike.models.common.init import ones_, zeros_

NORMS = ("rmsnorm", "layernorm")


def build_norm(kind: str, dim: int, *, eps: float, bias: bool = True) -> nn.Module:
    """kind: rmsnorm | layernorm (bias only applies to layernorm)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    raise ValueError(f"unknown norm {kind!r}; expected one of {NORMS}")


def init_norm(norm: nn.Module) -> None:
    """Identity at init: scale 1, shift 0."""
    ones_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        zeros_(norm.bias)
