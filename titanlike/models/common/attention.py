"""Core attention: causal, or block-causal within the documents of a packed sequence.

Samples are windows cut from a stream of documents packed end to end, each ended by
an end-of-document token (EOS). Plain causal attention lets a token see the end of
the previous document; with document masking (Megatron's reset_attention_mask and
reset_position_ids) a token sees only earlier tokens of its own document and its
RoPE position restarts at 0 with every document.

Kernels:
- causal: SDPA with is_causal, which torch sends to its fused flash / cuDNN /
  memory-efficient kernels (reported at start by `describe_sdpa_kernel`).
- document mask, "flex": FlexAttention with a block mask, which skips whole blocks
  of keys outside the document (GPU; it has no backward on CPU).
- document mask, "sdpa": SDPA with a dense boolean (batch, 1, seq, seq) mask; exact
  everywhere, but O(seq^2) memory and no block skipping. The CPU path, where torch runs it with
  its math kernel over every (query, key) pair. So on CPU, eager, without window or sinks, each
  document of a row is attended alone instead (`by_documents`: SDPA's fused kernel on
  [start, stop) of q, k, v), from document lengths read on the host when the mask is built.

Sliding windows (Gemma 3's local layers, gpt-oss's banded ones, Mistral's): an attention module
built with `window=W` lets each query see only the W most recent tokens, itself included (HF's
`sliding_window`: key j is seen by query i when i - W < j <= i). The family picks which layers
slide. Every kernel takes the window as one more condition on its mask: a banded SDPA mask, a
FlexAttention block mask that also skips the blocks outside the band, context parallel attention
(parallel/context.py) from the global positions of its queries and keys, and the KV cache
(SlidingKVCache in kv_cache.py), which keeps only the last W keys of a sliding layer.

Attention sinks (gpt-oss): an attention module built with `sinks=True` learns one logit per head that
joins the softmax's denominator and no value, so a head may give part of its weight to no token at
all. The kernels add it in two ways: SDPA paths compute the scores and append the sink as one more
column before the softmax (`sink_attention`: exact, but no fused kernel takes a sink, so it is the
dense O(seq^2) path, as the document masks on CPU already are); FlexAttention and context parallel
attention correct their output from its log-sum-exp, out * sigmoid(lse - sink) (`add_sinks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.args import AttentionShape
from titanlike.models.common.dtensor import local_part, scale_rows_
from titanlike.models.common.eager import eager_only
from titanlike.models.common.init import LinearInit, ones_, zeros_
from titanlike.models.common.kv_cache import KVCache, SlidingKVCache
from titanlike.models.common.sinks import add_sinks, sink_attention
from titanlike.models.common.rope import apply_rotary_emb

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


def sdpa_takes_gqa(q: torch.Tensor) -> bool:
    """Whether to pass grouped k/v to SDPA with enable_gqa=True instead of repeating them.

    How GQA reaches the kernel matters for speed and memory, not for the result:
    - On CPU, enable_gqa dispatches to the fused flash kernel and was measured ~17%
      faster (forward+backward, torch 2.13) than repeating k/v, with the same numbers.
    - On CUDA, flash attention (fp16/bf16) accepts enable_gqa, but the memory-efficient
      kernel that fp32 needs does not, and SDPA then silently falls back to the
      O(seq^2)-memory math kernel; repeating k/v keeps fp32 on a fused kernel.
    """
    return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if sdpa_takes_gqa(q):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1),
                                          **kwargs)


class WindowedMasks:
    """window -> a DocumentMask restricted to it. A plain object, not a dict: utilities that rebuild a
    module's inputs field by field (FSDP's cast of forward inputs, dataclasses.replace) then hand every
    copy of a mask the same one, so the layers of a microbatch share what the first built."""

    def __init__(self):
        self.by_window: dict[int, DocumentMask] = {}


@dataclass(frozen=True)
class DocumentMask:
    """Which earlier tokens each token may attend to in a batch of packed sequences.

    Built once per microbatch (outside the model, so compiled blocks only read it) and
    shared by every layer. `document_ids` and `positions` are (batch, seq) over the
    whole sequence in order, also under context parallelism, whose attention picks the
    rows of its own tokens. Exactly one of `dense` / `block_mask` is set for the
    kernel that will run, or neither when context parallel attention does the work;
    `document_lengths` comes with `dense` on CPU, for attention one document at a time.
    """

    document_ids: torch.Tensor  # (batch, seq) int: index of each token's document in its sample
    positions: torch.Tensor  # (batch, seq) int: each token's position within its document
    dense: torch.Tensor | None = None  # (batch, 1, seq, seq) bool, True where attention is allowed
    block_mask: object | None = None  # torch.nn.attention.flex_attention.BlockMask
    # False: a token sees every token of its document, later ones too (an encoder's padding mask).
    causal: bool = True
    # This mask restricted to each sliding window (`windowed`), built at the first sliding layer and
    # shared by the others; it lives and dies with the microbatch's mask.
    windowed_masks: WindowedMasks = field(default_factory=lambda: WindowedMasks(), repr=False, compare=False)
    # Per sample, the lengths of its documents in order, for attention one document at a time
    # (`by_documents`), or None for a sample whose documents are too many to pay (it reads `dense`).
    # Set with `dense` on CPU (host integers, read without syncing a device), else None.
    document_lengths: tuple[tuple[int, ...] | None, ...] | None = None

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eod_id: int, kernel: str | None) -> DocumentMask:
        """Documents of `tokens` (batch, seq): a new one starts after every `eod_id`.

        kernel: "sdpa" (dense mask), "flex" (block mask) or None (ids and positions only).
        """
        is_eod = (tokens == eod_id).long()
        # A token's document is the number of EODs strictly before it: the EOD closes its own.
        return cls.from_document_ids(is_eod.cumsum(1) - is_eod, kernel)

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor, kernel: str | None, *, causal: bool = True) -> DocumentMask:
        """The mask of (batch, seq) document ids that are non-decreasing along each sample (a sample
        field such as an encoder's 0 for real tokens, 1 for padding). causal=False: each token sees
        its whole document, both ways."""
        seq = document_ids.shape[1]
        index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
        # Position = index - index of the document's first token (a running max over starts).
        starts = torch.where(document_ids != F.pad(document_ids, (1, -1), value=-1), index, 0)
        positions = index - starts.cummax(1).values
        dense = block_mask = lengths = None
        if kernel == "sdpa":
            # Built even when every sample goes by documents: sliding windows, sinks and compiled
            # blocks read it (b * seq^2 bools once per microbatch, a small part of one layer's scores).
            dense = (document_ids[:, :, None] == document_ids[:, None, :]).unsqueeze(1)
            if causal:
                dense = dense & torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
            # Host values without a device sync: CPU tensors, not the estimator's fake ones (no values).
            if document_ids.device.type == "cpu" and type(document_ids) is torch.Tensor:
                lengths = tuple(_lengths_if_they_pay(row) for row in document_ids)
                if all(row is None for row in lengths):  # one dense call rather than one per sample
                    lengths = None
        elif kernel == "flex":
            block_mask = _flex_block_mask(document_ids, causal=causal)
        elif kernel is not None:
            raise ValueError(f"unknown document-mask kernel {kernel!r}; expected 'sdpa', 'flex' or None")
        return cls(document_ids, positions, dense, block_mask, causal, document_lengths=lengths)

    @eager_only  # built once per microbatch, eagerly, even when the blocks are compiled
    def windowed(self, window: int) -> DocumentMask:
        """This mask where each token also sees only the `window` most recent tokens (itself included)."""
        if not self.causal:
            raise ValueError("a sliding window needs causal attention")
        masks = self.windowed_masks.by_window
        if window not in masks:
            dense = block_mask = None
            if self.dense is not None:
                dense = self.dense & sliding_window_band(self.dense.shape[-1], window, self.dense.device)
            elif self.block_mask is not None:
                block_mask = _flex_block_mask(self.document_ids, causal=True, window=window)
            masks[window] = DocumentMask(self.document_ids, self.positions, dense, block_mask, True)
        return masks[window]

    def rows(self, start: int, stop: int) -> DocumentMask:
        """The mask of samples start..stop-1 (a pipeline microbatch of this batch)."""
        return DocumentMask(
            self.document_ids[start:stop], self.positions[start:stop],
            dense=None if self.dense is None else self.dense[start:stop],
            document_lengths=None if self.document_lengths is None else self.document_lengths[start:stop],
            # Rebuilt rather than sliced: the mask function indexes document ids by sample.
            block_mask=None if self.block_mask is None else _flex_block_mask(self.document_ids[start:stop],
                                                                             causal=self.causal),
            causal=self.causal,
        )


# What one more SDPA call costs on CPU, in (query, key) pairs of the dense mask's math kernel: forward
# and backward, 16 heads of 16, one thread, torch 2.13, a call on a few tokens took ~70 us and the
# dense kernel ~57 ns a pair (docs/performance.md, "Document masks on CPU by documents").
_CALL_PAIRS = 1024


def _lengths_if_they_pay(document_ids: torch.Tensor) -> tuple[int, ...] | None:
    """A sample's document lengths, or None where attending each document alone would cost more than
    the dense mask: the fused kernel's work was measured about the math kernel's on the same pairs
    (it does not halve for causal at small head_dim), so the sum of the documents' squared lengths
    plus a call's overhead per extra document is weighed against seq^2. Measured: by documents wins
    at seq 512 and over (still 0.6 of the dense time with 128 documents of ~4 tokens a row), is up to
    12% slower than the dense mask at seq 128, and loses for many tiny documents in a short row."""
    lengths = torch.unique_consecutive(document_ids, return_counts=True)[1].tolist()
    seq = document_ids.shape[0]
    return tuple(lengths) if sum(n * n for n in lengths) + _CALL_PAIRS * (len(lengths) - 1) <= seq * seq else None


def by_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[tuple[int, ...] | None, ...],
                 dense: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Attention of each document alone: SDPA (is_causal=causal) on each run of `lengths` of a sample's
    q, k, v, the outputs put back in place; a sample whose lengths are None reads its rows of `dense`.

    The batch's sequences are laid end to end, (heads, batch * seq, head_dim) (a view of the
    transposed projections Attention.forward hands in), and cut with one split: its backward writes
    each gradient once, where slicing each document allocates a whole zero gradient per document
    (measured 10x slower at 128 documents a row)."""
    batch, heads, seq, _ = q.shape
    runs = []  # (length, None) for each document, or (seq, row) for a sample that reads `dense`
    for row, row_lengths in enumerate(lengths):
        runs += [(seq, row)] if row_lengths is None else [(n, None) for n in row_lengths]
    sizes = [n for n, _ in runs]
    # Each tensor its own heads (GQA's k, v) and features (MLA's v: models/deepseek_v3/attention.py).
    q_runs, k_runs, v_runs = (t.transpose(0, 1).reshape(t.shape[1], batch * seq, t.shape[3]).split(sizes, dim=1)
                              for t in (q, k, v))
    out = [_sdpa(qd[None], kd[None], vd[None], is_causal=causal) if row is None else
           _sdpa(qd[None], kd[None], vd[None], attn_mask=dense[row:row + 1])
           for (_, row), qd, kd, vd in zip(runs, q_runs, k_runs, v_runs)]
    return torch.cat(out, dim=2)[0].view(heads, batch, seq, v.shape[3]).transpose(0, 1)


def sliding_window_band(seq: int, window: int, device=None) -> torch.Tensor:
    """(seq, seq) bool, True where query i may see key j: i - window < j <= i."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def _flex_block_mask(document_ids: torch.Tensor, *, causal: bool = True, window: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    def same_document_window(b, h, q_idx, kv_idx):
        return same_document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    def same_document(b, h, q_idx, kv_idx):
        return document_ids[b, q_idx] == document_ids[b, kv_idx]

    batch, seq = document_ids.shape
    mask_mod = same_document if not causal else same_document_causal if window is None else same_document_window
    return create_block_mask(mask_mod, batch, None, seq, seq, device=document_ids.device)


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention materializes the full score matrix; compiled it is a fused kernel.
    # Inside a compiled block dynamo inlines it either way.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def _flex_attention(q, k, v, block_mask, sinks=None):
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                          return_aux=AuxRequest(lse=True))
    return add_sinks(out, aux.lse, sinks)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: DocumentMask | None = None, *, causal: bool = True, window: int | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads than q (GQA).

    mask None is plain causal attention (or full attention with causal=False); a DocumentMask
    restricts attention to each document (its own `causal` says whether to later tokens too).
    window: each query sees only the `window` most recent tokens, itself included (causal only).
    sinks: (heads,) learned logits added to each head's softmax denominator (see the module docstring).
    """
    if mask is not None and mask.causal != causal:
        raise ValueError(f"a {'causal' if mask.causal else 'bidirectional'} document mask was given to "
                         f"{'causal' if causal else 'bidirectional'} attention")

    def dense(allowed: torch.Tensor | None, **kwargs) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(q, k, v, allowed, sinks)
        return _sdpa(q, k, v, attn_mask=allowed, **kwargs)

    if window is not None:
        if mask is None:  # a band within the sequence (no fused kernel takes one: a dense mask)
            return dense(sliding_window_band(q.shape[2], window, q.device))
        mask = mask.windowed(window)
    if not causal and mask is None:
        return dense(None)
    if mask is None:
        if sinks is not None:
            return dense(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril())
        return _sdpa(q, k, v, is_causal=True)
    if mask.block_mask is not None:
        return _flex_attention(q, k, v, mask.block_mask, sinks)
    if mask.dense is None:
        raise ValueError("this DocumentMask was built without a kernel (for context parallel attention only)")
    # Compiled blocks keep the dense mask: splitting at each batch's boundaries would recompile.
    # is_compiling first: dynamo then never reads the lengths (a guard on them would recompile too).
    if not torch.compiler.is_compiling() and mask.document_lengths is not None and sinks is None:
        return by_documents(q, k, v, mask.document_lengths, mask.dense, causal=mask.causal)
    return dense(mask.dense)


def max_logit(q: torch.Tensor, k: torch.Tensor, mask: DocumentMask | None = None, *, causal: bool = True,
              window: int | None = None, chunk_bytes: int = 1 << 26) -> torch.Tensor:
    """(heads,) float32: each query head's largest attention logit q.k / sqrt(head_dim) over the
    (query, key) pairs the kernels let attend, for QK-clip (train/qk_clip.py).

    No fused kernel returns its logits, so this computes q.k^T once more, without gradients and a
    block of queries at a time (at most `chunk_bytes` of float32 scores): half the FLOPs of the
    attention's forward matmuls (QK^T and PV), a sixth of forward and backward's, over every pair
    (FlexAttention's skipped blocks included). The allowed pairs come from the mask's document ids,
    so the SDPA and FlexAttention paths agree."""
    with torch.no_grad():
        b, heads, s, d = q.shape
        kv_heads = k.shape[1]
        # Query head h reads key head h // rep, as repeat_interleave lays them out.
        qg = q.float().view(b, kv_heads, heads // kv_heads, s, d)
        kt = k.float().transpose(-1, -2).unsqueeze(2) * d**-0.5
        rows = max(1, min(s, chunk_bytes // (4 * b * heads * k.shape[2])))
        keys = torch.arange(k.shape[2], device=q.device)
        out = torch.full((heads,), float("-inf"), device=q.device)
        for start in range(0, s, rows):
            scores = qg[:, :, :, start:start + rows] @ kt  # (b, kv_heads, rep, rows, keys)
            queries = torch.arange(start, min(start + rows, s), device=q.device)[:, None]
            allowed = torch.ones(len(queries), len(keys), dtype=torch.bool, device=q.device)
            if causal:
                allowed = allowed & (keys[None] <= queries)
            if window is not None:
                allowed = allowed & (queries - keys[None] < window)
            if mask is not None:
                ids = mask.document_ids
                allowed = allowed & (ids[:, start:start + rows, None] == ids[:, None, :])[:, None, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.maximum(out, scores.amax(dim=(0, 3, 4)).reshape(heads))
        return out



def resolve_attention_backend(backend: str, device_type: str) -> str:
    """The kernel for document masks: "auto" is FlexAttention on CUDA, dense-mask SDPA elsewhere."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device_type == "cuda" else "sdpa"
    return backend


def validate_attention_backend(backend: str, *, cuda: bool) -> None:
    if backend == "flex" and not cuda:
        raise ValueError("model.attention_backend flex needs a CUDA GPU (FlexAttention has no backward on CPU); "
                         "use auto or sdpa")


def describe_sdpa_kernel(shape: AttentionShape, *, seq_len: int, dtype: torch.dtype, device: torch.device,
                         dense_mask: bool = False) -> str:
    """Name of the SDPA kernel torch picks for this model's attention (flash, cuDNN, efficient, math).

    Asks torch's own dispatcher with tiny stand-in tensors of the real head count, head_dim
    and dtype (batch 1, and a short sequence for the dense-mask case to keep the probe small).
    """
    from torch.nn.attention import SDPBackend

    seq = min(seq_len, 128) if dense_mask else seq_len
    q = torch.empty(1, shape.heads, seq, shape.head_dim, dtype=dtype, device=device)
    kv_heads = shape.kv_heads if sdpa_takes_gqa(q) else shape.heads
    k = torch.empty(1, kv_heads, seq, shape.head_dim, dtype=dtype, device=device)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).tril() if dense_mask else None
    try:
        choice = torch._fused_sdp_choice(q, k, k, attn_mask=mask, is_causal=shape.causal and not dense_mask,
                                         enable_gqa=kv_heads != shape.heads)
        return SDPBackend(choice).name.lower()
    except Exception as err:  # a private torch API: report rather than fail the run
        return f"unknown ({type(err).__name__})"


class Attention(nn.Module):
    """Multi-head attention with grouped-query k/v heads, optional biases and optional RoPE.

    Projections wq, wk, wv (split by heads under tensor parallelism) and wo. `core_attention` is a
    hook, not a fixed call, so that context parallelism can swap in attention across ranks without
    touching this module. causal=False gives bidirectional attention (encoders).

    head_dim need not be dim // n_heads (Qwen3: 128 at any width). qk_norm_eps set adds QK-norm
    (Qwen3, OLMo 2 style): q_norm and k_norm, RMSNorms over each head's features shared by all
    heads, applied to q and k before RoPE; they keep attention logits bounded as training goes on.

    window: a sliding-window layer (each query sees the `window` most recent tokens; see the module
    docstring), None for full attention; the family chooses it per layer. softmax_scale: the scale of
    q.k when it is not head_dim^-0.5 (Gemma 3: query_pre_attn_scalar^-0.5); q is multiplied by the
    ratio so that every kernel (CP, the KV cache) keeps its default scale. sinks=True learns a per-head
    sink logit (gpt-oss; see the module docstring), passed to the kernels beside the window.

    logit_max: None, or (this rank's query heads,) float32 that QK-clip (train/qk_clip.py) sets: each
    training forward then raises it in place to the heads' largest logit (`max_logit`), on the device.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, bias: bool = False,
                 causal: bool = True, qk_norm_eps: float | None = None, window: int | None = None,
                 softmax_scale: float | None = None, sinks: bool = False):
        super().__init__()
        if window is not None and (not causal or window < 1):
            raise ValueError(f"a sliding window needs causal attention and at least 1 token, got {window}")
        self.head_dim = head_dim
        self.causal = causal
        self.window = window
        self.q_scale = None if softmax_scale is None else softmax_scale * head_dim**0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        # One logit per query head, which tensor parallelism splits with the heads (models/protocol.py).
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        if sinks:
            self.head_split_parameters = ("sinks",)
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.core_attention = core_attention
        # A buffer, so that compiled blocks update it in place; left out of checkpoints.
        self.register_buffer("logit_max", None, persistent=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, mask: DocumentMask | None = None, *,
                cache: KVCache | None = None) -> torch.Tensor:
        """rope: rotary angles (see apply_rotary_emb), None for models without rotary positions.
        cache: this layer's keys and values when generating (models/common/kv_cache.py)."""
        bsz, seqlen, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism this rank holds only its local heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = apply_rotary_emb(q, rope)
            k = apply_rotary_emb(k, rope)
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.logit_max is not None and self.training and cache is None and torch.is_grad_enabled():
            self.logit_max.copy_(torch.maximum(self.logit_max, max_logit(q, k, mask, causal=self.causal,
                                                                         window=self.window)))
        # Only sliding layers pass the keyword (sink layers theirs), so kernels that know no window
        # (or no sink) still serve the others.
        sinks = {} if self.sinks is None else {"sinks": local_part(self.sinks)}
        options = sinks if self.window is None else {"window": self.window, **sinks}
        if cache is not None:
            out = cache.attend(q, k, v, lambda q, k, v: self.core_attention(q, k, v, mask, **options), **sinks)
        elif self.causal:
            out = self.core_attention(q, k, v, mask, **options)
        else:  # only kernels that can attend both ways accept the keyword
            out = self.core_attention(q, k, v, mask, causal=False, **sinks)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    # QK-clip's protocol (train/qk_clip.py): qk_clip_heads, has_qk_norm, scale_qk_heads_ and logit_max.

    def qk_clip_heads(self) -> int | None:
        """The query heads (over all tensor-parallel ranks) whose logits this attention records, or
        None for a subclass with its own forward, which does not record them."""
        return self.wq.weight.shape[0] // self.head_dim if type(self).forward is Attention.forward else None

    @property
    def has_qk_norm(self) -> bool:
        return self.q_norm is not None

    @torch.no_grad()
    def scale_qk_heads_(self, gamma: torch.Tensor) -> None:
        """Rescale the heads by gamma (every query head's tau / max, 1 where under): a query head's
        rows (weight and bias) by sqrt(gamma_h); a key head g shared by the query heads G (grouped-
        query attention) by sqrt(min over G of gamma_h), so the group's largest logit decides and every
        head of the group ends at or under tau. This rank's rows only (FSDP2 and TP shards alike)."""
        kv_heads = self.wk.weight.shape[0] // self.head_dim
        q_factor = gamma.sqrt().repeat_interleave(self.head_dim)
        k_factor = gamma.view(kv_heads, -1).amin(1).sqrt().repeat_interleave(self.head_dim)
        for linear, factor in ((self.wq, q_factor), (self.wk, k_factor)):
            scale_rows_(linear.weight, factor)
            scale_rows_(linear.bias, factor)

    def new_cache(self, cache, dtype: torch.dtype) -> KVCache:
        """Room for this layer's keys and values (the heads this rank computes, sized at the prefill)."""
        if self.window is not None:
            return SlidingKVCache(cache, dtype, self.window)
        return KVCache(cache, dtype)

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        for name in ("wq", "wk", "wv"):
            init.fill(getattr(self, name).weight, seed=seed, fqn=f"{prefix}{name}.weight")
        init.fill(self.wo.weight, seed=seed, fqn=f"{prefix}wo.weight", output=True)
        for name in ("wq", "wk", "wv", "wo"):
            bias = getattr(self, name).bias
            if bias is not None:
                zeros_(bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                ones_(norm.weight)
        if self.sinks is not None:
            zeros_(self.sinks)
