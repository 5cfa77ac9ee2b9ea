"""The Qwen3 family (dense and MoE): registry, which blocks are MoE, shapes, QK-norm and explicit
head_dim, parameter counts against transformers' own models, presets.

HF weight interchange is in tests/integration/test_moe_hf.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import REPO
from family_checks import materialize
from titanlike.models.common import sharding
from titanlike.models.common.attention import Attention
from titanlike.models.common.init import LinearInit
from titanlike.models.common.moe import MoE, MoEArgs
from titanlike.models.qwen3 import Qwen3, Qwen3ModelArgs, qwen3_flavors
from titanlike.models.registry import get_model_spec, spec_for_hf_model_type

SPEC = get_model_spec("qwen3")
MOE = qwen3_flavors["debugmodel_moe"]


def tiny(moe: bool = True, **changes) -> Qwen3ModelArgs:
    args = dataclasses.replace(MOE, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, explicit_head_dim=24,
                               ffn_hidden_dim=96, vocab_size=300, max_seq_len=64)
    if moe:
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, hidden_dim=32))
    else:
        args = dataclasses.replace(args, moe=None)
    return dataclasses.replace(args, **changes)


def build(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3:
    return materialize(Qwen3, args, seed)


def test_registry_reads_both_hf_model_types_and_writes_the_fitting_one():
    assert SPEC.model_cls is Qwen3 and SPEC.hf.model_types == ("qwen3", "qwen3_moe")
    assert spec_for_hf_model_type("qwen3") is SPEC and spec_for_hf_model_type("qwen3_moe") is SPEC
    for flavor, model_type in (("8B", "qwen3"), ("30B-A3B", "qwen3_moe")):
        args = qwen3_flavors[flavor]
        assert SPEC.hf.model_type(args) == SPEC.hf.args_to_config(args)["model_type"] == model_type
    assert SPEC.pipeline_ends.inputs == ("tok_embeddings",) and SPEC.pipeline_ends.outputs == ("norm", "output")
    assert SPEC.shard.block["attention.q_norm"] is SPEC.shard.block["attention.k_norm"] is sharding.head_norm
    assert SPEC.shard.block["feed_forward.w3"] is sharding.colwise
    assert SPEC.shard.block["moe"] is sharding.sequence_local


def test_debugmodel_moe_layers_and_shapes():
    assert (MOE.dim, MOE.n_layers, MOE.n_heads, MOE.n_kv_heads, MOE.head_dim) == (256, 8, 16, 8, 16)
    assert (MOE.vocab_size, MOE.max_seq_len) == (2256, 2048)
    m = MOE.moe
    assert (m.num_experts, m.top_k, m.hidden_dim, m.first_k_dense, m.score_func, m.route_norm, m.aux_loss_coeff) == (
        8, 2, 128, 1, "softmax", True, 0.01)
    with torch.device("meta"):
        model = Qwen3(MOE)
    kinds = ["moe" if block.moe is not None else "dense" for block in model.layers.values()]
    assert kinds == ["dense"] + ["moe"] * 7
    block = model.layers["1"]
    assert isinstance(block.moe, MoE) and block.feed_forward is None
    assert block.moe.experts.w1.shape == (8, 128, 256) and block.moe.experts.w2.shape == (8, 256, 128)
    assert block.moe.router.gate.weight.shape == (8, 256) and block.moe.shared_experts is None
    assert model.layers["0"].feed_forward.w1.weight.shape == (768, 256)


def test_explicit_head_dim_sizes_the_projections():
    args = qwen3_flavors["30B-A3B"]
    assert (args.dim, args.n_heads, args.head_dim) == (2048, 32, 128)  # 32 x 128 = 4096 != 2048
    with torch.device("meta"):
        attention = Qwen3(dataclasses.replace(args, n_layers=1)).layers["0"].attention
    assert attention.wq.weight.shape == (32 * 128, 2048) and attention.wo.weight.shape == (2048, 32 * 128)
    assert attention.wk.weight.shape == (4 * 128, 2048) and attention.q_norm.weight.shape == (128,)
    assert args.attention_shape().head_dim == 128
    # Without explicit_head_dim the rule is unchanged: dim // n_heads, which must divide.
    assert dataclasses.replace(args, explicit_head_dim=None).head_dim == 64
    with pytest.raises(ValueError, match="divisible by n_heads"):
        dataclasses.replace(args, explicit_head_dim=None, n_heads=30, n_kv_heads=2)


def test_qk_norm_makes_attention_invariant_to_the_scale_of_q_and_k():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    rope = build(tiny(moe=False)).rope_cache[:8]
    for qk_norm, invariant in ((1e-6, True), (None, False)):
        attention = Attention(64, 4, 2, 24, qk_norm_eps=qk_norm)
        attention.to_empty(device="cpu")
        attention.init_weights(LinearInit(std=0.2, out_std=0.2), seed=0, prefix="")
        assert (attention.q_norm is not None) is invariant
        if invariant:
            assert torch.equal(attention.q_norm.weight, torch.ones(24))
        with torch.no_grad():
            before = attention(x, rope)
            attention.wq.weight.mul_(7.0)
            attention.wk.weight.mul_(3.0)
            after = attention(x, rope)
        assert torch.allclose(before, after, atol=1e-5) is invariant


def test_qk_norm_off_drops_its_parameters():
    on, off = tiny(), tiny(qk_norm=False)
    assert on.num_params() - off.num_params() == 2 * on.head_dim * on.n_layers
    with torch.device("meta"):
        assert Qwen3(off).layers["0"].attention.q_norm is None
    assert sum(p.numel() for p in build(off).parameters()) == off.num_params()


def _hf_counts(args: Qwen3ModelArgs) -> tuple[int, int]:
    """(total, active) parameters of transformers' model built from our config (on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = SPEC.hf.args_to_config(args)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    if args.moe is None:
        return total, total
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) // args.moe.num_experts
    return total, total - len(experts) * (args.moe.num_experts - args.moe.top_k) * per_expert


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "0.6B", "8B", "30B-A3B"])
def test_num_params_equal_the_transformers_model(flavor):
    args = qwen3_flavors[flavor]
    total, active = _hf_counts(args)
    assert args.num_params() == total and args.num_params(active=True) == active


def test_published_sizes():
    billions = {f: round(a.num_params() / 1e9, 1) for f, a in qwen3_flavors.items() if "debug" not in f}
    assert billions == {"0.6B": 0.6, "1.7B": 1.7, "4B": 4.0, "8B": 8.2, "14B": 14.8, "32B": 32.8,
                        "30B-A3B": 30.5, "235B-A22B": 235.1}
    assert round(qwen3_flavors["30B-A3B"].num_params(active=True) / 1e9, 1) == 3.4
    assert round(qwen3_flavors["235B-A22B"].num_params(active=True) / 1e9, 1) == 22.2
    big = qwen3_flavors["235B-A22B"]
    assert (big.n_layers, big.dim, big.n_heads, big.n_kv_heads, big.head_dim, big.moe.hidden_dim) == (
        94, 4096, 64, 4, 128, 1536)
    for args in qwen3_flavors.values():
        assert args.rope_theta == 1e6 and args.qk_norm


def test_flops_count_the_active_parameters():
    args = qwen3_flavors["30B-A3B"]
    n = args.num_params(exclude_embedding=True, active=True)
    assert args.flops_per_token(4096) == 6 * n + 12 * 48 * 32 * 128 * 4096


def test_sidecar_round_trip_and_moe_overrides():
    args = qwen3_flavors["debugmodel_moe"]
    assert Qwen3ModelArgs.from_dict(args.to_dict()) == args
    changed = args.with_moe_args(dataclasses.replace(args.moe, aux_loss_coeff=0.0))
    assert changed.moe_args().aux_loss_coeff == 0.0 and args.moe_args().aux_loss_coeff == 0.01
    assert qwen3_flavors["8B"].moe_args() is None


def test_moe_layers_follow_first_k_dense_and_layer_freq():
    args = tiny(n_layers=6)
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, first_k_dense=2, layer_freq=2))
    with torch.device("meta"):
        model = Qwen3(args)
    assert [i for i, block in enumerate(model.layers.values()) if block.moe is not None] == [2, 4]
    assert args.num_params() == sum(p.numel() for p in model.parameters())


def validate_preset(preset: str, world: int):
    """The preset names its intended world size on its first line and validates for it."""
    from titanlike.config import load_job_config
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.train.plan import plan_job

    path = REPO / "train_configs" / f"{preset}.toml"
    assert path.read_text().startswith(f"# World size {world}")
    cfg = load_job_config(["--job.config_file", str(path), "--model.tokenizer_path", DEFAULT_TOKENIZER_PATH])
    assert preset.startswith(f"{cfg.model.name}_")
    return cfg, plan_job(cfg, world_size=world).dims


@pytest.mark.parametrize("preset, world", [("qwen3_debug_moe", 1), ("qwen3_30b_a3b", 8),
                                           ("qwen3_30b_a3b_64gpu", 64), ("qwen3_235b_a22b", 256)])
def test_presets_parse_and_validate(preset, world):
    cfg, dims = validate_preset(preset, world)
    if preset == "qwen3_debug_moe":
        assert (cfg.model.flavor, dims.ep) == ("debugmodel_moe", 1)
        return
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.activation_checkpoint.mode == "full"
    expected = {"qwen3_30b_a3b": (1, 8, 8), "qwen3_30b_a3b_64gpu": (1, 8, 64), "qwen3_235b_a22b": (4, 32, 64)}
    assert (dims.pp, dims.ep, dims.dp_shard) == expected[preset]


def test_moe_args_validation_reaches_the_family():
    with pytest.raises(ValueError, match="top_k 9 is larger than the 8 experts"):
        MoEArgs(num_experts=8, top_k=9)
    from titanlike.parallel.parallel_dims import ParallelDims

    dims = ParallelDims.resolve(world_size=3, dp_replicate=1, dp_shard=3, cp=1, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="expert_parallel_degree 3 must divide the model's 8 experts"):
        MOE.validate(dims, seq_len=256)
