"""Rotary position embedding (RoPE), real-valued, in Meta's interleaved-pair layout.

Meta's reference Llama rotates the pairs (x[2i], x[2i+1]) of each head as complex
numbers. We keep that pairing, because it is the layout of Meta's original
checkpoints and torchtitan's (Hugging Face's rotate-half layout differs only by a
fixed row permutation of wq/wk, applied in the HF adapter), but we compute it with
cos/sin in real arithmetic: complex tensors make inductor warn and fall back to eager.

The table is stored as one (max_seq_len, head_dim) float32 tensor holding
[cos | sin] along the last dim, so that it can be sliced (or sharded for context
parallelism) along the sequence dim like any other activation.
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


def rope_inv_freq(head_dim: int, theta: float, scaling: RoPEScaling | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair angular frequencies theta^(-2i/head_dim), i < head_dim/2, with optional scaling."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
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
                          scaling: RoPEScaling | None = None,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """The (max_seq_len, head_dim) float32 table [cos | sin] for positions 0..max_seq_len-1."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


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
        angles = rope_cache.unsqueeze(2)
    else:
        if rope_cache.shape[0] < seqlen or rope_cache.shape[1] != head_dim:
            raise ValueError(
                f"rope_cache of shape {tuple(rope_cache.shape)} cannot rotate {seqlen} positions of "
                f"head_dim {head_dim}; is the sequence longer than max_seq_len?"
            )
        angles = rope_cache[:seqlen].view(1, seqlen, 1, head_dim)
    cos, sin = angles.float().chunk(2, dim=-1)
    pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
