"""The Llama-style decoder whose MLPs may be mixtures of experts (Qwen3 / Qwen3-MoE, Mixtral, DeepSeek-V3).

Pre-norm blocks with RMSNorm, rotary position embeddings from a table the model keeps, and in the
layers `moe.is_moe_layer` picks a routed mixture of experts (models/common/moe.py) instead of the
dense SwiGLU of ffn_hidden_dim. The module tree is Llama's (tok_embeddings, layers.N.attention.wq,
..., layers.N.moe.experts.w1, norm, output), so checkpoints keep their keys whichever family
builds it.
"""

from __future__ import annotations

import math

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
# scaling), as for Llama and torchtitan's DeepSeek-V3.
BASE_INIT_STD = 0.02


def depth_scaled_init(layer_id: int) -> LinearInit:
    """Output projections scaled by the block's depth (torchtitan's depth_init)."""
    return LinearInit(std=BASE_INIT_STD, out_std=BASE_INIT_STD / math.sqrt(2 * (layer_id + 1)))


class MoEDecoder(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size).

    The args provide, beside DecoderArgs' sizes: rope_theta, qk_norm (an RMSNorm over each head's
    q and k before RoPE), moe, and ffn_hidden_dim for the dense layers. A family with another
    attention or RoPE table overrides build_block or _rope_cache.
    """

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        # Not persistent: a pure function of the args, rebuilt by init_weights after to_empty.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        attention = Attention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim,
                              qk_norm_eps=a.norm_eps if a.qk_norm else None)
        return TransformerBlock(layer_id, attention=attention, attention_norm=self.build_norm(),
                                ffn_norm=self.build_norm(), init=depth_scaled_init(layer_id),
                                **self.build_mlp(layer_id))

    def build_mlp(self, layer_id: int) -> dict[str, nn.Module]:
        """The block's MLP under its module name: `moe` in the layers moe.is_moe_layer picks, else a
        dense `feed_forward`."""
        a = self.model_args
        if a.moe is not None and a.moe.is_moe_layer(layer_id):
            return dict(moe=MoE(a.dim, a.moe))
        return dict(feed_forward=FeedForward(a.dim, a.ffn_hidden_dim))

    def build_norm(self) -> nn.Module:
        return nn.RMSNorm(self.model_args.dim, eps=self.model_args.norm_eps)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, None, device=device)

    def rotary_angles(self, positions: torch.Tensor | None) -> torch.Tensor:
        # The blocks rotate token j by row j of the table they get; picking the rows here gives
        # every token its global angle.
        return self.rope_cache if positions is None else self.rope_cache[positions]

    def init_buffers(self, buffer_device) -> None:
        self.rope_cache = self._rope_cache(device=buffer_device or self.rope_cache.device)


__all__ = ["BASE_INIT_STD", "MoEDecoder", "depth_scaled_init"]
