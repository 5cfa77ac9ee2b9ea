"""Attention sinks (models/common/attention.py): a learned per-head logit in the softmax denominator.
Every kernel against a naive reference with the sink written out as one more score whose value is 0,
forwards and backwards in fp32, with document masks, sliding windows and the KV cache. Context
parallel sinks are checked with the other CP masks in tests/distributed/test_context_attention.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from titanlike.models.common.attention import Attention, DocumentMask, core_attention
from titanlike.models.common.sinks import add_sinks
from titanlike.models.common.kv_cache import ModelCache

EOD = 1
TOL = dict(atol=1e-6, rtol=1e-6)


def _naive(q, k, v, allowed, sinks):
    """Softmax over the allowed keys and a sink key of score `sink` and value 0 (k/v heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    sink_key = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    sink_value = torch.zeros(*v.shape[:2], 1, v.shape[-1])
    return torch.cat([scores, sink_key], -1).softmax(-1) @ torch.cat([v, sink_value], 2)


def _inputs(seq=12, heads=4, kv_heads=2, d=8):
    torch.manual_seed(0)
    tensors = [torch.randn(2, heads, seq, d), torch.randn(2, kv_heads, seq, d), torch.randn(2, kv_heads, seq, d),
               torch.randn(heads) * 2]
    return [t.requires_grad_() for t in tensors]


def _documents(seq=12):
    tokens = torch.randint(2, 50, (2, seq))
    tokens[0, [2, 8]] = EOD
    tokens[1, 6] = EOD
    return tokens


def _allowed(seq, *, window=None, documents=None, causal=True):
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = (j <= i) if causal else torch.ones(seq, seq, dtype=torch.bool)
    if window is not None:
        allowed = allowed & (i - j < window)
    if documents is not None:
        allowed = (allowed & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
    return allowed


def _assert_same_with_grads(ours, naive, inputs):
    torch.testing.assert_close(ours, naive, **TOL)
    probe = torch.randn_like(ours)
    got = torch.autograd.grad((ours * probe).sum(), inputs)
    want = torch.autograd.grad((naive * probe).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("window", [None, 1, 4, 40])
@pytest.mark.parametrize("documents", [False, True])
def test_sinks_match_the_naive_reference(window, documents):
    q, k, v, sinks = inputs = _inputs()
    mask = DocumentMask.from_tokens(_documents(), EOD, "sdpa") if documents else None
    allowed = _allowed(12, window=window, documents=None if mask is None else mask.document_ids)
    extra = {} if window is None else {"window": window}
    ours = core_attention(q, k, v, mask, sinks=sinks, **extra)
    _assert_same_with_grads(ours, _naive(q, k, v, allowed, sinks), inputs)


def test_bidirectional_sinks_match_the_naive_reference():
    q, k, v, sinks = inputs = _inputs()
    _assert_same_with_grads(core_attention(q, k, v, None, causal=False, sinks=sinks),
                            _naive(q, k, v, _allowed(12, causal=False), sinks), inputs)


def test_a_very_negative_sink_is_plain_attention():
    q, k, v, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(core_attention(q, k, v, None, sinks=torch.full((4,), -1e4)),
                                   core_attention(q, k, v, None), **TOL)


def test_the_lse_correction_of_flex_matches_the_sink_column(monkeypatch):
    # FlexAttention runs forward-only in eager on CPU: enough to check that out * sigmoid(lse - sink),
    # which the flex path computes, is the sink column's attention. Its warning of eager use is shown
    # once per process; this test's own record of it is dropped after (test_document_mask.py expects it).
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 16) for _ in range(3))
    sinks = torch.randn(4) * 2
    tokens = torch.randint(2, 50, (2, 256))
    tokens[0, [40, 200]] = EOD
    dense = core_attention(q, k, v, DocumentMask.from_tokens(tokens, EOD, "sdpa"), window=70, sinks=sinks)
    block_mask = DocumentMask.from_tokens(tokens, EOD, "flex").windowed(70).block_mask
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        out, aux = flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(add_sinks(out, aux.lse, sinks), dense, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_sink_cache_decodes_as_the_full_forward(window):
    """Prefill right-padded prompts, then decode: every step equals the training forward (sinks included),
    for full layers and for sliding ones (whose rolling buffer the sink leaves as it is)."""
    torch.manual_seed(0)
    steps, dim, prompt_lengths = 6, 16, [3, 9]
    attention = Attention(dim, 4, 2, 8, window=window, sinks=True, bias=True)
    with torch.no_grad():
        attention.sinks.copy_(torch.randn(4) * 2)
    x = torch.randn(2, max(prompt_lengths) + steps, dim)
    cache = ModelCache(2, capacity=32, device="cpu")
    layer_cache = attention.new_cache(cache, torch.float32)
    padded = max(prompt_lengths)
    with torch.no_grad():
        cache.begin_prefill(torch.tensor(prompt_lengths), padded)
        prefill = attention(x[:, :padded], None, cache=layer_cache)
        cache.end_prefill()
        for row, length in enumerate(prompt_lengths):
            torch.testing.assert_close(prefill[row, :length], attention(x[row:row + 1, :length], None)[0])
        for _ in range(steps):
            new = torch.stack([x[row, cache.lengths[row]] for row in range(2)])[:, None]
            cache.begin_decode()
            out = attention(new, None, cache=layer_cache)
            for row in range(2):
                n = int(cache.lengths[row])
                seq = torch.cat([x[row, :n], new[row]])[None]
                torch.testing.assert_close(out[row, 0], attention(seq, None)[0, -1], atol=1e-6, rtol=1e-5)
            cache.end_decode()


def test_sinks_are_a_parameter_per_head_initialized_to_zero():
    attention = Attention(16, 4, 2, 8, sinks=True)
    assert attention.sinks.shape == (4,)
    assert Attention(16, 4, 2, 8).sinks is None
