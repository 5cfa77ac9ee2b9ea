"""Memory estimation (estimation/): the probe and its layout against every row of torchtitan's published
table, what users run as the README shows it, the command line, the planner on every family.

Estimates run the job's own step on fake tensors under a fake process group, in this process, one
block of each kind: a second or two for the tiny models, a few for 8B-405B. Against steps measured
on this machine (subprocesses and a 2-rank launch): tests/integration/test_estimation_measured.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from estimation.layout import estimate
from estimation.options import EstimateOptions, parse_estimate_args, prepare_job
from estimation.probe import probe, probe_generation, probed_layers
from estimation.estimate import run_estimate, verdict
from estimation_checks import FAMILY_PRESETS, estimate_job, preset_argv
from titanlike.config import ConfigError, load_job_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_tiny",
        "--training.seq_len", "64", "--training.local_batch_size", "4"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
GiB = 2**30


# Options and planning ---------------------------------------------------------------------------


def test_estimate_options_are_split_from_training_options():
    opts, rest = parse_estimate_args(["--job.config_file", "x.toml", "--estimate.world_size", "512",
                                      "--estimate.json", "--training.steps=3", "--estimate.device_memory_gib=80",
                                      "--estimate.device", "cpu", "--estimate.plan_ac_modes", "none,full"])
    assert rest == ["--job.config_file", "x.toml", "--training.steps=3"]
    assert opts.world_size == 512 and opts.json and opts.device_memory_gib == 80.0
    assert opts.device == "cpu" and opts.plan_ac_modes == ["none", "full"]
    with pytest.raises(ConfigError, match="did you mean 'estimate.world_size'"):
        parse_estimate_args(["--estimate.world_sise", "8"])
    with pytest.raises(ConfigError, match="must be one of"):
        parse_estimate_args(["--estimate.device", "tpu"])


@pytest.mark.parametrize("overrides, world, fragment", [
    (["--parallelism.tensor_parallel_degree", "4"], 6, "not divisible"),
    (["--parallelism.tensor_parallel_degree", "4"], 4, "key/value heads"),
    (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1"], 2, "microbatches"),
])
def test_impossible_layouts_fail_with_one_sentence(overrides, world, fragment):
    with pytest.raises(ConfigError) as e:
        prepare_job(load_job_config([*TINY, *overrides]), world)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_what_a_probe_cannot_run_is_noted_not_refused():
    prep = prepare_job(load_job_config(["--job.config_file", str(REPO / "train_configs" / "llama3_405b.toml")]), 512)
    text = " ".join(prep.notes)
    assert "float8" in text and "compile" in text and "async tensor parallel" not in text
    # compile stays on, its graphs partitioned as inductor does but run by the estimator's own backend
    assert prep.plan.parallelize.compile_blocks and prep.plan.parallelize.compile_backend == "estimate_partitioned"
    assert prep.plan.dims.pp == 8 and prep.plan.dims.tp == 8


def test_an_mx_job_is_probed_on_the_emulated_path():
    # Without a Blackwell GPU the job itself is refused; the probe runs torchao's emulated MXFP8 path (whose
    # ops have fake kernels: plain torch) and says so.
    moe = ["--job.config_file", str(REPO / "train_configs" / "qwen3_debug_moe.toml"), "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--model.converters", "mx", "--mx.grouped_mm_fqns", "experts"]
    prep = prepare_job(load_job_config(moe), 1)
    assert any(n.startswith("mx: probed with the trainer's converter on torchao's emulated MXFP8 path")
               for n in prep.notes)
    (row,) = estimate(prep.plan, probe(prep.plan, device="cpu"))
    assert row.reserved > 0


# What the probe keeps ---------------------------------------------------------------------------


def test_the_probe_keeps_one_pair_of_each_pair_of_neighbouring_kinds():
    assert probed_layers(list("AAAAAAAA")) == {("A", "A"): 1}  # away from the ends
    assert probed_layers(list("DDDMMMMT")) == {("D", "D"): 1, ("D", "M"): 2, ("M", "M"): 3, ("M", "T"): 6}
    assert probed_layers(list("EEEEDDDD")) == {("E", "E"): 1, ("E", "D"): 3, ("D", "D"): 4}
    assert probed_layers(list("AB")) == {("A", "B"): 0}


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
@pytest.mark.parametrize("layout, world", [
    (["--training.global_batch_size", "16"], 2),  # FSDP, two microbatches
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_microbatch_size", "1", *BF16], 4),
])
def test_some_blocks_lay_out_as_all_blocks_probed(layout, world, monkeypatch):
    """The windows of the probed blocks, repeated along the model, give the peak that probing every
    block gives (the debug model, 8 layers)."""
    import estimation.probe as probe_module

    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.seq_len", "128",
            "--training.local_batch_size", "4", *layout]
    some = estimate_job(*args, world=world)
    monkeypatch.setattr(probe_module, "_kept", lambda kinds, where: list(range(len(kinds))))
    every = estimate_job(*args, world=world)
    for a, b in zip(some, every):
        assert abs(a.peak_bytes - b.peak_bytes) <= 0.01 * b.peak_bytes, (a.pp_rank, a.peak_bytes, b.peak_bytes)


# Against torchtitan's published figures (scripts/published_memory.py holds every row) ---------------


sys.path.insert(0, str(REPO / "scripts"))
from published_memory import ROWS, long_context_flavors  # noqa: E402

_ROW_ESTIMATES: dict = {}


def _row_estimate(gpus: int, argv: list[str]):
    """The busiest rank's estimate of a row; rows whose prepared plans are equal (a row and its compile
    or async-TP variant, which the probe runs in eager / as plain TP) are probed once."""
    with long_context_flavors():
        prep = prepare_job(load_job_config(argv), gpus)
        key = (gpus, repr(prep.plan.cfg))
        if key not in _ROW_ESTIMATES:
            _ROW_ESTIMATES[key] = max(estimate(prep.plan, probe(prep.plan)), key=lambda r: r.reserved)
    return _ROW_ESTIMATES[key]


# Slow though it starts no process: the rows probe 8B-405B models at up to 262k tokens, about 70 s on one
# core, a third of what the fast lane would take with them.
@pytest.mark.slow
@pytest.mark.parametrize("published, gpus, argv", [pytest.param(*row[2:], id=f"{row[0]} {row[1]}") for row in ROWS])
def test_published_torchtitan_memory_within_25_percent(published, gpus, argv):
    """What the caching allocator reserves, by the estimate, against torchtitan's published H100 figure
    for every row of its table (nothing fitted to these rows; docs/performance.md has the table)."""
    top = _row_estimate(gpus, argv)
    assert abs(top.reserved / GiB - published) <= 0.25 * published, (top.reserved / GiB, published)
    assert top.peak_bytes < top.reserved


def test_rows_beyond_the_models_context_are_refused_in_one_sentence():
    (argv,) = [row[4] for row in ROWS if row[1] == "FSDP 1, CP 8, seq 262144" and row[3] == 8]
    argv = [a for a in argv if "_ctx" not in a and a != "--model.flavor"]  # the 8B flavor itself
    with pytest.raises(ConfigError, match="exceeds the model's context of 131072 positions"):
        prepare_job(load_job_config(argv), 8)


# What users run as the README shows it (issue 32) --------------------------------------------------


@pytest.mark.parametrize("preset, world", [("qwen3_30b_a3b", 8), ("deepseek_v3_671b", 256)])
def test_moe_presets_plan_on_the_smallest_world_their_degrees_allow(preset, world):
    """No --estimate.world_size: dp_shard -1 takes the fewest shards expert parallelism allows."""
    assert prepare_job(load_job_config(preset_argv(preset))).plan.dims.world_size == world


def test_a_real_flavor_without_a_tokenizer_keeps_its_own_vocabulary_and_says_so():
    """torchtitan's llama3_8b.toml with hf_assets_path cleared: the 8B flavor's 128,256-token vocabulary,
    not the debug tokenizer's 2,048 (a 7.0B model), in one note; debug presets keep the debug tokenizer."""
    argv = ["--job.config_file", str(REPO / "tests" / "fixtures" / "torchtitan" / "llama3_8b_v0.2.2.toml")]
    as_written = prepare_job(load_job_config(argv), 8)  # its hf_assets_path is a folder this machine lacks
    assert as_written.plan.model_args.vocab_size == 128256
    assert any("model.hf_assets_path ./assets/hf/Llama-3.1-8B not found here" in n for n in as_written.notes)
    prep = prepare_job(load_job_config([*argv, "--model.hf_assets_path", ""]), 8)
    assert prep.plan.model_args.vocab_size == 128256 and round(prep.plan.model_args.num_params() / 1e9, 2) == 8.03
    said = [n for n in prep.notes if "debug tokenizer" in n]
    assert len(said) == 1 and "128,256" in said[0] and "7.00B" in said[0] and "\n" not in said[0]
    debug = prepare_job(load_job_config(preset_argv("debug_model")), 1)
    assert debug.plan.model_args.vocab_size == 2048 and not any("tokenizer" in n for n in debug.notes)


# Mixture of experts ------------------------------------------------------------------------------


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_expert_parallel_probe_assumes_balanced_routing():
    """Routing sizes tensors from values fake tensors lack: the probe answers as balanced routing would
    (a top-k picks round-robin, so every expert gets tokens x top_k / experts rows), and under EP 2 each
    rank gathers only its own experts' weights."""
    import torch

    from estimation.fake import AssumedValues, fake_mode

    with fake_mode(), AssumedValues():
        chosen = torch.empty(12, 8).topk(2).indices  # 12 tokens, top 2 of 8 experts
        counts = torch.bincount(chosen.reshape(-1), minlength=8)
        assert counts.tolist() == [3] * 8 and int(counts.sum()) == 24
        assert torch.repeat_interleave(torch.arange(8), counts).shape == (24,)
    moe = [*preset_argv("qwen3_debug_moe"), "--training.seq_len", "128", "--training.local_batch_size", "2"]
    one, two = (estimate_job(*moe, "--parallelism.expert_parallel_degree", str(ep), world=2)[0] for ep in (1, 2))
    assert two.peak_bytes < one.peak_bytes
    result = run_estimate(load_job_config([*moe, "--parallelism.expert_parallel_degree", "2"]),
                          EstimateOptions(world_size=2))
    assert any("balanced routing" in n for n in result["notes"])


# The command line and the verdict ---------------------------------------------------------------


def test_verdict_adds_the_memory_outside_the_allocator():
    opts, _ = parse_estimate_args(["--estimate.device_memory_gib", "10", "--estimate.reserved_gib", "2"])
    assert verdict(int(7.5 * GiB), opts)["fits"] and not verdict(int(8.5 * GiB), opts)["fits"]
    assert verdict(1, parse_estimate_args([])[0]) is None


def test_json_and_text_reports(capsys):
    from estimation.estimate import main
    from estimation.estimate import format_report

    assert main([*TINY, *BF16, "--estimate.world_size", "2", "--estimate.json", "--estimate.device_memory_gib", "1",
                 "--estimate.reserved_gib", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["breakdown"]["total"] == result["peak_bytes"] <= result["reserved_bytes"]
    assert result["verdict"]["fits"] and result["probe"]["probed_layers"] <= result["probe"]["layers"]
    text = format_report(result)
    assert "reserved" in text and "probed" in text and "verdict: fits" in text


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_llava_7b_estimate_counts_each_image_through_the_tower(capsys):
    """estimate.py on LLaVA-1.5-7B: one more image per sample (llava.max_images) adds its FLOPs (tower and
    projector, over the sample's tokens) and the tower's activations over its 577 positions: at least
    what each of the 23 CLIP-L blocks saves for backward in bf16 (the inputs of its 6 matmuls of width
    1024 and the MLP's two 4096-wide tensors), at most twice that (measured: 1.47x)."""
    from estimation.estimate import main
    from titanlike.models.registry import get_model_spec

    def run(images: int) -> dict:
        assert main(["--model.name", "llava", "--model.flavor", "llava-1.5-7b", "--training.seq_len", "1280",
                     "--training.local_batch_size", "1", "--training.dataset", "webdataset",
                     "--training.dataset_path", "shards.tar", "--llava.max_images", str(images),
                     "--estimate.world_size", "1", "--estimate.json"]) == 0
        return json.loads(capsys.readouterr().out)

    one, two = run(1), run(2)
    image = get_model_spec("llava").flavors["llava-1.5-7b"].image_flops()
    assert two["flops_per_token"] - one["flops_per_token"] == 2 * image // 1280 - image // 1280
    assert one["parameters"] == two["parameters"] > 6.8e9  # the tower's 0.3B included
    rise, saved = two["peak_bytes"] - one["peak_bytes"], 23 * 577 * (6 * 1024 + 2 * 4096) * 2
    assert saved <= rise <= 2 * saved, (rise, saved)


def test_cli_reports_impossible_layout_as_config_error(capsys):
    from estimation.estimate import main

    assert main([*TINY, "--estimate.world_size", "3", "--parallelism.tensor_parallel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and err.count("\n") == 1


# The planner ------------------------------------------------------------------------------------


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_planner_ranks_fitting_layouts_by_throughput():
    from estimation.plan import format_plan, run_plan

    opts, _ = parse_estimate_args(["--estimate.world_size", "4", "--estimate.device_memory_gib", "0.05",
                                   "--estimate.reserved_gib", "0", "--estimate.plan_top", "3",
                                   "--estimate.plan_probes", "8"])
    plan = run_plan(load_job_config([*TINY, *BF16]), opts)
    top = plan["top"]
    assert top and plan["counts"]["estimated"] <= 8 and plan["counts"]["candidates"] > len(top)
    speeds = [c["tokens_per_second_per_gpu"] for c in top]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c["reserved_bytes"] <= 0.05 * GiB for c in top)
    assert "--parallelism.tensor_parallel_degree" in top[0]["overrides"] and "tokens/s/GPU" in format_plan(plan)
    with pytest.raises(ConfigError, match="needs --estimate.device_memory_gib"):
        run_plan(load_job_config(TINY), parse_estimate_args(["--estimate.world_size", "4"])[0])


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_planner_plans_every_familys_debug_preset(name):
    """The planner knows no family: on 2 ranks it enumerates each debug preset's layouts, estimates the
    fastest, and the layout it prints plans again as train.py would."""
    from estimation.plan import run_plan

    opts, _ = parse_estimate_args(["--estimate.world_size", "2", "--estimate.device_memory_gib", "80",
                                   "--estimate.plan_top", "1", "--estimate.plan_probes", "1",
                                   "--estimate.plan_ac_modes", "none"])
    job = [*preset_argv(name), "--training.seq_len", "64", "--training.local_batch_size", "2"]
    plan = run_plan(load_job_config(job), opts)
    assert plan["counts"]["estimated"] == 1 and len(plan["top"]) == 1, plan["counts"]
    best = plan["top"][0]
    assert 0 < best["peak_bytes"] <= best["reserved_bytes"] and best["tokens_per_second_per_gpu"] > 0
    again = prepare_job(load_job_config([*job, *best["overrides"].split()]), 2).plan.dims
    assert (again.dp_shard, again.tp, again.cp, again.pp) == (best["dp_shard"], best["tp"], best["cp"], best["pp"])


def test_planner_searches_expert_degrees_and_lighter_end_stages():
    from estimation.plan import expert_degrees, expert_layouts, stage_splits

    assert expert_degrees(8, 4) == [1, 2, 4]
    # Expert tensor parallelism 1, or tp: ep x etp within the 8 ranks, ep within the 4 experts.
    assert expert_layouts(8, 4, 2) == [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]
    assert expert_layouts(8, 4, 1) == [(1, 1), (2, 1), (4, 1)]
    args = prepare_job(load_job_config(preset_argv("deepseek_v3_debug")), 1).plan.model_args
    assert args.total_layers > args.num_layers  # multi-token prediction rides on the last stage
    assert len(stage_splits(args, 2, "1F1B")) >= 1 and stage_splits(args, 1, None) == [None]


def test_dpo_reference_model_is_counted_as_parameters_only():
    """dpo.reference model holds a frozen copy of the policy: the estimate's parameters double (fp32,
    one process: 4 bytes a parameter, and the RoPE buffers), its gradients and optimizer state do not; the
    reference-free loss (simpo) holds none."""
    dpo = [*TINY, "--training.objective", "dpo", "--training.dataset", "text", "--training.dataset_path",
           str(REPO / "tests" / "assets" / "dpo" / "prefer_reverse.jsonl")]
    prep = prepare_job(load_job_config(dpo), 1)
    pr = probe(prep.plan, device="cpu", granularity=1)
    (with_reference,) = estimate(prep.plan, pr)
    simpo = prepare_job(load_job_config([*dpo, "--dpo.loss_type", "simpo"]), 1)
    (without,) = estimate(simpo.plan, pr)  # the same step, measured once
    numel = sum(p.numel() for p in prep.plan.spec.model_cls(prep.plan.model_args).parameters())
    assert with_reference.peak.parameters == 2 * without.peak.parameters  # the copy holds the buffers too
    assert 0 <= without.peak.parameters - 4 * numel < 0.01 * without.peak.parameters
    assert (with_reference.peak.gradients, with_reference.peak.optimizer_state) == \
        (without.peak.gradients, without.peak.optimizer_state)


def test_a_distillation_teacher_is_counted_as_parameters_and_a_forward(tmp_path):
    """distill.teacher (Objective.frozen_models) is probed as the trainer builds it: its parameter shards
    join the parameters (fp32, one process: 4 bytes a parameter, and its RoPE buffers), its gradients and
    optimizer state do not exist, and each microbatch first runs its forward; the same job without the
    teacher in the probe is the student's alone."""
    import dataclasses

    import torch

    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=1, vocab_size=2048)
    with torch.device("meta"):
        teacher = spec.model_cls(args)
    teacher.to_empty(device="cpu")
    write_dcp_model(dict(teacher.state_dict()), str(tmp_path / "teacher"),
                    {"contents": "model_only", "step": 0, "model": model_description("qwen3", args)})
    prep = prepare_job(load_job_config([*TINY, "--training.objective", "distill", "--distill.teacher",
                                        str(tmp_path / "teacher")]), 1)
    pr = probe(prep.plan, device="cpu", granularity=1)
    (with_teacher,) = estimate(prep.plan, pr)
    (other, measured), = pr.frozen
    pr.frozen = []
    (student,) = estimate(prep.plan, pr)
    numel = sum(p.numel() for p in teacher.parameters())
    extra = with_teacher.peak.parameters - student.peak.parameters
    assert 0 <= extra - 4 * numel < 0.01 * extra  # the shards and the buffers
    assert (with_teacher.peak.gradients, with_teacher.peak.optimizer_state) == \
        (student.peak.gradients, student.peak.optimizer_state)
    assert other.spec.name == "qwen3" and len(measured.kinds) == 1  # the teacher's own plan and probe
    assert with_teacher.peak_bytes > student.peak_bytes


@pytest.mark.parametrize("family,flavor", [("gemma3", "debugmodel"), ("gpt_oss", "debugmodel"),
                                           ("qwen3_next", "debugmodel_tiny")])
def test_a_generators_cache_holds_a_window_per_sliding_layer_and_a_fixed_state_per_delta_layer(family, flavor):
    """The generator's cache (the engine's own, filled on fake tensors) of issue 43's families: a sliding
    layer keeps keys and values of its window only (rolling), a full layer of seq_len tokens, a Gated
    DeltaNet layer its delta-rule state (v_heads x k_dim x v_dim, fp32) and its conv's last K-1 inputs,
    whatever seq_len; byte for byte at two lengths."""
    rows = 6
    for seq in (64, 128):
        grpo = ["--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--model.name", family,
                "--model.flavor", flavor, "--training.dataset_path",
                str(REPO / "tests" / "assets" / "grpo" / "addition.jsonl"), "--training.local_batch_size", "2",
                "--grpo.num_generations", "3", "--training.seq_len", str(seq)]
        plan = prepare_job(load_job_config(grpo), 1).plan
        a = plan.model_args
        want = 2 * rows * 8  # each row's length, twice (int64)
        for layer in range(a.n_layers):
            if getattr(a, "is_full_attention", lambda i: True)(layer):
                tokens = min(seq, a.attention_window(layer) or seq)
                want += 2 * rows * tokens * (a.n_kv_heads or a.n_heads) * a.head_dim * 4
            else:
                state = a.linear_v_heads * a.linear_k_dim * a.linear_v_dim
                want += rows * (state + (a.conv_kernel - 1) * a.conv_dim) * 4
        g, note = probe_generation(plan, sharded=False, device="cpu", granularity=1)
        assert note is None and g.rows == rows and g.cache == want, (seq, g.cache, want)


def test_a_grpo_generator_counts_its_rows_its_cache_and_the_policys_copy():
    """training.objective grpo: the step trains local_batch_size x num_generations rows, the generator's
    cache holds keys and values for as many rows of seq_len tokens (fp32: the policy's dtype), and under
    FSDP the whole copy of the policy it reads (PolicyWeights) joins the parameters; on one process it
    reads the trained module itself, no copy."""
    grpo = ["--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--model.flavor", "debugmodel_tiny",
            "--training.dataset_path", str(REPO / "tests" / "assets" / "grpo" / "addition.jsonl"),
            "--training.local_batch_size", "2", "--grpo.num_generations", "3"]
    one = prepare_job(load_job_config(grpo), 1).plan
    pr = probe(one, device="cpu", granularity=1)
    g, a = pr.generation, one.model_args
    assert pr.microbatch == 6 and g.rows == 6 and g.copy == 0
    kv_heads = a.n_kv_heads or a.n_heads
    kv = 2 * a.n_layers * 6 * 64 * kv_heads * (a.dim // a.n_heads) * 4
    assert 0 <= g.cache - kv <= 2 * 6 * 8  # and each row's length, twice (int64)
    assert g.prefill > g.cache
    (alone,) = estimate(one, pr)
    pr.generation = None
    (without,) = estimate(one, pr)
    assert alone.peak.parameters == without.peak.parameters
    assert alone.peak_bytes >= without.peak_bytes

    fsdp = prepare_job(load_job_config([*grpo, "--parallelism.data_parallel_shard_degree", "2"]), 2).plan
    pr = probe(fsdp, device="cpu", granularity=1)
    model = fsdp.spec.model_cls(fsdp.model_args)
    whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert pr.sharded and pr.generation.copy == whole
    (sharded,) = estimate(fsdp, pr)
    pr.generation = None
    (no_copy,) = estimate(fsdp, pr)
    assert sharded.peak.parameters == no_copy.peak.parameters + whole
