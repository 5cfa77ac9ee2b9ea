"""The Qwen3 decoder, dense (Qwen3ForCausalLM) and mixture of experts (Qwen3MoeForCausalLM).

Llama-like pre-norm blocks (RMSNorm, grouped-query attention with RoPE, SwiGLU, no biases) with
two differences: QK-norm (an RMSNorm over each head's q and k before RoPE) and a head_dim of its
own (128 at every width). In the MoE models the MLP of the layers `moe.is_moe_layer` picks is a
routed mixture of experts (softmax scores, top-k, renormalized when norm_topk_prob is set); the
other layers keep a dense SwiGLU of ffn_hidden_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from titanlike.models.common.attention import Attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import Decoder, DecoderArgs
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.init import LinearInit
from titanlike.models.common.moe import MoE
from titanlike.models.common.rope import precompute_rope_cache

# Standard deviation of the input projections (and of the output projections before depth
# scaling), as for Llama.
_BASE_INIT_STD = 0.02


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 3072  # SwiGLU hidden size of the dense layers (HF intermediate_size)
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True

    hf_model_type = "qwen3"
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3", "qwen3_moe")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    def block_params(self, layer_id: int, *, active: bool = False) -> int:
        """Parameters of one block: attention (+ QK-norm), the MLP or MoE, two norms."""
        attention = self.attention_params() + (2 * self.head_dim if self.qk_norm else 0)
        if self.moe is not None and self.moe.is_moe_layer(layer_id):
            mlp = self.moe.params(self.dim, active=active)
        else:
            mlp = 3 * self.dim * self.ffn_hidden_dim
        return attention + mlp + 2 * self.dim

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        blocks = sum(self.block_params(i, active=active) for i in range(self.n_layers))
        return blocks + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)

    def to_hf_config(self, *, max_position_embeddings: int | None = None) -> dict:
        from titanlike.models.qwen3.hf_adapter import args_to_hf_config

        return args_to_hf_config(self, max_position_embeddings=max_position_embeddings)

    @classmethod
    def from_hf_config(cls, config: dict) -> Qwen3ModelArgs:
        from titanlike.models.qwen3.hf_adapter import args_from_hf_config

        return args_from_hf_config(config)


class Qwen3(Decoder):
    """Qwen3 / Qwen3-MoE: tokens (batch, seq) -> logits (batch, seq, vocab_size).

    Families with the same module tree (Mixtral: no QK-norm, every layer MoE) reuse it; their
    args provide dim, n_heads, num_kv_heads, head_dim, norm_eps, rope_theta, qk_norm, moe and
    (for dense layers) ffn_hidden_dim.
    """

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(args)
        # Not persistent: a pure function of the args, rebuilt by init_weights after to_empty.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        # Output projections scaled by depth, as Llama (torchtitan's depth_init).
        init = LinearInit(std=_BASE_INIT_STD, out_std=_BASE_INIT_STD / math.sqrt(2 * (layer_id + 1)))
        attention = Attention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim,
                              qk_norm_eps=a.norm_eps if a.qk_norm else None)
        if a.moe is not None and a.moe.is_moe_layer(layer_id):
            mlp = dict(moe=MoE(a.dim, a.moe))
        else:
            mlp = dict(feed_forward=FeedForward(a.dim, a.ffn_hidden_dim))
        return TransformerBlock(layer_id, attention=attention, attention_norm=self.build_norm(),
                                ffn_norm=self.build_norm(), init=init, **mlp)

    def build_norm(self) -> nn.Module:
        return nn.RMSNorm(self.model_args.dim, eps=self.model_args.norm_eps)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, None, device=device)

    def rotary_angles(self, positions: torch.Tensor | None) -> torch.Tensor:
        return self.rope_cache if positions is None else self.rope_cache[positions]

    def init_buffers(self, buffer_device) -> None:
        self.rope_cache = self._rope_cache(device=buffer_device or self.rope_cache.device)
