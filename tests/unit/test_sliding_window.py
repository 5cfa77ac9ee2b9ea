"""Sliding-window attention (models/common/attention.py): every kernel against a naive reference with
the band written out, the rolling KV cache of a sliding layer (bounded by the window, prefill and
decode equal to the training forward) and the FLOPs count of a sliding layer. Context parallel
windows are checked with the other CP masks in tests/distributed/test_context_attention.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from titanlike.models.common.attention import Attention, DocumentMask, core_attention, sliding_window_band
from titanlike.models.common.kv_cache import ModelCache, SlidingKVCache

EOD = 1


def _naive(q, k, v, allowed):
    """Softmax attention with the allowed (query, key) pairs written out; k/v heads repeated (GQA)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v


def _qkv(seq=12, heads=4, kv_heads=2, d=8):
    torch.manual_seed(0)
    return (torch.randn(2, heads, seq, d), torch.randn(2, kv_heads, seq, d), torch.randn(2, kv_heads, seq, d))


def test_band_holds_the_window_most_recent_tokens():
    assert sliding_window_band(5, 2).int().tolist() == [[1, 0, 0, 0, 0],
                                                        [1, 1, 0, 0, 0],
                                                        [0, 1, 1, 0, 0],
                                                        [0, 0, 1, 1, 0],
                                                        [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("window", [1, 3, 12, 40])
def test_window_without_documents_matches_the_naive_band(window):
    q, k, v = _qkv()
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    allowed = (j <= i) & (i - j < window)
    torch.testing.assert_close(core_attention(q, k, v, None, window=window), _naive(q, k, v, allowed))
    if window >= 12:  # a window as long as the sequence is plain causal attention
        torch.testing.assert_close(core_attention(q, k, v, None, window=window), core_attention(q, k, v, None))


def test_window_within_documents_matches_the_naive_band():
    q, k, v = _qkv()
    tokens = torch.randint(2, 50, (2, 12))
    tokens[0, [2, 8]] = EOD
    tokens[1, 6] = EOD
    mask = DocumentMask.from_tokens(tokens, EOD, "sdpa")
    docs = mask.document_ids
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    allowed = ((j <= i) & (i - j < 4) & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)
    torch.testing.assert_close(core_attention(q, k, v, mask, window=4), _naive(q, k, v, allowed))
    # The windowed mask is built once per microbatch mask and shared by every sliding layer, also through
    # the copies FSDP's cast of forward inputs makes of the mask (dataclasses.replace).
    assert mask.windowed(4) is mask.windowed(4) is dataclasses.replace(mask).windowed(4)
    # Full layers of the same microbatch keep the plain document mask.
    full = ((j <= i) & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)
    torch.testing.assert_close(core_attention(q, k, v, mask), _naive(q, k, v, full))


def test_flex_window_matches_dense(monkeypatch):
    # FlexAttention runs forward-only in eager on CPU: enough to check that its windowed block mask
    # describes the same attention as the dense one. Its warning of eager use is shown once per
    # process; this test's own record of it is dropped after (test_document_mask.py expects it).
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 16) for _ in range(3))
    tokens = torch.randint(2, 50, (2, 256))
    tokens[0, [40, 200]] = EOD
    dense = core_attention(q, k, v, DocumentMask.from_tokens(tokens, EOD, "sdpa"), window=70)
    block_mask = DocumentMask.from_tokens(tokens, EOD, "flex").windowed(70).block_mask
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        flex = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(flex, dense, atol=2e-6, rtol=1e-5)


def test_a_window_needs_causal_attention():
    with pytest.raises(ValueError, match="causal"):
        Attention(16, 2, 2, 8, causal=False, window=4)


@pytest.mark.parametrize("prompt_lengths", [[3, 9], [11, 11], [2, 5]])
def test_sliding_cache_decodes_as_the_full_forward_within_the_window(prompt_lengths):
    """Prefill right-padded prompts longer and shorter than the window, then decode: every step equals
    the training forward over the whole sequence, and the buffers hold the window's slots only."""
    torch.manual_seed(0)
    window, steps, dim = 4, 6, 16
    attention = Attention(dim, 4, 2, 8, window=window)
    x = torch.randn(2, max(prompt_lengths) + steps, dim)
    rope = None
    cache = ModelCache(2, capacity=32, device="cpu")
    layer_cache = attention.new_cache(cache, torch.float32)
    assert isinstance(layer_cache, SlidingKVCache)
    lengths = torch.tensor(prompt_lengths)
    padded = max(prompt_lengths)
    with torch.no_grad():
        cache.begin_prefill(lengths, padded)
        prefill = attention(x[:, :padded], rope, cache=layer_cache)
        cache.end_prefill()
        for row, length in enumerate(prompt_lengths):
            full = attention(x[row:row + 1, :length], rope)
            torch.testing.assert_close(prefill[row, :length], full[0])
        for _ in range(steps):
            new = torch.stack([x[row, cache.lengths[row]] for row in range(2)])[:, None]
            cache.begin_decode()
            out = attention(new, rope, cache=layer_cache)
            for row in range(2):
                n = int(cache.lengths[row])
                seq = torch.cat([x[row, :n], new[row]])[None]
                torch.testing.assert_close(out[row, 0], attention(seq, rope)[0, -1], atol=1e-6, rtol=1e-5)
            cache.end_decode()
    assert layer_cache.k.shape == (2, 2, window, 8)  # the window's slots, not the capacity's


def test_a_sliding_layer_counts_the_keys_of_its_window():
    from titanlike.models.qwen3 import Qwen3ModelArgs

    class Windowed(Qwen3ModelArgs):
        def attention_window(self, layer_id):
            return 64 if layer_id % 2 == 0 else None

    sizes = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=16, ffn_hidden_dim=128,
                 vocab_size=256, max_seq_len=4096)
    full, windowed = Qwen3ModelArgs(**sizes), Windowed(**sizes)
    per_key = 12 * 4 * 16  # 12 H Q per key a query sees
    assert full.flops_per_token(1024) - windowed.flops_per_token(1024) == 2 * per_key * (1024 - 64)
    assert full.flops_per_token(32) == windowed.flops_per_token(32)  # a window longer than the sequence
