"""The decoder-only language model skeleton shared by the families built from transformer blocks.

tokens -> token embeddings (+ a family's position encoding) -> blocks -> final norm -> output
projection. A family subclasses DecoderArgs with its own fields and formulas and Decoder with
its block, its norm, its position encoding and its initialization; everything else (tied
embeddings, pipeline-stage ends, the forward loop) lives here once.

Pipeline stages are deep copies of the meta model with `tok_embeddings` (and a family's other
input ends), `norm` and `output` set to None and entries of `layers` deleted: a stage without
embeddings takes hidden states (batch, seq, dim), a stage without output returns them.
`layers` is keyed by the original layer index so parameter names stay stable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from titanlike.models.args import AttentionShape, BaseModelArgs, LayoutDegrees, check_divisible
from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.init import normal_, trunc_normal_
from titanlike.models.common.kv_cache import ModelCache, last_prompt_tokens
from titanlike.models.common.moe import MoEArgs
from titanlike.models.common.norms import init_norm


@dataclass
class DecoderArgs(BaseModelArgs):
    """The sizes every decoder family has; families add their own fields after these."""

    # Megatron's and Hugging Face's names of these fields (and of the MLP size and RoPE base the
    # families that have them add), for [model.args] (BaseModelArgs.with_overrides).
    ARG_ALIASES = {
        "hidden_size": ("dim",), "num_layers": ("n_layers",), "num_hidden_layers": ("n_layers",),
        "num_attention_heads": ("n_heads",), "num_query_groups": ("n_kv_heads",),
        "num_key_value_heads": ("n_kv_heads",), "kv_channels": ("explicit_head_dim",),
        "head_dim": ("explicit_head_dim",), "ffn_hidden_size": ("ffn_hidden_dim",),
        "intermediate_size": ("ffn_hidden_dim",), "max_position_embeddings": ("max_seq_len",),
        "norm_epsilon": ("norm_eps",), "rms_norm_eps": ("norm_eps",), "layernorm_epsilon": ("norm_eps",),
        "rotary_base": ("rope_theta",),
    }

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many key/value heads as query heads (no GQA)
    vocab_size: int = 128256
    max_seq_len: int = 131072
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Mixture of experts in the MLP of some layers (MoEArgs.is_moe_layer); None: dense.
    moe: MoEArgs | None = None
    # Features per attention head when they are not dim // n_heads (Qwen3: 128 at every width);
    # None: dim // n_heads. Read it through the head_dim property.
    explicit_head_dim: int | None = None
    # The output projection gives one score per position (a reward model's head, with_score_head)
    # instead of the vocabulary's logits.
    score_head: bool = False
    OBJECTIVE_FIELDS: ClassVar[dict[str, str]] = {"score_head": "training.objective reward"}

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a checkpoint sidecar (to_dict)
            self.moe = MoEArgs(**self.moe)
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.num_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.num_kv_heads})")

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

    def vocab_params(self, *, exclude_embedding: bool) -> int:
        """The token table and the output projection: two tables unless tied. The table alone is a
        lookup (left out by exclude_embedding); tied to the output projection it does matmul work."""
        table = self.vocab_size * self.dim
        if self.score_head:
            return table * (not exclude_embedding) + self.dim
        if self.tie_word_embeddings:
            return table
        return table if exclude_embedding else 2 * table

    def moe_args(self) -> MoEArgs | None:
        return self.moe

    @property
    def has_score_head(self) -> bool:
        return self.score_head

    def with_score_head(self) -> DecoderArgs:
        # The head is its own (1, dim) matrix: nothing to tie to the token table.
        return dataclasses.replace(self, score_head=True, tie_word_embeddings=False)

    def with_moe_args(self, moe: MoEArgs) -> DecoderArgs:
        return dataclasses.replace(self, moe=moe)

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_heads, self.num_kv_heads, self.head_dim)

    def attention_params(self, *, bias: bool = False) -> int:
        """Parameters of one attention module (wq, wk, wv, wo)."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weights = self.dim * q_dim + 2 * self.dim * kv_dim + q_dim * self.dim
        return weights + ((q_dim + 2 * kv_dim + self.dim) if bias else 0)

    def attention_window(self, layer_id: int) -> int | None:
        """The sliding window of layer layer_id's attention (models/common/attention.py), None for full
        attention (the default: every layer)."""
        return None

    def flops_per_token(self, seq_len: int) -> int:
        """6 N + 12 L H Q T: N parameters a token uses (without embeddings; routed experts: top_k), L layers, H heads, Q head_dim,
        T = seq_len; the attention term counts the full T x T scores (non-causal). A sliding-window
        layer counts the keys its band holds, min(window, T), instead of T."""
        n = self.num_params(exclude_embedding=True, active=True)
        keys = sum(min(seq_len, self.attention_window(i) or seq_len) for i in range(self.n_layers))
        return 6 * n + 12 * self.n_heads * self.head_dim * keys

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        # A head cannot be split across tensor-parallel ranks.
        check_divisible(self.n_heads, "attention heads", dims.tp, "tensor_parallel_degree")
        check_divisible(self.num_kv_heads, "key/value heads", dims.tp, "tensor_parallel_degree")
        if self.moe is not None:
            self.moe.validate_layout(dim=self.dim, ep=dims.ep, cp=dims.cp, etp=dims.etp)
        # Called on the flavor's args, before update_from_config sizes max_seq_len for the job: the
        # positions the model has a table or RoPE angles for (Llama 3.1: 131072, GPT-2: 1024).
        if seq_len > self.context_len:
            raise ValueError(f"training.seq_len {seq_len} exceeds the model's context of {self.context_len} "
                             f"positions; set training.seq_len to at most {self.context_len}")


class Decoder(nn.Module):
    """The skeleton; subclasses implement build_block and may override the hooks below."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = self.build_norm()
        self.output: nn.Linear | None = nn.Linear(args.dim, 1 if args.has_score_head else args.vocab_size, bias=False)
        # {alias: owner}: names of one Parameter under two names. Generic code (pipeline split,
        # checkpoints, gradient sync) reads this, not the tie flag.
        self.tied_weights: dict[str, str] = (
            {"output.weight": "tok_embeddings.weight"} if args.tie_word_embeddings else {})
        self.tie_weights()

    # Family hooks -----------------------------------------------------------------------------

    def build_block(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def build_norm(self) -> nn.Module:
        raise NotImplementedError

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Input embeddings of `tokens`; families with learned positions add them here."""
        return self.tok_embeddings(tokens)

    def rotary_angles(self, positions: torch.Tensor | None) -> torch.Tensor | None:
        """What every block's attention gets as `rope` (None: no rotary positions)."""
        return None

    def init_embeddings(self, *, seed: int) -> None:
        """Initialize the input and output ends this module holds (tok_embeddings, output, ...).

        The default (Llama's): a unit-normal table and an output projection drawn with std
        dim^-0.5, truncated at 3 std, so initial logits are O(1) (every block normalizes its
        input). Tied, the one matrix gets the projection's scale. Draws are seeded by parameter
        name, the tied matrix under the owner's, so pipeline stages holding separate copies (first
        and last) agree. Families with other ends (learned positions, other scales) override it.
        """
        std = self.model_args.dim**-0.5
        if self.model_args.tie_word_embeddings:
            shared = self.tok_embeddings if self.tok_embeddings is not None else self.output
            if shared is not None:
                trunc_normal_(shared.weight, std=std, a=-3 * std, b=3 * std, seed=seed, fqn="tok_embeddings.weight")
            return
        if self.tok_embeddings is not None:
            normal_(self.tok_embeddings.weight, std=1.0, seed=seed, fqn="tok_embeddings.weight")
        if self.output is not None:
            trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std, seed=seed, fqn="output.weight")

    def init_buffers(self, buffer_device: torch.device | str | None) -> None:
        """Rebuild non-persistent buffers after to_empty (e.g. a RoPE table)."""

    # Shared machinery -------------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Make every alias in tied_weights the same Parameter as its owner, where both exist here."""
        for alias, owner in self.tied_weights.items():
            alias_module, alias_attr = _parent(self, alias)
            owner_module, owner_attr = _parent(self, owner)
            if alias_module is None or owner_module is None:
                continue  # a pipeline stage holding one end only
            shared = getattr(owner_module, owner_attr)
            if getattr(alias_module, alias_attr) is not shared:
                setattr(alias_module, alias_attr, shared)

    def _apply(self, fn, recurse=True):
        # to_empty (meta -> real device) creates a new Parameter per module, which silently unties
        # shared weights; tie them again. FSDP2's _apply wraps this one and then re-registers the
        # (now shared) sharded parameter.
        ret = super()._apply(fn, recurse)
        self.tie_weights()
        return ret

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None, *, cache: ModelCache | None = None,
                embeddings: torch.Tensor | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """positions: each token's position, (seq,) or per sample (batch, seq), when it is not
        0..seq-1 (a context-parallel slice, positions restarting per document); None means
        0..seq-1. mask: attend within documents only (None: plain causal). cache: the decoding
        state when generating (see prefill and decode_step), None in training. embeddings: what
        embed(tokens, positions) would give, computed by the caller (a vision-language model splices
        image features into it, models/llava); None: embed the tokens here. logits_at: (N,) indices
        into the flattened (batch x seq) positions, the only ones whose logits the loss reads (an RL
        objective's completion tokens): the logits are then (N, vocab), and the final norm and the
        output projection, which with a large vocabulary cost more than the blocks, run on N rows
        (objectives/base.py Microbatch.logits_at)."""
        if embeddings is not None:
            h = embeddings
        else:
            h = self.embed(tokens, positions) if self.tok_embeddings is not None else tokens
        rope = self.rotary_angles(positions)
        if cache is None:
            for layer in self.layers.values():
                h = layer(h, rope, mask)
        else:
            for key, layer in self.layers.items():
                h = layer(h, rope, mask, cache=cache.layer(key))
            h = last_prompt_tokens(h, cache)
        if logits_at is not None:
            h = h.flatten(0, 1).index_select(0, logits_at)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    # Generation (models/protocol.py: init_cache, prefill, decode_step) ---------------------------

    def init_cache(self, batch_size: int, capacity: int, *, device: torch.device | str,
                   dtype: torch.dtype) -> ModelCache:
        """An empty decoding state for batch_size rows of up to capacity tokens each: one entry per
        layer whose block keeps state (new_cache: attention's keys and values, a Mamba-2 state)."""
        cache = ModelCache(batch_size, capacity, device)
        for key, layer in self.cached_layers():
            entry = layer.new_cache(cache, dtype)
            if entry is not None:
                cache.layers[key] = entry
        return cache

    def cached_layers(self):
        """(key, block) of the layers a generating forward runs (DeepSeek: the trunk only)."""
        return self.layers.items()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: ModelCache, *,
                start_id: int | None = None) -> torch.Tensor:
        """tokens (batch, P), right-padded prompts of `lengths` real tokens -> the logits (batch, vocab)
        of the token after each prompt; the cache then holds the prompts. start_id: an encoder-
        decoder's decoder start token, unused here."""
        cache.begin_prefill(lengths, tokens.shape[1])
        logits = self(tokens, cache=cache)
        cache.end_prefill()
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """tokens (batch,), one new token per row at its row's next position -> logits (batch, vocab)."""
        cache.begin_decode()
        logits = self(tokens[:, None], positions=cache.positions(), cache=cache)[:, -1]
        cache.end_decode()  # after the logits: in a compiled step they end the graph (kv_cache.py: Static)
        return logits

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every parameter as a function of (seed, its name, model args) only.

        Works on whatever this module holds after parallelization and `to_empty`: a subset of
        layers, DTensor shards, wrapped submodules. buffer_device is where non-persistent buffers
        are rebuilt (default: where they already live).
        """
        self.init_buffers(buffer_device)
        self.init_embeddings(seed=seed)
        for key, layer in self.layers.items():
            layer.init_weights(seed=seed, prefix=f"layers.{key}.")
        if self.norm is not None:
            init_norm(self.norm)


def _parent(root: nn.Module, fqn: str) -> tuple[nn.Module | None, str]:
    """(module holding the parameter `fqn`, attribute name), or (None, name) where a module on the
    path is absent (set to None by a pipeline split)."""
    path, _, attr = fqn.rpartition(".")
    module = root
    for part in path.split(".") if path else ():
        module = getattr(module, part, None)
        if module is None:
            return None, attr
    return module, attr


__all__ = ["Decoder", "DecoderArgs"]
