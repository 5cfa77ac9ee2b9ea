"""Context parallelism: each rank of the cp mesh holds a slice of every sequence.

Everything outside attention is per token, so it runs unchanged on the local
slice; only attention needs the keys and values of the other slices. Two pieces:

Load-balanced layout. Under a causal mask, late tokens attend to many more keys
than early ones, so cutting the sequence into cp contiguous pieces would leave
the last rank with most of the work. Instead the sequence is cut into 2*cp equal
chunks and rank i holds chunks i and 2*cp-1-i (one from the head, one from the
tail): every rank then does the same causal work. `load_balanced_positions`
gives the global position of each local token; the trainer cuts inputs and
labels with it, and the model uses it to pick each token's RoPE angles.

Exact attention across ranks. `ContextParallelAttention` replaces a model's
core attention (the `core_attention` hook of its attention modules) and moves
K/V between the cp ranks:
  - "allgather": all-gather K/V once and attend with a causal mask built from
    the global positions of the local queries and of the gathered keys.
  - "alltoall": a ring. K/V hop to the next rank cp-1 times; each hop's block is
    attended with its own mask and log-sum-exp, and the partial results are
    merged with the online-softmax rescaling. Each hop talks to one neighbour only,
    and the next hop is issued before the current block is computed so that an
    asynchronous backend can overlap the two. (Plain autograd keeps every block for
    the backward, so this does not save activation memory over "allgather".)
With document masking both masks also require query and key to be in the same
document; every cp rank holds the document ids of the whole sequence, so no ids move.
Both are written with torch's functional collectives, which are differentiable
(the backward of the all-gather is a reduce-scatter, that of a ring hop is the
hop back), so they run and train on CPU/gloo.

Sequence mixers that carry state instead of attending (a Mamba-2 layer's scan and causal
conv) get a `ContextParallelCarry` through their `sequence_carry` hook: it hands each piece
of the sequence what the piece before it ends with (all-gathered, one small tensor per
piece), so they too compute exactly what one rank would.

On GPU the built-in `torch.distributed.tensor.experimental.context_parallel`
(fused flash/efficient kernels, overlapped ring) should be preferred; wiring it
in is future work. It fails on CPU: its dispatcher knows only the CUDA attention
ops, so this module is the path that works everywhere and is tested here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from titanlike.models import protocol
from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.sinks import add_sinks, sink_attention
from titanlike.parallel.utils import all_gather_autograd

ROTATE_METHODS = ("allgather", "alltoall")


def validate_context_parallel(seq_len: int, cp: int, tp: int) -> None:
    """Load balancing cuts each sequence into 2 x cp equal chunks and sequence parallel splits a
    rank's share over tp. Asking for chunks that tp splits evenly is slightly stricter than needed
    (lcm(2 cp, cp tp)) but is the rule torchtitan users know, and real lengths meet it."""
    unit = 2 * cp * tp
    if seq_len % unit:
        raise ValueError(
            f"training.seq_len {seq_len} must be divisible by 2 x context_parallel_degree {cp} x "
            f"tensor_parallel_degree {tp} = {unit}, so that context parallelism can cut it into "
            f"2 x {cp} equal chunks that tensor parallelism splits evenly")


def load_balanced_layout(seq_len: int, cp_degree: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(cp_degree, seq_len // cp_degree) global positions: row i holds those of cp rank i.

    Rank i gets chunks i and 2*cp_degree-1-i of the 2*cp_degree equal chunks, each in order.
    """
    chunks = 2 * cp_degree
    if seq_len % chunks:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x cp = {chunks} equal chunks")
    chunk = torch.arange(seq_len, device=device).view(chunks, seq_len // chunks)
    ranks = torch.arange(cp_degree, device=device)
    return torch.cat([chunk[ranks], chunk[chunks - 1 - ranks]], dim=1)


def load_balanced_positions(seq_len: int, cp_degree: int, cp_rank: int,
                            device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (seq_len // cp_degree,) of the tokens that cp rank cp_rank holds."""
    return load_balanced_layout(seq_len, cp_degree, device)[cp_rank]


def shard_sequence(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of x (inputs, labels, or any per-token tensor) along the sequence dim."""
    return x.index_select(dim, positions.to(x.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence over all cp ranks: the per-rank slices back in global order."""
    cp = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    order = load_balanced_layout(seq_len, cp, shards[0].device).flatten().argsort()
    return torch.cat(shards, dim=dim).index_select(dim, order)


class ContextParallelAttention:
    """Causal attention over (batch, heads, local_seq, head_dim) tensors whose tokens are this
    rank's load-balanced slice of the sequence; exact, as if computed on the whole sequence.

    k/v may have fewer heads than q (grouped-query attention): they travel between ranks
    with their own head count and are never repeated. Under tensor parallelism the heads
    are this rank's local heads, which changes nothing here.

    A plain callable, not an nn.Module: it holds no state a checkpoint should see.
    """

    def __init__(self, cp_mesh: DeviceMesh, rotate_method: str = "allgather"):
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(f"context_parallel_rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}")
        if cp_mesh.ndim != 1:
            raise ValueError(f"context parallelism needs a 1-D cp mesh, got {cp_mesh.ndim} dims")
        self.mesh = cp_mesh
        self.rotate_method = rotate_method
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.cp}, rotate_method={self.rotate_method!r})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: DocumentMask | None = None, *, causal: bool = True, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """mask: document ids of the whole sequence (every cp rank has them); None is plain causal
        (or, with causal=False, every token sees every token: an encoder without padding). window: a
        sliding-window layer's (models/common/attention.py), applied to the global positions, so a
        window that reaches into another rank's chunks sees exactly the keys one rank would. sinks: a
        sink layer's per-head logits, joined once to the softmax over every rank's keys."""
        if mask is not None and mask.causal != causal:
            raise ValueError("the document mask's direction differs from the attention's")
        if window is not None and not causal:
            raise ValueError("a sliding window needs causal attention")
        layout = load_balanced_layout(q.shape[2] * self.cp, self.cp, q.device)
        documents = None if mask is None else mask.document_ids
        if self.rotate_method == "allgather":
            return self._allgather(q, k, v, layout, documents, causal, window, sinks)
        return self._ring(q, k, v, layout, documents, causal, window, sinks)

    def _allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor, documents: torch.Tensor | None,
                 causal: bool, window: int | None = None) -> torch.Tensor:
        """Which keys (global positions k_pos) each query (q_pos) sees: (seq_q, seq_k), or
        (batch, 1, seq_q, seq_k) within documents."""
        allowed = k_pos[None, :] <= q_pos[:, None] if causal else \
            torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        if window is not None:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
        if documents is None:
            return allowed
        same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]
        return (allowed & same).unsqueeze(1)

    def _allgather(self, q, k, v, layout, documents, causal, window, sinks=None):
        # One collective for both: (b, h, s, dk + dv) gathered on dim 0 -> (cp * b, h, s, dk + dv).
        # Joined on the feature dim, which k and v need not share (MLA: v_head_dim != qk_head_dim).
        kv = all_gather_autograd(torch.cat([k, v], dim=-1), 0, self.mesh)
        kv = kv.unflatten(0, (self.cp, -1)).movedim(0, 2).flatten(2, 3)  # (b, h, cp * s, dk + dv)
        keys, values = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        # Keys stay in rank-major order: the mask carries their positions, and attention
        # does not care in which order its keys come.
        mask = self._allowed(layout[self.rank], layout.flatten(), documents, causal, window)
        if sinks is not None:
            return sink_attention(q, keys, values, mask, sinks)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _shift(self, kv: torch.Tensor) -> torch.Tensor:
        """Send kv to the next cp rank, receive the previous rank's (a differentiable ring hop)."""
        n = kv.shape[0]
        send = [0] * self.cp
        recv = [0] * self.cp
        send[(self.rank + 1) % self.cp] = n
        recv[(self.rank - 1) % self.cp] = n
        return funcol.all_to_all_single_autograd(kv, recv, send, self.mesh)

    def _ring(self, q, k, v, layout, documents, causal, window, sinks=None):
        b, hq, s, d = q.shape
        hkv, dk, dv = k.shape[1], k.shape[-1], v.shape[-1]
        q_pos = layout[self.rank]
        # Merging partial softmaxes in bf16 would lose the precision that exactness is about.
        qg = q.float().view(b, hkv, hq // hkv, s, d)  # query heads grouped by the k/v head they share
        # One tensor per hop, joined on the feature dim (k and v may differ in width).
        kv = torch.cat([k, v], dim=-1)
        out = lse = None
        for step in range(self.cp):
            # Start the next hop before computing on the current block, so that an asynchronous
            # backend can overlap them (functional collectives wait only when the result is used).
            nxt = self._shift(kv) if step < self.cp - 1 else None
            k_pos = layout[(self.rank - step) % self.cp]
            allowed = self._allowed(q_pos, k_pos, documents, causal, window)
            if documents is not None:
                allowed = allowed.unsqueeze(1)  # (batch, 1, 1, s, s): broadcast over k/v and query groups
            k_t, v_t = kv.float().unsqueeze(2).split([dk, dv], dim=-1)
            out_t, lse_t = _partial_attention(qg, k_t, v_t, allowed)
            if out is None:
                # Step 0 is this rank's own block: every query sees at least itself, so lse is finite.
                out, lse = out_t, lse_t
            else:
                new_lse = torch.logaddexp(lse, lse_t)
                out = out * torch.exp(lse - new_lse) + out_t * torch.exp(lse_t - new_lse)
                lse = new_lse
            kv = nxt
        out = out.reshape(b, hq, s, dv)
        if sinks is not None:  # one more term of the merged softmax: weight exp(sink), value 0
            out = add_sinks(out, lse.reshape(b, hq, s), sinks)
        return out.to(q.dtype)


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Softmax attention of q over one block of keys, and its log-sum-exp (unsqueezed last dim).

    A query that sees no key of the block gets output 0 and lse -inf, so the merge gives it
    zero weight. Such rows are computed through `where`, never through log(0) or 0/0, whose
    gradients would be NaN even when multiplied by zero.
    """
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, -math.inf)
    # The row max only keeps exp() in range; softmax and lse do not depend on it, so it needs no gradient.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    empty = torch.isinf(row_max)
    weights = torch.exp(scores - torch.where(empty, 0.0, row_max))
    total = weights.sum(dim=-1, keepdim=True)
    total = torch.where(empty, 1.0, total)
    out = (weights @ v) / total
    lse = torch.where(empty, -math.inf, row_max + torch.log(total))
    return out, lse


class ContextParallelCarry:
    """For sequence mixers that carry information along the sequence instead of attending (a
    state-space scan, a short causal convolution): what crosses from each piece of the sequence
    to the next when the pieces live on different cp ranks.

    Under the load-balanced layout a rank holds `pieces` (2) contiguous pieces of every sequence,
    in its local order; globally the sequence is the 2 x cp pieces in order. A mixer computes each
    of its pieces as if it started the sequence, asks `previous` for what the piece before each of
    its own hands on (the last inputs of a convolution) and `incoming` for the state entering it
    (a recurrence state_{i+1} = decay_i state_i + final_i over the pieces in order), and corrects.
    Both all-gather one small tensor per piece (differentiable: the backward reduce-scatters), so
    the result is exact. A plain object, not an nn.Module: it holds no state.
    """

    pieces = 2

    def __init__(self, cp_mesh: DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(f"context parallelism needs a 1-D cp mesh, got {cp_mesh.ndim} dims")
        self.mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        # Global index of each piece of each rank: the layout of a sequence of one token per piece.
        self.order = load_balanced_layout(self.pieces * self.cp, self.cp)  # (cp, pieces)

    def __repr__(self) -> str:
        return f"ContextParallelCarry(cp={self.cp})"

    def local_positions(self, local_len: int, device=None) -> torch.Tensor:
        """Global positions (local_len,) of this rank's tokens, in local order."""
        return load_balanced_positions(local_len * self.cp, self.cp, self.rank, device)

    def positions_before(self, local_len: int, count: int, device=None) -> torch.Tensor:
        """(pieces, count): the global positions of the `count` tokens before each local piece
        (negative before the sequence's start)."""
        length = local_len // self.pieces
        starts = self.order[self.rank].to(device) * length
        return starts[:, None] - count + torch.arange(count, device=device)

    def _in_order(self, t: torch.Tensor) -> torch.Tensor:
        """(pieces, ...) of every rank, gathered and put in sequence order: (cp x pieces, ...)."""
        gathered = all_gather_autograd(t.contiguous(), 0, self.mesh)  # rank-major
        return gathered[self.order.flatten().argsort().to(t.device)]

    def previous(self, last: torch.Tensor) -> torch.Tensor:
        """last: (pieces, ...) what each local piece hands to the piece after it. Returns
        (pieces, ...): what each local piece gets from the piece before it (zeros for the first)."""
        ordered = torch.cat([torch.zeros_like(last[:1]), self._in_order(last)])
        return ordered[self.order[self.rank].to(last.device)]  # piece i gets entry i (= piece i-1's)

    def incoming(self, final: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
        """final: (pieces, ...) each local piece's state at its end when started from zero; decay:
        (pieces, ...) broadcastable, the factor by which a piece scales the state entering it.
        Returns (pieces, ...): the state entering each local piece."""
        finals, decays = self._in_order(final), self._in_order(decay)
        state = torch.zeros_like(final[0])
        entering = []
        for f, d in zip(finals.unbind(0), decays.unbind(0)):
            entering.append(state)
            state = d * state + f
        entering = torch.stack(entering)
        return entering[self.order[self.rank].to(final.device)]


def require_context_parallel_hooks(model: nn.Module) -> None:
    """ValueError unless the whole model has a hook context parallelism can switch: a model without
    one would silently attend within each rank's slice only. Asked of the whole model, before a
    pipeline split: a stage of MLP layers only has none and needs none."""
    if not protocol.core_attention_modules(model) and not protocol.sequence_carry_modules(model):
        raise ValueError(f"{type(model).__name__} has no attention module with a core_attention hook (nor a "
                         "sequence mixer with a sequence_carry hook), so it cannot run context parallel")


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, rotate_method: str) -> int:
    """Point the `core_attention` hook of every attention module of model (a whole model or a
    pipeline stage) at CP attention, and the `sequence_carry` hook of every module that carries
    state along the sequence (a state-space mixer) at a ContextParallelCarry.

    Must run before activation checkpointing and compile wrap the blocks. Returns the number of
    modules switched (0 for a stage without attention or mixers; require_context_parallel_hooks
    checks the whole model).
    """
    attention = ContextParallelAttention(cp_mesh, rotate_method)
    carry = ContextParallelCarry(cp_mesh)
    attention_modules = protocol.core_attention_modules(model)
    carry_modules = protocol.sequence_carry_modules(model)
    for module in attention_modules:
        protocol.set_core_attention(module, attention)
    for module in carry_modules:
        protocol.set_sequence_carry(module, carry)
    return len(attention_modules) + len(carry_modules)
