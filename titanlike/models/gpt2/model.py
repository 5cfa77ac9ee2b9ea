"""GPT-2 / GPT-3 decoder, as Megatron-LM trains GPT and as transformers' GPT2LMHeadModel computes.

Pre-norm blocks with LayerNorm (with bias), learned absolute position embeddings added to the
token embeddings, multi-head attention without GQA, a GELU MLP of hidden size 4*dim (tanh
approximation, HF's gelu_new, by default; the exact GELU with gelu_approximate "none"), biases on every linear, a final LayerNorm and an output
projection without bias tied to the token embeddings.

No dropout: Megatron's GPT-3 recipes and modern pre-training run without it, and parity
across parallel layouts needs a deterministic forward. (HF's published GPT-2 configs say 0.1;
those values do not change logits in eval mode, so loading such a folder is exact.)

The position table is a weight of max_seq_len rows, so max_seq_len is the flavor's context and
never the job's training.seq_len (see GPT2Args.update_from_config).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.models.common.attention import Attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import Decoder, DecoderArgs
from titanlike.models.common.feed_forward import GeluMLP
from titanlike.models.common.init import LinearInit, normal_
from titanlike.models.common.norms import build_norm


@dataclass
class GPT2Args(DecoderArgs):
    # Standard deviation of every weight drawn at init (embeddings, input projections); each
    # block's output projections (wo, w2) use init_std / sqrt(2 * n_layers). 0.02 is GPT-2's and
    # Megatron's default; Megatron's GPT-3 175B script uses 0.006 (its --init-method-std).
    init_std: float = 0.02
    # The MLP's GELU: "tanh", the approximation GPT-2 and HF's gelu_new compute (Megatron-LM's
    # --openai-gelu), or "none", the exact erf GELU (Megatron-LM's default, HF's "gelu").
    gelu_approximate: str = "tanh"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"gelu_approximate must be 'tanh' or 'none' (the exact GELU), got {self.gelu_approximate!r}")
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError(f"GPT-2 has no grouped-query attention: n_kv_heads ({self.n_kv_heads}) must be "
                             f"n_heads ({self.n_heads}) or None")

    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim

    # Sizes ------------------------------------------------------------------------------------

    def update_from_config(self, *, vocab_size: int, seq_len: int, decoder_seq_len: int | None = None) -> GPT2Args:
        """Only the vocabulary comes from the job: max_seq_len sizes the learned position table (a
        weight), so it stays the flavor's context; DecoderArgs.validate refuses a longer training.seq_len."""
        return dataclasses.replace(self, vocab_size=vocab_size)

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        d = self.dim
        ln = 2 * d  # LayerNorm weight + bias
        block = self.attention_params(bias=True) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * ln
        # The position table is a lookup (left out by exclude_embedding); the token table and the
        # output projection (tied, untied, or a reward model's score head) as DecoderArgs counts them.
        positions = 0 if exclude_embedding else self.max_seq_len * d
        return self.n_layers * block + ln + positions + self.vocab_params(exclude_embedding=exclude_embedding)


class GPT2(Decoder):
    """GPT-2: tokens (batch, seq) -> logits (batch, seq, vocab_size)."""

    def __init__(self, args: GPT2Args):
        super().__init__(args)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(args.max_seq_len, args.dim)

    def _linear_init(self) -> LinearInit:
        a = self.model_args
        return LinearInit(std=a.init_std, out_std=a.init_std / math.sqrt(2 * a.n_layers), truncated=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        return TransformerBlock(
            layer_id,
            attention=Attention(a.dim, a.n_heads, a.n_heads, a.head_dim, bias=True),
            feed_forward=GeluMLP(a.dim, a.ffn_hidden_dim, bias=True, approximate=a.gelu_approximate),
            attention_norm=self.build_norm(), ffn_norm=self.build_norm(), init=self._linear_init())

    def build_norm(self) -> nn.Module:
        return build_norm("layernorm", self.model_args.dim, eps=self.model_args.norm_eps, bias=True)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Token plus position embeddings. positions: None (0..seq-1), (seq,) (a context-parallel
        slice) or (batch, seq) (positions restarting per document). The position table is indexed
        with a (1 | batch, seq) tensor, so its output is (1 | batch, seq, dim): the shape the
        tensor-parallel position_embedding style cuts along the sequence."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is None:
            return h
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        return h + self.pos_embeddings(positions.to(tokens.device))

    def init_embeddings(self, *, seed: int) -> None:
        std = self.model_args.init_std
        if self.pos_embeddings is not None:
            normal_(self.pos_embeddings.weight, std=std, seed=seed, fqn="pos_embeddings.weight")
        if self.model_args.tie_word_embeddings:
            # One matrix, seeded under the owner's name: the copies that the first and the last
            # pipeline stage hold start equal.
            shared = self.tok_embeddings if self.tok_embeddings is not None else self.output
            if shared is not None:
                normal_(shared.weight, std=std, seed=seed, fqn="tok_embeddings.weight")
            return
        if self.tok_embeddings is not None:
            normal_(self.tok_embeddings.weight, std=std, seed=seed, fqn="tok_embeddings.weight")
        if self.output is not None:
            normal_(self.output.weight, std=std, seed=seed, fqn="output.weight")


__all__ = ["GPT2", "GPT2Args"]
