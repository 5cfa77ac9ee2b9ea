"""BERT: a bidirectional encoder trained with masked-LM and a sentence-pair binary head.

As in Devlin et al. 2019 (and transformers' BertForPreTraining): word + learned position +
token-type embeddings, an embedding LayerNorm, post-LayerNorm blocks (norm after each residual
add) with bidirectional attention, an exact (erf) GELU MLP of hidden size 4*dim (or
explicit_ffn_hidden_dim: HF's intermediate_size, Megatron's --ffn-hidden-size) and biases on
every linear. pre_norm=True gives the block order Megatron-LM's BERT uses (LayerNorm before
attention and MLP, and a final LayerNorm): Shoeybi et al. 2019 (section 3) found it necessary to
train BERT beyond ~336M parameters, so the 3.9B flavor uses it.

Heads, on the last pipeline stage:
  - masked LM: lm_head (dense + GELU + LayerNorm), then `output`, the projection tied to the word
    embeddings, with its own bias (vocab,). forward returns these logits; the trainer's
    cross-entropy on the masked positions (labels IGNORE_INDEX elsewhere) is the MLM loss.
  - binary (next-sentence / sentence-order prediction, binary_head=True): binary_head, a pooler
    (dense + tanh of position 0, the [CLS] token) and a Linear(dim, 2) classifier. Its loss joins the objective
    inside forward (attach_loss), so the loss function and the pipeline schedule stay generic.

No dropout: parity across parallel layouts needs a deterministic forward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.args import AttentionShape, LayoutDegrees
from titanlike.models.common.attention import Attention, DocumentMask
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import Decoder, DecoderArgs
from titanlike.models.common.feed_forward import GeluMLP
from titanlike.models.common.init import LinearInit, normal_, zeros_
from titanlike.models.common.norms import build_norm, init_norm
from titanlike.models.outputs import attach_loss

BINARY_LOSS = "binary_loss"


@dataclass
class BertArgs(DecoderArgs):
    """DecoderArgs' sizes (dim, n_layers, n_heads, vocab_size, max_seq_len = the position table's
    rows, norm_eps) plus BERT's own. The output projection is always tied to the word embeddings."""

    norm_eps: float = 1e-12
    tie_word_embeddings: bool = True
    type_vocab_size: int = 2  # token types (segments A and B)
    # False: post-LayerNorm blocks (original BERT, HF). True: pre-LayerNorm blocks plus a final
    # LayerNorm (Megatron-LM's BERT).
    pre_norm: bool = False
    # The pooler and the binary (NSP/SOP) head, trained on sentence pairs; False: masked LM only.
    binary_head: bool = True
    # Standard deviation of every weight drawn at init; each block's output projections (wo, w2)
    # use init_std / sqrt(2 * n_layers), as Megatron-LM's scaled init.
    init_std: float = 0.02
    # The MLP's hidden size when it is not 4 x dim (HF's intermediate_size, Megatron's --ffn-hidden-size);
    # None: 4 x dim. Read it through the ffn_hidden_dim property.
    explicit_ffn_hidden_dim: int | None = None

    ARG_ALIASES = {**DecoderArgs.ARG_ALIASES, "ffn_hidden_size": ("explicit_ffn_hidden_dim",),
                   "intermediate_size": ("explicit_ffn_hidden_dim",), "ffn_hidden_dim": ("explicit_ffn_hidden_dim",)}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError(f"BERT has no grouped-query attention: n_kv_heads ({self.n_kv_heads}) must be "
                             f"n_heads ({self.n_heads}) or None")
        if not self.tie_word_embeddings:
            raise ValueError("BERT's MLM output projection is tied to the word embeddings: "
                             "tie_word_embeddings must be True")
        if self.moe is not None:
            raise ValueError("BERT has no mixture-of-experts variant: moe must be None")

    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim if self.explicit_ffn_hidden_dim is None else self.explicit_ffn_hidden_dim

    # Samples and shapes ------------------------------------------------------------------------

    def reported_losses(self) -> tuple[str, ...]:
        return (BINARY_LOSS,) if self.binary_head else ()

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_heads, self.n_heads, self.head_dim, causal=False)

    def update_from_config(self, *, vocab_size: int, seq_len: int, decoder_seq_len: int | None = None) -> BertArgs:
        """Only the vocabulary comes from the job: max_seq_len sizes the learned position table (a
        weight), so it stays the flavor's context; validate refuses a longer training.seq_len."""
        return dataclasses.replace(self, vocab_size=vocab_size)

    # Counting ----------------------------------------------------------------------------------

    def _sequence_head_params(self) -> int:
        """The pooler and the binary head: run once per sequence, not per token."""
        d = self.dim
        return (d * d + d + 2 * d + 2) if self.binary_head else 0

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        d = self.dim
        ln = 2 * d  # LayerNorm weight + bias
        f = self.ffn_hidden_dim
        block = self.attention_params(bias=True) + (d * f + f) + (f * d + d) + 2 * ln
        tokens = self.vocab_size * d  # the word table, also the MLM output projection (tied)
        lookups = self.max_seq_len * d + self.type_vocab_size * d  # position and token-type tables
        final_norm = ln if self.pre_norm else 0
        lm_head = (d * d + d) + ln + self.vocab_size  # transform (dense + LayerNorm) and output bias
        total = (tokens + lookups + ln + self.n_layers * block + final_norm + lm_head
                 + self._sequence_head_params())
        # Without embeddings: the pure lookups go; the tied table does the output matmul and stays.
        return total - lookups if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """6 N + 12 L H Q T (attention counted over the full T x T scores: BERT's is bidirectional).
        N: parameters without the position and token-type tables (the tied word table stays, it is
        the MLM output projection), with the MLM head's transform, and without the pooler and the
        binary head, which run once per sequence (a 1/T share of a dim^2 matmul per token)."""
        n = self.num_params(exclude_embedding=True) - self._sequence_head_params()
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        # Heads divisible by TP, seq_len within the position table.
        super().validate(dims, seq_len=seq_len)


class BertBlock(TransformerBlock):
    """Post-norm (pre_norm=False): h = norm1(x + attention(x)); out = norm2(h + mlp(h)).
    Pre-norm: TransformerBlock's order. The norms keep TransformerBlock's names in both orders
    (attention_norm belongs to the attention sublayer, ffn_norm to the MLP's)."""

    def __init__(self, layer_id: int, *, pre_norm: bool, **block):
        super().__init__(layer_id, **block)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: DocumentMask | None = None) -> torch.Tensor:
        if self.pre_norm:
            return super().forward(x, rope, mask)
        h = self.attention_norm(x + self.attention(x, rope, mask))
        return self.ffn_norm(h + self.feed_forward(h))


class LMHeadTransform(nn.Module):
    """The MLM head's transform before the tied output projection: LayerNorm(gelu(dense(h)))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = build_norm("layernorm", dim, eps=eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h)))


class BinaryHead(nn.Module):
    """The binary (NSP/SOP) head: classifier(tanh(pooler(h[:, 0]))), the pooler reading position 0
    ([CLS]) and the classifier a Linear(dim, 2) whose logit 1 means "not in order" (segments
    swapped / B random).

    It declares the binary loss as a reported loss (titanlike/models/outputs.py): training forwards
    add the loss they attach to `reported_loss_sum`, which the trainer reads and zeroes each step.
    The buffer sits on this wrapper, which tensor parallelism leaves a plain module (its linears are
    distributed), so it stays a plain tensor."""

    reported_loss = BINARY_LOSS

    def __init__(self, dim: int):
        super().__init__()
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, 2)
        # Low-precision converters (float8) leave these alone: they multiply one row per sequence,
        # too few for float8 matmuls and too little work to gain from them.
        self.pooler.keep_high_precision = self.classifier.keep_high_precision = True
        self.register_buffer("reported_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.record_statistics = True  # off while a pipeline infers shapes on placeholder inputs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(batch, 2) logits from the final hidden states (batch, seq, dim)."""
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


class Bert(Decoder):
    """tokens (batch, seq) -> MLM logits (batch, seq, vocab_size); see forward."""

    # An encoder: every token sees the whole sequence, so there is nothing to continue and no cache
    # (models/protocol.py: None means the model cannot generate).
    init_cache = prefill = decode_step = None

    def __init__(self, args: BertArgs):
        super().__init__(args)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(args.max_seq_len, args.dim)
        self.type_embeddings: nn.Embedding | None = nn.Embedding(args.type_vocab_size, args.dim)
        self.embedding_norm: nn.Module | None = self._layernorm()
        if not args.pre_norm:
            self.norm = None  # post-norm blocks end normalized
        self.lm_head: LMHeadTransform | None = LMHeadTransform(args.dim, args.norm_eps)
        # The decoder's output projection has no bias; BERT's has one (its weight stays tied).
        self.output = nn.Linear(args.dim, args.vocab_size, bias=True)
        self.binary_head: BinaryHead | None = BinaryHead(args.dim) if args.binary_head else None
        self.tie_weights()
        # The objective's weight for the binary loss (attach_loss): the step's weight tensor, set
        # once at build time; None: 1.
        self.loss_weight: torch.Tensor | None = None

    def _layernorm(self) -> nn.Module:
        return build_norm("layernorm", self.model_args.dim, eps=self.model_args.norm_eps, bias=True)

    def build_norm(self) -> nn.Module:
        return self._layernorm()

    def _linear_init(self) -> LinearInit:
        a = self.model_args
        return LinearInit(std=a.init_std, out_std=a.init_std / math.sqrt(2 * a.n_layers), truncated=False)

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        return BertBlock(
            layer_id, pre_norm=a.pre_norm,
            attention=Attention(a.dim, a.n_heads, a.n_heads, a.head_dim, bias=True, causal=False),
            feed_forward=GeluMLP(a.dim, a.ffn_hidden_dim, bias=True, approximate="none"),
            attention_norm=self._layernorm(), ffn_norm=self._layernorm(), init=self._linear_init())

    # Forward -----------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None,
              token_types: torch.Tensor | None = None) -> torch.Tensor:
        """LayerNorm(word + position + token-type embeddings). The position and type tables are
        indexed with (1 | batch, seq) tensors, the shape the tensor-parallel position_embedding
        style cuts along the sequence."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        if token_types is None:
            token_types = torch.zeros_like(tokens)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions.to(tokens.device))
        return self.embedding_norm(h + self.type_embeddings(token_types))

    def encode(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               mask: DocumentMask | None = None, token_types: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's final hidden states (batch, seq, dim) of this stage's part of the model."""
        h = self.embed(tokens, positions, token_types) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, None, mask)
        return self.norm(h) if self.norm is not None else h

    def binary_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(batch, 2) logits of the binary head from the final hidden states h (batch, seq, dim)."""
        return self.binary_head(h)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None, token_types: torch.Tensor | None = None,
                binary_labels: torch.Tensor | None = None,
                binary_weights: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) (on a later pipeline stage: hidden states (batch, seq, dim)) -> MLM
        logits (batch, seq, vocab_size), or hidden states on a stage without the output end.

        positions: the global positions (seq,) of these tokens (a context-parallel slice), None:
        0..seq-1. mask: a bidirectional DocumentMask (None: every token sees every token).
        token_types (batch, seq): segment ids, None: all 0. binary_labels (batch,): 1 where the
        segments were swapped; given (training), sum_s CE(binary logits_s, label_s) * binary_weights_s
        joins the objective (binary_weights (batch,): each sample's MLM target count, None: 1).
        """
        h = self.encode(tokens, positions, mask, token_types)
        if self.output is None:
            return h
        if self.binary_head is not None and binary_labels is not None:
            h = attach_loss(h, self._binary_loss(h, positions, binary_labels, binary_weights), self.loss_weight)
        return self.output(self.lm_head(h))

    def _binary_loss(self, h: torch.Tensor, positions: torch.Tensor | None, labels: torch.Tensor,
                     weights: torch.Tensor | None) -> torch.Tensor:
        """The binary head's loss in summed units. Under context parallelism position 0 ([CLS]) is
        on one rank only: elsewhere the loss is computed on the local first token and multiplied by
        0, so every rank runs the same graph and gives the pooler and head a (zero) gradient, which
        keeps gradient reduction over the data/context ranks uniform, with no host sync."""
        logits = self.binary_logits(h).float()
        ce = F.cross_entropy(logits, labels.reshape(-1).long(), reduction="none")
        if weights is not None:
            ce = ce * weights.reshape(-1).to(ce.dtype)
        loss = ce.sum()
        if positions is not None:
            loss = loss * (positions.reshape(-1)[0] == 0).to(loss.dtype)
        if self.training and torch.is_grad_enabled() and self.binary_head.record_statistics:
            self.binary_head.reported_loss_sum.add_(loss.detach().float())
        return loss

    # Initialization ----------------------------------------------------------------------------

    def init_embeddings(self, *, seed: int) -> None:
        std = self.model_args.init_std
        # One matrix under the owner's name: the word table and the tied output projection that the
        # first and the last pipeline stage hold start equal.
        shared = self.tok_embeddings if self.tok_embeddings is not None else self.output
        if shared is not None:
            normal_(shared.weight, std=std, seed=seed, fqn="tok_embeddings.weight")
        for name in ("pos_embeddings", "type_embeddings"):
            table = getattr(self, name)
            if table is not None:
                normal_(table.weight, std=std, seed=seed, fqn=f"{name}.weight")
        if self.embedding_norm is not None:
            init_norm(self.embedding_norm)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        super().init_weights(seed=seed, buffer_device=buffer_device)
        std = self.model_args.init_std
        if self.lm_head is not None:
            normal_(self.lm_head.dense.weight, std=std, seed=seed, fqn="lm_head.dense.weight")
            zeros_(self.lm_head.dense.bias)
            init_norm(self.lm_head.norm)
        if self.output is not None:
            zeros_(self.output.bias)
        if self.binary_head is not None:
            for name in ("pooler", "classifier"):
                linear = getattr(self.binary_head, name)
                normal_(linear.weight, std=std, seed=seed, fqn=f"binary_head.{name}.weight")
                zeros_(linear.bias)
            self.binary_head.reported_loss_sum.zero_()  # after to_empty it holds whatever memory held


__all__ = ["BINARY_LOSS", "Bert", "BertArgs", "BertBlock", "BinaryHead", "LMHeadTransform"]
