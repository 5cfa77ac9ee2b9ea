"""The Gemma 3 text decoder (Gemma3ForCausalLM: the 1B model, and the language model of 4B, 12B, 27B).

What differs from a Llama-style decoder:
- local and global layers: every `sliding_window_pattern`-th layer attends to the whole sequence, the
  others to a sliding window of the last `sliding_window` tokens (the shared option of
  models/common/attention.py), each kind with its own RoPE base (global 1M, linearly scaled by 8 from
  4B up; local 10k);
- norms before and after attention and the MLP (four per block), QK-norm, RMSNorm eps 1e-6;
- q.k scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5 (27B: 168 for head_dim 128);
- embeddings multiplied by sqrt(dim), and tied to the output projection;
- a gated MLP with GELU (tanh approximation) in place of SiLU.
Gemma's RMSNorm multiplies by (1 + weight); ours keep the product itself as their weight (1 at init),
so they are plain nn.RMSNorm everywhere (sharding, init); the HF adapter adds and removes the 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.common.attention import Attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import Decoder, DecoderArgs
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.moe_decoder import depth_scaled_init
from titanlike.models.common.norms import init_norm
from titanlike.models.common.rope import rope_inv_freq


@dataclass
class Gemma3ModelArgs(DecoderArgs):
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 6912  # gated GELU hidden size (HF intermediate_size)
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0  # global layers
    rope_scaling_factor: float = 1.0  # global layers' linear scaling (positions divided by it)
    rope_local_theta: float = 10_000.0  # sliding layers
    sliding_window: int = 512
    sliding_window_pattern: int = 6  # layer i is global when (i + 1) % pattern == 0
    query_pre_attn_scalar: int = 256  # q.k scaled by its -1/2 power

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("sliding_window", "sliding_window_pattern"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def attention_window(self, layer_id: int) -> int | None:
        return None if (layer_id + 1) % self.sliding_window_pattern == 0 else self.sliding_window

    def block_params(self) -> int:
        return self.attention_params() + 2 * self.head_dim + 3 * self.dim * self.ffn_hidden_dim + 4 * self.dim

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        return self.n_layers * self.block_params() + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)

    def layer_costs(self, seq_len: int) -> list[float]:
        """Forward FLOPs per token of each layer: a global layer's attention reads every key, a local one's
        its window, so at long sequences the pipeline split gives stages of global layers fewer layers."""
        attention = 4 * self.n_heads * self.head_dim
        return [float(2 * self.block_params() + attention * min(seq_len, self.attention_window(i) or seq_len))
                for i in range(self.n_layers)]


class GatedGelu(FeedForward):
    """w2(gelu_tanh(w1 x) * w3 x): SwiGLU's shape (and its sharding and init) with GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class Gemma3Block(TransformerBlock):
    """h = x + post_attention_norm(attention(attention_norm(x))); out = h + post_ffn_norm(mlp(ffn_norm(h))).
    `rope` is the model's {"local", "global"} pair of angle tables; the block takes its kind's."""

    def __init__(self, layer_id: int, *, local: bool, post_attention_norm: nn.Module, post_ffn_norm: nn.Module,
                 **parts):
        super().__init__(layer_id, **parts)
        self.post_attention_norm = post_attention_norm
        self.post_ffn_norm = post_ffn_norm
        self.rope_kind = "local" if local else "global"

    def forward(self, x: torch.Tensor, rope: dict, mask=None, *, cache=None) -> torch.Tensor:
        angles, attention_in = rope[self.rope_kind], self.attention_norm(x)
        out = (self.attention(attention_in, angles, mask) if cache is None
               else self.attention(attention_in, angles, mask, cache=cache))
        h = x + self.post_attention_norm(out)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))

    def init_weights(self, *, seed: int, prefix: str) -> None:
        super().init_weights(seed=seed, prefix=prefix)
        init_norm(self.post_attention_norm)
        init_norm(self.post_ffn_norm)


def rope_table(head_dim: int, max_seq_len: int, theta: float, factor: float, device) -> torch.Tensor:
    """(max_seq_len, head_dim) (cos, sin) pairs with HF's "linear" scaling (frequencies divided by factor)."""
    inv_freq = rope_inv_freq(head_dim, theta, device=device) / factor
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2)


class Gemma3(Decoder):
    """Gemma 3 (text): tokens (batch, seq) -> logits (batch, seq, vocab_size)."""

    def __init__(self, args: Gemma3ModelArgs):
        super().__init__(args)
        # Not persistent: pure functions of the args, rebuilt by init_weights after to_empty.
        self.register_buffer("rope_global", self._rope_table(args.rope_theta, args.rope_scaling_factor, None),
                             persistent=False)
        self.register_buffer("rope_local", self._rope_table(args.rope_local_theta, 1.0, None), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        window = a.attention_window(layer_id)
        attention = Attention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim, qk_norm_eps=a.norm_eps, window=window,
                              softmax_scale=a.query_pre_attn_scalar**-0.5)
        return Gemma3Block(layer_id, local=window is not None, attention=attention,
                           feed_forward=GatedGelu(a.dim, a.ffn_hidden_dim), attention_norm=self.build_norm(),
                           post_attention_norm=self.build_norm(), ffn_norm=self.build_norm(),
                           post_ffn_norm=self.build_norm(), init=depth_scaled_init(layer_id))

    def build_norm(self) -> nn.Module:
        return nn.RMSNorm(self.model_args.dim, eps=self.model_args.norm_eps)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        # sqrt(dim) rounded to the activations' dtype first, as Gemma's reference does (bf16: 33.75 for 1B).
        return h * torch.tensor(self.model_args.dim**0.5, dtype=h.dtype, device=h.device)

    def _rope_table(self, theta: float, factor: float, device) -> torch.Tensor:
        a = self.model_args
        return rope_table(a.head_dim, a.max_seq_len, theta, factor, device)

    def rotary_angles(self, positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
        tables = {"global": self.rope_global, "local": self.rope_local}
        return tables if positions is None else {kind: table[positions] for kind, table in tables.items()}

    def init_buffers(self, buffer_device) -> None:
        a, device = self.model_args, buffer_device or self.rope_global.device
        self.rope_global = self._rope_table(a.rope_theta, a.rope_scaling_factor, device)
        self.rope_local = self._rope_table(a.rope_local_theta, 1.0, device)


__all__ = ["Gemma3", "Gemma3Block", "Gemma3ModelArgs", "GatedGelu"]
