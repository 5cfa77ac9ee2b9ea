"""Qwen3-Next's and Qwen3.5's Hugging Face interchange against transformers' own Qwen3NextForCausalLM,
Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM, built offline
from a small config of a size no flavor has (width 48, the published 3:1 layer pattern) with random
weights, in fp32, both ways, through the path users take: save_pretrained -> convert_hf_to_dcp.py ->
titanlike.load_model, and our DCP -> convert_dcp_to_hf.py -> from_pretrained. Two key heads of two
value heads each, so a wrong permutation of the conv channels or of the grouped projections shows;
40 tokens in chunks of 16 (a partial chunk). Logits agree within 1e-5 (measured: a few 1e-7).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
import transformers
from transformers import Qwen3NextForCausalLM

from family_checks import check_hf_export, check_hf_import, materialize, probe_tokens, write_model_only_dcp
from titanlike.models.common.moe import MoEArgs
from titanlike.models.qwen3_next import Qwen3Next, Qwen3NextModelArgs
from titanlike.models.registry import get_model_spec

HF = get_model_spec("qwen3_next").hf
ATOL = 1e-5


def args(moe: bool, release: str = "qwen3_next") -> Qwen3NextModelArgs:
    # Qwen3.5's MoE models route every layer through experts; Qwen3-Next's may keep dense layers.
    dense_first = int(release == "qwen3_next")
    experts = MoEArgs(num_experts=4, top_k=2, hidden_dim=24, num_shared_experts=1, shared_hidden_dim=40,
                      route_norm=True, first_k_dense=dense_first, aux_loss_coeff=0.001) if moe else None
    return Qwen3NextModelArgs(dim=48, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=16, ffn_hidden_dim=80,
                              vocab_size=300, max_seq_len=128, rope_theta=10_000.0, linear_k_heads=2,
                              linear_v_heads=4, linear_k_dim=8, linear_v_dim=12, chunk_size=16, moe=experts,
                              release=release)


CASES = {"qwen3_next": (False, "qwen3_next"), "qwen3_next_moe": (True, "qwen3_next"),
         "qwen3_5": (False, "qwen3_5"), "qwen3_5_moe": (True, "qwen3_5")}


def hf_class(a: Qwen3NextModelArgs):
    return getattr(transformers, HF.args_to_config(a)["architectures"][0])


def hf_model(case: str, seed: int = 0):
    """A random HF model whose norms, dt_bias and A_log are away from their init, so that a mis-mapped or
    mis-permuted one shows in the logits."""
    a = args(*CASES[case])
    torch.manual_seed(seed)
    cls = hf_class(a)
    model = cls(cls.config_class(**HF.args_to_config(a))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(0.2 * torch.randn_like(p))
    return a, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_titanlike_and_back(tmp_path, case):
    a, hf = hf_model(case)
    assert HF.config_to_args(hf.config.to_dict()) == a
    t = probe_tokens(a.vocab_size)
    want = check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", "qwen3_next", t, ATOL)
    check_hf_export(tmp_path / "dcp", tmp_path / "out", hf_class(a), t, want, ATOL)
    written = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"])
    assert written == set(load_file(tmp_path / "hf" / "model.safetensors"))  # the keys save_pretrained writes


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_multimodal_qwen3_5_folder_is_read_as_its_text_model(tmp_path, moe):
    """The published Qwen3.5 folders are Qwen3_5(Moe)ForConditionalGeneration: text_config, the text model
    under model.language_model., a vision tower; on text the logits are its text model's."""
    a, text_model = hf_model("qwen3_5_moe" if moe else "qwen3_5")
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=a.dim, patch_size=4)
    hf = cls(cls.config_class(text_config=text_model.config.to_dict(), vision_config=vision)).eval()
    with torch.no_grad():  # the text model's weights, norms and all
        for name, p in hf.named_parameters():
            if name.startswith("model.language_model.") or name == "lm_head.weight":
                p.copy_(text_model.get_parameter(name.replace("model.language_model.", "model.")))
    assert HF.config_to_args(hf.config.to_dict()) == a
    check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", "qwen3_next", probe_tokens(a.vocab_size), ATOL)


def test_titanlike_weights_give_the_same_logits_in_transformers(tmp_path):
    """The other direction with weights of our own init, via a model-only DCP."""
    a = args(moe=True)
    model = materialize(Qwen3Next, a, seed=3)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith(("dt_bias", "A_log")):
                p.add_(0.2 * torch.randn_like(p))
    model.eval()
    write_model_only_dcp(model, "qwen3_next", a, tmp_path / "dcp")
    t = probe_tokens(a.vocab_size)
    with torch.no_grad():
        want = model(t)
    check_hf_export(tmp_path / "dcp", tmp_path / "hf", Qwen3NextForCausalLM, t, want, ATOL)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_next"


def test_what_transformers_cannot_express_is_refused_in_one_sentence():
    base = HF.args_to_config(args(moe=True))
    for changes, fragment in [
        ({"layer_types": ["full_attention"] * 4}, "layer_types is not every full_attention_interval-th layer"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"shared_expert_intermediate_size": 0}, "no shared expert"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "only unscaled RoPE"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            HF.config_to_args({**base, **changes})
    with_a_dense_layer = dataclasses.replace(args(True, "qwen3_5"), moe=args(True).moe)  # first_k_dense 1
    with pytest.raises(ValueError, match="route every layer through experts"):
        HF.args_to_config(with_a_dense_layer)
    with pytest.raises(ValueError, match="one shared expert"):
        HF.args_to_config(dataclasses.replace(args(moe=True), moe=dataclasses.replace(args(True).moe,
                                                                                       score_func="sigmoid")))
