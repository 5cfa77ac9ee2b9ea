"""Qwen3 (dense and MoE) and Mixtral Hugging Face interchange, checked against transformers' own
Qwen3ForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM (offline, random weights from a
small config), in fp32 with a tight tolerance, both ways, through the path users take:
save_pretrained -> convert_hf_to_dcp.py -> titanlike.load_model, and our DCP ->
convert_dcp_to_hf.py -> from_pretrained. HF's experts run eagerly (a loop over experts), so
its routing and ours compute the same fp32 numbers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import titanlike
from family_checks import check_hf_export, check_hf_import, materialize, probe_tokens, write_model_only_dcp
from titanlike.checkpoint.format import CheckpointError
from titanlike.models.common.moe import MoEArgs
from titanlike.models.mixtral import MixtralModelArgs, mixtral_flavors
from titanlike.models.qwen3 import Qwen3ModelArgs, qwen3_flavors
from titanlike.models.registry import get_model_spec

QWEN3_HF = get_model_spec("qwen3").hf
ATOL = 1e-5


def qwen3_dense(tied: bool = False) -> Qwen3ModelArgs:
    # head_dim 24 with dim 64 and 4 heads: q/k width (96) differs from the model width.
    return dataclasses.replace(qwen3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               explicit_head_dim=24, ffn_hidden_dim=96, vocab_size=300, max_seq_len=64,
                               tie_word_embeddings=tied)


def qwen3_moe(route_norm: bool = True) -> Qwen3ModelArgs:
    # 12 experts, so experts 10 and 11 would land out of place if sorted as strings; layer 0 dense.
    moe = MoEArgs(num_experts=12, top_k=3, hidden_dim=32, route_norm=route_norm, first_k_dense=1,
                  aux_loss_coeff=0.01)
    return dataclasses.replace(qwen3_dense(), n_layers=3, moe=moe)


def mixtral() -> MixtralModelArgs:
    moe = dataclasses.replace(mixtral_flavors["debugmodel"].moe, num_experts=10, hidden_dim=48)
    return dataclasses.replace(mixtral_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               vocab_size=300, max_seq_len=64, moe=moe)


CASES = {
    "qwen3": ("qwen3", qwen3_dense, Qwen3Config, Qwen3ForCausalLM),
    "qwen3_tied": ("qwen3", lambda: qwen3_dense(tied=True), Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": ("qwen3", qwen3_moe, Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen3_moe_unnormalized": ("qwen3", lambda: qwen3_moe(route_norm=False), Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": ("mixtral", mixtral, MixtralConfig, MixtralForCausalLM),
}


def hf_model(case: str, seed: int = 0):
    """A random HF model whose norms are not at their init (1), so a mis-mapped or mis-permuted
    norm weight shows in the logits, and whose router is sharp (no near-ties in the top-k)."""
    family, make_args, config_cls, model_cls = CASES[case]
    args = make_args()
    torch.manual_seed(seed)
    model = model_cls(config_cls(**get_model_spec(family).hf.args_to_config(args))).eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight") and p.shape[0] == args.moe.num_experts:
                p.normal_(std=0.5)
    return args, model



@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_titanlike_and_back(tmp_path, case):
    args, hf = hf_model(case)
    # The config both ways (HF's own to_dict spells the expert count num_local_experts).
    assert get_model_spec(CASES[case][0]).hf.config_to_args(hf.config.to_dict()) == args
    t = probe_tokens(args.vocab_size)
    # HF folder -> DCP -> our model, and the HF folder read directly.
    want = check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", CASES[case][0], t, ATOL)

    # DCP -> HF (several shards) -> transformers: the per-expert keys save_pretrained writes.
    check_hf_export(tmp_path / "dcp", tmp_path / "out", CASES[case][3], t, want, ATOL, ("--max-shard-size", "60KB"),
                    experts_implementation="eager")
    written = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"])
    saved = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert written == saved


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "mixtral"])
def test_titanlike_weights_give_the_same_logits_in_transformers(tmp_path, case):
    """The other direction with weights of our own init (not HF's), via a model-only DCP."""
    name, make_args, _, model_cls = CASES[case]
    args, spec = make_args(), get_model_spec(name)
    model = materialize(spec.model_cls, args, seed=3)
    with torch.no_grad():  # norms away from 1 (QK-norm permutation), a sharp router
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(0.2 * torch.randn_like(p))
            elif key.endswith("router.gate.weight"):
                p.normal_(std=0.5)
    model.eval()
    write_model_only_dcp(model, name, args, tmp_path / "dcp")
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        want = model(t)
    check_hf_export(tmp_path / "dcp", tmp_path / "hf", model_cls, t, want, ATOL, experts_implementation="eager")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == (
        {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}[case])


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_incomplete_expert_set_is_refused(tmp_path, case):
    args, hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    sd = load_file(path)
    dropped = [k for k in sd if ".experts.7." in k and k.endswith(("up_proj.weight", "w3.weight"))][0]
    del sd[dropped]
    save_file(sd, path, metadata={"format": "pt"})
    adapter = get_model_spec(CASES[case][0]).hf
    with pytest.raises(ValueError, match=r"experts are incomplete for 10|experts are incomplete for 12"):
        adapter.from_hf_state_dict(sd, args)
    with pytest.raises(CheckpointError, match=r"missing \[7\]"):
        titanlike.load_model(tmp_path / "hf")


def test_experts_are_stacked_by_integer_index():
    args, hf = hf_model("qwen3_moe")
    on_disk = {}
    for key, value in hf.state_dict().items():  # in memory HF stacks gate and up: build disk keys
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2)
                on_disk[f"{prefix}{e}.gate_proj.weight"], on_disk[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif key.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                on_disk[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = value[e]
        else:
            on_disk[key] = value
    ours = QWEN3_HF.from_hf_state_dict(dict(reversed(on_disk.items())), args)
    for e in (2, 10, 11):
        assert torch.equal(ours["layers.1.moe.experts.w1"][e], on_disk[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(ours["layers.2.moe.experts.w2"][e], on_disk[f"model.layers.2.mlp.experts.{e}.down_proj.weight"])


def test_moe_layer_patterns_map_both_ways():
    base = QWEN3_HF.args_to_config(qwen3_moe())
    assert base["mlp_only_layers"] == [0] and base["decoder_sparse_step"] == 1
    # Every second layer from layer 1 (HF's decoder_sparse_step 2) is first_k_dense 1, layer_freq 2.
    args = QWEN3_HF.config_to_args({**base, "num_hidden_layers": 4, "mlp_only_layers": [],
                                    "decoder_sparse_step": 2})
    assert (args.moe.first_k_dense, args.moe.layer_freq) == (1, 2)
    assert QWEN3_HF.config_to_args(QWEN3_HF.args_to_config(args)) == args
    # Layers 0, 2 and 3 are MoE (layer 1 dense): no first_k_dense / layer_freq says that.
    with pytest.raises(ValueError, match=r"MoE layers \[0, 2, 3\] are not every k-th layer"):
        QWEN3_HF.config_to_args({**base, "num_hidden_layers": 4, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match="no MoE layer"):
        QWEN3_HF.config_to_args({**base, "mlp_only_layers": [0, 1, 2]})


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("attention_bias", True), ("use_sliding_window", True)])
def test_unsupported_qwen3_configs_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        QWEN3_HF.config_to_args({**QWEN3_HF.args_to_config(qwen3_moe()), key: value})


def test_routing_without_hf_equivalent_is_refused():
    moe = dataclasses.replace(qwen3_moe().moe, score_func="sigmoid")
    with pytest.raises(ValueError, match="only softmax top-k routing"):
        QWEN3_HF.args_to_config(dataclasses.replace(qwen3_moe(), moe=moe))
