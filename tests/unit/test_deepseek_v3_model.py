"""The DeepSeek-V3 family: registry and TP plan, MLA shapes with and without the low-rank query,
parameter counts against instantiated models (ours and transformers'), FLOPs, YaRN against
transformers' own RoPE init, routing against transformers' DeepseekV3TopkRouter, validation
messages, presets.

HF weight interchange is in tests/integration/test_deepseek_v3_hf.py; layouts (TP gradients of
every parameter, FSDP/TP/EP/CP/PP through train.py) in tests/distributed/test_deepseek_v3_parity.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from family_checks import materialize
from test_qwen3_model import validate_preset
from titanlike.models.common import sharding
from titanlike.models.common.moe import MoE, MoEArgs, Router
from titanlike.models.common.rope import YaRNScaling, precompute_rope_cache, rope_inv_freq, yarn_mscale
from titanlike.models.deepseek_v3 import DeepSeekV3, DeepSeekV3ModelArgs, deepseek_v3_flavors
from titanlike.models.deepseek_v3.attention import MLA
from titanlike.models.deepseek_v3.sharding import replicated_to_heads
from titanlike.models.registry import get_model_spec, spec_for_hf_model_type
from titanlike.parallel.parallel_dims import ParallelDims

SPEC = get_model_spec("deepseek_v3")
DEBUG = deepseek_v3_flavors["debugmodel"]
V3 = deepseek_v3_flavors["671B"]
# The main model only: what the report's 671B / 37B count and what transformers builds (it skips
# the multi-token-prediction module).
V3_TRUNK = dataclasses.replace(V3, mtp_num_layers=0)


def tiny(**changes) -> DeepSeekV3ModelArgs:
    args = dataclasses.replace(DEBUG, dim=64, n_layers=3, n_heads=4, vocab_size=300, max_seq_len=64, ffn_hidden_dim=96,
                               q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
                               moe=dataclasses.replace(DEBUG.moe, hidden_dim=32),
                               mtp_num_layers=0)  # multi-token prediction: its own tests
    return dataclasses.replace(args, **changes)


def build(args: DeepSeekV3ModelArgs, seed: int = 0) -> DeepSeekV3:
    return materialize(DeepSeekV3, args, seed)


def dims(**degrees) -> ParallelDims:
    d = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1) | degrees
    world = d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"]
    return ParallelDims.resolve(world_size=world, **d)


def test_registry_and_sharding():
    assert SPEC.model_cls is DeepSeekV3 and SPEC.hf.model_types == ("deepseek_v3",)
    assert spec_for_hf_model_type("deepseek_v3") is SPEC
    assert SPEC.pipeline_ends.inputs == ("tok_embeddings",) and SPEC.pipeline_ends.outputs[:2] == ("norm", "output")
    block = SPEC.shard.block
    # The replicated down projections read the gathered input in high precision: no float8 readers.
    assert block["attention"] == sharding.gather_input() and block["attention.wo"] is sharding.rowwise
    assert all(block[f"attention.{n}"] is sharding.colwise for n in ("wq", "wq_b", "wkv_b"))
    assert all(block[f"attention.{n}"] is sharding.replicated for n in ("wq_a", "q_norm", "wkv_a", "kv_norm"))
    assert block["attention.wk_pe"] is replicated_to_heads and block["moe"] is sharding.sequence_local
    assert "attention.wk" not in block and "attention.wv" not in block


def test_debugmodel_layers_and_routing():
    assert (DEBUG.dim, DEBUG.n_layers, DEBUG.n_heads, DEBUG.q_lora_rank, DEBUG.kv_lora_rank) == (256, 4, 8, 128, 64)
    assert (DEBUG.qk_nope_head_dim, DEBUG.qk_rope_head_dim, DEBUG.v_head_dim) == (32, 16, 32)
    m = DEBUG.moe
    assert (m.num_experts, m.top_k, m.n_groups, m.topk_groups, m.num_shared_experts, m.first_k_dense) == (
        8, 2, 4, 2, 1, 1)
    assert (m.score_func, m.route_norm, m.route_scale) == ("sigmoid", True, 2.5)
    assert all(v % 8 == 0 for v in (DEBUG.dim, m.hidden_dim))  # torch._grouped_mm
    assert deepseek_v3_flavors["debugmodel_nolora"].q_lora_rank == 0
    with torch.device("meta"):
        model = DeepSeekV3(DEBUG)
    # the trunk, then the multi-token-prediction module (an MoE block too, as layer 61 of DeepSeek-V3)
    assert [b.moe is not None for b in model.layers.values()] == [False, True, True, True, True]
    assert DEBUG.mtp_num_layers == 1 and type(model.layers["4"]).__name__ == "MTPBlock"
    block = model.layers["1"]
    assert isinstance(block.moe, MoE) and block.moe.shared_experts.w1.weight.shape == (128, 256)
    assert model.rope_cache.shape == (2048, 16)  # angles for the RoPE part of each head only


@pytest.mark.parametrize("q_lora_rank", [48, 0])
def test_mla_shapes(q_lora_rank):
    args = tiny(q_lora_rank=q_lora_rank)
    attention = build(args).layers["0"].attention
    assert isinstance(attention, MLA) and attention.qk_head_dim == 24
    if q_lora_rank:
        assert attention.wq is None
        assert attention.wq_a.weight.shape == (48, 64) and attention.q_norm.weight.shape == (48,)
        assert attention.wq_b.weight.shape == (4 * 24, 48)
    else:
        assert attention.wq_a is None and attention.q_norm is None and attention.wq_b is None
        assert attention.wq.weight.shape == (4 * 24, 64)
    assert attention.wkv_a.weight.shape == (32, 64) and attention.kv_norm.weight.shape == (32,)
    assert attention.wkv_b.weight.shape == (4 * (16 + 20), 32)  # per head: k_nope, then v
    assert attention.wk_pe.weight.shape == (8, 64)
    assert attention.wo.weight.shape == (64, 4 * 20)  # v_head_dim 20, not qk_head_dim 24
    # The latent norms use RMSNorm's default epsilon, as DeepSeek's reference and transformers.
    assert attention.kv_norm.eps == 1e-6 and attention.q_scale == 1.0
    out = attention(torch.randn(2, 10, 64), build(args).rope_cache)
    assert out.shape == (2, 10, 64)


def test_forward_runs_the_trunk_only():
    """Entries of `layers` keyed n_layers and above (multi-token prediction) are not trunk blocks."""
    args = tiny()
    model = build(args).eval()
    t = torch.randint(0, args.vocab_size, (1, 8))
    with torch.no_grad():
        want = model(t)
        model.layers[str(args.n_layers)] = model.layers["1"]  # a stand-in extra entry
        assert [int(k) for k, _ in zip(model.layers, model.trunk())] == [0, 1, 2]
        torch.testing.assert_close(model(t), want)


def _hf_counts(args: DeepSeekV3ModelArgs) -> tuple[int, int]:
    """(total, active) parameters of transformers' DeepseekV3ForCausalLM built from our config (on meta)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**SPEC.hf.args_to_config(args)))
    total = sum(p.numel() for p in model.parameters())
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) // args.moe.num_experts
    return total, total - len(experts) * (args.moe.num_experts - args.moe.top_k) * per_expert


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_nolora", "16B", "671B"])
def test_num_params_equal_the_transformers_model(flavor):
    args = deepseek_v3_flavors[flavor]
    args = dataclasses.replace(args, n_layers=args.moe.first_k_dense + 2, mtp_num_layers=0)
    total, active = _hf_counts(args)
    assert args.num_params() == total and args.num_params(active=True) == active


def test_published_sizes():
    # DeepSeek-V3: 671B total, 37B activated per token (its report; without the MTP module).
    assert round(V3_TRUNK.num_params() / 1e9) == 671 and round(V3_TRUNK.num_params(active=True) / 1e9, 1) == 37.6
    moonlight = deepseek_v3_flavors["16B"]
    assert round(moonlight.num_params() / 1e9, 1) == 16.0 and round(moonlight.num_params(active=True) / 1e9, 1) == 2.9
    assert (V3.dim, V3.n_layers, V3.n_heads, V3.q_lora_rank, V3.moe.first_k_dense, V3.mtp_num_layers) == (
        7168, 61, 128, 1536, 3, 1)
    assert (V3.moe.n_groups, V3.moe.topk_groups, V3.moe.route_scale, V3.vocab_size, V3.max_seq_len) == (
        8, 4, 2.5, 129280, 163840)
    assert (moonlight.q_lora_rank, moonlight.moe.num_shared_experts, moonlight.ffn_hidden_dim, moonlight.norm_eps) == (
        0, 2, 11264, 1e-5)


def test_flops_count_mla_attention():
    args = V3_TRUNK
    n = args.num_params(exclude_embedding=True, active=True)
    # q.k over qk_head_dim 192, the weighted sum over v_head_dim 128.
    assert args.flops_per_token(4096) == 6 * n + 6 * 61 * 128 * (192 + 128) * 4096
    assert args.attention_shape() == type(args.attention_shape())(128, 128, 192)


# YaRN -------------------------------------------------------------------------------------------


YARN_CASES = {
    "deepseek_v3": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                        mscale_all_dim=1.0),
    "mscale_ratio": dict(factor=4.0, original_max_position_embeddings=2048, beta_fast=16, beta_slow=2, mscale=0.707,
                         mscale_all_dim=1.0),
    "plain": dict(factor=8.0, original_max_position_embeddings=512),
    "untruncated": dict(factor=8.0, original_max_position_embeddings=512, truncate=False),
    "attention_factor": dict(factor=8.0, original_max_position_embeddings=512, attention_factor=1.3),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_matches_transformers(case):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", **YARN_CASES[case]}
    max_positions = int(rope["factor"] * rope["original_max_position_embeddings"])
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, rope_theta=10000.0,
                              max_position_embeddings=max_positions, rope_scaling=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = YaRNScaling.from_hf(config.rope_parameters, max_position_embeddings=max_positions)
    assert torch.equal(rope_inv_freq(64, 10000.0, scaling), inv_freq)
    assert scaling.attention_scaling() == pytest.approx(attention_factor, rel=1e-12)
    # The table carries the factor on cos and sin, as transformers' rotary embedding.
    table = precompute_rope_cache(64, 16, 10000.0, scaling)
    angles = torch.outer(torch.arange(16, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(table, torch.stack([angles.cos(), angles.sin()], -1).flatten(-2) * attention_factor)
    assert YaRNScaling.from_hf(scaling.to_hf()) == scaling


def test_yarn_stretches_only_the_slow_frequencies():
    scaling = YaRNScaling(**YARN_CASES["deepseek_v3"])
    plain, scaled = rope_inv_freq(64, 10000.0), rope_inv_freq(64, 10000.0, scaling)
    torch.testing.assert_close(scaled[:5], plain[:5], rtol=0, atol=0)  # fast: kept
    torch.testing.assert_close(scaled[-5:], plain[-5:] / 40)  # slow: interpolated
    assert ((scaled <= plain * (1 + 1e-6)) & (scaled >= plain / 40 * (1 - 1e-6))).all()  # a ramp between


def test_deepseek_v3_softmax_scale_takes_mscale_squared():
    mscale = 0.1 * math.log(40) + 1
    assert yarn_mscale(40.0, 1.0) == pytest.approx(mscale)
    assert V3.softmax_scale_factor == pytest.approx(mscale**2)  # ~1.874
    assert V3.rope_scaling.attention_scaling() == 1.0  # mscale / mscale_all_dim: the table is unscaled
    with torch.device("meta"):
        attention = DeepSeekV3(dataclasses.replace(V3, n_layers=1, max_seq_len=16)).layers["0"].attention
    assert attention.q_scale == pytest.approx(mscale**2)
    assert tiny().softmax_scale_factor == 1.0
    assert dataclasses.replace(V3, rope_scaling=dataclasses.replace(V3.rope_scaling, mscale_all_dim=None)
                               ).softmax_scale_factor == 1.0


# Routing ----------------------------------------------------------------------------------------


def test_routing_equals_transformers_deepseek_router():
    """Sigmoid scores, the bias in the choice only, groups ranked by their best two biased scores,
    renormalized and scaled gate values: our Router equals DeepseekV3TopkRouter."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = MoEArgs(num_experts=16, top_k=4, hidden_dim=8, num_shared_experts=1, score_func="sigmoid", route_norm=True,
                  route_scale=2.5, n_groups=4, topk_groups=2, bias_update_rate=1e-3)
    args = dataclasses.replace(tiny(), moe=moe)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(**SPEC.hf.args_to_config(args)))
    ours = Router(64, moe)
    torch.manual_seed(0)
    with torch.no_grad():
        ours.gate.weight.normal_(std=0.3)
        hf.weight.copy_(ours.gate.weight)
        hf.e_score_correction_bias.normal_(std=0.3)  # large: it moves the choice of experts and groups
    x = torch.randn(200, 64)
    _, hf_weights, hf_experts = hf(x)
    routing = ours(x, hf.e_score_correction_bias)
    order, hf_order = routing.experts.sort(-1), hf_experts.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(routing.weights.gather(-1, order.indices), hf_weights.gather(-1, hf_order.indices))
    # The bias changed the choice (else this test would not see it).
    assert not torch.equal(ours(x, None).experts.sort(-1).values, order.values)


# Rules ------------------------------------------------------------------------------------------


def test_validate_messages():
    with pytest.raises(ValueError, match="8 attention heads are not divisible by tensor_parallel_degree 3"):
        DEBUG.validate(dims(tp=3), seq_len=256)
    with pytest.raises(ValueError, match="expert_parallel_degree 3 must divide the model's 8 experts"):
        DEBUG.validate(dims(dp_shard=3, ep=3), seq_len=256)
    with pytest.raises(ValueError, match="training.seq_len 4096 exceeds the model's context of 2048"):
        DEBUG.validate(dims(), seq_len=4096)
    DEBUG.validate(dims(tp=2, dp_shard=2, ep=4), seq_len=256)
    with pytest.raises(ValueError, match="as many key/value heads as query heads"):
        dataclasses.replace(DEBUG, n_kv_heads=4)
    with pytest.raises(ValueError, match="qk_rope_head_dim .15. must be even"):
        dataclasses.replace(DEBUG, qk_rope_head_dim=15)
    with pytest.raises(ValueError, match="q_lora_rank must be >= 0"):
        dataclasses.replace(DEBUG, q_lora_rank=-1)


def test_sidecar_round_trip_and_moe_overrides():
    for args in (DEBUG, V3):
        assert DeepSeekV3ModelArgs.from_dict(args.to_dict()) == args
    changed = DEBUG.with_moe_args(dataclasses.replace(DEBUG.moe, seq_aux_loss_coeff=0.0))
    assert changed.moe_args().seq_aux_loss_coeff == 0.0 and DEBUG.moe_args().seq_aux_loss_coeff == 1e-4


@pytest.mark.parametrize("preset, world", [("deepseek_v3_debug", 1), ("deepseek_v3_16b", 8)])
def test_presets_parse_and_validate(preset, world):
    cfg, layout = validate_preset(preset, world)
    assert cfg.model.name == "deepseek_v3"
    if preset == "deepseek_v3_debug":
        assert (cfg.model.flavor, layout.ep) == ("debugmodel", 1)
        return
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.activation_checkpoint.mode == "full"
    assert (cfg.model.flavor, layout.dp_shard, layout.ep) == ("16B", 8, 8)


def test_multi_token_prediction_joins_the_objective_in_training_only():
    """The prediction module after the trunk: its weighted loss reaches every parameter's gradient
    through the logits, its per-depth value is reported, and evaluation skips it."""
    from titanlike.models.outputs import cross_entropy_sum
    from titanlike.objectives.causal_lm import lookahead_targets

    args = tiny(mtp_num_layers=2, mtp_loss_weight=0.5)
    assert (args.total_layers, args.lookahead_tokens, args.reported_losses()) == (5, 2, ("mtp_loss",))
    model = build(args).train()
    assert [type(b).__name__ for b in model.layers.values()][3:] == ["MTPBlock", "MTPBlock"]
    assert model.mtp_embeddings.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    stream = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = stream[:, :-1], stream[:, 1:]
    lookahead = lookahead_targets(labels, labels, 2)
    logits = model(inputs, lookahead=lookahead)
    loss = cross_entropy_sum(logits, labels)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if "expert" not in n), [n for n, p in model.named_parameters() if p.grad is None]
    # the reported value: each depth's cross-entropy sum / depth, recomputed by hand
    with torch.no_grad():
        h = model.tok_embeddings(inputs)
        rope = model.rotary_angles(None)
        for layer in model.trunk():
            h = layer(h, rope)
        want = []
        for k, key in enumerate(("3", "4")):
            h, normed = model.layers[key](h, rope, embedded=model.tok_embeddings(lookahead[..., k, 0]))
            want.append(cross_entropy_sum(model.output(normed), lookahead[..., k, 1]) / 2)
    got = [float(model.layers[k].reported_loss_sum) for k in ("3", "4")]
    assert got == pytest.approx([float(w) for w in want], rel=1e-5)
    # the objective's gradient includes weight / depth x the modules' losses: the eh_proj gradient
    # scales with mtp_loss_weight
    grad = model.layers["4"].eh_proj.weight.grad.clone()
    model.zero_grad()
    model.model_args.mtp_loss_weight = 1.0
    cross_entropy_sum(model(inputs, lookahead=lookahead), labels).backward()
    # (summation order differs between the two backward passes: compare at the gradient's scale)
    torch.testing.assert_close(model.layers["4"].eh_proj.weight.grad, 2 * grad, rtol=1e-3,
                               atol=1e-3 * float(grad.abs().max()))
    model.eval()
    with torch.no_grad():
        plain = model(inputs)
        torch.testing.assert_close(model(inputs, lookahead=lookahead), plain)
    assert args.flops_per_token(16) > dataclasses.replace(args, mtp_num_layers=0).flops_per_token(16)
