"""Rotary position embedding (RoPE), real-valued, in Meta's interleaved-pair layout.

Meta's reference Llama rotates the pairs (x[2i], x[2i+1]) of each head as complex
numbers. We keep that pairing, because it is the layout of Meta's original
checkpoints and torchtitan's (Hugging Face's rotate-half layout differs only by a
fixed row permutation of wq/wk, applied in the HF adapter). The rotation is a complex
multiply in eager and real arithmetic under torch.compile (see rotate_pairs_complex).

The table is stored as one real (max_seq_len, head_dim) float32 tensor holding the pairs
(cos, sin) of each frequency, i.e. the real view of the complex table cos + i sin
(torchtitan's freqs_cis), so that it can be sliced (or sharded for context parallelism)
along the sequence dim like any other activation, and seen as complex without a copy.

Two frequency scalings stretch a model's context beyond its pre-training length: Llama 3.1's
(RoPEScaling) and YaRN (YaRNScaling, DeepSeek-V3 and others), each exactly as Hugging Face
computes it, so that imported checkpoints see the angles they were trained with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoPEScaling:
    """Llama 3.1 frequency scaling (Hugging Face rope_type "llama3").

    Wavelengths shorter than original_max_position_embeddings / high_freq_factor are
    kept, those longer than original_max_position_embeddings / low_freq_factor are
    divided by `factor`, and the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times: 0.1 mscale ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YaRNScaling:
    """YaRN (Peng et al. 2023; Hugging Face rope_type "yarn").

    Frequencies that turn fewer than beta_slow times over original_max_position_embeddings are
    divided by `factor` (interpolated), those turning more than beta_fast times are kept
    (extrapolated), with a linear ramp over the pair indices in between (its ends rounded outward
    when `truncate`). cos and sin are multiplied by attention_scaling(): `attention_factor` when
    given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek:
    1 / 1 = 1, the correction then moves into its softmax scale), else mscale(factor).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, pos_freqs: torch.Tensor, theta: float, head_dim: int) -> torch.Tensor:
        """Scaled frequencies from the unscaled theta^(2i/head_dim) (pos_freqs). Written as
        transformers' _compute_yarn_parameters, so the float32 values agree bit for bit."""
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        low, high = (self._correction_dim(self.beta_fast, head_dim, theta),
                     self._correction_dim(self.beta_slow, head_dim, theta))
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = (1 - ramp).to(pos_freqs.device)  # the share of each pair's original frequency
        return interpolated * (1 - keep) + extrapolated * keep

    def _correction_dim(self, rotations: float, head_dim: int, theta: float) -> float:
        """The (fractional) pair dimension whose frequency turns `rotations` times over the original context."""
        return (head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    def to_hf(self) -> dict:
        """The rope_scaling entry of a config.json (rope_theta is written beside it)."""
        out = {"type": "yarn", "rope_type": "yarn", "factor": float(self.factor),
               "original_max_position_embeddings": int(self.original_max_position_embeddings),
               "beta_fast": float(self.beta_fast), "beta_slow": float(self.beta_slow)}
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                out[key] = float(getattr(self, key))
        if not self.truncate:
            out["truncate"] = False
        return out

    @classmethod
    def from_hf(cls, rope: dict, *, max_position_embeddings: int | None = None) -> YaRNScaling:
        """From a config.json's rope_scaling (4.x) or rope_parameters (5.x) of type yarn; transformers
        derives a missing factor from the context ratio, and 0 / missing betas mean the defaults."""
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        factor = rope.get("factor")
        if factor is None:
            factor = max_position_embeddings / original
        optional = {k: float(rope[k]) if rope.get(k) is not None else None
                    for k in ("mscale", "mscale_all_dim", "attention_factor")}
        return cls(factor=float(factor), original_max_position_embeddings=original,
                   beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                   truncate=bool(rope.get("truncate", True)), **optional)


def rope_inv_freq(head_dim: int, theta: float, scaling: RoPEScaling | YaRNScaling | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair angular frequencies theta^(-2i/head_dim), i < head_dim/2, with optional scaling."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    pos_freqs = theta**exponents
    if isinstance(scaling, YaRNScaling):
        return scaling.inv_freq(pos_freqs, theta, head_dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq

    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # smooth is 0 at the low-frequency edge of the band and 1 at the high-frequency edge.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def precompute_rope_cache(head_dim: int, max_seq_len: int, theta: float,
                          scaling: RoPEScaling | YaRNScaling | None = None,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """The (max_seq_len, head_dim) float32 table of (cos, sin) pairs for positions 0..max_seq_len-1
    (YaRN: times its attention scaling, which scales q.k by its square)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2)
    if isinstance(scaling, YaRNScaling) and scaling.attention_scaling() != 1.0:
        table = table * scaling.attention_scaling()
    return table


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, seq, heads, head_dim) by the angles in rope_cache.

    rope_cache is either the (max_seq_len, head_dim) table, whose rows 0..seq-1 are
    used, or (batch, seq, head_dim) rows already picked per token (positions that
    restart per document, or a context-parallel slice). The table is sliced here,
    where the sequence length is the one attention really sees (with sequence
    parallelism the block input holds only a slice of it).
    The rotation is done in float32 (as Meta's reference does) and cast back, so bf16
    activations do not lose the phase precision of late positions.
    """
    batch, seqlen, head_dim = x.shape[0], x.shape[1], x.shape[-1]
    if rope_cache.ndim == 3:
        if rope_cache.shape != (batch, seqlen, head_dim):
            raise ValueError(f"per-token rope angles of shape {tuple(rope_cache.shape)} do not match "
                             f"(batch, seq, head_dim) = {(batch, seqlen, head_dim)}")
        rotation = rope_cache.unsqueeze(2)  # (batch, seq, 1, head_dim): one row for all heads
    else:
        if rope_cache.shape[0] < seqlen or rope_cache.shape[1] != head_dim:
            raise ValueError(
                f"rope_cache of shape {tuple(rope_cache.shape)} cannot rotate {seqlen} positions of "
                f"head_dim {head_dim}; is the sequence longer than max_seq_len?"
            )
        # (seq, 1, head_dim), broadcast over batch and heads (sliced only when the table is longer).
        rotation = (rope_cache if rope_cache.shape[0] == seqlen else rope_cache[:seqlen]).unsqueeze(1)
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return rotate_pairs_real(x, rotation)
    return rotate_pairs_complex(x, rotation)


# Two spellings of one rotation, (a + ib)(cos + i sin) on the pairs (x[2i], x[2i+1]), which give the
# same float32 numbers (a cos - b sin and a sin + b cos, each rounded once).
#
# In eager, the complex spelling is the fast one: the multiply is a single vectorized pass over x
# (views make the pairs complex and back for free), and its backward is a single pass too
# (grad * conj(cos + i sin)). The real spelling is about ten passes in eager (strided selects of the
# even and odd halves, four multiplies, two adds, a stack), and its backward adds zero-filled
# select gradients: on the debug model (batch 8, seq 256, head_dim 16, CPU) it cost 7 to 9 times the
# time of the complex one, 2 to 3% of a training step (docs/performance.md).
#
# Under torch.compile, the real spelling is the one to trace: inductor fuses it into one kernel,
# whereas it cannot generate code for complex operators (it warns and falls back to eager). Tensor
# subclasses (DTensor, FakeTensor, ...) take the real spelling too: every subclass handles real
# elementwise ops, not every one handles complex views.


def rotate_pairs_complex(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) rotated pairwise by `rotation`, (cos, sin) pairs (..., head_dim) broadcast
    against x (a table's rows), as complex numbers in float32; cast back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    try:
        pairs = torch.view_as_complex(pairs)
    except RuntimeError:  # an odd offset or stride (a slice of a wider head, as DeepSeek's rotary part)
        pairs = torch.view_as_complex(pairs.clone(memory_format=torch.contiguous_format))
    if rotation.requires_grad:
        angles = torch.view_as_complex(rotation.float().unflatten(-1, (-1, 2)))
    else:  # a dtype view: one op, where no gradient has to flow (the tables are buffers)
        angles = rotation.float().view(torch.complex64)
    return torch.view_as_real(pairs * angles).flatten(-2).type_as(x)


def rotate_pairs_real(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """rotate_pairs_complex in real arithmetic: the same numbers, the form inductor compiles."""
    cos, sin = rotation.float().unflatten(-1, (-1, 2)).unbind(-1)
    pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
