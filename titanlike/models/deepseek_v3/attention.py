"""Multi-head latent attention (MLA, DeepSeek-V2 / V3).

Keys and values are not projected from the input directly but from a small latent:

    q:   x -> wq                                (q_lora_rank 0)
         x -> wq_a -> q_norm -> wq_b            (a low-rank query, q_lora_rank > 0)
         each head's q = [q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)], q_pe rotated
    kv:  x -> wkv_a -> kv_norm -> wkv_b -> each head's [k_nope (qk_nope_head_dim) | v (v_head_dim)]
    k:   [k_nope | k_pe], k_pe = rotate(wk_pe x): one RoPE key shared by every head
    out: attention over the heads -> wo

Only the latent (kv_lora_rank) and the shared RoPE key are what inference caches; training
computes the full per-head keys and values, as above. DeepSeek's checkpoints (and Hugging Face's
`kv_a_proj_with_mqa`) keep wkv_a and wk_pe as one matrix of kv_lora_rank + qk_rope_head_dim rows;
we keep the RoPE key's rows apart because under tensor parallelism they need a different gradient
rule (every rank's local heads read k_pe directly, while the latent reaches them through wkv_b,
a colwise linear, see the plan in titanlike/models/deepseek_v3/__init__.py). The HF adapter joins
and splits the rows.

`core_attention` is the same hook as in common/attention.py (context parallelism swaps it); its
kernels scale scores by 1/sqrt(q.shape[-1]), so a softmax scale other than qk_head_dim^-0.5 (YaRN's
mscale correction) is applied by scaling q beforehand.

QK-clip (train/qk_clip.py) follows the Kimi K2 report's rule for MLA: a head's logit is
q_nope.k_nope + q_pe.k_pe, so with gamma_h = tau / max_h its q_nope rows (of wq or wq_b) and its
k_nope rows of wkv_b take sqrt(gamma_h), its q_pe rows the whole gamma_h, and the RoPE key wk_pe,
shared by every head, is left alone (as are the value rows); the latent projections and norms
before them are shared too, so the low-rank query path clips as the single projection does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlike.models.common.attention import DocumentMask, core_attention, max_logit
from titanlike.models.common.dtensor import local_part, scale_rows_
from titanlike.models.common.init import LinearInit, ones_
from titanlike.models.common.kv_cache import copy_slots, lazy_buffer
from titanlike.models.common.rope import apply_rotary_emb

# DeepSeek's reference and transformers build the latent norms (q_norm, kv_norm) with RMSNorm's
# default epsilon, not the model's rms_norm_eps (Moonlight: 1e-5 in the blocks, 1e-6 here).
LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    """Multi-head latent attention: (batch, seq, dim) -> (batch, seq, dim).

    softmax_scale_factor multiplies the usual qk_head_dim^-0.5 (YaRN's mscale^2 for DeepSeek-V3;
    1.0 otherwise).

    logit_max: as the shared Attention's (models/common/attention.py), for QK-clip: None, or (this
    rank's heads,) float32 that each training forward raises to the heads' largest logit.
    """

    # Its q_norm normalises the query latent, before the per-head rows QK-clip scales: no QK-norm.
    has_qk_norm = False

    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, softmax_scale_factor: float = 1.0):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank > 0:
            self.wq = None
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, kv_lora_rank, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wk_pe = nn.Linear(dim, qk_rope_head_dim, bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        # The kernels (SDPA, and context parallelism's) scale by 1/sqrt(qk_head_dim); the rest of
        # the softmax scale is folded into q, so the hook keeps its (q, k, v, mask) signature.
        self.q_scale = softmax_scale_factor
        self.core_attention = core_attention
        # A buffer, so that compiled blocks update it in place; left out of checkpoints.
        self.register_buffer("logit_max", None, persistent=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None, *,
                cache: LatentCache | None = None) -> torch.Tensor:
        """rope: rotary angles for qk_rope_head_dim (see apply_rotary_emb). cache: this layer's
        latent cache when generating (LatentCache)."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads, not n_heads: under tensor parallelism this rank holds only its local heads.
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(self.wkv_a(x))
        k_pe = apply_rotary_emb(self.wk_pe(x).unsqueeze(2), rope)  # (batch, seq, 1, rope): one for all heads
        if cache is not None:
            cache.store(latent, k_pe[:, :, 0])
            if not cache.cache.prefilling:
                return self._decode(q_nope, apply_rotary_emb(q_pe, rope), cache)
        kv = self.wkv_b(latent).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, rope)], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.logit_max is not None and self.training and cache is None and torch.is_grad_enabled():
            self.logit_max.copy_(torch.maximum(self.logit_max, max_logit(q, k, mask)))
        out = self.core_attention(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache) -> torch.Tensor:
        """One new token per row against the cached latents, with wkv_b absorbed (DeepSeek-V2,
        section 2.1.2): a head's score q_nope . (W_uk c) is (W_uk^T q_nope) . c and its output
        W_uv (sum p c), so the keys and values of the past are never expanded per head.
        q_nope (batch, 1, heads, nope), q_pe (batch, 1, heads, rope), rotated."""
        bsz = q_nope.shape[0]
        w = _local(self.wkv_b.weight).view(-1, self.qk_nope_head_dim + self.v_head_dim, cache.rank)
        w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # (heads, nope | v, rank)
        latents, k_pe = cache.read()  # (batch, slots, rank), (batch, slots, rope)
        q_latent = torch.einsum("bqhn,hnr->bhqr", q_nope, w_uk.to(q_nope.dtype))
        scores = (torch.einsum("bhqr,bsr->bhqs", q_latent, latents.to(q_latent.dtype))
                  + torch.einsum("bqhe,bse->bhqs", q_pe, k_pe.to(q_pe.dtype)))
        scores = scores.float() * (self.q_scale / self.qk_head_dim**0.5)
        scores = scores.masked_fill(~cache.cache.decode_mask, float("-inf"))
        weights = scores.softmax(-1).to(latents.dtype)
        out_latent = torch.einsum("bhqs,bsr->bhqr", weights, latents)
        out = torch.einsum("bhqr,hvr->bqhv", out_latent, w_uv.to(out_latent.dtype))
        return self.wo(out.reshape(bsz, 1, -1))

    # QK-clip's protocol (train/qk_clip.py): qk_clip_heads, has_qk_norm, scale_qk_heads_ and logit_max.

    def qk_clip_heads(self) -> int:
        """The query heads over all tensor-parallel ranks (DTensor shapes are global)."""
        return self.wkv_b.weight.shape[0] // (self.qk_nope_head_dim + self.v_head_dim)

    @torch.no_grad()
    def scale_qk_heads_(self, gamma: torch.Tensor) -> None:
        """Rescale the heads by gamma (every head's tau / max, 1 where under) by the rule of the module
        docstring, on this rank's rows only (FSDP2 and TP shards alike)."""
        def per_head(*parts: tuple[torch.Tensor, int]) -> torch.Tensor:
            return torch.cat([f[:, None].expand(-1, width) for f, width in parts], dim=1).flatten()

        root = gamma.sqrt()
        scale_rows_((self.wq if self.wq is not None else self.wq_b).weight,
                    per_head((root, self.qk_nope_head_dim), (gamma, self.qk_rope_head_dim)))
        scale_rows_(self.wkv_b.weight, per_head((root, self.qk_nope_head_dim),
                                                (torch.ones_like(gamma), self.v_head_dim)))

    def new_cache(self, cache, dtype: torch.dtype) -> LatentCache:
        return LatentCache(cache, dtype)

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wk_pe"):
            linear = getattr(self, name)
            if linear is not None:
                init.fill(linear.weight, seed=seed, fqn=f"{prefix}{name}.weight")
        init.fill(self.wo.weight, seed=seed, fqn=f"{prefix}wo.weight", output=True)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                ones_(norm.weight)


class LatentCache:
    """What MLA keeps of the past: per token the normalized latent kv_norm(wkv_a x) (kv_lora_rank)
    and the rotated RoPE key shared by the heads (qk_rope_head_dim), not per-head keys and values:
    (kv_lora_rank + qk_rope_head_dim) numbers per token and layer instead of heads x (qk_head_dim +
    v_head_dim). The same on every tensor-parallel rank (the latent is replicated)."""

    def __init__(self, cache, dtype: torch.dtype):
        # Allocated at the first store, shaped as the forward's latent (kv_cache.lazy_buffer).
        self.cache, self.dtype = cache, dtype
        self.latents: torch.Tensor | None = None  # (batch, capacity, kv_lora_rank)
        self.k_pe: torch.Tensor | None = None  # (batch, capacity, qk_rope_head_dim)

    @property
    def rank(self) -> int:
        return self.latents.shape[-1]

    def store(self, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        latent, k_pe = _local(latent), _local(k_pe)
        self.latents = lazy_buffer(self.latents, self.cache, latent, slot_dim=1, dtype=self.dtype)
        self.k_pe = lazy_buffer(self.k_pe, self.cache, k_pe, slot_dim=1, dtype=self.dtype)
        self.cache.write(self.latents, latent, dim=1)
        self.cache.write(self.k_pe, k_pe, dim=1)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(self.latents, 1), self.cache.read(self.k_pe, 1)

    def copy_row(self, row: int, source: LatentCache, source_row: int) -> None:
        self.latents = lazy_buffer(self.latents, self.cache, source.latents, slot_dim=1)
        self.k_pe = lazy_buffer(self.k_pe, self.cache, source.k_pe, slot_dim=1)
        copy_slots(self.latents, row, source.latents, source_row, dim=1)
        copy_slots(self.k_pe, row, source.k_pe, source_row, dim=1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_part(t)


__all__ = ["LATENT_NORM_EPS", "LatentCache", "MLA"]
