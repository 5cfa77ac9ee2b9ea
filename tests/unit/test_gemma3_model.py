"""The Gemma 3 family: what is unique to it against transformers' Gemma3ForCausalLM (the conformance
suite checks sizes, init, stages and the HF round trip of every family; tests/conformance/
test_generation.py the KV cache against transformers' greedy tokens on the debug flavor's structure).

Here: a tiny random transformers model of a size no flavor has (7 layers: two global ones at a
pattern of 3, a window of 5 over sequences of 20, the 8x linear global RoPE, query_pre_attn_scalar
not head_dim, norms off their init) imports with logits equal to transformers' within 1e-5 (fp32),
also with the published configs' keys (transformers 4) instead of rope_parameters; our model exports
to a folder transformers loads with the same logits; and greedy generation with the rolling window
cache gives transformers' tokens past the window.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from family_checks import check_greedy_equals_hf, import_hf_folder, materialize
from titanlike.checkpoint.hf import write_hf
from titanlike.models.gemma3 import Gemma3, gemma3_flavors
from titanlike.models.registry import get_model_spec

transformers = pytest.importorskip("transformers")

SPEC = get_model_spec("gemma3")
ATOL = 1e-5


def _hf_model(**changes):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=20, sliding_window=5, sliding_window_pattern=3,
        max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1000.0,
        rope_local_base_freq=100.0, attn_implementation="eager", **changes)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (times 1 + weight): move them so a missed +1 shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _import(folder) -> Gemma3:
    return import_hf_folder(SPEC, folder)


def _tokens(seq=20):
    return torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(1))


def test_a_transformers_folder_of_any_size_gives_its_logits(tmp_path):
    hf = _hf_model()
    assert hf.config.layer_types.count("full_attention") == 2
    hf.save_pretrained(tmp_path)
    ours = _import(tmp_path)
    args = ours.model_args
    assert [args.attention_window(i) for i in range(7)] == [5, 5, None, 5, 5, None, 5]
    assert (args.rope_scaling_factor, args.rope_theta, args.rope_local_theta) == (8.0, 1000.0, 100.0)
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < ATOL, diff


def test_the_published_configs_keys_are_read_as_rope_parameters(tmp_path):
    """google/gemma-3-*'s config.json (transformers 4) spells the RoPE settings rope_theta,
    rope_local_base_freq and rope_scaling: the same model as transformers 5's rope_parameters."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    published = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    published.update(rope_theta=1000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert SPEC.hf.read_config(published) == SPEC.hf.read_config(config)


def test_our_model_exports_to_transformers_with_its_logits(tmp_path):
    args = dataclasses.replace(gemma3_flavors["debugmodel"], vocab_size=300, max_seq_len=64, sliding_window=6)
    ours = materialize(Gemma3, args, seed=0).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    write_hf(ours.state_dict(), SPEC, args, str(tmp_path))
    hf = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < ATOL, diff


def test_greedy_generation_past_the_window_equals_transformers(tmp_path):
    hf = _hf_model(pad_token_id=0)
    hf.save_pretrained(tmp_path)
    check_greedy_equals_hf(_import(tmp_path), hf, [[5, 9, 44, 17, 3, 8, 100, 21], [7, 250, 31]])


@pytest.mark.parametrize("key, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("hidden_activation", "silu", "hidden_activation"),
    ("layer_types", ["full_attention"] * 6, "every sliding_window_pattern"),
])
def test_configs_with_no_equivalent_are_refused_in_one_sentence(key, value, message):
    config = SPEC.hf.args_to_config(gemma3_flavors["debugmodel"])
    with pytest.raises(ValueError, match=message) as err:
        SPEC.hf.read_config({**config, key: value})
    assert "\n" not in str(err.value)


def test_local_layers_count_attention_flops_by_their_window():
    args = gemma3_flavors["4B"]
    per_key = 12 * args.n_heads * args.head_dim
    n = args.num_params(exclude_embedding=True)
    globals_ = sum(args.attention_window(i) is None for i in range(args.n_layers))
    assert globals_ == 5  # 34 layers: 5 global, 29 local
    want = 6 * n + per_key * (globals_ * 8192 + (args.n_layers - globals_) * 1024)
    assert args.flops_per_token(8192) == want
