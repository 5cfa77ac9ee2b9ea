"""Llama 3 model: shapes, attention semantics, RoPE, initialization, FLOPs, the family's layout rule.

The FSDP2, FSDP x TP and TP checks run on spawned gloo ranks: tests/distributed/test_llama3_model_ranks.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from family_checks import held_params
from llama3_checks import TINY, build, tiny_args
from titanlike.models.common import attention as attention_mod
from titanlike.models.common.init import canonical_fqn, seed_for
from titanlike.models.common.rope import RoPEScaling, apply_rotary_emb, precompute_rope_cache, rope_inv_freq
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.models.registry import get_model_spec


# ---------------------------------------------------------------- shapes and sizes

# Published totals (embeddings included) and SwiGLU hidden sizes (HF intermediate_size).
PUBLISHED = {
    "1B": (1.236e9, 8192),
    "3B": (3.213e9, 8192),
    "8B": (8.03e9, 14336),
    "70B": (70.6e9, 28672),
    "405B": (405.9e9, 53248),
}


def test_registry_exposes_llama3():
    spec = get_model_spec("llama3")
    assert spec.model_cls is Transformer
    assert {"debugmodel", "debugmodel_tiny", "100M", "1B", "3B", "8B", "70B", "405B"} <= set(spec.flavors)
    assert spec.hf is not None


@pytest.mark.parametrize("flavor", sorted(llama3_flavors))
def test_flavor_shapes_on_meta(flavor):
    args = llama3_flavors[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    hd = args.dim // args.n_heads
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (args.n_heads * hd, args.dim)
    assert attn.wk.weight.shape == (args.num_kv_heads * hd, args.dim)
    assert attn.wo.weight.shape == (args.dim, args.n_heads * hd)
    assert model.layers["0"].feed_forward.w1.weight.shape == (args.ffn_hidden_dim, args.dim)
    assert model.output.weight.shape == (args.vocab_size, args.dim)
    assert model.rope_cache.shape == (args.max_seq_len, hd)
    assert held_params(model) == args.num_params()
    assert held_params(model) - (0 if args.tie_word_embeddings else args.vocab_size * args.dim) == \
        args.num_params(exclude_embedding=True)
    if flavor in PUBLISHED:
        total, hidden = PUBLISHED[flavor]
        assert args.ffn_hidden_dim == hidden
        assert abs(args.num_params() - total) / total < 0.01
        assert args.rope_theta == 500000.0
        assert args.vocab_size == 128256


def test_published_rope_scaling_and_tying():
    for name in ("8B", "70B", "405B"):
        assert llama3_flavors[name].rope_scaling == RoPEScaling(8.0, 1.0, 4.0, 8192)
        assert not llama3_flavors[name].tie_word_embeddings
    for name in ("1B", "3B"):
        assert llama3_flavors[name].rope_scaling == RoPEScaling(32.0, 1.0, 4.0, 8192)
        assert llama3_flavors[name].tie_word_embeddings
    dbg = llama3_flavors["debugmodel"]
    assert (dbg.dim, dbg.n_layers, dbg.n_heads, dbg.n_kv_heads) == (256, 8, 16, 8)
    assert (TINY.dim, TINY.n_layers, TINY.n_heads, TINY.n_kv_heads) == (64, 8, 4, 2)


def test_100m_flavor_is_about_100m_with_the_debug_tokenizer():
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    vocab = build_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    args = dataclasses.replace(llama3_flavors["100M"], vocab_size=vocab)
    assert vocab == 2048
    assert args.ffn_hidden_dim == 2816
    assert args.num_params() == 98_583_552
    assert args.num_params(exclude_embedding=True) == 96_486_400


def test_invalid_head_counts_are_rejected():
    with pytest.raises(ValueError, match="n_kv_heads"):
        tiny_args(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        tiny_args(dim=66, n_heads=4)


# ---------------------------------------------------------------- forward semantics


def _naive_attention(q, k, v):
    # Textbook causal softmax attention with k/v heads repeated per query group.
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("takes_gqa", [True, False])
def test_causal_attention_gqa_matches_naive(monkeypatch, takes_gqa):
    # Both dispatch paths (enable_gqa and repeated k/v) must give textbook attention.
    monkeypatch.setattr(attention_mod, "sdpa_takes_gqa", lambda q: takes_gqa)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(attention_mod.core_attention(q, k, v), _naive_attention(q, k, v))


def test_gqa_equals_mha_with_repeated_kv_heads():
    # A GQA model must equal the MHA model whose k/v heads are copies of each group's head.
    gqa_args = tiny_args(n_layers=2, n_heads=4, n_kv_heads=2)
    mha_args = dataclasses.replace(gqa_args, n_kv_heads=4)
    gqa = build(gqa_args, seed=3)
    mha = build(mha_args, seed=99)
    sd = gqa.state_dict()
    hd = gqa_args.head_dim
    for key, value in list(sd.items()):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            sd[key] = value.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, gqa_args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)
    assert gqa.layers["0"].attention.wk.weight.shape[0] == 2 * hd


# ---------------------------------------------------------------- RoPE


def _meta_reference_scaled_freqs(head_dim, theta, factor, low, high, old_len):
    # Scalar transcription of Meta's Llama 3.1 apply_scaling.
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_rope_scaling_values(factor):
    scaling = RoPEScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    ours = rope_inv_freq(128, 500000.0, scaling).double()
    ref = _meta_reference_scaled_freqs(128, 500000.0, factor, 1.0, 4.0, 8192)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    unscaled = rope_inv_freq(128, 500000.0).double()
    assert ours[0] == unscaled[0]  # highest frequency untouched
    torch.testing.assert_close(ours[-1], unscaled[-1] / factor)  # lowest divided by factor
    wavelen = 2 * math.pi / unscaled
    band = (wavelen >= 8192 / 4) & (wavelen <= 8192 / 1)
    assert band.any()
    assert ((ours[band] < unscaled[band]) & (ours[band] > unscaled[band] / factor)).any()


def test_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072,
                      rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    ours = rope_inv_freq(128, 500000.0, RoPEScaling(32.0, 1.0, 4.0, 8192))
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=1e-6, atol=0)


def test_real_rope_equals_complex_reference():
    # Meta's reference: pairs (x[2i], x[2i+1]) as complex numbers times exp(i * pos * freq).
    head_dim, seqlen = 16, 9
    cache = precompute_rope_cache(head_dim, 32, 10000.0, RoPEScaling(8.0, 1.0, 4.0, 16))
    x = torch.randn(2, seqlen, 3, head_dim, dtype=torch.float32)
    freqs = rope_inv_freq(head_dim, 10000.0, RoPEScaling(8.0, 1.0, 4.0, 16))
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    rot = torch.polar(torch.ones_like(angles), angles).view(1, seqlen, 1, head_dim // 2)
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, seqlen, 3, -1, 2)) * rot).flatten(-2)
    torch.testing.assert_close(apply_rotary_emb(x, cache), expected, rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    cache = precompute_rope_cache(8, 64, 10000.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def score(m, n):
        rq = apply_rotary_emb(q.float().expand(1, 64, 1, 8), cache)[0, m, 0]
        rk = apply_rotary_emb(k.float().expand(1, 64, 1, 8), cache)[0, n, 0]
        return (rq * rk).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(10, 3), score(10, 4), atol=1e-3)


def test_rope_rejects_sequences_beyond_the_table():
    with pytest.raises(ValueError, match="max_seq_len"):
        apply_rotary_emb(torch.zeros(1, 9, 1, 8), precompute_rope_cache(8, 8, 10000.0))


# ---------------------------------------------------------------- tied embeddings


def test_tied_embeddings():
    args = tiny_args(n_layers=2, tie_word_embeddings=True)
    untied = build(dataclasses.replace(args, tie_word_embeddings=False))
    model = build(args, seed=1)
    # to_empty from meta must not untie (it creates new Parameters per module).
    assert model.output.weight is model.tok_embeddings.weight
    assert held_params(model) == held_params(untied) - args.vocab_size * args.dim == args.num_params()
    # The shared matrix is also the output projection: it stays in the FLOP count.
    assert args.num_params(exclude_embedding=True) == args.num_params()
    assert model.tied_weights == {"output.weight": "tok_embeddings.weight"}
    assert {"tok_embeddings.weight", "output.weight"} <= set(model.state_dict())
    # Initialized once, at the output projection's scale (logits O(1) at init).
    std = args.dim**-0.5
    w = model.tok_embeddings.weight
    assert w.abs().max() <= 3 * std + 1e-6 and 0.8 * std < w.std() < 1.1 * std
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    model(tokens).sum().backward()
    assert model.tok_embeddings.weight.grad is model.output.weight.grad is not None
    # A last pipeline stage holds its own copy of the shared matrix: same values.
    with torch.device("meta"):
        last_stage = Transformer(args)
    last_stage.tok_embeddings = None
    last_stage.to_empty(device="cpu")
    last_stage.init_weights(seed=1)
    assert torch.equal(last_stage.output.weight, model.tok_embeddings.weight)


# ---------------------------------------------------------------- initialization


def test_canonical_fqn_strips_wrappers():
    name = "layers.3._checkpoint_wrapped_module._orig_mod.attention._fsdp_wrapped_module.wq.weight"
    assert canonical_fqn(name) == "layers.3.attention.wq.weight"
    assert seed_for(0, name) == seed_for(0, "layers.3.attention.wq.weight") != seed_for(1, name)


def test_init_is_deterministic_and_seed_dependent():
    args = tiny_args()
    a, b, c = build(args, seed=7), build(args, seed=7), build(args, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # Distinct parameters of equal shape must not share values.
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    torch.testing.assert_close(a.rope_cache, precompute_rope_cache(args.head_dim, args.max_seq_len,
                                                                   args.rope_theta, args.rope_scaling))


def test_init_scheme():
    args = tiny_args(dim=128, n_heads=4, n_kv_heads=2, vocab_size=1000)
    model = build(args, seed=0)
    layer0, layer7 = model.layers["0"], model.layers["7"]

    def close_std(t, std):
        return abs(t.std().item() / std - 1) < 0.1

    assert close_std(model.tok_embeddings.weight, 1.0)
    out_std = args.dim**-0.5
    assert close_std(model.output.weight, out_std) and model.output.weight.abs().max() <= 3 * out_std + 1e-6
    assert close_std(layer0.attention.wq.weight, 0.02) and close_std(layer7.feed_forward.w1.weight, 0.02)
    assert close_std(layer0.attention.wo.weight, 0.02 / math.sqrt(2 * 1))
    assert close_std(layer7.feed_forward.w2.weight, 0.02 / math.sqrt(2 * 8))
    assert torch.equal(layer7.ffn_norm.weight, torch.ones(args.dim))
    flat = build(dataclasses.replace(args, depth_init=False), seed=0)
    assert close_std(flat.layers["0"].attention.wo.weight, 0.02 / math.sqrt(2 * args.n_layers))


def test_init_is_independent_of_which_layers_exist_and_of_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = tiny_args()
    full = build(args, seed=11)

    with torch.device("meta"):
        stage = Transformer(args)
    for i in range(4):
        del stage.layers[str(i)]
    stage.tok_embeddings = None
    # Wrappers add name components (_checkpoint_wrapped_module., _orig_mod.) that must not matter.
    stage.layers["4"] = checkpoint_wrapper(stage.layers["4"])
    stage.layers["5"] = torch.compile(stage.layers["5"])
    stage.to_empty(device="cpu")
    stage.init_weights(seed=11)

    full_params = dict(full.named_parameters())
    stage_params = dict(stage.named_parameters())
    assert any("_checkpoint_wrapped_module" in n for n in stage_params)
    assert any("_orig_mod" in n for n in stage_params)
    for name, p in stage_params.items():
        assert torch.equal(p, full_params[canonical_fqn(name)]), name
    assert len(stage_params) == len(full_params) - 1 - 4 * len(list(full.layers["0"].parameters()))


# ---------------------------------------------------------------- FLOPs


def test_num_flops_per_token_hand_computed():
    args = tiny_args(vocab_size=2256, max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(args)
    # dim 64, 4 heads of 16, 2 kv heads, SwiGLU hidden 192 (int(8*64/3) = 170 -> multiple of 32).
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64
    ffn = 3 * 64 * 192
    n = 8 * (attention + ffn + 2 * 64) + 64 + 2256 * 64  # blocks, final norm, output projection
    assert args.num_params(exclude_embedding=True) == n == 538688
    assert held_params(model) == n + 2256 * 64
    assert args.flops_per_token(128) == 6 * n + 12 * 8 * 4 * 16 * 128


# ---------------------------------------------------------------- the family's layout rule


def test_family_rule_rejects_heads_tensor_parallelism_cannot_split():
    from titanlike.parallel.parallel_dims import ParallelDims

    args = tiny_args(n_heads=4, n_kv_heads=2)
    args.validate(ParallelDims.resolve(world_size=2, tp=2), seq_len=64)
    with pytest.raises(ValueError, match="2 key/value heads are not divisible by tensor_parallel_degree 4"):
        args.validate(ParallelDims.resolve(world_size=4, tp=4), seq_len=64)
