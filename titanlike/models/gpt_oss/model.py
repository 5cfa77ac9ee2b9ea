"""The gpt-oss decoder (OpenAI's gpt-oss-20b and gpt-oss-120b; transformers' GptOssForCausalLM).

What differs from the shared MoE decoder (models/common/moe_decoder.py):
- attention with learned sinks (a per-head logit in the softmax denominator) and biases on q/k/v/o,
  every other layer a sliding window of 128 tokens (layer 0 slides, layer 1 attends to everything,
  ...): both shared options of models/common/attention.py;
- YaRN RoPE (factor 32 over an original 4096 positions, no rounding of the ramp ends: truncate False),
  whose cos and sin carry YaRN's magnitude correction (models/common/rope.py);
- a router with a bias, choosing the top k of its logits and taking the softmax over those k;
- experts with biases and a clamped SwiGLU: gate clamped above at `limit`, up clamped to +-`limit`,
  out = (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts).
The router and the experts are the shared ones (models/common/moe.py) with these additions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.common.attention import Attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import DecoderArgs
from titanlike.models.common.dtensor import local_part, local_part_in_place
from titanlike.models.common.init import LinearInit, zeros_
from titanlike.models.common.moe import GroupedExperts, MoE, MoEArgs, Router, Routing
from titanlike.models.common.moe_decoder import MoEDecoder, depth_scaled_init
from titanlike.models.common.rope import YaRNScaling, precompute_rope_cache


def _published_yarn() -> YaRNScaling:
    return YaRNScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                       truncate=False)


@dataclass
class GptOssModelArgs(DecoderArgs):
    norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    rope_scaling: YaRNScaling | None = field(default_factory=_published_yarn)
    sliding_window: int = 128
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from a checkpoint sidecar (to_dict)
            self.rope_scaling = YaRNScaling(**self.rope_scaling)
        super().__post_init__()
        if self.moe is None or self.moe.first_k_dense or self.moe.layer_freq != 1:
            raise ValueError("gpt-oss args need moe in every layer (first_k_dense 0, layer_freq 1)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.sliding_window < 1 or self.swiglu_limit <= 0:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= 1 and swiglu_limit "
                             f"({self.swiglu_limit}) > 0")

    def attention_window(self, layer_id: int) -> int | None:
        return self.sliding_window if layer_id % 2 == 0 else None

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        moe, experts = self.moe, self.moe.top_k if active else self.moe.num_experts
        # Routed experts with their biases (gate, up: hidden each; down: dim), the router with its bias.
        expert = 3 * self.dim * moe.hidden_dim + 2 * moe.hidden_dim + self.dim
        block = (self.attention_params(bias=True) + self.n_heads + (self.dim + 1) * moe.num_experts
                 + experts * expert + 2 * self.dim)
        return self.n_layers * block + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)


class GptOssRouter(Router):
    """The shared router's linear gate with a bias; top-k of the logits, softmax over the k chosen."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__(dim, args)
        self.gate = nn.Linear(dim, args.num_experts, bias=True)
        self.gate.keep_high_precision = True

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> Routing:
        logits = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())
        choice = logits if expert_bias is None else logits + expert_bias
        experts = choice.topk(self.args.top_k, dim=-1).indices
        weights = logits.gather(-1, experts).softmax(dim=-1)
        return Routing(experts, weights * self.args.route_scale, logits.softmax(dim=-1), logits)


class GptOssExperts(GroupedExperts):
    """The shared stacked experts (w1 gate, w3 up: (E, F, D); w2 down: (E, D, F)) with biases b1, b3 (E, F)
    and b2 (E, D), and the clamped SwiGLU. Biases are sharded with the weights under expert parallelism.
    Under expert tensor parallelism b1 and b3 split with the hidden units; b2 splits over the output
    features, each rank adding its slice to its partial sum of the down projection, so that the sum
    over the ranks adds b2 once (and each slice's gradient is that of the whole output's columns)."""

    tensor_parallel_dims = GroupedExperts.tensor_parallel_dims | {"b1": 1, "b3": 1, "b2": 1}

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, impl: str, *, alpha: float, limit: float):
        super().__init__(dim, hidden_dim, num_experts, impl)
        self.alpha, self.limit = alpha, limit
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to(x.dtype) for w in self.local_weights())
        b1, b3 = (local_part(b).to(x.dtype) for b in (self.b1, self.b3))
        b2 = local_part_in_place(self.b2, 1).to(x.dtype)
        # Each row's expert, to pick its biases.
        expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                         output_size=x.shape[0])
        gate = self._linear(x, counts, w1) + b1[expert]
        up = self._linear(x, counts, w3) + b3[expert]
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return self._linear(h, counts, w2) + b2[expert]

    def _linear(self, x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert (counts[e] for expert e) times their expert's w (E, out, in), transposed."""
        # Compiled, torch traces _grouped_mm with a meta kernel that takes bf16 only (see GroupedExperts).
        if self.impl == "grouped_mm" and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()):
            return self.grouped_mm(x, w, counts.cumsum(0).to(torch.int32))
        # The reference: one matmul per expert.
        outputs = [rows @ weight.T for rows, weight in zip(torch.split(x, counts.tolist()), w.unbind(0))]
        return torch.cat(outputs) if outputs else x.new_zeros(0, w.shape[1])

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        super().init_weights(init, seed=seed, prefix=prefix)
        for bias in (self.b1, self.b2, self.b3):
            zeros_(bias)


class GptOssMoE(MoE):
    """The shared MoE layer with gpt-oss's router and experts."""

    def __init__(self, dim: int, args: MoEArgs, *, alpha: float, limit: float):
        super().__init__(dim, args)
        self.router = GptOssRouter(dim, args)
        self.experts = GptOssExperts(dim, args.hidden_dim, args.num_experts, args.experts_impl, alpha=alpha,
                                     limit=limit)

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        super().init_weights(init, seed=seed, prefix=prefix)
        zeros_(self.router.gate.bias)


class GptOss(MoEDecoder):
    """gpt-oss: tokens (batch, seq) -> logits (batch, seq, vocab_size)."""

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        attention = Attention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim, bias=True, sinks=True,
                              window=a.attention_window(layer_id))
        moe = GptOssMoE(a.dim, a.moe, alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        return TransformerBlock(layer_id, attention=attention, attention_norm=self.build_norm(),
                                ffn_norm=self.build_norm(), init=depth_scaled_init(layer_id), moe=moe)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)


__all__ = ["GptOss", "GptOssExperts", "GptOssModelArgs", "GptOssMoE", "GptOssRouter"]
