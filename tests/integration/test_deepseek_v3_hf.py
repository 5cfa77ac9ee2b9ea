"""DeepSeek-V3 Hugging Face interchange, checked against transformers' own DeepseekV3ForCausalLM
(offline, random weights from a small config) in fp32 with a tight tolerance, both ways, through
the path users take: save_pretrained -> convert_hf_to_dcp.py -> titanlike.load_model, and our DCP
-> convert_dcp_to_hf.py -> from_pretrained.

The cases cover what the mapping must get right: the low-rank query (q_a/q_b) and the single
query projection, kv_a_proj_with_mqa split into our wkv_a and wk_pe, both RoPE row layouts
(rope_interleave true, DeepSeek's own, needs no permutation; false needs one per head), YaRN with
its mscale softmax correction, the routing bias e_score_correction_bias, shared experts, a dense
first layer. Tolerance: measured max |logit difference| ~2e-7 for logits of magnitude ~1; a
wrong RoPE layout moves logits by ~4e-2, a missing mscale by ~2e-3, a dropped routing bias by ~1e-1
(the weights are perturbed so that each of these shows: norms away from 1, a sharp router, a large
bias).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import titanlike
from conftest import REPO
from family_checks import check_hf_export, check_hf_import, materialize, probe_tokens, write_model_only_dcp
from titanlike.checkpoint.format import model_description
from titanlike.checkpoint.hf import read_hf
from titanlike.checkpoint.hf import write_dcp_model
from titanlike.models.common.rope import YaRNScaling
from titanlike.models.deepseek_v3 import DeepSeekV3ModelArgs, deepseek_v3_flavors
from titanlike.models.registry import get_model_spec

sys.path.insert(0, str(REPO / "scripts"))
import convert_dcp_to_hf  # noqa: E402

ATOL = 1e-5
SPEC = get_model_spec("deepseek_v3")
HF = SPEC.hf


def tiny(**changes) -> DeepSeekV3ModelArgs:
    # 12 experts in 3 groups (experts 10, 11 land out of place if sorted as strings); layer 0 dense;
    # v_head_dim 20 != qk_head_dim 24.
    debug = deepseek_v3_flavors["debugmodel"]
    moe = dataclasses.replace(debug.moe, num_experts=12, top_k=3, hidden_dim=32, n_groups=3, topk_groups=2)
    args = dataclasses.replace(debug, dim=64, n_layers=3, n_heads=4, vocab_size=300, max_seq_len=64,
                               ffn_hidden_dim=96, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=20, moe=moe,
                               mtp_num_layers=0)  # multi-token prediction: its own tests
    return dataclasses.replace(args, **changes)


YARN = YaRNScaling(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                   mscale_all_dim=1.0)
CASES = {
    "q_lora": tiny,
    "q_lora_rotate_half": lambda: tiny(hf_rope_interleave=False),
    "no_q_lora_yarn_rotate_half": lambda: tiny(q_lora_rank=0, rope_scaling=YARN, hf_rope_interleave=False),
}


def sharpen(named_tensors, num_experts: int) -> None:
    """Norms away from 1 (a mis-mapped norm shows), a sharp router and a large routing bias (the
    bias changes which experts are chosen)."""
    with torch.no_grad():
        for name, t in named_tensors:
            if "norm" in name:
                t.add_(0.2 * torch.randn_like(t))
            elif name.endswith(("gate.weight", "router.gate.weight")) and t.shape[0] == num_experts:
                t.normal_(std=0.5)
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                t.normal_(std=0.1)


def hf_model(case: str, seed: int = 0):
    args = CASES[case]()
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF.args_to_config(args))).eval()
    model.set_experts_implementation("eager")
    sharpen([*model.named_parameters(), *model.named_buffers()], args.moe.num_experts)
    return args, model



@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_titanlike_and_back(tmp_path, case):
    args, hf = hf_model(case)
    assert HF.config_to_args(hf.config.to_dict()) == args
    t = probe_tokens(args.vocab_size)
    want = check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", "deepseek_v3", t, ATOL)

    # DCP -> HF -> transformers: the same logits, and the tensors save_pretrained wrote, bit for bit
    # (permutations and the kv_a join included).
    check_hf_export(tmp_path / "dcp", tmp_path / "out", DeepseekV3ForCausalLM, t, want, ATOL,
                    experts_implementation="eager")
    (saved, _), (written, _) = read_hf(str(tmp_path / "hf")), read_hf(str(tmp_path / "out"))
    assert set(written) == set(saved)
    assert all(torch.equal(written[k], saved[k]) for k in saved)


@pytest.mark.parametrize("interleave", [True, False])
def test_titanlike_weights_give_the_same_logits_in_transformers(tmp_path, interleave):
    """The other direction with weights of our own init (not HF's), via a model-only DCP."""
    args = tiny(hf_rope_interleave=interleave, rope_scaling=YARN)
    model = materialize(SPEC.model_cls, args, seed=3)
    sharpen([*model.named_parameters(), *model.named_buffers()], args.moe.num_experts)
    model.eval()
    write_model_only_dcp(model, "deepseek_v3", args, tmp_path / "dcp")
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        want = model(t)
    check_hf_export(tmp_path / "dcp", tmp_path / "hf", DeepseekV3ForCausalLM, t, want, ATOL,
                    experts_implementation="eager")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["rope_interleave"]) == ("deepseek_v3", interleave)


def test_routing_bias_without_aux_loss_free_balancing():
    """Without bias updates our layers keep no bias: export writes zeros (the same choice), import
    refuses a nonzero one rather than silently routing differently."""
    args, hf = hf_model("q_lora")
    plain = dataclasses.replace(args, moe=dataclasses.replace(args.moe, bias_update_rate=0.0))
    with torch.device("meta"):
        model = SPEC.model_cls(plain)
    exported = HF.to_hf_state_dict(model.state_dict(), plain)
    assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (12,)
    hf_sd = hf.state_dict()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate.e_score_correction_bias is not zero.*update_rate"):
        HF.from_hf_state_dict(_on_disk(hf_sd), plain)


def _on_disk(hf_sd: dict) -> dict:
    """HF's in-memory state dict with the experts one tensor per expert, as save_pretrained writes them."""
    out = {}
    for key, value in hf_sd.items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = value[e].chunk(2)
        elif key.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def test_published_configs_read():
    """The fields of deepseek-ai/DeepSeek-V3's and moonshotai/Moonlight-16B-A3B's config.json (4.x
    spelling: rope_theta + rope_scaling) give our flavors."""
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "first_k_dense_replace": 3,
          "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
          "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
          "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
          "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
          "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                  "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
          "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128,
          "vocab_size": 129280}
    ours = deepseek_v3_flavors["671B"]
    # The config's aux_loss_alpha (0.001) is not the report's sequence-wise factor (1e-4), which the flavor keeps.
    assert HF.config_to_args(v3) == dataclasses.replace(
        ours, moe=dataclasses.replace(ours.moe, seq_aux_loss_coeff=0.001))
    moonlight = {**v3, "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264,
                 "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
                 "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
                 "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "rms_norm_eps": 1e-05,
                 "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1,
                 "vocab_size": 163840}
    assert HF.config_to_args(moonlight) == deepseek_v3_flavors["16B"]


@pytest.mark.parametrize("key, value", [("scoring_func", "softmax"), ("topk_method", "greedy"), ("hidden_act", "gelu"),
                                        ("num_key_value_heads", 2), ("moe_layer_freq", 2)])
def test_unsupported_configs_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        HF.config_to_args({**HF.args_to_config(tiny()), key: value})


def test_routing_without_hf_equivalent_is_refused():
    args = tiny()
    with pytest.raises(ValueError, match="sigmoid"):
        HF.args_to_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax")))
    with pytest.raises(ValueError, match="layer_freq 1"):
        HF.args_to_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, layer_freq=2)))


def test_multi_token_prediction_layers_export_after_the_trunk(tmp_path):
    """Our prediction module leaves as model.layers.<n_layers> with DeepSeek's names (and copies of
    the table and head), transformers (which ignores those layers) gives the same logits, and the
    folder reads back with the module bit for bit; a folder whose config lists the module but whose
    weights lack it (transformers' save_pretrained drops it) reads as the model without it, as
    transformers reads it."""
    args = tiny(mtp_num_layers=1)
    model = materialize(SPEC.model_cls, args, seed=3)
    model.eval()
    write_dcp_model(model.state_dict(), str(tmp_path / "dcp"),
                    {"contents": "model_only", "step": 0, "model": model_description("deepseek_v3", args)})
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    written, config = read_hf(str(tmp_path / "hf"))
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    mtp = {k.removeprefix("model.layers.3.") for k in written if k.startswith("model.layers.3.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight"} <= mtp
    assert torch.equal(written["model.layers.3.embed_tokens.weight"], written["model.embed_tokens.weight"])
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager").eval()
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(t).logits, model(t), rtol=0, atol=ATOL)
    back = titanlike.load_model(tmp_path / "hf")
    ours = {k: v for k, v in model.state_dict().items() if k != "mtp_embeddings.weight"}
    theirs = back.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    hf.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    trunk = titanlike.load_model(tmp_path / "saved")
    assert trunk.model_args.mtp_num_layers == 0
    with torch.no_grad():
        torch.testing.assert_close(trunk(t), model(t), rtol=0, atol=ATOL)
