"""The Qwen3 decoder, dense (Qwen3ForCausalLM) and mixture of experts (Qwen3MoeForCausalLM).

Llama-like pre-norm blocks (RMSNorm, grouped-query attention with RoPE, SwiGLU, no biases) with
two differences: QK-norm (an RMSNorm over each head's q and k before RoPE) and a head_dim of its
own (128 at every width). In the MoE models the MLP of the layers `moe.is_moe_layer` picks is a
routed mixture of experts (softmax scores, top-k, renormalized when norm_topk_prob is set); the
other layers keep a dense SwiGLU of ffn_hidden_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlike.models.common.decoder import DecoderArgs
from titanlike.models.common.moe_decoder import MoEDecoder


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 3072  # SwiGLU hidden size of the dense layers (HF intermediate_size)
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True

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


class Qwen3(MoEDecoder):
    """Qwen3 / Qwen3-MoE: tokens (batch, seq) -> logits (batch, seq, vocab_size); the shared MoE
    decoder (models/common/moe_decoder.py) on Qwen3's args."""
