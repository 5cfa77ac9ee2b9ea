"""The Llama 3 decoder (Llama 3 / 3.1 / 3.2 dense models).

Pre-norm decoder blocks: h = x + Attention(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h)),
with grouped-query attention and rotary position embeddings (Llama 3.1 frequency
scaling). The module tree mirrors Meta's reference implementation and torchtitan
(tok_embeddings, layers.N.attention.wq, ..., norm, output) so that checkpoints and
parallelize plans written against those names apply unchanged.

The model is meant to be built on the meta device, parallelized, materialized with
`to_empty`, and then initialized with `init_weights(seed=...)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.common.attention import DocumentMask, core_attention
from titanlike.models.common.init import normal_, ones_, trunc_normal_
from titanlike.models.common.rope import RoPEScaling, apply_rotary_emb, precompute_rope_cache

# Standard deviation of the input projections (and of the output projections before
# depth scaling), as in torchtitan's Llama.
_BASE_INIT_STD = 0.02


@dataclass
class TransformerModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many key/value heads as query heads (no GQA)
    vocab_size: int = 128256
    # SwiGLU hidden size: int(8 * dim / 3), times ffn_dim_multiplier, rounded up to multiple_of.
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RoPEScaling | None = None
    max_seq_len: int = 131072
    tie_word_embeddings: bool = False
    # Scale the init std of each block's output projections by its depth (torchtitan's
    # default) rather than by the total number of layers.
    depth_init: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.num_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RoPEScaling(**self.rope_scaling)

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Meta's rule: 2/3 of 4*dim keeps SwiGLU's three matrices at the cost of a 4*dim MLP.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def num_params_from_args(args: TransformerModelArgs, *, exclude_embedding: bool = False) -> int:
    """Parameter count of the full model, computed from its args (tied weights counted once).

    With exclude_embedding the embedding lookup table is left out; a tied table is
    also the output projection, which does matmul work, so it stays counted.
    """
    q_dim, kv_dim = args.n_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attention = args.dim * q_dim + 2 * args.dim * kv_dim + q_dim * args.dim
    feed_forward = 3 * args.dim * args.ffn_hidden_dim
    block = attention + feed_forward + 2 * args.dim
    table = args.vocab_size * args.dim
    total = args.n_layers * block + args.dim + table
    if not args.tie_word_embeddings:
        total += table  # the separate output projection
    if exclude_embedding and not args.tie_word_embeddings:
        total -= table
    return total


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # (q, k, v, mask) -> out over (batch, heads, seq, head_dim). A hook, not a fixed call, so
        # that context parallelism can swap in attention across ranks without touching this module.
        self.core_attention = core_attention

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism this rank holds only its local heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q = apply_rotary_emb(q, rope_cache)
        k = apply_rotary_emb(k, rope_cache)
        out = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, *, seed: int, prefix: str, out_std: float) -> None:
        for name in ("wq", "wk", "wv"):
            trunc_normal_(getattr(self, name).weight, std=_BASE_INIT_STD, seed=seed, fqn=f"{prefix}{name}.weight")
        trunc_normal_(self.wo.weight, std=out_std, seed=seed, fqn=f"{prefix}wo.weight")


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, *, seed: int, prefix: str, out_std: float) -> None:
        trunc_normal_(self.w1.weight, std=_BASE_INIT_STD, seed=seed, fqn=f"{prefix}w1.weight")
        # w3 feeds the residual stream only through w2, but torchtitan scales it with
        # depth too; we keep that so runs are comparable with theirs.
        for name in ("w2", "w3"):
            trunc_normal_(getattr(self, name).weight, std=out_std, seed=seed, fqn=f"{prefix}{name}.weight")


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = _BASE_INIT_STD / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, *, seed: int, prefix: str) -> None:
        ones_(self.attention_norm.weight)
        ones_(self.ffn_norm.weight)
        self.attention.init_weights(seed=seed, prefix=f"{prefix}attention.", out_std=self.out_init_std)
        self.feed_forward.init_weights(seed=seed, prefix=f"{prefix}feed_forward.", out_std=self.out_init_std)


class Transformer(nn.Module):
    """Llama 3 decoder returning logits (batch, seq, vocab_size) for tokens (batch, seq).

    A pipeline stage may set `tok_embeddings`, `norm` and `output` to None and delete
    entries of `layers`: a stage without embeddings takes hidden states
    (batch, seq, dim) as input, a stage without output returns hidden states.
    `layers` is keyed by the original layer index so names stay stable.
    """

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: it is a pure function of the args, recomputed by init_weights
        # after to_empty, and checkpoints should not carry it.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def tie_weights(self) -> None:
        """Make output.weight the same Parameter as tok_embeddings.weight (if tied and both exist)."""
        if (self.model_args.tie_word_embeddings and self.tok_embeddings is not None
                and self.output is not None and self.output.weight is not self.tok_embeddings.weight):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty (meta -> real device) creates a new Parameter per module, which
        # silently unties shared weights; tie them again. FSDP2's _apply wraps this one
        # and then re-registers the (now shared) sharded parameter.
        ret = super()._apply(fn, recurse)
        self.tie_weights()
        return ret

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device=device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None) -> torch.Tensor:
        """positions: the RoPE position of each token, (seq,) or per sample (batch, seq), when it
        is not 0..seq-1 (a context-parallel slice, positions restarting per document); None
        means 0..seq-1. mask: attend within documents only (None: plain causal)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The blocks rotate token j by row j of the table they get; picking the rows here
        # gives every token its global angle.
        rope_cache = self.rope_cache if positions is None else self.rope_cache[positions]
        for layer in self.layers.values():
            h = layer(h, rope_cache, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every parameter as a function of (seed, its name, model args) only.

        Works on whatever this module holds after parallelization and `to_empty`:
        a subset of layers, DTensor shards, wrapped submodules. buffer_device is where
        the RoPE table is rebuilt (default: where the buffer already lives).
        """
        args = self.model_args
        self.rope_cache = self._rope_cache(device=buffer_device or self.rope_cache.device)

        if args.tie_word_embeddings:
            # One matrix serves as table and projection. We give it the output
            # projection's scale so initial logits are O(1); a tiny embedding is harmless
            # because every block normalizes its input. It is seeded under one name so
            # that pipeline stages holding separate copies (first and last) agree.
            shared = self.tok_embeddings.weight if self.tok_embeddings is not None else (
                self.output.weight if self.output is not None else None)
            if shared is not None:
                self._init_output_projection(shared, seed=seed, fqn="tok_embeddings.weight")
        else:
            if self.tok_embeddings is not None:
                normal_(self.tok_embeddings.weight, std=1.0, seed=seed, fqn="tok_embeddings.weight")
            if self.output is not None:
                self._init_output_projection(self.output.weight, seed=seed, fqn="output.weight")

        for key, layer in self.layers.items():
            layer.init_weights(seed=seed, prefix=f"layers.{key}.")
        if self.norm is not None:
            ones_(self.norm.weight)

    def _init_output_projection(self, weight: torch.Tensor, *, seed: int, fqn: str) -> None:
        std = self.model_args.dim**-0.5
        trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, seed=seed, fqn=fqn)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held by this module (tied weights once; a pipeline stage counts its own).

        exclude_embedding leaves out the embedding lookup table, which does no matmul
        work; a tied table is also the output projection and stays counted.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None and not self.model_args.tie_word_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the whole model: 6*N + 12*L*H*Q*T.

        N is the parameter count without the embedding table (of the full model, also
        on a pipeline stage), L layers, H heads, Q head_dim, T = seq_len. The attention
        term counts the full T x T score matrix, i.e. attention is counted as
        non-causal (a causal kernel does about half of that work).
        """
        args = self.model_args
        n = num_params_from_args(args, exclude_embedding=True)
        return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
