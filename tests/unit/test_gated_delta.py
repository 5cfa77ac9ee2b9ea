"""The gated delta rule (models/common/gated_delta.py): the chunked and recurrent forms against a
naive reference written here from the equations (one document at a time, the state a matrix product),
forwards and backwards in fp32, on packed documents, and against transformers' torch functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titanlike.models.common.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8


def inputs(batch=2, seq=150, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, seq, K_HEADS, K_DIM, generator=gen))
    k = l2norm(torch.randn(batch, seq, K_HEADS, K_DIM, generator=gen))
    v = torch.randn(batch, seq, V_HEADS, V_DIM, generator=gen)
    g = -F.softplus(torch.randn(batch, seq, V_HEADS, generator=gen)) * 0.5
    beta = torch.rand(batch, seq, V_HEADS, generator=gen)
    out = (q, k, v, g, beta)
    return tuple(t.requires_grad_() for t in out) if requires_grad else out


def documents(batch, seq, count, seed=0):
    """Document ids (batch, seq), non-decreasing, several documents per row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, (batch, seq), generator=gen).sort(dim=1).values


def naive(q, k, v, g, beta, *, initial_state=None, documents=None):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(k_dim),
    each (sample, head) on its own, the state zeroed where a document starts (the initial state
    belongs to token 0's document)."""
    batch, seq = v.shape[:2]
    rep = V_HEADS // K_HEADS
    out = torch.zeros(batch, seq, V_HEADS, V_DIM)
    finals = torch.zeros(batch, V_HEADS, K_DIM, V_DIM)
    eye = torch.eye(K_DIM)
    for b in range(batch):
        for h in range(V_HEADS):
            state = torch.zeros(K_DIM, V_DIM) if initial_state is None else initial_state[b, h]
            rows = []
            for t in range(seq):
                if documents is not None and t > 0 and documents[b, t] != documents[b, t - 1]:
                    state = torch.zeros(K_DIM, V_DIM)
                kt, qt = k[b, t, h // rep], q[b, t, h // rep] * K_DIM ** -0.5
                state = (g[b, t, h].exp() * (eye - beta[b, t, h] * torch.outer(kt, kt)) @ state
                         + beta[b, t, h] * torch.outer(kt, v[b, t, h]))
                rows.append(state.t() @ qt)
            out[b, :, h] = torch.stack(rows)
            finals[b, h] = state
    return out, finals


@pytest.mark.parametrize("with_documents", [False, True])
def test_both_forms_equal_the_naive_reference_forwards(with_documents):
    # 150 tokens in chunks of 32: four whole chunks and a padded remainder; documents cross chunks.
    q, k, v, g, beta = inputs()
    init = torch.randn(2, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(1))
    docs = documents(2, 150, 6) if with_documents else None
    want_o, want_state = naive(q, k, v, g, beta, initial_state=init, documents=docs)
    for o, state in (chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, initial_state=init, documents=docs),
                     recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init, documents=docs)):
        torch.testing.assert_close(o, want_o, rtol=0, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


def test_both_forms_equal_the_naive_reference_backwards():
    seq = 45
    docs = documents(2, seq, 3, seed=2)
    grad = torch.randn(2, seq, V_HEADS, V_DIM, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        tensors = inputs(seq=seq, requires_grad=True)
        o, state = fn(*tensors)
        (o * grad).sum().add(state.sum()).backward()
        return [t.grad for t in tensors]

    want = grads(lambda *t: naive(*t, documents=docs))
    for fn in (lambda *t: chunk_gated_delta_rule(*t, chunk_size=16, documents=docs),
               lambda *t: recurrent_gated_delta_rule(*t, documents=docs)):
        for name, got, w in zip("q k v g beta".split(), grads(fn), want):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


def test_the_chunk_loop_backward_does_not_grow_with_the_square_of_the_chunks():
    """Each chunk's slices are taken once (unbind), not indexed inside the loop: indexing a chunk
    backpropagates a zero tensor of the whole sequence per chunk (SelectBackward0), which made the
    backward quadratic in the chunks (1.3 s against 0.46 s at seq 4096 on CPU, bench_gated_delta.py)."""
    def graph_nodes(chunks):
        o, state = chunk_gated_delta_rule(*inputs(batch=1, seq=16 * chunks, requires_grad=True), chunk_size=16)
        seen, stack, kinds = set(), [o.grad_fn, state.grad_fn], {}
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            kinds[type(node).__name__] = kinds.get(type(node).__name__, 0) + 1
            stack.extend(next_fn for next_fn, _ in node.next_functions)
        return kinds

    few, many = graph_nodes(4), graph_nodes(12)
    assert few.get("SelectBackward0", 0) == many.get("SelectBackward0", 0) <= 2, (few, many)



def test_each_chunk_costs_a_few_operators():
    """The loop's products are bmm and baddbmm on (batch x heads) stacks: matmul on 4-d tensors wraps each
    bmm in views and expands, 64 operators per chunk forward and backward against 28. The estimator's
    probe runs the loop on fake tensors, operator by operator: the Qwen3-Next preset's pre-flight took
    15.3 s of it before, 7.4 s after (`python -m estimation.estimate --job.config_file
    train_configs/qwen3_next_80b_a3b.toml --estimate.world_size 32`)."""
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators += func.namespace != "prim"  # prim.device: a query, not an operator
            return func(*args, **(kwargs or {}))

    def operators(chunks):
        with Count() as count:
            o, state = chunk_gated_delta_rule(*inputs(batch=1, seq=16 * chunks, requires_grad=True), chunk_size=16)
            (o.sum() + state.sum()).backward()
        return count.operators

    per_chunk = (operators(12) - operators(4)) / 8
    assert per_chunk <= 32, per_chunk

def test_a_document_boundary_is_a_fresh_start():
    # Two documents packed in one row give what each gives alone.
    q, k, v, g, beta = inputs(batch=1, seq=70)
    docs = (torch.arange(70) >= 30).long()[None]
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, documents=docs)
    first, _ = chunk_gated_delta_rule(*(t[:, :30] for t in (q, k, v, g, beta)), chunk_size=16)
    second, _ = chunk_gated_delta_rule(*(t[:, 30:] for t in (q, k, v, g, beta)), chunk_size=16)
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=0, atol=1e-6)


def test_equal_to_transformers_torch_functions():
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    raw = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 100, K_HEADS, K_DIM, generator=raw) for _ in range(2))
    _, _, v, g, beta = inputs(seq=100)
    init = torch.randn(2, V_HEADS, K_DIM, V_DIM, generator=raw)
    theirs = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=init,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours = chunk_gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, initial_state=init)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # A decode step: one token from a state.
    step = [t[:, :1] for t in (q, k, v, g, beta)]
    theirs = qwen3_next.torch_recurrent_gated_delta_rule(*step, initial_state=init, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    ours = recurrent_gated_delta_rule(l2norm(step[0]), l2norm(step[1]), *step[2:], initial_state=init)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_unequal_heads_are_refused():
    q, k, v, g, beta = inputs(seq=4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
