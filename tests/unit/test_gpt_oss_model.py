"""The gpt-oss family: what is unique to it against transformers' GptOssForCausalLM (the conformance
suite checks sizes, init, stages and the HF round trip of every family; tests/conformance/
test_generation.py the KV cache against transformers' greedy tokens on the debug flavor's structure).

Here: a tiny random transformers model of a size no flavor has (5 layers, a window of 5 over sequences
of 20, YaRN without rounding, 6 experts choosing 3, biases, sinks and norms off their init) imports
with logits equal to transformers' within 1e-5 (fp32); our model exports to a folder transformers loads
with the same logits; greedy generation with the rolling window cache gives transformers' tokens past
the window; the MXFP4 experts of the published checkpoints dequantize as transformers does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from family_checks import check_greedy_equals_hf, import_hf_folder, materialize
from titanlike.checkpoint.hf import write_hf
from titanlike.models.gpt_oss import GptOss, gpt_oss_flavors
from titanlike.models.gpt_oss.hf_adapter import dequantize_mxfp4
from titanlike.models.registry import get_model_spec

transformers = pytest.importorskip("transformers")

SPEC = get_model_spec("gpt_oss")
ATOL = 1e-5


def _shift_off_init(model, names=("bias", "sinks", "norm")):
    # Biases, sinks and norms start at 0 or 1: move them so that a missed permutation or sign shows.
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in names):
                p.add_(0.3 * torch.randn_like(p))


def _hf_model(**changes):
    torch.manual_seed(0)
    sizes = dict(vocab_size=300, hidden_size=48, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=3, sliding_window=5,
                 max_position_embeddings=256)
    config = transformers.GptOssConfig(
        **{**sizes, **changes}, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 1000.0})
    model = transformers.GptOssForCausalLM(config).eval()
    _shift_off_init(model)
    return model


def _import(folder) -> GptOss:
    return import_hf_folder(SPEC, folder)


def _tokens(seq=20):
    return torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(1))


def test_a_transformers_folder_of_any_size_gives_its_logits(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    ours = _import(tmp_path)
    args = ours.model_args
    assert [args.attention_window(i) for i in range(5)] == [5, None, 5, None, 5]
    assert (args.rope_scaling.factor, args.rope_scaling.truncate, args.rope_theta) == (8.0, False, 1000.0)
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < ATOL, diff


def test_our_model_exports_to_transformers_with_its_logits(tmp_path):
    args = dataclasses.replace(gpt_oss_flavors["debugmodel"], vocab_size=300, max_seq_len=256, sliding_window=6)
    ours = materialize(GptOss, args, seed=0).eval()
    _shift_off_init(ours, names=("bias", "b1", "b2", "b3", "sinks", "norm"))
    write_hf(ours.state_dict(), SPEC, args, str(tmp_path))
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < ATOL, diff


def test_greedy_generation_past_the_window_equals_transformers(tmp_path):
    hf = _hf_model(pad_token_id=0)
    hf.save_pretrained(tmp_path)
    check_greedy_equals_hf(_import(tmp_path), hf, [[5, 9, 44, 17, 3, 8, 100, 21], [7, 250, 31]])


def test_mxfp4_experts_dequantize_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=g)  # 3 experts, 10 rows, 64 columns
    scales = torch.randint(120, 134, (3, 10, 2), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 10, 64) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales), atol=0, rtol=0)


def test_a_published_checkpoints_mxfp4_experts_import(tmp_path):
    """The experts of a folder stored as the published checkpoints store them (MXFP4 blocks and scales, the
    biases plain) import as their dequantized values."""
    hf = _hf_model(intermediate_size=64, hidden_size=64)
    hf_sd = {k: v for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    for layer in range(5):
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj, (rows, cols) in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64))):
            del hf_sd[prefix + proj]
            hf_sd[prefix + proj + "_blocks"] = torch.randint(0, 256, (6, rows, cols // 32, 16), dtype=torch.uint8,
                                                            generator=g)
            hf_sd[prefix + proj + "_scales"] = torch.randint(122, 130, (6, rows, cols // 32), dtype=torch.uint8,
                                                            generator=g)
    args = SPEC.hf.read_config({**hf.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}})
    sd = SPEC.hf.from_hf_state_dict(hf_sd, args)
    prefix = "model.layers.0.mlp.experts."
    gate_up = dequantize_mxfp4(hf_sd[prefix + "gate_up_proj_blocks"], hf_sd[prefix + "gate_up_proj_scales"])
    torch.testing.assert_close(sd["layers.0.moe.experts.w1"], gate_up[:, 0::2])
    torch.testing.assert_close(sd["layers.0.moe.experts.w3"], gate_up[:, 1::2])
    down = dequantize_mxfp4(hf_sd[prefix + "down_proj_blocks"], hf_sd[prefix + "down_proj_scales"])
    torch.testing.assert_close(sd["layers.0.moe.experts.w2"], down)
    materialize(GptOss, args, seed=0).load_state_dict(sd)


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", False, "attention_bias"),
    ("layer_types", ["full_attention"] * 4, "layer_types"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization"),
])
def test_configs_with_no_equivalent_are_refused_in_one_sentence(key, value, message):
    config = SPEC.hf.args_to_config(gpt_oss_flavors["debugmodel"])
    with pytest.raises(ValueError, match=message) as err:
        SPEC.hf.read_config({**config, key: value})
    assert "\n" not in str(err.value)


def test_the_clamped_swiglu_is_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts

    from titanlike.models.gpt_oss.model import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=1)
    hf = HFExperts(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 3)  # large enough that both clamps act
    ours = GptOssExperts(16, 8, 1, "loop", alpha=1.702, limit=7.0)
    with torch.no_grad():
        ours.w1.copy_(hf.gate_up_proj[0, :, 0::2].T[None])
        ours.w3.copy_(hf.gate_up_proj[0, :, 1::2].T[None])
        ours.b1.copy_(hf.gate_up_proj_bias[:, 0::2])
        ours.b3.copy_(hf.gate_up_proj_bias[:, 1::2])
        ours.w2.copy_(hf.down_proj.transpose(1, 2))
        ours.b2.copy_(hf.down_proj_bias)
        x = torch.randn(5, 16)
        want = hf(x, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1))
        gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
        assert (gate_up[:, 0::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()  # both clamps act
        # Outputs of magnitude ~30: fp32 sums in another order differ by a few ulp.
        torch.testing.assert_close(ours(x, torch.tensor([5])), want, rtol=1e-5, atol=1e-4)


def test_the_published_20b_config_reads_as_the_20b_flavor():
    """openai/gpt-oss-20b's config.json (transformers 4 keys: rope_theta beside rope_scaling; MXFP4
    quantization; keys of OpenAI's own runtime such as experts_per_token) is the 20B flavor."""
    published = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
        "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"],
                                                        "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    assert SPEC.hf.read_config(published) == gpt_oss_flavors["20B"]
