"""Position-wise MLPs: SwiGLU (Llama) and GELU (GPT-2, BERT).

Both name their input projection(s) w1 (and w3) and their output projection w2, so one
tensor-parallel rule covers them: inputs split by output features, w2 by input features.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.common.init import LinearInit, zeros_


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.w1.weight, seed=seed, fqn=f"{prefix}w1.weight")
        # w3 feeds the residual stream only through w2, but torchtitan scales it with depth too;
        # we keep that so runs are comparable with theirs.
        init.fill(self.w2.weight, seed=seed, fqn=f"{prefix}w2.weight", output=True)
        init.fill(self.w3.weight, seed=seed, fqn=f"{prefix}w3.weight", output=True)
        for linear in (self.w1, self.w2, self.w3):
            if linear.bias is not None:
                zeros_(linear.bias)


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)); approximate="tanh" is GPT-2's gelu_new, "none" the exact erf GELU."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = True, approximate: str = "tanh"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.w1.weight, seed=seed, fqn=f"{prefix}w1.weight")
        init.fill(self.w2.weight, seed=seed, fqn=f"{prefix}w2.weight", output=True)
        for linear in (self.w1, self.w2):
            if linear.bias is not None:
                zeros_(linear.bias)
