"""GPT-2 family: sizes, FLOPs, positions, initialization, pipeline split and its config rules.

The family is new files only (titanlike/models/gpt2/); these tests reach it through the registry
and train.py like any user would.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import REPO
from family_checks import check_stages_initialized_as_full, held_params, init_pipeline_stages, materialize, run_stages
from titanlike.models.common import sharding
from titanlike.models.gpt2 import GPT2, GPT2Args, gpt2_flavors
from titanlike.models.registry import get_model_spec, model_names
from titanlike.parallel.pipeline import plan_layout

SPEC = get_model_spec("gpt2")


def tiny_args(**overrides) -> GPT2Args:
    return dataclasses.replace(gpt2_flavors["debugmodel"], **{"dim": 64, "n_heads": 4, "vocab_size": 320,
                                                              "max_seq_len": 48, **overrides})


def build(args, seed=0) -> GPT2:
    return materialize(GPT2, args, seed)


# ---------------------------------------------------------------- registry, sizes, FLOPs


def test_registered_by_its_folder_alone():
    assert "gpt2" in model_names()
    assert SPEC.model_cls is GPT2 and SPEC.hf.model_types == ("gpt2",)
    assert {"debugmodel", "124M", "355M", "774M", "1.5B", "175B"} <= set(SPEC.flavors)
    assert SPEC.shard.top["pos_embeddings"] is sharding.position_embedding
    assert SPEC.shard.block["feed_forward.w1"] is sharding.colwise and "feed_forward.w3" not in SPEC.shard.block
    assert SPEC.pipeline_ends.inputs == ("tok_embeddings", "pos_embeddings")
    assert all(a.tie_word_embeddings for a in gpt2_flavors.values())


@pytest.mark.parametrize("flavor", sorted(gpt2_flavors))
def test_num_params_counts_the_meta_model(flavor):
    args = gpt2_flavors[flavor]
    with torch.device("meta"):
        model = GPT2(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert args.num_params() == held_params(model)
    # Without embeddings: the position table goes, the tied table (the output projection) stays.
    assert args.num_params(exclude_embedding=True) == held_params(model) - model.pos_embeddings.weight.numel()
    block = model.layers["0"]
    assert block.attention.wq.bias is not None and block.feed_forward.w2.bias is not None
    assert block.feed_forward.w1.weight.shape == (4 * args.dim, args.dim)
    assert model.output.bias is None and model.pos_embeddings.weight.shape == (args.max_seq_len, args.dim)


def test_untied_variant_counts_both_tables():
    args = tiny_args(tie_word_embeddings=False)
    model = build(args)
    assert model.output.weight is not model.tok_embeddings.weight
    assert args.num_params() == held_params(model)
    table = args.vocab_size * args.dim
    assert args.num_params(exclude_embedding=True) == held_params(model) - table - args.max_seq_len * args.dim
    # A reward model's score head (one row) in place of the output projection.
    scored = args.with_score_head()
    model = build(scored)
    assert model.output.weight.shape == (1, args.dim) and scored.num_params() == held_params(model)


def test_published_sizes():
    # GPT-2 small as published / as transformers counts GPT2LMHeadModel (tied lm_head once).
    assert gpt2_flavors["124M"].num_params() == 124_439_808
    sizes = {name: gpt2_flavors[name].num_params() / 1e6 for name in ("355M", "774M", "1.5B")}
    assert sizes == pytest.approx({"355M": 354.8, "774M": 774.0, "1.5B": 1557.6}, abs=0.1)
    assert gpt2_flavors["175B"].num_params() / 1e9 == pytest.approx(174.6, abs=0.05)
    for name, (dim, layers, heads, ctx) in {"124M": (768, 12, 12, 1024), "355M": (1024, 24, 16, 1024),
                                            "774M": (1280, 36, 20, 1024), "1.5B": (1600, 48, 25, 1024),
                                            "175B": (12288, 96, 96, 2048)}.items():
        a = gpt2_flavors[name]
        assert (a.dim, a.n_layers, a.n_heads, a.max_seq_len, a.vocab_size) == (dim, layers, heads, ctx, 50257)


def test_flops_per_token():
    a = gpt2_flavors["124M"]
    n = a.num_params(exclude_embedding=True)
    assert n == 124_439_808 - 1024 * 768
    assert a.flops_per_token(1024) == 6 * n + 12 * 12 * 12 * 64 * 1024
    assert a.attention_shape().kv_heads == a.n_heads == 12


def test_update_from_config_keeps_the_context():
    a = gpt2_flavors["debugmodel"].update_from_config(vocab_size=777, seq_len=64)
    assert (a.vocab_size, a.max_seq_len, a.context_len) == (777, 1024, 1024)
    with pytest.raises(ValueError, match="no grouped-query attention"):
        tiny_args(n_kv_heads=2)


# ---------------------------------------------------------------- positions and initialization


def test_positions_none_1d_and_per_sample():
    torch.manual_seed(0)
    model = build(tiny_args(), seed=1)
    tokens = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        base = model(tokens)
        torch.testing.assert_close(model(tokens, positions=torch.arange(12)), base, rtol=0, atol=0)
        torch.testing.assert_close(model(tokens, positions=torch.arange(12).expand(2, 12)), base, rtol=0, atol=0)
        # Positions are the learned table's rows: an offset slice (context parallel) or per-sample
        # restarts (document masking) give the same tokens other embeddings.
        shifted = model.embed(tokens, torch.arange(5, 17))
        want = model.tok_embeddings(tokens) + model.pos_embeddings.weight[5:17]
        torch.testing.assert_close(shifted, want, rtol=0, atol=0)
        per_sample = torch.stack([torch.arange(12), torch.arange(12) % 4])
        got = model.embed(tokens, per_sample)
        for row in range(2):
            want = model.tok_embeddings(tokens[row]) + model.pos_embeddings.weight[per_sample[row]]
            torch.testing.assert_close(got[row], want, rtol=0, atol=0)


def test_init_is_gpt2s():
    args = tiny_args(n_layers=6, dim=256, n_heads=8, vocab_size=2048, max_seq_len=1024)
    model = build(args, seed=0)
    out_std = 0.02 / math.sqrt(2 * args.n_layers)
    block = model.layers["3"]
    for name, std in [("tok_embeddings", 0.02), ("pos_embeddings", 0.02)]:
        assert getattr(model, name).weight.std().item() == pytest.approx(std, rel=0.02), name
    for linear, std in [(block.attention.wq, 0.02), (block.feed_forward.w1, 0.02),
                        (block.attention.wo, out_std), (block.feed_forward.w2, out_std)]:
        assert linear.weight.std().item() == pytest.approx(std, rel=0.03)
        assert torch.count_nonzero(linear.bias) == 0
    # A plain normal (Megatron, GPT-2), not one truncated at +-2 std.
    assert model.tok_embeddings.weight.abs().max() > 2.5 * 0.02
    for norm in (block.attention_norm, block.ffn_norm, model.norm):
        assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
    assert model.output.weight is model.tok_embeddings.weight
    # GPT-3 175B draws with Megatron's 0.006.
    assert gpt2_flavors["175B"].init_std == 0.006


# ---------------------------------------------------------------- pipeline split


def test_pipeline_stages_compose_to_the_full_model():
    full_args = tiny_args()  # 4 layers
    with torch.device("meta"):
        full = GPT2(full_args)
    layout = plan_layout(4, 2, "Interleaved1F1B", None)  # 4 one-layer stages, looped
    parts = init_pipeline_stages(full, SPEC, layout, seed=3)
    first, last = parts[0], parts[layout.num_stages - 1]
    assert first.pos_embeddings is not None and first.output is None
    assert last.tok_embeddings is None and last.pos_embeddings is None
    # The last stage holds the tied table as output.weight, drawn as tok_embeddings.weight.
    assert set(dict(last.named_parameters())) >= {"output.weight", "norm.weight", "norm.bias"}
    assert all(p.pos_embeddings is None for s, p in parts.items() if s)
    torch.testing.assert_close(last.output.weight, first.tok_embeddings.weight, rtol=0, atol=0)
    check_stages_initialized_as_full(parts, full, seed=3)
    tokens = torch.randint(0, full_args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.arange(16), torch.arange(16) % 5])
    for pos in (None, positions):
        h = run_stages(parts, tokens, positions=pos)  # only the first stage reads the positions
        with torch.no_grad():
            torch.testing.assert_close(h, full(tokens, positions=pos), rtol=0, atol=0)


# ---------------------------------------------------------------- config rules through train.py


def run_train(argv, world, monkeypatch):
    """train.py argv in the test process (conftest.train_here) as a rank of a world of `world` sees it:
    the refusals come before any process group exists."""
    from conftest import train_here

    monkeypatch.setenv("WORLD_SIZE", str(world))
    return train_here(argv)


@pytest.mark.parametrize("argv, world, fragment", [
    (["--model.flavor", "1.5B", "--parallelism.tensor_parallel_degree", "2"], 2,
     "gpt2 1.5B: 25 attention heads are not divisible by tensor_parallel_degree 2"),
    (["--model.flavor", "debugmodel", "--training.seq_len", "2048"], 1,
     "gpt2 debugmodel: training.seq_len 2048 exceeds the model's context of 1024 positions"),
])
def test_family_rules_refuse_with_one_sentence(argv, world, fragment, monkeypatch):
    proc = run_train(["--model.name", "gpt2", *argv], world, monkeypatch)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and line.startswith("config error")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert "set training.seq_len to at most 1024" in lines[0] or "tensor_parallel" in lines[0]


def test_family_rules_accept_valid_layouts():
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    # 25 heads split over 5 ranks (sequence parallelism also needs seq_len divisible by 5).
    cfg = load_job_config(["--model.name", "gpt2", "--model.flavor", "1.5B", "--training.seq_len", "1000",
                           "--parallelism.tensor_parallel_degree", "5"])
    assert plan_job(cfg, world_size=5).dims.tp == 5


@pytest.mark.parametrize("preset", ["gpt2_debug", "gpt2_124m", "gpt3_175b"])
def test_presets_parse_and_validate(preset):
    from titanlike.config import load_job_config
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.train.plan import plan_job

    cfg = load_job_config(["--job.config_file", str(REPO / "train_configs" / f"{preset}.toml"),
                           "--model.tokenizer_path", DEFAULT_TOKENIZER_PATH])
    assert cfg.model.name == "gpt2"
    world = {"gpt2_debug": 1, "gpt2_124m": 8, "gpt3_175b": 1024}[preset]
    dims = plan_job(cfg, world_size=world).dims
    if preset == "gpt3_175b":
        assert (dims.tp, dims.pp, dims.dp_degree) == (8, 16, 8)
        assert (cfg.training.seq_len, cfg.training.global_batch_size, cfg.optimizer.lr) == (2048, 1536, 0.6e-4)
        assert cfg.lr_scheduler.decay_type == "cosine"
