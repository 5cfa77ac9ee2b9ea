"""Hybrid state-space models: Mamba-2 layers mixed with attention, MLP and MoE layers, laid out by
Megatron's pattern string (`--hybrid-layer-pattern`, Nemotron-H's `hybrid_override_pattern`).

One character per layer, each layer one residual block `x + mixer(norm(x))`:

    M   a Mamba-2 mixer (models/common/mamba2.py)
    *   grouped-query self-attention (models/common/attention.py), no position encoding unless
        rope_theta is set (Nemotron-H has none: the Mamba layers carry the order)
    -   an MLP: squared ReLU with up and down projections (Nemotron-H), or SwiGLU
    E   a mixture of experts (models/common/moe.py), whose args say which layers are MoE by the
        pattern (PatternMoEArgs)

so "M-M-M*-" is Mamba, MLP, Mamba, MLP, Mamba, attention, MLP. A block keeps its mixer under the
name of its kind (mamba, attention, feed_forward, moe), so one sharding plan (sharding.py) covers every
kind (entries a block does not have are skipped) and checkpoints say what each layer is.
A pattern of M only is a pure Mamba-2 model (Mamba2ForCausalLM).

Pipeline stages are balanced by cost, not by layer count (`layer_costs`): a Mamba layer, an
attention layer and an MLP cost different amounts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.args import AttentionShape, BaseModelArgs, LayoutDegrees, check_divisible
from titanlike.models.common.attention import Attention, DocumentMask
from titanlike.models.common.decoder import Decoder
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.init import LinearInit
from titanlike.models.common.mamba2 import Mamba2Args, Mamba2Mixer
from titanlike.models.common.moe import MoE, MoEArgs
from titanlike.models.common.norms import init_norm
from titanlike.models.common.rope import precompute_rope_cache

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "feed_forward", "E": "moe"}
MLP_ACTIVATIONS = ("relu2", "swiglu")
_BASE_INIT_STD = 0.02  # Megatron's init_method_std


@dataclass
class PatternMoEArgs(MoEArgs):
    """MoE settings whose MoE layers are listed (the pattern's E positions) instead of following
    first_k_dense / layer_freq."""

    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        super().__post_init__()

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.layers


def parse_pattern(pattern: str) -> str:
    """The pattern, checked: ValueError in one sentence for what it cannot be."""
    if not pattern:
        raise ValueError("hybrid_layer_pattern is empty; give one character per layer (M, *, -, E)")
    if "|" in pattern:
        raise ValueError("hybrid_layer_pattern: pipeline stage boundaries ('|') are not supported; the "
                         "pipeline split balances the layers' costs itself (or set "
                         "parallelism.pipeline_parallel_layers_per_stage)")
    unknown = sorted(set(pattern) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"hybrid_layer_pattern {pattern!r} has unknown layer symbol(s) {', '.join(map(repr, unknown))}; "
                         "known: M (Mamba-2), * (attention), - (MLP), E (mixture of experts)")
    return pattern


@dataclass
class HybridModelArgs(BaseModelArgs):
    # Megatron's and Hugging Face's names of the fields, for [model.args].
    ARG_ALIASES = {
        "hidden_size": ("dim",), "num_attention_heads": ("n_heads",), "num_query_groups": ("n_kv_heads",),
        "num_key_value_heads": ("n_kv_heads",), "kv_channels": ("head_dim",), "ffn_hidden_size": ("ffn_hidden_dim",),
        "intermediate_size": ("ffn_hidden_dim",), "max_position_embeddings": ("max_seq_len",),
        "norm_epsilon": ("norm_eps",), "rotary_base": ("rope_theta",),
    }
    dim: int = 4096
    hybrid_layer_pattern: str = "M-M-M*-"
    vocab_size: int = 131072
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Attention layers (*).
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float | None = None  # None: no position encoding (Nemotron-H)
    # MLP layers (-).
    ffn_hidden_dim: int = 21504
    mlp_activation: str = "relu2"  # relu2: down(relu(up x)^2) | swiglu
    # Mamba-2 layers (M).
    mamba: Mamba2Args = field(default_factory=Mamba2Args)
    # Mixture-of-experts layers (E); rebuilt as PatternMoEArgs listing the pattern's E layers.
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        parse_pattern(self.hybrid_layer_pattern)
        if isinstance(self.mamba, dict):  # from a checkpoint sidecar (to_dict)
            self.mamba = Mamba2Args(**self.mamba)
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation {self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
        if self.has("*") and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.rope_theta is not None and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        moe_layers = tuple(i for i, kind in enumerate(self.hybrid_layer_pattern) if kind == "E")
        if moe_layers and self.moe is None:
            raise ValueError("hybrid_layer_pattern has E (mixture-of-experts) layers but the model has no moe settings")
        if self.moe is not None:
            if not moe_layers:
                raise ValueError("the model has moe settings but hybrid_layer_pattern has no E layer")
            fields = self.moe if isinstance(self.moe, dict) else dataclasses.asdict(self.moe)
            self.moe = PatternMoEArgs(**{**fields, "layers": moe_layers})

    def has(self, kind: str) -> bool:
        return kind in self.hybrid_layer_pattern

    def count(self, kind: str) -> int:
        return self.hybrid_layer_pattern.count(kind)

    @property
    def n_layers(self) -> int:
        return len(self.hybrid_layer_pattern)

    def moe_args(self) -> MoEArgs | None:
        return self.moe

    def with_moe_args(self, moe: MoEArgs) -> HybridModelArgs:
        return dataclasses.replace(self, moe=moe)

    def attention_shape(self) -> AttentionShape | None:
        return AttentionShape(self.n_heads, self.n_kv_heads, self.head_dim) if self.has("*") else None

    # Counting ---------------------------------------------------------------------------------

    def layer_params(self, layer_id: int, *, active: bool = False) -> int:
        """Parameters of one layer: its norm and its mixer."""
        kind = self.hybrid_layer_pattern[layer_id]
        if kind == "M":
            mixer = self.mamba.params(self.dim)
        elif kind == "*":
            q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            mixer = 2 * self.dim * q + 2 * self.dim * kv
        elif kind == "-":
            mixer = (3 if self.mlp_activation == "swiglu" else 2) * self.dim * self.ffn_hidden_dim
        else:
            mixer = self.moe.params(self.dim, active=active)
        return self.dim + mixer

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        table = self.vocab_size * self.dim
        vocab = table if self.tie_word_embeddings else (table if exclude_embedding else 2 * table)
        layers = sum(self.layer_params(i, active=active) for i in range(self.n_layers))
        return layers + self.dim + vocab

    def mixing_flops_per_token(self, layer_id: int, seq_len: int) -> int:
        """Forward FLOPs per token a layer spends mixing tokens, beyond 2 x its parameters: attention's
        scores and weighted sum over the full T x T block (4 H Q T, counted non-causal), the
        Mamba-2 scan's (Mamba2Args.scan_flops_per_token, linear in T), none for MLPs."""
        kind = self.hybrid_layer_pattern[layer_id]
        if kind == "*":
            return 4 * self.n_heads * self.head_dim * seq_len
        if kind == "M":
            return self.mamba.scan_flops_per_token()
        return 0

    def flops_per_token(self, seq_len: int) -> int:
        """6 N + 3 x the mixing FLOPs of every layer (forward + backward): N parameters a token uses
        without embeddings (routed experts: top_k); for attention layers the usual 12 L H Q T, for
        Mamba-2 layers 3 x the chunked scan's FLOPs (independent of T)."""
        n = self.num_params(exclude_embedding=True, active=True)
        return 6 * n + 3 * sum(self.mixing_flops_per_token(i, seq_len) for i in range(self.n_layers))

    def layer_costs(self, seq_len: int) -> list[float]:
        """Forward FLOPs per token of each layer (2 x its active parameters + its mixing FLOPs)."""
        return [float(2 * self.layer_params(i, active=True) + self.mixing_flops_per_token(i, seq_len))
                for i in range(self.n_layers)]

    # Rules -------------------------------------------------------------------------------------

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        if self.has("*"):
            check_divisible(self.n_heads, "attention heads", dims.tp, "tensor_parallel_degree")
            check_divisible(self.n_kv_heads, "key/value heads", dims.tp, "tensor_parallel_degree")
        if self.has("M"):
            # A rank holds whole groups of Mamba heads (their B and C are shared within a group).
            check_divisible(self.mamba.n_groups, "Mamba-2 head groups (mamba n_groups)", dims.tp,
                            "tensor_parallel_degree")
            piece = seq_len // (2 * dims.cp)
            if dims.cp > 1 and piece < self.mamba.conv_kernel - 1:
                raise ValueError(f"context_parallel_degree {dims.cp} cuts training.seq_len {seq_len} into pieces of "
                                 f"{piece} tokens, fewer than the {self.mamba.conv_kernel - 1} the Mamba-2 conv reads "
                                 "back; use a longer seq_len or a lower context_parallel_degree")
        if self.moe is not None:
            self.moe.validate_layout(dim=self.dim, ep=dims.ep, cp=dims.cp, etp=dims.etp)
        # Only a RoPE table limits the positions (max_seq_len is the context the flavor was trained
        # at); Mamba layers and attention without position encoding run at any length.
        if self.rope_theta is not None and seq_len > self.context_len:
            raise ValueError(f"training.seq_len {seq_len} exceeds the model's RoPE table of {self.context_len} "
                             f"positions; set training.seq_len to at most {self.context_len}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if out["moe"] is not None:
            out["moe"].pop("layers")  # the pattern says which layers are MoE
        return out


class SquaredReLUMLP(nn.Module):
    """w2(relu(w1 x)^2): Nemotron-H's MLP (Megatron's squared_relu), up and down projections only."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)).square())

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.w1.weight, seed=seed, fqn=f"{prefix}w1.weight")
        init.fill(self.w2.weight, seed=seed, fqn=f"{prefix}w2.weight", output=True)


class HybridBlock(nn.Module):
    """x + mixer(norm(x)), the mixer kept under the name of its kind (LAYER_KINDS)."""

    def __init__(self, layer_id: int, kind: str, *, norm: nn.Module, mixer: nn.Module, init: LinearInit):
        super().__init__()
        self.layer_id = layer_id
        self.kind = kind
        self.norm = norm
        self.mixer_name = LAYER_KINDS[kind]
        setattr(self, self.mixer_name, mixer)
        self.init = init

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: DocumentMask | None = None, *,
                cache=None) -> torch.Tensor:
        """cache: the mixer's decoding state when generating (attention's keys and values, a Mamba-2
        state), None in training and for MLP / MoE layers."""
        h = self.norm(x)
        if self.kind == "*":
            out = self.attention(h, rope, mask) if cache is None else self.attention(h, rope, mask, cache=cache)
        elif self.kind == "M":
            # positionally: its tensor-parallel style prepares both inputs
            out = self.mamba(h, mask) if cache is None else self.mamba(h, mask, cache=cache)
        else:
            out = getattr(self, self.mixer_name)(h)
        return x + out

    def new_cache(self, cache, dtype: torch.dtype):
        """The mixer's decoding state: attention's keys and values, a Mamba-2 conv and SSM state;
        None for MLP and MoE layers, which keep nothing between tokens."""
        if self.kind in ("*", "M"):
            return getattr(self, self.mixer_name).new_cache(cache, dtype)
        return None

    def init_weights(self, *, seed: int, prefix: str) -> None:
        init_norm(self.norm)
        getattr(self, self.mixer_name).init_weights(self.init, seed=seed, prefix=f"{prefix}{self.mixer_name}.")


class HybridModel(Decoder):
    """tokens (batch, seq) -> logits (batch, seq, vocab_size), one block per pattern character."""

    def __init__(self, args: HybridModelArgs):
        super().__init__(args)
        if args.rope_theta is not None:
            # Not persistent: a pure function of the args, rebuilt by init_weights after to_empty.
            self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        kind = a.hybrid_layer_pattern[layer_id]
        # Megatron's scaled init: output projections (into the residual stream) / sqrt(2 x layers).
        init = LinearInit(std=_BASE_INIT_STD, out_std=_BASE_INIT_STD / math.sqrt(2 * a.n_layers))
        if kind == "M":
            mixer = Mamba2Mixer(a.dim, a.mamba, norm_eps=a.norm_eps)
        elif kind == "*":
            mixer = Attention(a.dim, a.n_heads, a.n_kv_heads, a.head_dim)
        elif kind == "-":
            mixer = (FeedForward(a.dim, a.ffn_hidden_dim) if a.mlp_activation == "swiglu"
                     else SquaredReLUMLP(a.dim, a.ffn_hidden_dim))
        else:
            mixer = MoE(a.dim, a.moe)
        return HybridBlock(layer_id, kind, norm=self.build_norm(), mixer=mixer, init=init)

    def build_norm(self) -> nn.Module:
        return nn.RMSNorm(self.model_args.dim, eps=self.model_args.norm_eps)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, None, device=device)

    def rotary_angles(self, positions: torch.Tensor | None) -> torch.Tensor | None:
        if self.model_args.rope_theta is None:
            return None
        return self.rope_cache if positions is None else self.rope_cache[positions]

    def init_buffers(self, buffer_device) -> None:
        if self.model_args.rope_theta is not None:
            self.rope_cache = self._rope_cache(device=buffer_device or self.rope_cache.device)


__all__ = ["HybridBlock", "HybridModel", "HybridModelArgs", "LAYER_KINDS", "PatternMoEArgs", "SquaredReLUMLP",
           "parse_pattern"]
