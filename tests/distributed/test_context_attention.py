"""Context-parallel attention is exact: the load-balanced layout, RoPE at global positions,
and CP attention (output and q/k/v gradients) against full causal attention on one device,
also with document masks (packed documents whose boundaries fall inside and across chunks).

The distributed check spawns 4 gloo processes once and runs cp=4 on all of them and cp=2
on both halves of a 2 x 2 mesh, each with both rotate methods, GQA and MHA, and values
narrower or wider than the keys (multi-head latent attention: v_head_dim != qk_head_dim),
bidirectional (an encoder's, with and without documents), attention sinks, and sliding windows that cross chunk
and rank boundaries (with and without documents). These are every kind of q/k/v and mask
a family hands the CP attention, so the per-family layouts (tests/layouts) run one rotate method
(the ring) and the choice of method is checked here. Tolerances:
every rank computes in fp32 and differs from one device only in summation order (measured
max abs error 1.4e-6 over attention outputs and q/k/v gradients of magnitude up to ~3, and
1e-5 over model logits and parameter gradients, the largest on output.weight entries of
magnitude ~10, so well inside ATOL + RTOL * |x|). A wrong layout, mask, merge or RoPE
position is off by 1e-2 or more (logits) and O(1) (attention gradients).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from conftest import sharp_llama
from family_checks import run_on_gloo_ranks
from titanlike.models.common.attention import DocumentMask, core_attention
from titanlike.models.common.rope import apply_rotary_emb, precompute_rope_cache
from titanlike.parallel.context import (
    ROTATE_METHODS,
    ContextParallelAttention,
    apply_context_parallel,
    load_balanced_layout,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)

ATOL = 2e-5
RTOL = 1e-4
TIMEOUT_S = 180


# Layout and RoPE (one process) -----------------------------------------------------------

def test_layout_pairs_head_and_tail_chunks():
    # 16 tokens, cp 2: four chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_layout_is_a_partition_with_equal_causal_work(cp):
    seq = 8 * cp
    layout = load_balanced_layout(seq, cp)
    assert sorted(layout.flatten().tolist()) == list(range(seq))
    # Causal work of a rank: keys visible to its queries = sum of (position + 1).
    work = (layout + 1).sum(dim=1)
    assert work.min() == work.max()


def test_layout_rejects_uneven_chunks():
    with pytest.raises(ValueError, match="2 x cp = 4 equal chunks"):
        load_balanced_layout(10, 2)


def test_shard_then_unshard_is_identity():
    x = torch.arange(3 * 24).view(3, 24)
    shards = [shard_sequence(x, load_balanced_positions(24, 3, r)) for r in range(3)]
    assert all(s.shape == (3, 8) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards), x)


def test_rope_of_a_slice_uses_global_positions():
    # Rotating the whole sequence and then slicing equals slicing first and rotating with
    # the table rows of the slice's positions, which is what the model does under CP.
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 8)
    cache = precompute_rope_cache(8, 16, 10000.0)
    positions = load_balanced_positions(16, 2, 1)
    torch.testing.assert_close(apply_rotary_emb(x, cache)[:, positions],
                               apply_rotary_emb(x[:, positions], cache[positions]))
    # Slicing without the positions would rotate by 0..7: clearly different.
    assert not torch.allclose(apply_rotary_emb(x, cache)[:, positions], apply_rotary_emb(x[:, positions], cache))


# CP attention against one device (spawned gloo ranks) -------------------------------------

EOD = 1


def _packed_tokens(seq: int, vocab: int) -> torch.Tensor:
    """Two samples of several documents each, with boundaries inside and across CP chunks."""
    tokens = torch.randint(2, vocab, (2, seq))
    tokens[0, [3, seq // 2, seq // 2 + 1]] = EOD
    tokens[1, [seq // 4, seq - 5]] = EOD
    return tokens


def _document_mask(tokens: torch.Tensor, kernel: str | None, causal: bool) -> DocumentMask:
    mask = DocumentMask.from_tokens(tokens, EOD, kernel)
    return mask if causal else DocumentMask.from_document_ids(mask.document_ids, kernel, causal=False)


def _check_attention(mesh, method: str, heads: int, kv_heads: int, documents: bool, v_dim: int = 16,
                     causal: bool = True, window: int | None = None, sinks: bool = False) -> None:
    cp, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(1234)  # the same full tensors on every rank
    b, seq, d = 2, 8 * cp, 16
    q = torch.randn(b, heads, seq, d, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, v_dim, requires_grad=True)
    grad_out = torch.randn(b, heads, seq, v_dim)
    tokens = _packed_tokens(seq, 50) if documents else None
    extra = {} if window is None else {"window": window}
    sink = (torch.randn(heads) * 2).requires_grad_() if sinks else None
    if sinks:
        extra["sinks"] = sink
    ref = core_attention(q, k, v, _document_mask(tokens, "sdpa", causal) if documents else None, causal=causal,
                         **extra)
    ref.backward(grad_out)

    positions = load_balanced_positions(seq, cp, rank)
    local = [shard_sequence(t.detach(), positions, dim=2).requires_grad_() for t in (q, k, v)]
    mask = _document_mask(tokens, None, causal) if documents else None
    if sinks:  # each rank's own leaf, whose grads summed over cp are the one-device grad
        reference_sink_grad = sink.grad.clone()
        extra["sinks"] = sink = sink.detach().clone().requires_grad_()
    out = ContextParallelAttention(mesh, method)(*local, mask, causal=causal, **extra)
    out.backward(shard_sequence(grad_out, positions, dim=2))

    what = (f"cp={cp} {method} heads={heads}/{kv_heads} v_dim={v_dim} documents={documents} causal={causal} "
            f"window={window} sinks={sinks} cp rank {rank}")
    torch.testing.assert_close(out, shard_sequence(ref.detach(), positions, dim=2), atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"output, {what}: {m}")
    for name, full, part in zip("qkv", (q, k, v), local):
        torch.testing.assert_close(part.grad, shard_sequence(full.grad, positions, dim=2), atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")
    if sinks:
        dist.all_reduce(sink.grad, group=mesh.get_group())
        torch.testing.assert_close(sink.grad, reference_sink_grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"grad sinks, {what}: {m}")


def _check_model(mesh, method: str, documents: bool) -> None:
    """A whole Llama under CP (RoPE at global positions, CP attention in every block) gives the
    one-device logits on its tokens, and its parameter grads summed over cp are the one-device grads.

    Training-sized parity cannot see RoPE: at init attention is nearly uniform, so rotating
    by local instead of global positions moves the train.py losses by only ~1e-5. Here wq/wk
    are scaled up so that attention is sharp and positions matter.
    """
    cp, rank = mesh.size(), mesh.get_local_rank()
    seq = 8 * cp
    model = sharp_llama(seq, vocab=128)
    args = model.model_args
    torch.manual_seed(99)
    tokens = _packed_tokens(seq, args.vocab_size) if documents else torch.randint(args.vocab_size, (2, seq))
    grad_logits = torch.randn(2, seq, args.vocab_size)

    ref_mask = DocumentMask.from_tokens(tokens, EOD, "sdpa") if documents else None
    ref = model(tokens, positions=None if ref_mask is None else ref_mask.positions, mask=ref_mask)
    ref.backward(grad_logits)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    apply_context_parallel(model, mesh, method)
    positions = load_balanced_positions(seq, cp, rank)
    mask = DocumentMask.from_tokens(tokens, EOD, None) if documents else None
    local_positions = positions if mask is None else shard_sequence(mask.positions, positions)
    out = model(shard_sequence(tokens, positions), positions=local_positions, mask=mask)
    out.backward(shard_sequence(grad_logits, positions))
    what = f"model cp={cp} {method} documents={documents} cp rank {rank}"
    torch.testing.assert_close(out, shard_sequence(ref.detach(), positions), atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"logits, {what}: {m}")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        torch.testing.assert_close(grad, ref_grads[name], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")


WORLD = 4


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    cp4 = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    cp2 = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "cp"))["cp"]
    for mesh in (cp2, cp4):
        for method in ROTATE_METHODS:
            for heads, kv_heads in ((4, 2), (4, 4)):
                _check_attention(mesh, method, heads, kv_heads, documents=False)
            _check_attention(mesh, method, 4, 2, documents=True)
            _check_attention(mesh, method, 4, 4, documents=False, v_dim=24)
            _check_attention(mesh, method, 4, 2, documents=True, v_dim=8)
            # An encoder's attention (BERT): every token sees the whole sequence, or its whole document.
            _check_attention(mesh, method, 4, 4, documents=False, causal=False)
            _check_attention(mesh, method, 4, 2, documents=True, causal=False)
            # Sliding windows (Gemma 3's local layers) of 5 and 11 tokens over chunks of 4: windows reach
            # across chunk and rank boundaries and end inside other ranks' chunks.
            for window in (5, 11):
                _check_attention(mesh, method, 4, 2, documents=False, window=window)
                _check_attention(mesh, method, 4, 2, documents=True, window=window)
            # Attention sinks (gpt-oss): joined once to the softmax over every rank's keys.
            _check_attention(mesh, method, 4, 2, documents=False, sinks=True)
            _check_attention(mesh, method, 4, 2, documents=True, window=5, sinks=True)
            for documents in (False, True):
                _check_model(mesh, method, documents)


@pytest.mark.distributed
def test_cp_attention_matches_full_attention():
    run_on_gloo_ranks(_worker, world=WORLD, timeout_s=TIMEOUT_S, what="context-parallel attention workers")
