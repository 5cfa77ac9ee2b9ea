"""DPO through train.py (one process, in this one): the debug preset learns its synthetic preference
(held-out pairs: the model's own preference, log pi(chosen) > log pi(rejected), before and after,
and the implicit reward accuracy against the reference), and the LoRA variant whose reference is the
policy with its adapters off runs and learns too."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from conftest import REPO, TINY_JOB, read_metrics, train_in_process
from preference_assets import reverse_preferences

PRESET = ["--job.config_file", str(REPO / "train_configs" / "dpo_debug.toml"), "--metrics.no_enable_tensorboard"]


def preference_accuracy(policy, reference, rows) -> tuple[float, float]:
    """(the fraction of pairs whose chosen answer `policy` finds more likely, the fraction whose
    implicit DPO reward against `reference` is higher for the chosen answer) over `rows`."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.preferences import PreferenceSamples, tokenize_pairs
    from titanlike.models.outputs import logits_of
    from titanlike.objectives.base import BatchContext
    from titanlike.objectives.preference import DPO, token_logps

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    pairs = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(rows)], load_chat_template("auto", tokenizer),
                           tokenizer, seq_len=64)
    samples = PreferenceSamples(pairs, seq_len=64, packing=True, pad_id=tokenizer.eos_id)
    batch = {k: torch.as_tensor(np.stack([samples[i][k] for i in range(len(samples))])) for k in samples.fields}
    objective = DPO()
    ctx = BatchContext(torch.device("cpu"), mask_kernel="sdpa")
    mb = objective.prepare(batch, ctx)
    pairs_n = mb.units
    assert int(pairs_n) == len(rows)
    with torch.no_grad():
        logits = logits_of(policy(mb.inputs, **mb.forward_kwargs()))
        # reference 0: rewards are beta x the answers' log-probabilities
        own = objective.loss(logits, mb.targets, ctx).reported[3] / pairs_n
        ref = token_logps(logits_of(reference(mb.inputs, **mb.forward_kwargs())), mb.targets["labels"])
        implicit = objective.loss(logits, mb.targets | {"ref_logps": ref}, ctx).reported[3] / pairs_n
    return float(own), float(implicit)


def test_dpo_preset_learns_the_preference(tmp_path):
    import titanlike

    started = time.perf_counter()
    train_in_process([*PRESET, "--job.dump_folder", str(tmp_path / "seed"), "--checkpoint.create_seed_checkpoint"])
    train_in_process([*PRESET, "--job.dump_folder", str(tmp_path / "dpo"), "--metrics.enable_jsonl",
                      "--validation.enable", "--validation.freq", "8", "--training.split", "90,10"])
    records = read_metrics(tmp_path / "dpo")
    metrics = [r for r in records if "loss" in r]
    validation = [r for r in records if "validation_loss" in r]
    first, last = metrics[0], metrics[-1]
    # Validation on the held-out 10% of the pairs: loss per pair, preference accuracy of the rewards.
    assert [r["validation_tokens"] for r in validation] == [48, 48], validation  # 6 full batches of 8 pairs
    assert validation[-1]["validation_loss"] < validation[0]["validation_loss"] < math.log(2)
    assert validation[-1]["validation_accuracy"] > 0.9, validation
    # Step 1: the policy is its reference (every reward 0, the loss log 2).
    assert abs(first["loss"] - math.log(2)) < 1e-5 and first["reward_margin"] == 0.0
    assert last["loss"] < 0.55 and last["reward_margin"] > 0.2 and last["reward_accuracy"] > 0.9, last

    held_out = reverse_preferences(64, seed=1)
    initial = titanlike.load_model(tmp_path / "seed" / "checkpoint")
    trained = titanlike.load_model(tmp_path / "dpo" / "checkpoint" / "step-16")
    before, _ = preference_accuracy(initial, initial, held_out)
    after, implicit = preference_accuracy(trained, initial, held_out)
    figures = (f"held-out preference accuracy {before:.0%} before, {after:.0%} after, implicit reward accuracy "
               f"{implicit:.0%}; training loss {first['loss']:.3f} -> {last['loss']:.3f} "
               f"({time.perf_counter() - started:.0f} s)")
    assert before < 0.5 and after > before + 0.3 and implicit > 0.9, figures
    print(figures)


def test_dpo_with_lora_adapters_as_reference(tmp_path):
    """dpo.reference adapters: the reference is the policy with its adapters off, so step 1 is
    exactly log 2 and the rewards move only through the adapters."""
    train_in_process([*PRESET, "--job.dump_folder", str(tmp_path / "lora"), "--model.converters", "lora",
                      "--dpo.reference", "adapters", "--optimizer.lr", "1e-2", "--training.steps", "8",
                      "--metrics.log_freq", "1", "--checkpoint.no_enable"])
    metrics = read_metrics(tmp_path / "lora")
    assert abs(metrics[0]["loss"] - math.log(2)) < 1e-5
    assert metrics[-1]["loss"] < 0.6 and metrics[-1]["reward_margin"] > 0, metrics[-1]


DATA = str(REPO / "tests" / "assets" / "dpo" / "prefer_reverse.jsonl")
DPO_JOB = ("--training.objective", "dpo", "--training.dataset", "text", "--training.dataset_path", DATA,
           "--model.flavor", "debugmodel_tiny", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1",
           "--training.local_batch_size", "4", "--training.global_batch_size", "8")
VALIDATED = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "2", "--training.split", "90,10")
LAYOUTS = {"fsdp": (), "tp": ("--parallelism.tensor_parallel_degree", "2"),
           "pp": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"),
           "cp": ("--parallelism.context_parallel_degree", "2")}
HSDP = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--training.local_batch_size", "2")


@pytest.mark.distributed
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, name="one")
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, *LAYOUTS["fsdp"], name="fsdp", nproc=2)
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, *LAYOUTS["tp"], name="tp", nproc=2)
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, *LAYOUTS["pp"], name="pp", nproc=2)
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, *LAYOUTS["cp"], name="cp", nproc=2)
@pytest.mark.train_run(*DPO_JOB, *VALIDATED, *HSDP, name="hsdp", nproc=4)
def test_dpo_layouts_match_one_process(train_runs):
    """DPO with its frozen reference (a copy sharded like the policy): FSDP2, HSDP 2x2, TP2 (log-probabilities
    from vocabulary-parallel logits, never gathered), PP2 (the reference through a forward-only
    schedule of its own stages) and CP2 (each pair's sums completed over the cp ranks) equal one
    process step by step, loss (per pair), gradient norm and rewards, and so does validation (loss per
    held-out pair and the preference accuracy of the rewards)."""
    keys = ("loss", "grad_norm", "reward_margin", "rewards_chosen")
    checks = ("validation_loss", "validation_accuracy", "validation_tokens")

    def table(name):
        records = train_runs[name].metrics
        return ([[r[k] for k in keys] for r in records if "loss" in r],
                [[r[k] for k in checks] for r in records if "validation_loss" in r])

    one, one_validation = table("one")
    assert len(one) == 4 and one[-1][0] < one[0][0] and one[-1][2] > 0  # it learns
    assert len(one_validation) == 2 and one_validation[0][2] == 8
    for name in (*LAYOUTS, "hsdp"):
        got, validation = table(name)
        # Validation batches are per data-parallel rank: FSDP2 and HSDP read more pairs than the others.
        data_parallel = name in ("fsdp", "hsdp")
        compared = one + (one_validation if not data_parallel else [])
        for want, have in zip(compared, got + (validation if not data_parallel else [])):
            assert have == pytest.approx(want, abs=5e-5, rel=1e-4), name
        assert len(got) == 4 and len(validation) == 2, name


def test_dpo_resumes_exactly_with_its_reference(tmp_path):
    """Stopped after step 2 of 4 and resumed, the run gives the uninterrupted run's steps 3 and 4 bit
    for bit: the frozen reference is rebuilt as the run started (here from checkpoint.initial_load_path,
    a model of another seed, which the resumed run's own initialization is not)."""
    import shutil

    from conftest import train_metrics

    train_metrics(tmp_path, "start", "--debug.seed", "7", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                  "--model.flavor", "debugmodel_tiny")
    job = [*DPO_JOB, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only",
           "--checkpoint.initial_load_path", str(tmp_path / "start" / "checkpoint" / "step-0")]
    whole = train_metrics(tmp_path, "whole", *job)
    shutil.rmtree(tmp_path / "whole" / "checkpoint" / "step-4")
    (tmp_path / "whole" / "metrics.jsonl").unlink()
    resumed = train_metrics(tmp_path, "whole", *job)
    assert [r["step"] for r in resumed] == [3, 4]
    keys = ("loss", "reward_margin", "rewards_chosen")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[2:]]
    assert whole[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the loaded model


ADAPTERS = (*DPO_JOB, "--model.converters", "lora", "--dpo.reference", "adapters", "--optimizer.lr", "1e-2")


@pytest.mark.distributed
@pytest.mark.train_run(*ADAPTERS, name="one")
@pytest.mark.train_run(*ADAPTERS, *LAYOUTS["pp"], name="pp", nproc=2)
def test_dpo_adapters_reference_under_pipeline_parallelism_matches_one_process(train_runs):
    """The reference as the policy's own stages with the adapters off, through a forward-only
    schedule of its own over the same modules."""
    keys = ("loss", "grad_norm", "reward_margin")
    one = [[r[k] for k in keys] for r in train_runs["one"].metrics]
    got = [[r[k] for k in keys] for r in train_runs["pp"].metrics]
    assert len(one) == 4 and one[-1][0] < one[0][0] and one[-1][2] > 0
    for want, have in zip(one, got):
        assert have == pytest.approx(want, abs=5e-5, rel=1e-4)


def test_dpo_with_precomputed_reference_equals_the_frozen_reference(tmp_path):
    """scripts/precompute_reference.py writes the reference's log-probabilities (the model the job
    starts from, each side alone) into the rows; dpo.reference precomputed then trains without a
    reference model and gives the frozen reference's run step by step (loss, grad norm, rewards).
    The start is a model of another seed, so a reference that were the job's own init would differ."""
    from conftest import train_metrics
    from titanlike.cli.precompute_reference import main

    train_metrics(tmp_path, "start", "--debug.seed", "7", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                  "--model.flavor", "debugmodel_tiny")
    pairs = tmp_path / "pairs.jsonl"  # 40 pairs: 4 steps of 8 and some left (the whole file takes ~2 minutes)
    pairs.write_text("".join(open(DATA).readlines()[:40]))
    job = [*DPO_JOB, "--training.dataset_path", str(pairs), "--checkpoint.enable", "--checkpoint.initial_load_path",
           str(tmp_path / "start" / "checkpoint" / "step-0")]
    stored = tmp_path / "with_reference.jsonl"
    assert main([str(stored), "--", *TINY_JOB, *job]) == 0
    frozen = train_metrics(tmp_path, "frozen", *job)
    precomputed = train_metrics(tmp_path, "precomputed", *job, "--training.dataset_path", str(stored),
                                "--dpo.reference", "precomputed")
    keys = ("loss", "grad_norm", "reward_margin", "rewards_chosen", "rewards_rejected")
    want, got = ([[r[k] for k in keys] for r in runs] for runs in (frozen, precomputed))
    assert len(want) == 4 and want[0][0] == pytest.approx(math.log(2), abs=1e-6) and want[-1][2] > 0
    for step, (w, g) in enumerate(zip(want, got)):
        assert g == pytest.approx(w, abs=1e-5, rel=1e-5), (step, g, w)
    # Every row records the model and tokenizer it was computed with; a job starting from another
    # checkpoint (the frozen run's own end) refuses the file at its first row, in one sentence.
    import json

    from titanlike.data import DataError
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.preferences import tokenize_pairs
    from titanlike.objectives.preference import reference_fingerprint

    rows = [json.loads(line) for line in stored.read_text().splitlines()]
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    plan = plan_job(load_job_config([*TINY_JOB, *job]), world_size=1)
    tok = plan.tokenizer
    start = reference_fingerprint(str(tmp_path / "start" / "checkpoint" / "step-0"), tok)
    assert {r["ref_fingerprint"] for r in rows} == {start}
    other = reference_fingerprint(str(tmp_path / "frozen" / "checkpoint"), tok)
    assert other != start
    template = load_chat_template(plan.objective.options.chat_template, tok)
    with pytest.raises(DataError, match="pairs.jsonl line 1: its reference log-probabilities were computed with "
                                        "another model or tokenizer") as e:
        tokenize_pairs([("pairs.jsonl line 1", rows[0])], template, tok, seq_len=512, reference=True,
                       fingerprint=other)
    assert "\n" not in str(e.value)
