"""apply_rotary_emb's two spellings: complex in eager (fast), real under torch.compile (inductor
cannot generate code for complex operators). They must give the same numbers and gradients."""

import pytest
import torch

from titanlike.models.common.rope import (
    RoPEScaling,
    YaRNScaling,
    apply_rotary_emb,
    precompute_rope_cache,
    rotate_pairs_complex,
    rotate_pairs_real,
)

# The Llama debug model's attention: batch 8, seq 256, 16 query and 8 key heads of 16 features.
BATCH, SEQ, HEAD_DIM = 8, 256, 16
SCALINGS = {
    "llama3.1": RoPEScaling(8.0, 1.0, 4.0, 8192),
    "yarn": YaRNScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8),
    "none": None,
}


def _rotation(scaling, positions=None):
    """Table rows of (cos, sin) pairs broadcastable against (batch, seq, heads, head_dim), as
    apply_rotary_emb passes them on."""
    table = precompute_rope_cache(HEAD_DIM, 2048, 500000.0, scaling)
    return table[:SEQ].unsqueeze(1) if positions is None else table[positions].unsqueeze(2)


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
@pytest.mark.parametrize("heads", [16, 8])
def test_complex_and_real_spellings_agree_in_float32(scaling, heads):
    torch.manual_seed(0)
    rotation = _rotation(scaling)
    x = torch.randn(BATCH, SEQ, heads, HEAD_DIM, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, heads, HEAD_DIM)
    fast, real = rotate_pairs_complex(x, rotation), rotate_pairs_real(x, rotation)
    torch.testing.assert_close(fast, real, rtol=0, atol=5e-7)
    (fast_grad,), (real_grad,) = torch.autograd.grad(fast, x, grad), torch.autograd.grad(real, x, grad)
    torch.testing.assert_close(fast_grad, real_grad, rtol=0, atol=5e-7)
    torch.testing.assert_close(apply_rotary_emb(x, precompute_rope_cache(HEAD_DIM, 2048, 500000.0, scaling)),
                               real, rtol=0, atol=5e-7)


def test_per_token_angles_agree():
    # Positions that restart per document (or a context-parallel slice): one row per token.
    torch.manual_seed(0)
    positions = torch.cat([torch.arange(100), torch.arange(SEQ - 100)]).expand(BATCH, SEQ)
    rotation = _rotation(SCALINGS["llama3.1"], positions)
    x = torch.randn(BATCH, SEQ, 8, HEAD_DIM)
    rows = precompute_rope_cache(HEAD_DIM, 2048, 500000.0, SCALINGS["llama3.1"])[positions]
    torch.testing.assert_close(apply_rotary_emb(x, rows), rotate_pairs_real(x, rotation), rtol=0, atol=5e-7)


def test_bfloat16_rotates_in_float32_and_keeps_its_dtype():
    torch.manual_seed(0)
    rotation = _rotation(SCALINGS["llama3.1"])
    x = torch.randn(BATCH, SEQ, 8, HEAD_DIM)
    out = apply_rotary_emb(x.bfloat16(), precompute_rope_cache(HEAD_DIM, 2048, 500000.0, SCALINGS["llama3.1"]))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rotate_pairs_real(x.bfloat16(), rotation), rtol=0, atol=0)
    # One bf16 rounding of the input and one of the output: within a few bf16 ulps of float32.
    torch.testing.assert_close(out.float(), rotate_pairs_real(x, rotation), rtol=2e-2, atol=2e-2)


def test_a_slice_at_an_odd_column_is_rotated():
    # DeepSeek's rotary features are the tail of each head: a view whose offset may be odd.
    torch.manual_seed(0)
    heads = torch.randn(2, 5, 3, 5 + HEAD_DIM)
    tail = heads[..., 5:]
    rotation = precompute_rope_cache(HEAD_DIM, 5, 10000.0).unsqueeze(1)
    torch.testing.assert_close(rotate_pairs_complex(tail, rotation), rotate_pairs_real(tail, rotation),
                               rtol=0, atol=5e-7)


def test_angles_that_require_grad_get_their_gradient():
    # The tables are buffers, but a learned table would be differentiated as in the real spelling.
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, HEAD_DIM)
    grads = []
    for rotate in (rotate_pairs_complex, rotate_pairs_real):
        table = precompute_rope_cache(HEAD_DIM, 8, 10000.0).requires_grad_()
        (grad,) = torch.autograd.grad(rotate(x, table.unsqueeze(1)).square().sum(), table)
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-5)


def test_compiled_graph_is_real_valued():
    # A recording backend instead of inductor: what dynamo hands the compiler, without the compile.
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    cache = precompute_rope_cache(HEAD_DIM, 64, 10000.0)
    x = torch.randn(2, 32, 4, HEAD_DIM)
    out = torch.compile(apply_rotary_emb, backend=record, fullgraph=True)(x, cache)
    torch.testing.assert_close(out, apply_rotary_emb(x, cache), rtol=0, atol=5e-7)
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes]
    assert targets and not [t for t in targets if "complex" in t], targets
