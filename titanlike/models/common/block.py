"""The pre-norm transformer block: h = x + attention(norm(x)); out = h + mlp(norm(h))."""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.init import LinearInit
from titanlike.models.common.norms import init_norm


class TransformerBlock(nn.Module):
    """One decoder (or encoder) layer. The submodule names (attention_norm, attention, ffn_norm, and
    feed_forward for a dense MLP or moe for a mixture of experts) are the ones the tensor-parallel
    plans and checkpoints refer to."""

    def __init__(self, layer_id: int, *, attention: nn.Module, attention_norm: nn.Module, ffn_norm: nn.Module,
                 init: LinearInit, feed_forward: nn.Module | None = None, moe: nn.Module | None = None):
        super().__init__()
        if (feed_forward is None) == (moe is None):
            raise ValueError("a transformer block takes either a feed_forward or a moe module")
        self.layer_id = layer_id
        self.attention_norm = attention_norm
        self.attention = attention
        self.ffn_norm = ffn_norm
        self.feed_forward = feed_forward
        self.moe = moe
        self.init = init

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: DocumentMask | None = None, *,
                cache=None) -> torch.Tensor:
        """rope: rotary angles for attention (None for models with learned or no positions). cache:
        the attention's decoding state when generating (models/common/kv_cache.py), else None."""
        attention_in = self.attention_norm(x)
        h = x + (self.attention(attention_in, rope, mask) if cache is None
                 else self.attention(attention_in, rope, mask, cache=cache))
        mlp = self.feed_forward if self.feed_forward is not None else self.moe
        return h + mlp(self.ffn_norm(h))

    def new_cache(self, cache, dtype: torch.dtype):
        """This layer's decoding state (its attention's): see models/common/kv_cache.py."""
        return self.attention.new_cache(cache, dtype)

    def init_weights(self, *, seed: int, prefix: str) -> None:
        init_norm(self.attention_norm)
        init_norm(self.ffn_norm)
        self.attention.init_weights(self.init, seed=seed, prefix=f"{prefix}attention.")
        if self.feed_forward is not None:
            self.feed_forward.init_weights(self.init, seed=seed, prefix=f"{prefix}feed_forward.")
        else:
            self.moe.init_weights(self.init, seed=seed, prefix=f"{prefix}moe.")
