"""Hybrid models' Hugging Face interchange, against transformers' own NemotronHForCausalLM (Mamba-2,
attention and MLP layers from the pattern) and Mamba2ForCausalLM (pure Mamba-2), built offline from
small configs with random weights, in fp32, both ways, through the path users take:
save_pretrained -> convert_hf_to_dcp.py -> titanlike.load_model, and our DCP -> convert_dcp_to_hf.py
-> from_pretrained. Two Mamba groups, so a wrong permutation of in_proj's grouped rows or the
conv's channels shows; sequences of 40 tokens with chunks of 16 (a partial chunk on both sides).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

from family_checks import check_hf_export, check_hf_import, materialize, probe_tokens, write_model_only_dcp
from titanlike.models.common.mamba2 import Mamba2Args
from titanlike.models.hybrid import HybridModel, HybridModelArgs, hybrid_flavors
from titanlike.models.registry import get_model_spec


HF = get_model_spec("hybrid").hf
ATOL = 2e-5
MAMBA = Mamba2Args(num_heads=4, head_dim=32, state_size=16, n_groups=2, chunk_size=16)


def nemotron_h() -> HybridModelArgs:
    # Every layer kind NemotronH has: Mamba-2, MLP (squared ReLU), attention without positions.
    return dataclasses.replace(hybrid_flavors["debugmodel_tiny"], hybrid_layer_pattern="M-M*-M", vocab_size=300,
                               max_seq_len=128)


def mamba2(tied: bool = True) -> HybridModelArgs:
    return HybridModelArgs(dim=64, hybrid_layer_pattern="MMM", vocab_size=300, max_seq_len=2048,
                           tie_word_embeddings=tied, mamba=MAMBA)


CASES = {
    "nemotron_h": (nemotron_h, NemotronHConfig, NemotronHForCausalLM),
    "mamba2": (mamba2, Mamba2Config, Mamba2ForCausalLM),
    "mamba2_untied": (lambda: mamba2(tied=False), Mamba2Config, Mamba2ForCausalLM),
}


def hf_model(case: str, seed: int = 0):
    """A random HF model whose per-head and per-channel parameters are away from their init (norm
    weights 1, D 1), so a mis-mapped or mis-permuted one shows in the logits."""
    make_args, config_cls, model_cls = CASES[case]
    args = make_args()
    torch.manual_seed(seed)
    model = model_cls(config_cls(**HF.args_to_config(args))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".D", "dt_bias", "conv1d.bias")):
                p.add_(0.2 * torch.randn_like(p))
    return args, model



@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_titanlike_and_back(tmp_path, case):
    args, hf = hf_model(case)
    assert HF.config_to_args(hf.config.to_dict()) == args
    t = probe_tokens(args.vocab_size)
    want = check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", "hybrid", t, ATOL)

    check_hf_export(tmp_path / "dcp", tmp_path / "out", CASES[case][2], t, want, ATOL)
    written = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"])
    assert written == set(load_file(tmp_path / "hf" / "model.safetensors"))  # the keys save_pretrained writes


@pytest.mark.parametrize("case", ["nemotron_h", "mamba2"])
def test_titanlike_weights_give_the_same_logits_in_transformers(tmp_path, case):
    """The other direction with weights of our own init, via a model-only DCP."""
    make_args, _, model_cls = CASES[case]
    args = make_args()
    model = materialize(HybridModel, args, seed=3)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith((".D", "conv_bias")):
                p.add_(0.2 * torch.randn_like(p))
    model.eval()
    write_model_only_dcp(model, "hybrid", args, tmp_path / "dcp")
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        want = model(t)
    check_hf_export(tmp_path / "dcp", tmp_path / "hf", model_cls, t, want, ATOL)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == case


def test_what_transformers_cannot_express_is_refused_in_one_sentence():
    base = HF.args_to_config(nemotron_h())
    assert base["layers_block_type"] == ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
                                         "linear_attention"]
    # The legacy pattern string reads the same.
    legacy = {k: v for k, v in base.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M-M*-M"}
    assert HF.config_to_args(legacy) == nemotron_h()
    for changes, fragment in [
        ({"layers_block_type": ["linear_attention", "moe"]}, "mixture-of-experts layers"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act = 'silu' is not supported"),
        ({"num_nextn_predict_layers": 1}, "multi-token prediction"),
        ({"use_bias": True}, "projections have no bias"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            HF.config_to_args({**base, **changes})
    with pytest.raises(ValueError, match="SwiGLU experts"):
        HF.args_to_config(hybrid_flavors["debugmodel_moe"])
    with pytest.raises(ValueError, match="need mamba dt_limit_min > 0"):
        HF.args_to_config(dataclasses.replace(nemotron_h(), mamba=dataclasses.replace(MAMBA, dt_limit_min=0.0)))
