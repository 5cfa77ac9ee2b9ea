"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks") in plain PyTorch:
the chunked form for training and prefill, the recurrent form for decoding.

The recurrence, per value head, with a state S (k_dim x v_dim):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T (scale q_t)

g_t <= 0 a log decay, beta_t in (0, 1) the write strength, k_t (unit length in Gated DeltaNet) the
slot written: the state's old value at k_t is replaced by v_t in proportion beta_t (the delta rule),
after the whole state decays by exp(g_t) (the gate). Written as a product,
S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T.

The chunked form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule") cuts the
sequence into chunks of C tokens. Within a chunk the C updates are one lower-triangular system
(I + A) [u, w] = [beta v, beta exp(c) k], A_ij = beta_i (k_i . k_j) exp(c_i - c_j) for j < i, c the
cumulative log decay in the chunk: u is what the chunk writes when it starts from a zero state, w how
much of the entering state each token's write removes. Across chunks one step per chunk carries the
state: v_new = u - w S, o = exp(c) q S + (q k^T * decay) v_new, S <- exp(c_last) S + k_decayed^T v_new.
Work is O(T C (k_dim + v_dim)) within chunks and O(T k_dim v_dim) across them, linear in T.

Both forms run in fp32 and match transformers' torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule (models/qwen3_next in transformers) with its q/k normalization done
by the caller (`l2norm`). Grouped value heads: q and k may have fewer heads than v, each serving
v_heads // k_heads consecutive value heads.

Documents. With `documents` (batch, seq) ids, non-decreasing along each sample
(DocumentMask.document_ids), the state resets where a document starts: a token reads only earlier
tokens of its own document, as attention with a document mask. An initial state belongs to the
document of token 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in fp32 (the flash-linear-attention kernels' and
    transformers' normalization of Gated DeltaNet's q and k)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale):
    """(batch, heads, seq, ...) fp32 tensors, q and k repeated to the value heads, q scaled."""
    k_heads, v_heads = k.shape[2], v.shape[2]
    if v_heads % k_heads:
        raise ValueError(f"value heads ({v_heads}) must be a multiple of key heads ({k_heads})")
    if v_heads != k_heads:
        q = q.repeat_interleave(v_heads // k_heads, dim=2)
        k = k.repeat_interleave(v_heads // k_heads, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, g, beta))
    return q * scale, k, v, g, beta


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                           chunk_size: int = 64, scale: float | None = None,
                           initial_state: torch.Tensor | None = None,
                           documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form.

    q, k: (batch, seq, k_heads, k_dim); v: (batch, seq, v_heads, v_dim); g (log decay, <= 0) and
    beta: (batch, seq, v_heads); scale: q's factor (None: k_dim^-0.5); initial_state: (batch,
    v_heads, k_dim, v_dim) or None (zeros); documents: (batch, seq) ids or None.
    Returns o (batch, seq, v_heads, v_dim) in v's dtype and the final state (fp32).
    """
    out_dtype = v.dtype
    batch, seq = v.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    # Pad to whole chunks with tokens that neither decay (g 0) nor write (beta 0, k 0) the state, in
    # the last document; their outputs are dropped.
    pad = (-seq) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
        if documents is not None:
            documents = torch.cat([documents, documents[:, -1:].expand(batch, pad)], dim=1)
    chunks = (seq + pad) // chunk_size
    q, k, v = (t.reshape(batch, heads, chunks, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(batch, heads, chunks, chunk_size) for t in (g, beta))
    c = g.cumsum(-1)  # log decay from the chunk's start to each token, inclusive

    visible = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    reads = ends = None
    if documents is not None:
        d = documents.reshape(batch, 1, chunks, chunk_size)
        visible = visible & (d[..., :, None] == d[..., None, :])
        # The document of the token before each chunk (chunk 0: token 0's, whose the initial state is):
        # tokens of another document do not read the state entering the chunk, and tokens of a
        # document that ends inside the chunk do not write the state leaving it.
        before = torch.cat([d[:, :, :1, :1], d[:, :, :-1, -1:]], dim=2)
        reads = (d == before).float()
        ends = (d == d[..., -1:]).float()
    # exp(c_i - c_j) where token i reads token j's write within the chunk, 0 elsewhere (masked
    # before exp: the entries above the diagonal would overflow).
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~visible, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the strictly lower part is A; the diagonal is unused
    decayed_k_beta = k_beta * c.exp()[..., None]
    q_state = q * c.exp()[..., None]
    k_state = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()
    if reads is not None:
        decayed_k_beta, q_state = decayed_k_beta * reads[..., None], q_state * reads[..., None]
        k_state = k_state * ends[..., None]
        chunk_decay = chunk_decay * reads[..., -1]
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    # -w, so that the loop's u - w S is one baddbmm without a scale (whose backward would add one)
    minus_w = torch.linalg.solve_triangular(system, -decayed_k_beta, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay

    # The loop runs on (batch x heads) stacks of matrices with bmm and baddbmm: one kernel per product
    # and sum, where matmul on 4-d tensors adds views and expands around each bmm (5x the operators per
    # chunk, which the estimator's fake-tensor probe pays one by one). unbind once, as ssd.py's scan
    # does: indexing [:, i] per chunk would make every step's backward write a gradient the size of the
    # whole tensor (quadratic in the number of chunks).
    stacks = batch * heads
    state = (v.new_zeros(stacks, k_dim, v_dim) if initial_state is None
             else initial_state.float().expand(batch, heads, k_dim, v_dim).reshape(stacks, k_dim, v_dim))
    outs = []
    per_chunk = zip(*(t.reshape(stacks, chunks, *t.shape[3:]).unbind(1) for t in
                      (u, minus_w, q_state, attn, k_state.transpose(-1, -2), chunk_decay[..., None, None])))
    for u_i, minus_w_i, q_i, attn_i, k_t_i, decay_i in per_chunk:
        v_new = torch.baddbmm(u_i, minus_w_i, state)  # u - w S
        outs.append(torch.baddbmm(torch.bmm(q_i, state), attn_i, v_new))
        state = torch.baddbmm(state * decay_i, k_t_i, v_new)
    o = torch.stack(outs, dim=1).reshape(batch, heads, chunks * chunk_size, v_dim)[:, :, :seq]
    return o.transpose(1, 2).to(out_dtype), state.reshape(batch, heads, k_dim, v_dim)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, scale: float | None = None,
                               initial_state: torch.Tensor | None = None,
                               documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form, token by token (a decode step is seq 1): the arguments and results of
    chunk_gated_delta_rule."""
    out_dtype = v.dtype
    batch, seq = v.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    state = (v.new_zeros(batch, heads, k_dim, v_dim) if initial_state is None
             else initial_state.float().expand(batch, heads, k_dim, v_dim))
    outs = []
    for t in range(seq):
        gate = g[:, :, t].exp()
        if documents is not None and t > 0:
            gate = gate * (documents[:, t] == documents[:, t - 1]).float()[:, None]
        state = state * gate[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


__all__ = ["chunk_gated_delta_rule", "l2norm", "recurrent_gated_delta_rule"]
