"""The Mixtral family: registry, every block MoE with HF's routing, shapes, parameter counts
against transformers' MixtralForCausalLM, presets. HF weights: tests/integration/test_moe_hf.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from family_checks import materialize
from test_qwen3_model import validate_preset
from titanlike.models.common import sharding
from titanlike.models.common.moe import MoEArgs, Router
from titanlike.models.mixtral import Mixtral, MixtralModelArgs, mixtral_flavors
from titanlike.models.registry import get_model_spec, spec_for_hf_model_type

SPEC = get_model_spec("mixtral")
DEBUG = mixtral_flavors["debugmodel"]


def tiny(**changes) -> MixtralModelArgs:
    moe = dataclasses.replace(DEBUG.moe, hidden_dim=48)
    return dataclasses.replace(DEBUG, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300,
                               max_seq_len=64, moe=moe, **changes)


def build(args: MixtralModelArgs, seed: int = 0) -> Mixtral:
    return materialize(Mixtral, args, seed)


def test_registry():
    assert SPEC.model_cls is Mixtral and SPEC.hf.model_types == ("mixtral",)
    assert spec_for_hf_model_type("mixtral") is SPEC
    assert "attention.q_norm" not in SPEC.shard.block and SPEC.shard.block["moe"] is sharding.sequence_local
    assert SPEC.pipeline_ends.outputs == ("norm", "output")


def test_every_block_is_moe_without_qk_norm():
    with torch.device("meta"):
        model = Mixtral(DEBUG)
    for block in model.layers.values():
        assert block.moe is not None and block.feed_forward is None and block.attention.q_norm is None
    assert model.layers["0"].moe.experts.w1.shape == (8, 256, 256)
    assert all(v % 8 == 0 for v in (DEBUG.dim, DEBUG.moe.hidden_dim, DEBUG.head_dim))
    with pytest.raises(ValueError, match="every layer"):
        dataclasses.replace(DEBUG, moe=dataclasses.replace(DEBUG.moe, first_k_dense=1))
    with pytest.raises(ValueError, match="need moe"):
        MixtralModelArgs(dim=64, n_heads=4)


def test_routing_is_hf_mixtral():
    """Softmax over all experts, top 2, renormalized: equal to the softmax of the top-2 logits."""
    torch.manual_seed(0)
    router = Router(64, DEBUG.moe)
    x = torch.randn(50, 64)
    routing = router(x, None)
    logits = x @ router.gate.weight.T
    top = logits.topk(2, dim=-1)
    assert torch.equal(routing.experts, top.indices)
    torch.testing.assert_close(routing.weights, top.values.softmax(-1))


@pytest.mark.parametrize("flavor", sorted(mixtral_flavors))
def test_num_params_equal_the_meta_model_and_transformers(flavor):
    from transformers import MixtralConfig, MixtralForCausalLM

    args = mixtral_flavors[flavor]
    with torch.device("meta"):
        ours = sum(p.numel() for p in Mixtral(args).parameters())
        hf = MixtralForCausalLM(MixtralConfig(**SPEC.hf.args_to_config(args)))
    total = sum(p.numel() for p in hf.parameters())
    experts = [m for name, m in hf.named_modules() if name.endswith("mlp.experts")]
    per_expert = sum(p.numel() for p in experts[0].parameters()) // 8
    assert args.num_params() == ours == total
    assert args.num_params(active=True) == total - args.n_layers * 6 * per_expert
    assert args.num_params(exclude_embedding=True) == total - args.vocab_size * args.dim


def test_published_sizes():
    sizes = {f: (round(a.num_params() / 1e9, 1), round(a.num_params(active=True) / 1e9, 1))
             for f, a in mixtral_flavors.items() if f != "debugmodel"}
    assert sizes == {"8x7B": (46.7, 12.9), "8x22B": (140.6, 39.2)}
    big = mixtral_flavors["8x22B"]
    assert (big.dim, big.n_layers, big.n_heads, big.n_kv_heads, big.moe.hidden_dim, big.vocab_size,
            big.max_seq_len) == (6144, 56, 48, 8, 16384, 32768, 65536)
    assert all(a.rope_theta == 1e6 and a.moe.aux_loss_coeff == 0.02 for a in mixtral_flavors.values())


def test_hf_config_round_trip_and_sidecar():
    for args in mixtral_flavors.values():
        assert SPEC.hf.config_to_args(SPEC.hf.args_to_config(args)) == args
        assert MixtralModelArgs.from_dict(args.to_dict()) == args
    with pytest.raises(ValueError, match="sliding_window"):
        SPEC.hf.config_to_args({**SPEC.hf.args_to_config(DEBUG), "sliding_window": 4096})
    with pytest.raises(ValueError, match="only softmax top-k routing"):
        SPEC.hf.args_to_config(
            dataclasses.replace(DEBUG, moe=MoEArgs(num_experts=8, top_k=2, score_func="sigmoid")))


@pytest.mark.parametrize("preset, world", [("mixtral_debug", 1), ("mixtral_8x7b", 32), ("mixtral_8x22b", 128)])
def test_presets_parse_and_validate(preset, world):
    cfg, dims = validate_preset(preset, world)
    if world > 1:
        assert dims.ep == 8 and dims.dp_shard == world and cfg.training.mixed_precision_param == "bfloat16"
