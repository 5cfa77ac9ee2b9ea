"""The hybrid family (Megatron's layer pattern: Mamba-2, attention, MLP, MoE): the pattern, the blocks
it builds, parameter and FLOP counts, layout rules, and the pipeline split balanced by layer cost.

Hugging Face interchange is in tests/integration/test_hybrid_hf.py; parallel layouts through
train.py in tests/distributed/test_hybrid_parity.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
import torch

from titanlike.config import ConfigError, load_job_config
from titanlike.models.args import BaseModelArgs
from titanlike.models.common import sharding
from titanlike.models.common.mamba2 import Mamba2Mixer, mamba2_head_split
from titanlike.models.common.moe import MoE
from titanlike.models.hybrid import HybridModel, HybridModelArgs, hybrid_flavors
from titanlike.models.hybrid.model import HybridBlock, SquaredReLUMLP
from titanlike.models.registry import get_model_spec, spec_for_hf_model_type
from titanlike.parallel.pipeline import balance_by_cost, plan_layout
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.train.plan import plan_job

SPEC = get_model_spec("hybrid")
TINY = hybrid_flavors["debugmodel_tiny"]


def dims(tp=1, cp=1, pp=1, ep=1) -> ParallelDims:
    return ParallelDims.resolve(world_size=tp * cp * pp * ep, dp_replicate=1, dp_shard=-1, cp=cp, tp=tp, pp=pp, ep=ep)


def test_registry_spec_and_hf_types():
    assert SPEC.model_cls is HybridModel and SPEC.hf.model_types == ("nemotron_h", "mamba2")
    assert spec_for_hf_model_type("nemotron_h") is SPEC and spec_for_hf_model_type("mamba2") is SPEC
    block = SPEC.shard.block
    assert (block["mamba"], block["mamba.in_proj"], block["mamba.out_proj"]) == (
        mamba2_head_split, sharding.colwise, sharding.rowwise)
    assert block["norm"] is sharding.sequence_norm and block["moe"] is sharding.sequence_local
    for flavor, model_type in (("nemotron_h_8b", "nemotron_h"), ("mamba2_2.7b", "mamba2")):
        args = hybrid_flavors[flavor]
        assert SPEC.hf.model_type(args) == SPEC.hf.args_to_config(args)["model_type"] == model_type


def test_each_pattern_character_builds_its_block():
    args = hybrid_flavors["debugmodel_moe"]  # "M-ME*-ME"
    with torch.device("meta"):
        model = HybridModel(args)
    kinds = {"M": Mamba2Mixer, "-": SquaredReLUMLP, "E": MoE}
    for i, (key, block) in enumerate(model.layers.items()):
        assert isinstance(block, HybridBlock) and key == str(i) and block.kind == args.hybrid_layer_pattern[i]
        names = [n for n in ("mamba", "attention", "feed_forward", "moe") if hasattr(block, n)]
        assert names == [block.mixer_name]  # one mixer per layer, under its kind's name
        if block.kind in kinds:
            assert isinstance(getattr(block, block.mixer_name), kinds[block.kind])
    assert args.moe.layers == (3, 7) and [i for i in range(8) if args.moe.is_moe_layer(i)] == [3, 7]
    assert not hasattr(model, "rope_cache")  # no position encoding (Nemotron-H)


def test_flops_are_linear_in_sequence_length_for_mamba_layers():
    mamba = hybrid_flavors["mamba2_2.7b"]
    assert mamba.flops_per_token(1024) == mamba.flops_per_token(16384)  # the scan's cost per token is fixed
    assert mamba.flops_per_token(1024) > 6 * mamba.num_params(exclude_embedding=True)
    hybrid = hybrid_flavors["nemotron_h_8b"]
    a = hybrid.attention_shape()
    # Only the 4 attention layers' 12 L H Q T grows with T.
    assert hybrid.flops_per_token(2048) - hybrid.flops_per_token(1024) == 12 * 4 * a.heads * a.head_dim * 1024
    assert mamba.attention_shape() is None


def test_pattern_and_settings_are_checked_in_one_sentence():
    cases = [
        (dict(hybrid_layer_pattern="M-X"), "unknown layer symbol"),
        (dict(hybrid_layer_pattern="M-|M*"), "pipeline stage boundaries"),
        (dict(hybrid_layer_pattern=""), "is empty"),
        (dict(hybrid_layer_pattern="M-E"), "no moe settings"),
        (dict(mlp_activation="gelu"), "mlp_activation 'gelu'"),
    ]
    for changes, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            dataclasses.replace(TINY, **changes)
    with pytest.raises(ValueError, match="no E layer"):
        dataclasses.replace(hybrid_flavors["debugmodel_moe"], hybrid_layer_pattern="M-M*")


def test_sidecar_round_trip_keeps_the_pattern_s_moe_layers():
    for flavor in ("debugmodel_moe", "debugmodel_tiny"):
        args = hybrid_flavors[flavor]
        again = HybridModelArgs.from_dict(args.to_dict())
        assert again == args
    moved = dataclasses.replace(hybrid_flavors["debugmodel_moe"], hybrid_layer_pattern="EM-M*-ME")
    assert moved.moe.layers == (0, 7)  # the MoE layers follow the pattern, not the copied settings


def test_layout_rules_are_the_family_s():
    mamba_one_group = hybrid_flavors["debugmodel_mamba2"]
    with pytest.raises(ValueError, match=r"1 Mamba-2 head groups \(mamba n_groups\) are not divisible by "
                                         "tensor_parallel_degree 2"):
        mamba_one_group.validate(dims(tp=2), seq_len=64)
    with pytest.raises(ValueError, match="4 attention heads are not divisible by tensor_parallel_degree 8"):
        TINY.validate(dims(tp=8), seq_len=64)
    with pytest.raises(ValueError, match="pieces of 2 tokens, fewer than the 3 the Mamba-2 conv reads back"):
        TINY.validate(dims(cp=4), seq_len=16)
    TINY.validate(dims(tp=2, cp=2), seq_len=64)
    # No RoPE table: any length; with RoPE the table's.
    TINY.validate(dims(), seq_len=1 << 20)
    with pytest.raises(ValueError, match="exceeds the model's RoPE table of 2048"):
        dataclasses.replace(TINY, rope_theta=10000.0).validate(dims(), seq_len=4096)


def test_config_refuses_tp_over_one_group_before_any_process_group():
    cfg = load_job_config(["--model.name", "hybrid", "--model.flavor", "debugmodel_mamba2",
                           "--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=2)
    assert str(err.value).startswith("hybrid debugmodel_mamba2: 1 Mamba-2 head groups") and "\n" not in str(err.value)


# Pipeline split by cost ---------------------------------------------------------------------------


def _max_stage(costs, layers):
    out, start = [], 0
    for n in layers:
        out.append(sum(costs[start:start + n]))
        start += n
    return max(out)


def test_balance_by_cost_is_optimal():
    rng = random.Random(0)
    for _ in range(30):
        n, stages = rng.randint(2, 9), rng.randint(1, 4)
        if stages > n:
            continue
        costs = [rng.choice([1.0, 3.0, 7.5]) for _ in range(n)]
        layers = balance_by_cost(costs, stages)
        assert sum(layers) == n and min(layers) >= 1 and len(layers) == stages
        best = min(_max_stage(costs, [b - a for a, b in zip((0, *cuts), (*cuts, n))])
                   for cuts in itertools.combinations(range(1, n), stages - 1))
        assert _max_stage(costs, layers) == best


def test_pipeline_stages_are_balanced_by_layer_cost_not_count():
    costs = TINY.layer_costs(64)  # M - M * M -: Mamba layers cost the most, MLPs the least
    assert costs[0] > costs[3] > costs[1] and costs[0] == costs[2] == costs[4]
    by_cost = plan_layout(TINY.num_layers, 2, "Interleaved1F1B", None, layer_costs=costs)
    by_count = plan_layout(TINY.num_layers, 2, "Interleaved1F1B", None)
    assert by_count.layers == (1, 2, 2, 1)
    assert by_cost.layers == (2, 1, 1, 2)
    assert _max_stage(costs, by_cost.layers) < _max_stage(costs, by_count.layers)
    # layers_per_stage, when given, wins; families without costs keep the even split.
    assert plan_layout(6, 3, "1F1B", 2, layer_costs=costs).layers == (2, 2, 2)
    assert BaseModelArgs().layer_costs(64) is None


def test_trainer_layout_uses_the_costs():
    cfg = load_job_config(["--model.name", "hybrid", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "64",
                           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                           "Interleaved1F1B"])
    assert plan_job(cfg, world_size=2).pipeline.layers == (2, 1, 1, 2)


@pytest.mark.parametrize("preset, world", [("hybrid_debug", 1), ("hybrid_nemotron_h_8b", 8),
                                           ("hybrid_nemotron_h_56b", 64), ("mamba2_2.7b", 8)])
def test_presets_parse_and_validate(preset, world):
    from conftest import REPO
    from titanlike.data import DEFAULT_TOKENIZER_PATH

    path = REPO / "train_configs" / f"{preset}.toml"
    assert path.read_text().startswith(f"# World size {world}")  # the world the preset is laid out for
    cfg = load_job_config(["--job.config_file", str(path), "--model.tokenizer_path", DEFAULT_TOKENIZER_PATH])
    layout = plan_job(cfg, world_size=world).dims
    assert cfg.model.name == "hybrid" and cfg.model.flavor in hybrid_flavors
    if preset == "hybrid_nemotron_h_56b":
        assert (layout.tp, layout.dp_shard) == (8, 8)


def test_hybrid_layer_pattern_replaces_the_flavor_s_pattern():
    from titanlike.train.plan import flavor_args

    cfg = load_job_config(["--model.name", "hybrid", "--model.flavor", "debugmodel", "--hybrid.layer_pattern",
                           "MM*-MM"])
    args = flavor_args(cfg, get_model_spec("hybrid"))
    assert args.hybrid_layer_pattern == "MM*-MM" != hybrid_flavors["debugmodel"].hybrid_layer_pattern
    assert args.n_layers == 6
    plan_job(cfg, world_size=1)
    for argv, message in (
        (["--model.name", "llama3"], "hybrid.layer_pattern 'M*E' is set, but it configures the hybrid family and "
                                     "model.name is llama3; remove it or set model.name hybrid"),
        (["--model.name", "hybrid"], "has E (mixture-of-experts) layers but the model has no moe settings"),
    ):
        bad = load_job_config([*argv, "--hybrid.layer_pattern", "M*E"])
        with pytest.raises(ConfigError, match="^[^\n]*" + re.escape(message)):
            plan_job(bad, world_size=1)


def test_model_hybrid_layer_pattern_still_loads_with_a_note():
    """The spelling before [hybrid] held it: read as hybrid.layer_pattern, with the loader's one-line note."""
    notes: list[str] = []
    cfg = load_job_config(["--model.name", "hybrid", "--model.hybrid_layer_pattern", "MM*-MM"], notes=notes)
    assert cfg.hybrid.layer_pattern == "MM*-MM"
    assert notes == ["model.hybrid_layer_pattern is deprecated (titanlike 0.1.0's spelling); read as "
                     "hybrid.layer_pattern"]
