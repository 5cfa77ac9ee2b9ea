"""Llama 3 <-> Hugging Face transformers: weights, RoPE layout and config.json.

The known answer is transformers' own LlamaForCausalLM, built offline from a config.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import hf_warnings
from family_checks import materialize
from titanlike.models.common.hf import half_to_interleaved, interleaved_to_half
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.models.registry import get_model_spec

HF = get_model_spec("llama3").hf
ATOL = 1e-5


def small_args(tied: bool, **overrides):
    base = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=300,
                               max_seq_len=64, tie_word_embeddings=tied)
    return dataclasses.replace(base, **overrides)


def hf_model(args, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**HF.args_to_config(args))).eval()


def ours(args, seed=0):
    return materialize(Transformer, args, seed=seed).eval()


def tokens(args, seq=40):
    return torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_weights_give_hf_logits(tied):
    args = small_args(tied)
    hf = hf_model(args)
    model = ours(args, seed=5)
    model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args), strict=True)
    if tied:
        assert model.output.weight is model.tok_embeddings.weight
    t = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(model(t), hf(t).logits, rtol=0, atol=ATOL)


@pytest.mark.parametrize("tied", [False, True])
def test_our_weights_give_our_logits_in_hf(tied):
    args = small_args(tied)
    model = ours(args, seed=9)
    hf = hf_model(args, seed=1)
    hf_sd = HF.to_hf_state_dict(model.state_dict(), args)
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert unexpected == []
    # A tied HF checkpoint has no lm_head.weight; the model ties it to the embedding.
    assert missing == (["lm_head.weight"] if tied else [])
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    t = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(hf(t).logits, model(t), rtol=0, atol=ATOL)


def test_multi_query_and_plain_multi_head_attention():
    for n_kv in (1, 4):
        args = small_args(False, n_kv_heads=n_kv, rope_scaling=None, rope_theta=10000.0)
        hf = hf_model(args, seed=n_kv)
        model = ours(args)
        model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args))
        t = tokens(args, seq=17)
        with torch.no_grad():
            torch.testing.assert_close(model(t), hf(t).logits, rtol=0, atol=ATOL)


def test_state_dict_round_trip_and_qk_permutation():
    args = small_args(False)
    sd = ours(args, seed=2).state_dict()
    hf_sd = HF.to_hf_state_dict(sd, args)
    assert set(hf_sd) == set(hf_model(args).state_dict())
    back = HF.from_hf_state_dict(hf_sd, args)
    assert set(back) == set(sd)
    for key in sd:
        assert torch.equal(back[key], sd[key]), key
    # q/k rows really are permuted (and v/o are not), so the test above is not vacuous.
    assert not torch.equal(hf_sd["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    assert not torch.equal(hf_sd["model.layers.0.self_attn.k_proj.weight"], sd["layers.0.attention.wk.weight"])
    assert torch.equal(hf_sd["model.layers.0.self_attn.v_proj.weight"], sd["layers.0.attention.wv.weight"])
    # Within a head, pair (2i, 2i+1) moves to rows (i, i + head_dim/2).
    w = torch.arange(8.0).repeat_interleave(3).view(8, 3)  # one head of dim 8, input dim 3
    half = interleaved_to_half(w, n_heads=1)
    assert half[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(half_to_interleaved(half, n_heads=1), w)


def test_wrapper_prefixes_are_ignored_on_export():
    args = small_args(False)
    sd = {k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v
          for k, v in ours(args).state_dict().items()}
    assert "model.layers.0.mlp.gate_proj.weight" in HF.to_hf_state_dict(sd, args)


def test_unknown_keys_are_rejected():
    args = small_args(False)
    hf_sd = dict(hf_model(args).state_dict())
    hf_sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(KeyError, match="q_proj.bias"):
        HF.from_hf_state_dict(hf_sd, args)
    with pytest.raises(KeyError, match="lm_head"):
        HF.from_hf_state_dict({"model.embed_tokens.weight": torch.zeros(300, 64)}, args)


@pytest.mark.parametrize("flavor", sorted(llama3_flavors))
def test_config_round_trip(flavor):
    args = llama3_flavors[flavor]
    cfg = HF.args_to_config(args)
    # A context within the RoPE scaling's original one (the debug flavors) is exported as the
    # context the scaling extends to, the only value transformers accepts without a warning.
    s = args.rope_scaling
    if s is not None and args.max_seq_len <= s.original_max_position_embeddings:
        args = dataclasses.replace(args, max_seq_len=int(s.original_max_position_embeddings * s.factor))
    assert cfg["max_position_embeddings"] == args.max_seq_len
    assert HF.config_to_args(cfg) == args
    # transformers 5.x re-serializes rope settings as rope_parameters; we read that too.
    with hf_warnings() as warned:
        hf_cfg = LlamaConfig(**cfg)
    assert warned == []
    assert HF.config_to_args(hf_cfg.to_dict()) == args


@pytest.mark.parametrize("flavor", ["1B", "8B"])
def test_hf_model_from_our_config_has_our_parameter_count(flavor):
    args = llama3_flavors[flavor]
    cfg = HF.args_to_config(args)
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**cfg))
        model = Transformer(args)
    hf_count = sum(p.numel() for p in hf.parameters())  # tied weights are one Parameter
    assert hf_count == args.num_params() == sum(p.numel() for p in model.parameters())


def test_published_hf_config_maps_to_flavor():
    # Llama-3.1-8B config.json as published (transformers 4.x keys).
    published = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256,
    }
    assert HF.config_to_args(published) == llama3_flavors["8B"]


def test_unpublished_ffn_sizes_are_reproduced():
    for intermediate in (100, 170, 171, 1000):
        cfg = HF.args_to_config(small_args(False))
        cfg["intermediate_size"] = intermediate
        assert HF.config_to_args(cfg).ffn_hidden_dim == intermediate


def test_unsupported_configs_are_rejected():
    cfg = HF.args_to_config(small_args(False))
    with pytest.raises(ValueError, match="rope_type"):
        HF.config_to_args({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        HF.config_to_args({**cfg, "attention_bias": True})
