"""The Mamba-2 state-space scan in plain PyTorch: chunked state-space duality (SSD), and the
token-by-token recurrence it must equal.

The recurrence, per head (h heads of p features; the heads of a group share B and C):

    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T        (p x n)
    y_t     = state_t C_t                                       (p)

with A < 0 a scalar per head, dt_t > 0 the token's step size, B_t, C_t (n,) the token's input
and output maps. Unrolled, y_t = sum_{s <= t} exp(a_{s+1} + ... + a_t) (C_t . B_s) dt_s x_s
(a_t = dt_t A): causal attention whose scores C_t . B_s are weighted by a decay instead of a
softmax. The chunked algorithm (Dao & Gu 2024, "Transformers are SSMs") cuts the sequence into
chunks of Q tokens and splits that sum in two:
  1. within a chunk, the quadratic (attention-like) form: a Q x Q matrix of decayed scores;
  2. across chunks, the recurrence on the state at chunk boundaries: each chunk's own
     contribution to the state at its end, then one step per chunk carrying the state forward
     (exp of the chunk's summed a), then each token reads the state its chunk started with.
Work is O(L Q) for (1) and O(L n p) for (2), so linear in the sequence length L.

Everything runs in fp32. A sequence that is not a multiple of the chunk is padded at the end
with tokens of step 0, which neither decay nor add to the state, and the padding is dropped.

Documents. Packed samples hold several documents; with `documents` (batch, seq) ids, non-
decreasing along the sequence (DocumentMask.document_ids), the state is reset where a document
starts: a token sees only earlier tokens of its own document, as attention with a document mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
             chunk_size: int, initial_state: torch.Tensor | None = None,
             documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan.

    x: (batch, seq, heads, p); dt: (batch, seq, heads), positive (after softplus and clamping);
    A: (heads,), negative; B, C: (batch, seq, groups, n), heads % groups == 0, head i reading
    group i // (heads / groups). initial_state: (batch, heads, p, n), the state before token 0 (it
    belongs to the first token's document). documents: (batch, seq) document ids or None.
    Returns y (batch, seq, heads, p) in fp32, without the D skip connection, and the state after
    the last token (batch, heads, p, n).
    """
    batch, seq, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    q = chunk_size
    pad = (-seq) % q
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad)) for t in (x, dt, B, C))
        if documents is not None:  # padding joins the last document; it adds nothing to it
            documents = torch.cat([documents, documents[:, -1:].expand(batch, pad)], dim=1)
    chunks = (seq + pad) // q
    per_group = heads // groups
    # (batch, chunk, position in chunk, group, head in group, ...)
    xdt = (x * dt.unsqueeze(-1)).view(batch, chunks, q, groups, per_group, p)
    a = (dt * A.float()).view(batch, chunks, q, groups, per_group)
    a_cum = a.cumsum(2)  # log of the decay from the chunk's start to each token (inclusive)
    B = B.view(batch, chunks, q, groups, n)
    C = C.view(batch, chunks, q, groups, n)
    docs = None if documents is None else documents.view(batch, chunks, q)

    # 1. Within each chunk: y_t += sum_{s <= t} exp(a_cum_t - a_cum_s) (C_t . B_s) dt_s x_s.
    # The masked entries (s > t, other documents) go to exp(-inf) = 0 before the exp, so nothing
    # overflows and their gradient is exactly zero.
    allowed = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[:, :, None, None]  # (t, s, 1, 1)
    if docs is not None:
        allowed = allowed & (docs[:, :, :, None] == docs[:, :, None, :])[..., None, None]
    log_decay = a_cum[:, :, :, None] - a_cum[:, :, None]  # (batch, chunk, t, s, group, head)
    decay = torch.exp(torch.where(allowed, log_decay, -torch.inf))
    scores = torch.einsum("bctgn,bcsgn->bctsg", C, B)
    y = torch.einsum("bctsgh,bcsghp->bctghp", decay * scores.unsqueeze(-1), xdt)

    # 2. Across chunks. Each chunk's contribution to the state at its last token:
    to_end = torch.exp(a_cum[:, :, -1:] - a_cum)  # (batch, chunk, s, group, head)
    if docs is not None:  # only tokens of the chunk's last document reach its end
        to_end = to_end * (docs == docs[:, :, -1:])[..., None, None]
    chunk_states = torch.einsum("bcsgn,bcsghp->bcghpn", B, xdt * to_end.unsqueeze(-1))
    # ... then the recurrence over chunks, one step each (exact: no long sums of logs).
    chunk_decay = torch.exp(a_cum[:, :, -1])  # (batch, chunk, group, head)
    state = (x.new_zeros(batch, groups, per_group, p, n) if initial_state is None
             else initial_state.float().reshape(batch, groups, per_group, p, n))
    before = docs[:, :1, 0] if docs is not None else None  # document of the token before each chunk
    entering = []
    # unbind once: indexing [:, c] per chunk would make every step's backward write a gradient the
    # size of the whole tensor (quadratic in the number of chunks).
    for c, (carry, own) in enumerate(zip(chunk_decay.unbind(1), chunk_states.unbind(1))):
        entering.append(state)
        if docs is not None:  # a chunk in which a new document starts passes nothing on
            carry = carry * (docs[:, c, -1:] == before)[..., None]
            before = docs[:, c, -1:]
        state = carry[..., None, None] * state + own
    entering = torch.stack(entering, dim=1)  # (batch, chunk, group, head, p, n)

    # Each token reads the state its chunk started with, decayed up to the token.
    into = torch.exp(a_cum)
    if docs is not None:
        previous = torch.cat([docs[:, :1, :1], docs[:, :-1, -1:]], dim=1)  # (batch, chunk, 1)
        into = into * (docs == previous)[..., None, None]
    y = y + torch.einsum("bctgn,bcghpn->bctghp", C, entering) * into.unsqueeze(-1)
    y = y.reshape(batch, chunks * q, heads, p)[:, :seq]
    return y, state.reshape(batch, heads, p, n)


def carried_output(C: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, state: torch.Tensor,
                   reads: torch.Tensor | None = None) -> torch.Tensor:
    """What a sequence scanned from a zero state is missing when a state entered it: token t adds
    exp(a_1 + ... + a_t) (state C_t). Shapes as ssd_scan's; state (batch, heads, p, n). reads:
    (batch, seq) bool, the tokens that see the entering state (those of its document), or None (all).
    Returns (batch, seq, heads, p) fp32."""
    batch, seq, heads = dt.shape
    groups = C.shape[2]
    decay = torch.exp((dt.float() * A.float()).cumsum(1))  # (batch, seq, heads)
    if reads is not None:
        decay = decay * reads[..., None]
    state = state.float().reshape(batch, groups, heads // groups, *state.shape[2:])
    out = torch.einsum("btgn,bghpn->btghp", C.float(), state).reshape(batch, seq, heads, -1)
    return out * decay.unsqueeze(-1)


def ssd_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                  initial_state: torch.Tensor | None = None,
                  documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence itself, one token at a time (the reference for tests; slow). Same arguments
    and results as ssd_scan."""
    batch, seq, heads, p = x.shape
    per_group = heads // B.shape[2]
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp64 stays fp64 (a reference for fp32)
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    B = B.repeat_interleave(per_group, dim=2)  # (batch, seq, heads, n)
    C = C.repeat_interleave(per_group, dim=2)
    state = x.new_zeros(batch, heads, p, B.shape[-1]) if initial_state is None else initial_state.to(dtype)
    ys = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * A)  # (batch, heads)
        if documents is not None and t > 0:
            decay = decay * (documents[:, t] == documents[:, t - 1])[:, None]
        update = (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(-2)  # (batch, heads, p, n)
        state = decay[..., None, None] * state + update
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


__all__ = ["carried_output", "ssd_recurrent", "ssd_scan"]
