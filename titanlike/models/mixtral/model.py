"""Mixtral (MixtralForCausalLM): a Llama-like decoder whose every MLP is a mixture of experts.

The module tree is Qwen3-MoE's without QK-norm and with head_dim = dim / n_heads: the shared MoE
decoder (models/common/moe_decoder.py); only the args differ. Routing: softmax over all experts,
top-k, the k gate values renormalized (HF's MixtralSparseMoeBlock), i.e. MoEArgs(score_func="softmax",
route_norm=True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlike.models.common.decoder import DecoderArgs
from titanlike.models.common.moe_decoder import MoEDecoder


@dataclass
class MixtralModelArgs(DecoderArgs):
    rope_theta: float = 1_000_000.0  # (moe, inherited, is required: every layer is MoE)

    # What the MoE decoder reads: no QK-norm, and no dense layers (so no ffn_hidden_dim).
    qk_norm: ClassVar[bool] = False
    ffn_hidden_dim: ClassVar[None] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe is None:
            raise ValueError("Mixtral args need moe (every layer is a mixture of experts)")
        if self.moe.first_k_dense or self.moe.layer_freq != 1:
            raise ValueError("Mixtral has a mixture of experts in every layer: set moe first_k_dense 0 and layer_freq 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        block = self.attention_params() + self.moe.params(self.dim, active=active) + 2 * self.dim
        return self.n_layers * block + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)


class Mixtral(MoEDecoder):
    """Mixtral: tokens (batch, seq) -> logits (batch, seq, vocab_size); the shared MoE decoder on Mixtral's args."""
