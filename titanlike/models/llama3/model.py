"""The Llama 3 decoder (Llama 3 / 3.1 / 3.2 dense models).

Pre-norm blocks with RMSNorm, grouped-query attention with rotary position embeddings (Llama
3.1 frequency scaling), a SwiGLU MLP, no biases. The module tree mirrors Meta's reference and
torchtitan (tok_embeddings, layers.N.attention.wq, ..., norm, output), so checkpoints and
parallelize plans written against those names apply unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.models.common.attention import Attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import Decoder, DecoderArgs
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.init import LinearInit
from titanlike.models.common.rope import RoPEScaling, precompute_rope_cache

# Standard deviation of the input projections (and of the output projections before depth
# scaling), as in torchtitan's Llama.
_BASE_INIT_STD = 0.02


@dataclass
class TransformerModelArgs(DecoderArgs):
    # SwiGLU hidden size: int(8 * dim / 3), times ffn_dim_multiplier, rounded up to multiple_of.
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling | None = None
    # Scale the init std of each block's output projections by its depth (torchtitan's default)
    # rather than by the total number of layers.
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RoPEScaling(**self.rope_scaling)

    @property
    def ffn_hidden_dim(self) -> int:
        # Meta's rule: 2/3 of 4*dim keeps SwiGLU's three matrices at the cost of a 4*dim MLP.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        block = self.attention_params() + 3 * self.dim * self.ffn_hidden_dim + 2 * self.dim
        return self.n_layers * block + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)


class Transformer(Decoder):
    """Llama 3: tokens (batch, seq) -> logits (batch, seq, vocab_size)."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__(args)
        # Not persistent: a pure function of the args, rebuilt by init_weights after to_empty.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        depth = layer_id + 1 if a.depth_init else a.n_layers
        init = LinearInit(std=_BASE_INIT_STD, out_std=_BASE_INIT_STD / math.sqrt(2 * depth))
        return TransformerBlock(
            layer_id,
            attention=Attention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim),
            feed_forward=FeedForward(a.dim, a.ffn_hidden_dim),
            attention_norm=self.build_norm(), ffn_norm=self.build_norm(), init=init)

    def build_norm(self) -> nn.Module:
        return nn.RMSNorm(self.model_args.dim, eps=self.model_args.norm_eps)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def rotary_angles(self, positions: torch.Tensor | None) -> torch.Tensor:
        # The blocks rotate token j by row j of the table they get; picking the rows here gives
        # every token its global angle.
        return self.rope_cache if positions is None else self.rope_cache[positions]

    def init_buffers(self, buffer_device) -> None:
        self.rope_cache = self._rope_cache(device=buffer_device or self.rope_cache.device)
