"""T5: an encoder-decoder transformer with relative position buckets, as Raffel et al. (2020) train it
and transformers' T5ForConditionalGeneration computes it.

- One token table shared by the encoder, the decoder and (tied) the output projection.
- Pre-norm blocks; T5's norm is an RMSNorm without bias (T5LayerNorm, eps 1e-6).
- No absolute positions: every attention score gets a learned bias per head and per bucket of the
  key's offset from the query (buckets exact for short offsets, log-spaced up to max_distance).
  Each stack has one table (HF keeps it in the stack's block 0 and shares it with the other
  blocks); the encoder's buckets tell "before" from "after", the decoder's only look back.
- Scores are not scaled by head_dim^-0.5: T5 folds that factor into the query projection's init.
- Decoder blocks add cross-attention over the encoder's output (no position bias there).
- MLP variants: "gated-gelu" (T5 v1.1: w2(gelu_tanh(w1 x) * w3 x), HF's gelu_new) and "relu"
  (the original T5: w2(relu(w1 x))).
- Original T5 ties the output projection to the token table and scales the decoder's output by
  dim^-0.5 first; v1.1 unties them and does not scale.
No dropout: parity across parallel layouts needs a deterministic forward.

Every block lives in one `layers` ModuleDict, encoder blocks "0".."E-1" first, then decoder blocks,
so activation checkpointing, compile and FSDP wrap them like any family's. The two relative-bias
tables are top-level modules (not inside block 0): the model computes each stack's bias once and
hands it to every block, so a block maps tensors to a tensor and FSDP gathers the tables with the
root module. The Hugging Face adapter maps them to HF's block-0 names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.args import AttentionShape, BaseModelArgs, LayoutDegrees, check_divisible
from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.dtensor import local_part
from titanlike.models.common.init import normal_, ones_
from titanlike.models.common.kv_cache import ModelCache, copy_slots, lazy_buffer

FEED_FORWARD_VARIANTS = ("gated-gelu", "relu")


@dataclass
class T5Args(BaseModelArgs):
    # Megatron's and Hugging Face's names of the fields, for [model.args].
    ARG_ALIASES = {
        "hidden_size": ("dim",), "d_model": ("dim",), "encoder_num_layers": ("n_encoder_layers",),
        "num_layers": ("n_encoder_layers",), "decoder_num_layers": ("n_decoder_layers",),
        "num_decoder_layers": ("n_decoder_layers",), "num_attention_heads": ("n_heads",), "num_heads": ("n_heads",),
        "kv_channels": ("head_dim",), "d_kv": ("head_dim",), "ffn_hidden_size": ("ffn_hidden_dim",),
        "d_ff": ("ffn_hidden_dim",), "layernorm_epsilon": ("norm_eps",), "layer_norm_epsilon": ("norm_eps",),
    }
    dim: int = 512  # d_model
    n_encoder_layers: int = 8
    n_decoder_layers: int = 8
    n_heads: int = 6
    head_dim: int = 64  # d_kv: T5 sets it apart from dim // n_heads
    ffn_hidden_dim: int = 1024  # d_ff
    vocab_size: int = 32128
    # "gated-gelu" (T5 v1.1) or "relu" (original T5): HF's feed_forward_proj values.
    feed_forward: str = "gated-gelu"
    # One matrix for the token table and the output projection (original T5) or two (v1.1).
    tie_word_embeddings: bool = False
    # Multiply the decoder's output by dim^-0.5 before the output projection (original T5, whose
    # token table is unit-normal and shared with the projection); transformers 5 names it so.
    scale_decoder_outputs: bool = False
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    norm_eps: float = 1e-6
    # Only what config.json's n_positions reports: relative buckets have no table of positions, so
    # any sequence length runs (the trainer sets this to training.seq_len).
    max_seq_len: int = 512
    # Decoder tokens per encoder token, for flops_per_token only (the trainer counts tokens as
    # batch x training.seq_len, the encoder's). 0.25 is Megatron's T5 recipe (encoder 512, decoder
    # 128) and our preset's (128 / 32).
    decoder_len_ratio: float = 0.25


    def __post_init__(self) -> None:
        if self.feed_forward not in FEED_FORWARD_VARIANTS:
            raise ValueError(f"T5 feed_forward must be one of {FEED_FORWARD_VARIANTS}, got {self.feed_forward!r}")
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1:
            raise ValueError("T5 needs at least one encoder and one decoder layer")

    @property
    def gated(self) -> bool:
        return self.feed_forward.startswith("gated-")

    # Sizes --------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.n_encoder_layers + self.n_decoder_layers

    def attention_shape(self) -> AttentionShape:
        # The encoder's (training.seq_len is its length): bidirectional.
        return AttentionShape(self.n_heads, self.n_heads, self.head_dim, causal=False)

    def _attention_params(self) -> int:
        inner = self.n_heads * self.head_dim
        return 4 * self.dim * inner  # wq, wk, wv, wo; no biases

    def _ffn_params(self) -> int:
        return (3 if self.gated else 2) * self.dim * self.ffn_hidden_dim

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        d = self.dim
        encoder_block = self._attention_params() + self._ffn_params() + 2 * d
        decoder_block = 2 * self._attention_params() + self._ffn_params() + 3 * d
        tables = 2 * self.relative_attention_num_buckets * self.n_heads  # lookups: embeddings
        tokens = self.vocab_size * d
        output = 0 if self.tie_word_embeddings else tokens
        total = (self.n_encoder_layers * encoder_block + self.n_decoder_layers * decoder_block + 2 * d
                 + tables + tokens + output)
        if exclude_embedding:
            # The tied table is the output projection (matmul work) and stays counted.
            total -= tables + (0 if self.tie_word_embeddings else tokens)
        return total

    def update_from_config(self, *, vocab_size: int, seq_len: int, decoder_seq_len: int | None = None) -> T5Args:
        """The job's vocabulary and encoder length; the decoder's length sets decoder_len_ratio, so
        flops_per_token (per encoder token) counts the decoder the job really runs."""
        ratio = self.decoder_len_ratio if decoder_seq_len is None else decoder_seq_len / seq_len
        return dataclasses.replace(self, vocab_size=vocab_size, max_seq_len=seq_len, decoder_len_ratio=ratio)

    def decoder_len(self, seq_len: int) -> int:
        return max(1, round(seq_len * self.decoder_len_ratio))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) of one sample divided by its ENCODER length S = seq_len,
        because the trainer's MFU divides by batch x training.seq_len. The decoder length is
        D = round(S x decoder_len_ratio). Each matrix counts 6 FLOPs per parameter per token it
        reads: encoder weights S tokens; decoder weights and the output projection D tokens, except
        cross-attention's wk and wv, which read the S encoder tokens. Attention scores count the full
        matrices (non-causal, as every family here): 12 H Q x (E S S + L D D + L D S) for E encoder
        and L decoder layers, H heads of Q features. Relative-bias lookups and norms' elementwise work
        are not counted (norm weights are, as parameters, like the other families)."""
        s, dlen = seq_len, self.decoder_len(seq_len)
        d, inner = self.dim, self.n_heads * self.head_dim
        encoder = self.n_encoder_layers * (self._attention_params() + self._ffn_params() + 2 * d) + d
        cross_kv = self.n_decoder_layers * 2 * d * inner
        decoder = (self.n_decoder_layers * (2 * self._attention_params() + self._ffn_params() + 3 * d) + d
                   - cross_kv + self.vocab_size * d)
        matmuls = 6 * (encoder * s + cross_kv * s + decoder * dlen)
        scores = 12 * inner * (self.n_encoder_layers * s * s + self.n_decoder_layers * (dlen * dlen + dlen * s))
        return (matmuls + scores) // s

    # Rules --------------------------------------------------------------------------------------

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        check_divisible(self.n_heads, "attention heads", dims.tp, "tensor_parallel_degree")
        if dims.pp > 1:
            raise ValueError("T5 does not support pipeline_parallel_degree > 1: every decoder stage would need the "
                             "encoder's output carried along with its own activations, which the pipeline schedules "
                             "do not do; set pipeline_parallel_degree to 1")
        if dims.cp > 1:
            raise ValueError("T5 does not support context_parallel_degree > 1: context-parallel attention splits "
                             "neither the relative position bias nor cross-attention; set context_parallel_degree "
                             "to 1")


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each offset (key position - query position), Mesh TensorFlow's rule as T5 uses it.

    Bidirectional: half the buckets for keys after the query, half for keys at or before it.
    Unidirectional (a causal decoder): keys after the query all fall in bucket 0 (they are masked
    anyway). Within a half, the first half of the buckets are exact distances 0, 1, ...; the rest
    are log-spaced up to max_distance, and every longer distance shares the last bucket.
    """
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # clamp: log(0) is never used (distance < exact takes the exact bucket) but must not be -inf.
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    log_bucket = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, log_bucket)


class RelativePositionBias(nn.Module):
    """A stack's learned bias per head and offset bucket, stored (n_heads, num_buckets) so tensor
    parallelism splits dim 0 with the heads (head_split_parameters): a rank reads only its heads' rows."""

    head_split_parameters = ("weight",)

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, *, bidirectional: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads, num_buckets))
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, length: int) -> torch.Tensor:
        """The bias of self-attention over `length` tokens: (1, local heads, length, length)."""
        weight = local_part(self.weight)
        position = torch.arange(length, device=weight.device)
        buckets = relative_position_bucket(position[None, :] - position[:, None], bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return weight[:, buckets].unsqueeze(0)


def masked_bias(bias: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The additive attention bias with disallowed scores at the dtype's lowest value (HF's choice:
    finite, so a row never becomes NaN; torch.where, so nothing overflows)."""
    return torch.where(allowed, bias, torch.finfo(bias.dtype).min)


class T5Attention(nn.Module):
    """Multi-head attention without biases or score scaling; `bias` (additive, broadcast to (batch,
    heads, queries, keys)) carries the relative positions and the masks. Projections wq, wk, wv,
    wo are named as the common Attention's, so the sharding plan (sharding.py) splits them by heads."""

    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        inner = n_heads * head_dim
        self.wq = nn.Linear(dim, inner, bias=False)
        self.wk = nn.Linear(dim, inner, bias=False)
        self.wv = nn.Linear(dim, inner, bias=False)
        self.wo = nn.Linear(inner, dim, bias=False)

    def attend(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(kv).view(bsz, kv.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.wv(kv).view(bsz, kv.shape[1], -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=1.0)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, args: T5Args, *, seed: int, prefix: str) -> None:
        # Mesh TensorFlow's (and HF's) scales: the query's includes the head_dim^-0.5 that the
        # scores leave out.
        inner = args.n_heads * args.head_dim
        stds = {"wq": (args.dim * args.head_dim) ** -0.5, "wk": args.dim**-0.5, "wv": args.dim**-0.5,
                "wo": inner**-0.5}
        for name, std in stds.items():
            normal_(getattr(self, name).weight, std=std, seed=seed, fqn=f"{prefix}{name}.weight")


    def _heads(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x).view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def _attend_cached(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.wq, x)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=bias.to(q.dtype), scale=1.0)
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class SelfAttention(T5Attention):
    def forward(self, x: torch.Tensor, bias: torch.Tensor, *, cache: T5LayerCache | None = None) -> torch.Tensor:
        if cache is None:
            return self.attend(x, x, bias)
        c = cache.cache
        k, v = self._heads(self.wk, x), self._heads(self.wv, x)
        cache.k = lazy_buffer(cache.k, c, k, slot_dim=2, dtype=cache.dtype)
        cache.v = lazy_buffer(cache.v, c, v, slot_dim=2, dtype=cache.dtype)
        c.write(cache.k, k, dim=2)
        c.write(cache.v, v, dim=2)
        return self._attend_cached(x, c.read(cache.k, 2), c.read(cache.v, 2), bias)


class CrossAttention(T5Attention):
    # Both x and the encoder's output are sequence-sharded activations under sequence parallelism:
    # the sharding's gather_input style all-gathers this many leading inputs (models/protocol.py).
    sequence_inputs = 2

    def forward(self, x: torch.Tensor, encoder_out: torch.Tensor | None, bias: torch.Tensor, *,
                cache: T5LayerCache | None = None) -> torch.Tensor:
        if cache is None:
            return self.attend(x, encoder_out, bias)
        if cache.cross_k is None:  # the prefill: the encoder's keys and values, once per layer
            cache.cross_k, cache.cross_v = self._heads(self.wk, encoder_out), self._heads(self.wv, encoder_out)
        return self._attend_cached(x, cache.cross_k, cache.cross_v, bias)


class T5LayerCache:
    """A decoder layer's state while generating: its self-attention's keys and values (one slot per
    decoder token) and its cross-attention's keys and values of the encoder's output, computed once
    at the prefill."""

    def __init__(self, cache: ModelCache, dtype: torch.dtype):
        # (batch, this rank's heads, capacity, head_dim), allocated at the first write from the
        # forward's own keys (models/common/kv_cache.lazy_buffer).
        self.cache, self.dtype = cache, dtype
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.cross_k: torch.Tensor | None = None
        self.cross_v: torch.Tensor | None = None

    def copy_row(self, row: int, source: T5LayerCache, source_row: int) -> None:
        """Continuous batching's refill (models/common/kv_cache.py): the decoder's slots, and the
        encoder's keys and values, the rows' encoder lengths padded to the longest (the cross
        bias, EncoderMask, masks the padding)."""
        self.k = lazy_buffer(self.k, self.cache, source.k, slot_dim=2)
        self.v = lazy_buffer(self.v, self.cache, source.v, slot_dim=2)
        copy_slots(self.k, row, source.k, source_row, dim=2)
        copy_slots(self.v, row, source.v, source_row, dim=2)
        self.cross_k = _fit_row(self.cross_k, row, source.cross_k, source_row, self.cache.batch_size, 0.0, -2)
        self.cross_v = _fit_row(self.cross_v, row, source.cross_v, source_row, self.cache.batch_size, 0.0, -2)


class EncoderMask:
    """The cross-attention bias of a generating batch, (batch, 1, 1, encoder length): 0 on each
    row's real encoder tokens, the lowest value on its padding (cache.extra["cross_bias"])."""

    def __init__(self, batch_size: int, bias: torch.Tensor | None = None):
        self.batch_size, self.bias = batch_size, bias

    def copy_row(self, row: int, source: EncoderMask, source_row: int) -> None:
        low = torch.finfo(source.bias.dtype).min
        self.bias = _fit_row(self.bias, row, source.bias, source_row, self.batch_size, low, -1)


def _fit_row(buffer: torch.Tensor | None, row: int, source: torch.Tensor, source_row: int, batch: int,
             fill: float, dim: int) -> torch.Tensor:
    """buffer (batch, ...) with row `row` replaced by source[source_row], whose length along `dim`
    (negative) may differ: the buffer grows to the longer one, the rest of the row is `fill`.
    buffer None: a new one, every other row at `fill`."""
    if buffer is None:
        buffer = source.new_full((batch, *source.shape[1:]), fill)
    elif buffer.shape[dim] < source.shape[dim]:
        shape = list(buffer.shape)
        shape[dim] = source.shape[dim] - buffer.shape[dim]
        buffer = torch.cat([buffer, buffer.new_full(shape, fill)], dim=dim)
    buffer[row] = fill
    buffer[row].narrow(dim, 0, source.shape[dim]).copy_(source[source_row])
    return buffer


class T5FeedForward(nn.Module):
    """gated-gelu: w2(gelu_tanh(w1 x) * w3 x); relu: w2(relu(w1 x)). Names as the common MLPs'."""

    def __init__(self, dim: int, hidden_dim: int, *, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False) if gated else None
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)))
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))

    def init_weights(self, args: T5Args, *, seed: int, prefix: str) -> None:
        normal_(self.w1.weight, std=args.dim**-0.5, seed=seed, fqn=f"{prefix}w1.weight")
        if self.w3 is not None:
            normal_(self.w3.weight, std=args.dim**-0.5, seed=seed, fqn=f"{prefix}w3.weight")
        normal_(self.w2.weight, std=args.ffn_hidden_dim**-0.5, seed=seed, fqn=f"{prefix}w2.weight")


class T5Block(nn.Module):
    """An encoder block (self-attention, MLP) or, with cross-attention, a decoder block; pre-norm."""

    def __init__(self, layer_id: int, args: T5Args, *, decoder: bool):
        super().__init__()
        self.layer_id = layer_id
        norm = lambda: nn.RMSNorm(args.dim, eps=args.norm_eps)  # noqa: E731
        self.attention_norm = norm()
        self.attention = SelfAttention(args.dim, args.n_heads, args.head_dim)
        self.cross_attention_norm = norm() if decoder else None
        self.cross_attention = CrossAttention(args.dim, args.n_heads, args.head_dim) if decoder else None
        self.ffn_norm = norm()
        self.feed_forward = T5FeedForward(args.dim, args.ffn_hidden_dim, gated=args.gated)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, encoder_out: torch.Tensor | None = None,
                cross_bias: torch.Tensor | None = None, *, cache: T5LayerCache | None = None) -> torch.Tensor:
        """cache: a decoder block's state when generating (T5LayerCache), else None."""
        if cache is None:
            h = x + self.attention(self.attention_norm(x), bias)
            if self.cross_attention is not None:
                h = h + self.cross_attention(self.cross_attention_norm(h), encoder_out, cross_bias)
        else:
            h = x + self.attention(self.attention_norm(x), bias, cache=cache)
            h = h + self.cross_attention(self.cross_attention_norm(h), encoder_out, cross_bias, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, args: T5Args, *, seed: int, prefix: str) -> None:
        for norm in (self.attention_norm, self.cross_attention_norm, self.ffn_norm):
            if norm is not None:
                ones_(norm.weight)
        self.attention.init_weights(args, seed=seed, prefix=f"{prefix}attention.")
        if self.cross_attention is not None:
            self.cross_attention.init_weights(args, seed=seed, prefix=f"{prefix}cross_attention.")
        self.feed_forward.init_weights(args, seed=seed, prefix=f"{prefix}feed_forward.")


class T5(nn.Module):
    """T5: encoder tokens (batch, seq) and decoder inputs (batch, decoder_seq) -> logits (batch,
    decoder_seq, vocab_size)."""

    def __init__(self, args: T5Args):
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        bias = lambda bidirectional: RelativePositionBias(  # noqa: E731
            args.n_heads, args.relative_attention_num_buckets, args.relative_attention_max_distance,
            bidirectional=bidirectional)
        self.encoder_relative_bias = bias(True)
        self.decoder_relative_bias = bias(False)
        self.layers = nn.ModuleDict({str(i): T5Block(i, args, decoder=i >= args.n_encoder_layers)
                                     for i in range(args.num_layers)})
        self.encoder_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # {alias: owner}, read by generic code (checkpoints, gradient sync).
        self.tied_weights: dict[str, str] = (
            {"output.weight": "tok_embeddings.weight"} if args.tie_word_embeddings else {})
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make output.weight the token table's Parameter again where tied (after to_empty or TP)."""
        if self.tied_weights and self.output is not None and self.tok_embeddings is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty makes a new Parameter per module, which unties shared weights; tie them again.
        ret = super()._apply(fn, recurse)
        self.tie_weights()
        return ret

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None, decoder_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: the encoder's inputs (batch, seq). positions: unused (T5's positions are relative
        offsets within each sequence; context parallelism, which would need global ones, is refused).
        mask: the encoder's bidirectional DocumentMask whose document 0 is the real tokens and
        document 1 the padding at the end; padded keys are hidden from encoder self-attention and
        from cross-attention, like HF's attention_mask (None: nothing is padding).
        decoder_inputs: (batch, decoder_seq), attended causally; its padding is at the end, so
        it needs no mask."""
        if decoder_inputs is None:
            raise ValueError("T5's forward needs decoder_inputs (batch, decoder_seq) besides the encoder's tokens")
        n_enc = self.model_args.n_encoder_layers
        blocks = list(self.layers.values())
        seq, dec_seq = tokens.shape[1], decoder_inputs.shape[1]

        # (batch | 1, 1, 1, seq): which encoder tokens are keys anyone may attend to.
        real = (torch.ones(1, seq, dtype=torch.bool, device=tokens.device) if mask is None
                else mask.document_ids == 0)[:, None, None, :]
        h = self.tok_embeddings(tokens)
        bias = masked_bias(self.encoder_relative_bias(seq), real)
        for block in blocks[:n_enc]:
            h = block(h, bias)
        encoder_out = self.encoder_norm(h)

        causal = torch.ones(dec_seq, dec_seq, dtype=torch.bool, device=tokens.device).tril()
        bias = masked_bias(self.decoder_relative_bias(dec_seq), causal)
        cross_bias = masked_bias(torch.zeros((), dtype=bias.dtype, device=bias.device), real)
        h = self.tok_embeddings(decoder_inputs)
        for block in blocks[n_enc:]:
            h = block(h, bias, encoder_out, cross_bias)
        h = self.norm(h)
        if self.model_args.scale_decoder_outputs:
            h = h * self.model_args.dim**-0.5
        return self.output(h)

    # Generation (models/protocol.py: init_cache, prefill, decode_step) ---------------------------
    # The prompt is the encoder's input; the decoder starts from start_id (the pad id, HF's
    # decoder_start_token_id) and the cache holds the decoder's tokens.

    def init_cache(self, batch_size: int, capacity: int, *, device: torch.device | str,
                   dtype: torch.dtype) -> ModelCache:
        cache = ModelCache(batch_size, capacity, device)
        for key in list(self.layers)[self.model_args.n_encoder_layers:]:
            cache.layers[key] = T5LayerCache(cache, dtype)
        cache.extra["cross_bias"] = EncoderMask(batch_size)
        return cache

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: ModelCache, *,
                start_id: int | None = None) -> torch.Tensor:
        """tokens (batch, P): the encoder's right-padded inputs of `lengths` real tokens, run once;
        then the decoder's start token start_id (the pad id the model was trained with, as the
        span-corruption samples start their decoder inputs; None: 0, T5's). Returns the logits
        (batch, vocab) of the first new token."""
        start_id = 0 if start_id is None else start_id
        n_enc = self.model_args.n_encoder_layers
        seq = tokens.shape[1]
        real = (torch.arange(seq, device=tokens.device)[None, :] < lengths[:, None])[:, None, None, :]
        h = self.tok_embeddings(tokens)
        bias = masked_bias(self.encoder_relative_bias(seq), real)
        for block in list(self.layers.values())[:n_enc]:
            h = block(h, bias)
        encoder_out = self.encoder_norm(h)
        zero = torch.zeros((), dtype=bias.dtype, device=bias.device)
        cache.extra["cross_bias"] = EncoderMask(tokens.shape[0], masked_bias(zero, real))
        cache.begin_prefill(torch.ones_like(lengths), 1)
        start = torch.full((tokens.shape[0], 1), start_id, dtype=torch.long, device=tokens.device)
        logits = self._decoder(start, self.decoder_relative_bias(1), cache, encoder_out)
        cache.end_prefill()
        return logits

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        cache.begin_decode()
        # The new token of each row at position lengths[i] against the slots in use.
        keys = torch.arange(cache.slots_in_use, device=tokens.device)
        buckets = relative_position_bucket(keys[None, :] - cache.lengths[:, None], bidirectional=False,
                                           num_buckets=self.decoder_relative_bias.num_buckets,
                                           max_distance=self.decoder_relative_bias.max_distance)
        table = local_part(self.decoder_relative_bias.weight)
        bias = masked_bias(table[:, buckets].transpose(0, 1)[:, :, None, :], cache.decode_mask)
        logits = self._decoder(tokens[:, None], bias, cache, None)
        cache.end_decode()
        return logits

    def _decoder(self, tokens: torch.Tensor, bias: torch.Tensor, cache: ModelCache,
                 encoder_out: torch.Tensor | None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for key, block in list(self.layers.items())[self.model_args.n_encoder_layers:]:
            h = block(h, bias, encoder_out, cache.extra["cross_bias"].bias, cache=cache.layer(key))
        h = self.norm(h[:, -1])
        if self.model_args.scale_decoder_outputs:
            h = h * self.model_args.dim**-0.5
        return self.output(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """Mesh TensorFlow's init, each tensor seeded by its name: a unit-normal token table, relative-
        bias tables with std dim^-0.5, norms at 1, projections as T5Attention and T5FeedForward say.
        An untied output projection gets std dim^-0.5 (Mesh TF's fan-in scaling, so initial logits
        are O(1); HF draws it unit-normal, which only matters for training from scratch). No buffers
        to rebuild (buffer_device is unused)."""
        a = self.model_args
        normal_(self.tok_embeddings.weight, std=1.0, seed=seed, fqn="tok_embeddings.weight")
        if not a.tie_word_embeddings:
            normal_(self.output.weight, std=a.dim**-0.5, seed=seed, fqn="output.weight")
        for name in ("encoder_relative_bias", "decoder_relative_bias"):
            normal_(getattr(self, name).weight, std=a.dim**-0.5, seed=seed, fqn=f"{name}.weight")
        for key, block in self.layers.items():
            block.init_weights(a, seed=seed, prefix=f"layers.{key}.")
        ones_(self.encoder_norm.weight)
        ones_(self.norm.weight)


__all__ = ["FEED_FORWARD_VARIANTS", "RelativePositionBias", "T5", "T5Args", "T5Block", "relative_position_bucket"]
