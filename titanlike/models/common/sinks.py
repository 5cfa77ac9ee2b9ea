"""Attention sinks (gpt-oss): a learned logit per query head that joins the softmax's denominator and
attends to nothing, so a head can put weight nowhere. Shared by the layers (attention.py) and the
decode steps of the KV caches (kv_cache.py)."""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   sinks: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Softmax attention whose denominator also holds exp(sink) of each query head (sinks: (heads,)).

    allowed: a bool mask broadcast to (batch, heads, q_seq, k_seq), True where attention is allowed, or
    None for every key. The sink is appended to the scores as one more column, and the softmax runs in
    fp32 (as transformers' gpt-oss does) before the column is dropped.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep != 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores.float(), sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks (out (batch, heads, seq, d), its log-sum-exp lse (batch, heads, seq)) turned
    into attention with them: the weights shrink by Z / (Z + exp(sink)) = sigmoid(lse - sink)."""
    kept = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * kept.unsqueeze(-1)).to(out.dtype)


__all__ = ["add_sinks", "sink_attention"]
