"""Qwen3-Next and Qwen3.5: Gated DeltaNet layers mixed with gated full attention.

Pre-norm blocks `h = x + mixer(norm(x)); out = h + mlp(norm(h))`, the mixer by position: every
`full_attention_interval`-th layer (the 4th, 8th, ...) is full attention, the others Gated DeltaNet.

Gated attention (GatedAttention): grouped-query attention with QK-norm whose query projection also
gives each head an output gate, out = wo(attention * sigmoid(gate)), and RoPE on the first
`rotary_dim` features of each head only (partial RoPE, 64 of 256).

Gated DeltaNet (GatedDeltaNet), per token:
    q k v z b a = projections of x; q k v through a short causal depthwise conv and SiLU
    q, k <- l2-normalized; beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
    o = the gated delta rule (models/common/gated_delta.py) over the sequence
    out = out_proj(rmsnorm(o) * silu(z))              (the norm per value head)
q and k have k_heads heads, v, z, b, a have v_heads, each key head serving v_heads / k_heads
consecutive value heads. The projections and conv channels are laid out key head by key head
([q, k, v, z] and [b, a] rows, [q, k, v] channels of each), as Qwen3-Next's checkpoints keep
in_proj_qkvz and in_proj_ba: a tensor-parallel split of rows (Shard(0)) hands each rank whole key
heads with their value heads, and the conv channels and per-head vectors split with them (sharding.py).

The MLP is SwiGLU, or in MoE models a routed mixture of experts (models/common/moe.py) whose one shared
expert is gated per token by sigmoid(w x) (GatedSharedExpert).

Norms: the block norms, final norm and QK-norms are RMSNorms holding their scale; Qwen's checkpoints
hold scale - 1 (a zero-centred norm), converted by the adapter (hf_adapter.py). Weight decay therefore
pulls them towards 0, as every family's norms here, not towards a scale of 1 as in Qwen's training.

Context parallelism is refused (validate): the state entering a piece of the sequence is transformed
by a k_dim x k_dim matrix per head, not scaled as the Mamba-2 carry of parallel/context.py does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.args import AttentionShape, LayoutDegrees, check_divisible
from titanlike.models.common.attention import Attention, DocumentMask
from titanlike.models.common.decoder import DecoderArgs
from titanlike.models.common.dtensor import local_part
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from titanlike.models.common.init import LinearInit, ones_, uniform_
from titanlike.models.common.mamba2 import MambaState, causal_conv
from titanlike.models.common.moe_decoder import MoEDecoder, depth_scaled_init
from titanlike.models.common.norms import init_norm
from titanlike.models.common.rope import apply_rotary_emb, precompute_rope_cache


RELEASES = ("qwen3_next", "qwen3_5")


@dataclass
class Qwen3NextModelArgs(DecoderArgs):
    ARG_ALIASES = {
        **DecoderArgs.ARG_ALIASES, "linear_num_key_heads": ("linear_k_heads",),
        "linear_num_value_heads": ("linear_v_heads",), "linear_key_head_dim": ("linear_k_dim",),
        "linear_value_head_dim": ("linear_v_dim",), "linear_conv_kernel_dim": ("conv_kernel",),
    }
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 5120  # SwiGLU hidden size of dense layers (HF intermediate_size)
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25  # the share of each head's features RoPE rotates
    full_attention_interval: int = 4  # layers interval-1, 2 interval-1, ... are full attention
    # Gated DeltaNet layers.
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64  # tokens per chunk of the chunked delta rule
    # Whose checkpoints these are: "qwen3_next", or "qwen3_5" (Qwen3.5 keeps the Gated DeltaNet's
    # projections apart and routes every layer through experts); the computation is the same.
    release: str = "qwen3_next"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.release not in RELEASES:
            raise ValueError(f"release {self.release!r} is not one of {RELEASES}")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"linear_v_heads ({self.linear_v_heads}) must be a multiple of linear_k_heads "
                             f"({self.linear_k_heads})")
        if self.full_attention_interval < 1:
            raise ValueError(f"full_attention_interval must be at least 1, got {self.full_attention_interval}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} must "
                             "give an even number of rotated features")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.full_attention_interval == 0

    @property
    def n_full_attention(self) -> int:
        return sum(self.is_full_attention(i) for i in range(self.n_layers))

    @property
    def conv_dim(self) -> int:
        return self.linear_k_heads * 2 * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    # Counting ---------------------------------------------------------------------------------

    def attention_params(self, *, bias: bool = False) -> int:
        """wq (queries and output gates), wk, wv, wo and the two QK-norms."""
        q, kv = self.n_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.dim * 2 * q + 2 * self.dim * kv + q * self.dim + 2 * self.head_dim

    def delta_net_params(self) -> int:
        """in_proj_qkvz, in_proj_ba, conv, dt_bias, A_log, norm, out_proj."""
        kh, vh, dk, dv = self.linear_k_heads, self.linear_v_heads, self.linear_k_dim, self.linear_v_dim
        projections = self.dim * (2 * kh * dk + 2 * vh * dv + 2 * vh) + vh * dv * self.dim
        return projections + self.conv_dim * self.conv_kernel + 2 * vh + dv

    def block_params(self, layer_id: int, *, active: bool = False) -> int:
        mixer = self.attention_params() if self.is_full_attention(layer_id) else self.delta_net_params()
        if self.moe is not None and self.moe.is_moe_layer(layer_id):
            mlp = self.moe.params(self.dim, active=active) + (self.dim if self.moe.num_shared_experts else 0)
        else:
            mlp = 3 * self.dim * self.ffn_hidden_dim
        return mixer + mlp + 2 * self.dim

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        blocks = sum(self.block_params(i, active=active) for i in range(self.n_layers))
        return blocks + self.dim + self.vocab_params(exclude_embedding=exclude_embedding)

    def delta_rule_flops_per_token(self) -> int:
        """Forward FLOPs per token of the chunked delta rule beyond its projections, with full chunk x
        chunk blocks: per value head the scores q.k and the system k.k (2 x 2 C k_dim), the chunk's
        reads of values (2 C v_dim, twice: u and the output), and the state's read, correction and
        update (3 x 2 k_dim v_dim)."""
        c, dk, dv = self.chunk_size, self.linear_k_dim, self.linear_v_dim
        return self.linear_v_heads * (4 * c * dk + 4 * c * dv + 6 * dk * dv)

    def flops_per_token(self, seq_len: int) -> int:
        """6 N + 12 L_attn H Q T for the full-attention layers + 3 x the delta rule's FLOPs for the
        others (independent of T)."""
        n = self.num_params(exclude_embedding=True, active=True)
        delta_layers = self.n_layers - self.n_full_attention
        return (6 * n + 12 * self.n_full_attention * self.n_heads * self.head_dim * seq_len
                + 3 * delta_layers * self.delta_rule_flops_per_token())

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_heads, self.num_kv_heads, self.head_dim)

    # Rules -------------------------------------------------------------------------------------

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        if dims.cp > 1:
            raise ValueError(f"context_parallel_degree {dims.cp} is not supported by Gated DeltaNet layers: the state "
                             "entering each piece of the sequence is transformed by a matrix per head, which the "
                             "context-parallel carry (a scaled state) cannot pass; set it to 1")
        super().validate(dims, seq_len=seq_len)
        check_divisible(self.linear_k_heads, "Gated DeltaNet key heads (linear_k_heads)", dims.tp,
                        "tensor_parallel_degree")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split by tensor parallelism (the whole of a plain one)."""
    return local_part(t)


def _partial_rope(x: torch.Tensor, rope: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    return torch.cat([apply_rotary_emb(x[..., :rotary_dim], rope), x[..., rotary_dim:]], dim=-1)


class GatedAttention(Attention):
    """Attention with QK-norm, partial RoPE and a per-head output gate: wq gives [query, gate] of each
    head (2 head_dim rows per head, so a tensor-parallel split keeps a head's together)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, rotary_dim: int, norm_eps: float):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, qk_norm_eps=norm_eps)
        self.wq = nn.Linear(dim, 2 * n_heads * head_dim, bias=False)
        self.rotary_dim = rotary_dim

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None, *,
                cache=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = _partial_rope(q, rope, self.rotary_dim), _partial_rope(k, rope, self.rotary_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            out = cache.attend(q, k, v, lambda q, k, v: self.core_attention(q, k, v, mask))
        else:
            out = self.core_attention(q, k, v, mask)
        out = out.transpose(1, 2) * torch.sigmoid(gate)
        return self.wo(out.reshape(bsz, seqlen, -1))


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet mixer: (batch, seq, dim) -> (batch, seq, dim). See the module docstring."""

    # The parameters tensor parallelism splits on dim 0 with the key heads (models/protocol.py).
    head_split_parameters = ("conv_weight", "dt_bias", "A_log")

    def __init__(self, dim: int, a: Qwen3NextModelArgs):
        super().__init__()
        self.k_dim, self.v_dim = a.linear_k_dim, a.linear_v_dim
        self.per_key = a.linear_v_heads // a.linear_k_heads  # value heads per key head
        self.chunk_size = a.chunk_size
        group = 2 * self.k_dim + 2 * self.per_key * self.v_dim
        self.in_proj_qkvz = nn.Linear(dim, a.linear_k_heads * group, bias=False)
        self.in_proj_ba = nn.Linear(dim, a.linear_k_heads * 2 * self.per_key, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(a.conv_dim, a.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(a.linear_v_heads))
        self.A_log = nn.Parameter(torch.empty(a.linear_v_heads))
        self.norm = nn.RMSNorm(self.v_dim, eps=a.norm_eps)  # over each value head's features
        self.out_proj = nn.Linear(a.linear_v_heads * self.v_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: DocumentMask | None = None, *, cache: MambaState | None = None):
        """mask: a DocumentMask (the conv and the state restart where a document starts); cache:
        this layer's conv and delta-rule state when generating (prefill or one decode step)."""
        batch, seq, _ = x.shape
        dk, dv, r = self.k_dim, self.v_dim, self.per_key
        # (batch, seq, local key heads, features): under TP this rank's key heads only.
        q, k, v, z = self.in_proj_qkvz(x).view(batch, seq, -1, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], -1)
        b, a = self.in_proj_ba(x).view(batch, seq, -1, 2 * r).split([r, r], -1)
        heads = q.shape[2]
        qkv = torch.cat([q, k, v], dim=-1).reshape(batch, seq, -1)
        documents = None if mask is None else mask.document_ids
        weight = _local(self.conv_weight)
        if cache is None:
            qkv = causal_conv(qkv, weight, None, documents=documents)
        else:
            qkv = self._conv_step(qkv, weight, cache)
        q, k, v = F.silu(qkv).view(batch, seq, heads, 2 * dk + r * dv).split([dk, dk, r * dv], -1)
        v = v.reshape(batch, seq, heads * r, dv)
        beta = b.reshape(batch, seq, -1).sigmoid()
        g = -_local(self.A_log).float().exp() * F.softplus(a.reshape(batch, seq, -1).float()
                                                             + _local(self.dt_bias).float())
        q, k = l2norm(q), l2norm(k)
        if cache is None:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, documents=documents)
        elif cache.cache.prefilling:
            # Placeholders past a row's prompt neither decay (g 0) nor write (beta 0) the state, so
            # the final state is the one after the row's last real token.
            real = (torch.arange(seq, device=x.device)[None, :] < cache.cache.prompt_lengths[:, None])[..., None]
            o, state = chunk_gated_delta_rule(q, k, v, g * real, beta * real, chunk_size=self.chunk_size)
            cache.ssm = cache.cache.keep(cache.ssm, state)
        else:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=cache.ssm)
            cache.ssm = cache.cache.keep(cache.ssm, state)
        o = self.norm(o) * F.silu(z.reshape(batch, seq, -1, dv).float())
        return self.out_proj(o.to(x.dtype).reshape(batch, seq, -1))

    def _conv_step(self, qkv: torch.Tensor, weight: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The conv of a prefill (keeping each row's last K-1 real inputs) or of one decode step."""
        cache, kernel = state.cache, weight.shape[1]
        if cache.prefilling:
            out = causal_conv(qkv, weight, None)
            # Token t is row t + K-1 of the zero-padded inputs: the K-1 inputs before each row's length.
            padded = torch.cat([qkv.new_zeros(qkv.shape[0], kernel - 1, qkv.shape[-1]), qkv], dim=1)
            index = cache.prompt_lengths[:, None] + torch.arange(kernel - 1, device=qkv.device)
            last = padded.gather(1, index[..., None].expand(-1, -1, qkv.shape[-1]))
            state.conv = cache.keep(state.conv, last.to(state.dtype))
            return out
        window = torch.cat([state.conv.to(qkv.dtype), qkv], dim=1)  # (batch, K, channels)
        state.conv = cache.keep(state.conv, window[:, 1:].to(state.conv.dtype))
        return (window * weight.to(qkv.dtype).t()).sum(1, keepdim=True)

    def new_cache(self, cache, dtype: torch.dtype) -> MambaState:
        """The last K-1 conv inputs and the delta-rule state (batch, v_heads, k_dim, v_dim, fp32): the
        two fixed-size pieces a Mamba-2 layer keeps too (MambaState)."""
        return MambaState(cache, dtype)

    @torch.no_grad()
    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.in_proj_qkvz.weight, seed=seed, fqn=f"{prefix}in_proj_qkvz.weight")
        init.fill(self.in_proj_ba.weight, seed=seed, fqn=f"{prefix}in_proj_ba.weight")
        init.fill(self.out_proj.weight, seed=seed, fqn=f"{prefix}out_proj.weight", output=True)
        # The conv as PyTorch initializes a depthwise Conv1d; dt_bias 1 and A uniform in [0.01, 16], as
        # transformers' Qwen3NextPreTrainedModel.
        bound = self.conv_weight.shape[1] ** -0.5
        uniform_(self.conv_weight, low=-bound, high=bound, seed=seed, fqn=f"{prefix}conv_weight")
        ones_(self.dt_bias)
        uniform_(self.A_log, low=0.01, high=16.0, seed=seed, fqn=f"{prefix}A_log")
        _local(self.A_log).log_()
        ones_(self.norm.weight)


class GatedSharedExpert(FeedForward):
    """The shared expert of Qwen3-Next's MoE layers: SwiGLU scaled per token by sigmoid(gate x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__(dim, hidden_dim)
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().forward(x)

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        super().init_weights(init, seed=seed, prefix=prefix)
        init.fill(self.gate.weight, seed=seed, fqn=f"{prefix}gate.weight")


class Qwen3NextBlock(nn.Module):
    """One layer: its mixer under `attention` (full attention) or `linear_attention` (Gated DeltaNet),
    its MLP under `feed_forward` or `moe`; the names the sharding plan and checkpoints use."""

    def __init__(self, layer_id: int, *, mixer: nn.Module, full_attention: bool, attention_norm: nn.Module,
                 ffn_norm: nn.Module, mlp: dict[str, nn.Module], init: LinearInit):
        super().__init__()
        self.layer_id = layer_id
        self.full_attention = full_attention
        self.attention_norm = attention_norm
        self.mixer_name = "attention" if full_attention else "linear_attention"
        setattr(self, self.mixer_name, mixer)
        self.ffn_norm = ffn_norm
        (self.mlp_name, mlp_module), = mlp.items()
        setattr(self, self.mlp_name, mlp_module)
        self.init = init

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None, *,
                cache=None) -> torch.Tensor:
        h = self.attention_norm(x)
        mixer = getattr(self, self.mixer_name)
        if self.full_attention:
            h = mixer(h, rope, mask) if cache is None else mixer(h, rope, mask, cache=cache)
        else:  # positionally: its tensor-parallel style prepares both inputs
            h = mixer(h, mask) if cache is None else mixer(h, mask, cache=cache)
        h = x + h
        return h + getattr(self, self.mlp_name)(self.ffn_norm(h))

    def new_cache(self, cache, dtype: torch.dtype):
        return getattr(self, self.mixer_name).new_cache(cache, dtype)

    def init_weights(self, *, seed: int, prefix: str) -> None:
        init_norm(self.attention_norm)
        init_norm(self.ffn_norm)
        getattr(self, self.mixer_name).init_weights(self.init, seed=seed, prefix=f"{prefix}{self.mixer_name}.")
        getattr(self, self.mlp_name).init_weights(self.init, seed=seed, prefix=f"{prefix}{self.mlp_name}.")


class Qwen3Next(MoEDecoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size)."""

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        full = a.is_full_attention(layer_id)
        if full:
            mixer = GatedAttention(a.dim, a.n_heads, a.num_kv_heads, a.head_dim, rotary_dim=a.rotary_dim,
                                   norm_eps=a.norm_eps)
        else:
            mixer = GatedDeltaNet(a.dim, a)
        mlp = self.build_mlp(layer_id)
        if "moe" in mlp and a.moe.num_shared_experts:
            mlp["moe"].shared_experts = GatedSharedExpert(a.dim, a.moe.shared_dim)
        return Qwen3NextBlock(layer_id, mixer=mixer, full_attention=full, attention_norm=self.build_norm(),
                              ffn_norm=self.build_norm(), mlp=mlp, init=depth_scaled_init(layer_id))

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.rotary_dim, a.max_seq_len, a.rope_theta, None, device=device)


__all__ = ["RELEASES", "GatedAttention", "GatedDeltaNet", "GatedSharedExpert", "Qwen3Next", "Qwen3NextBlock",
           "Qwen3NextModelArgs"]
