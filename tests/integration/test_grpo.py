"""GRPO learns (issue 42, item 5): a model made by the pre-train -> SFT chain (tests/integration/test_sft.py's
first steps) answers the reverse-words task on held-out questions better after GRPO through train.py,
with an exact-match reward written as a user writes one (tests/grpo_assets.py exact_text), for
loss_type grpo and for dapo."""

from __future__ import annotations

import time

import pytest

from conftest import REPO, read_metrics, train_in_process
from grpo_assets import prompt_rows
from sft_assets import exact_match, reverse_task, write_jsonl

GRPO = ["--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--metrics.no_enable_tensorboard",
        "--metrics.enable_jsonl", "--metrics.log_freq", "10", "--grpo.reward_funcs", "grpo_assets:exact_text",
        "--grpo.num_generations", "8", "--training.local_batch_size", "8", "--grpo.temperature", "1.0",
        "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "10", "--checkpoint.enable",
        "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only"]
# Measured on a shared 2-core machine (CPU seconds of the training process, one thread), same 60 held-out
# questions. The SFT model's accuracy rises steeply with its steps (60: 20%, 65: 48%, 70: 80%, 90: 100%);
# from the 60-step model (20%) the former recipe (constant lr 3e-4, no warm-up) reached 35% with grpo in
# 80 steps (109 s) and a warm-up + cosine decay at 5e-4 only 27%: few groups hold a right answer, and Adam
# amplifies the noise of the rest. From the 65-step model (48%), more groups differ: without a warm-up
# dapo fell to 35% after 20 steps and ended at 58%, grpo at 85%; with a 10-step warm-up to a constant
# 3e-4 (this recipe), 80 steps (about 115 s each):
#   grpo  debug.seed 0: 48% -> 88%, seed 1: 48% -> 95%      dapo  seed 0: 48% -> 88%, seed 1: 48% -> 85%
# and with the sampler drawing one uniform number per row (inference/sampling.py draw, another stream of
# samples from the same distributions), seed 0: grpo 48% -> 92%, dapo 48% -> 87%
# (after 60 steps 52-83%: too early to hold 20 points; 16 prompts per step for 40 steps matched 80 steps
# of 8 in the same time: dapo 48% -> 87%).
# Another stream of samples is another outcome: with the engine's linear layers through oneDNN (sums in
# another order, so a few samples differ and the run diverges from there) seed 0 at temperature 0.7 gave
# dapo 48% -> 60%, and seed 1 without them grpo 58%, dapo 67%; 20 runs (2026-11-29, seeds 0-2, lr 1e-4 to
# 5e-4, 16 prompts x 40 steps, 120 steps) spread from +10 to +45 points, so one seed's rise is no
# margin. At temperature 1.0 (TRL's default; more groups hold both right and wrong answers):
#   grpo  seed 0: 48% -> 87%, seed 1: 73%      dapo  seed 0: 92%, seed 1: 93%, seed 2: 63%
# (lr 1e-4 as well: grpo seed 1 65%, dapo seed 2 83%). The smallest rise at temperature 1.0, 15 points, is
# what this test asks less a margin of 3 (8 more of the 60 held-out answers right), with the sampled
# reward rising too. With the policy's logits computed at the completion tokens only (2026-11-30, another
# summation order in the output projection, so another stream of samples): grpo 48% -> 85%, dapo 48% -> 88%.
SFT_STEPS = 65
GRPO_STEPS = 80
RISE = 0.12


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """The debug model pre-trained 20 steps on the embedded corpus, then fine-tuned SFT_STEPS steps on
    the reverse task (sft_debug.toml): about half of the held-out answers right."""
    tmp = tmp_path_factory.mktemp("chain")
    train_in_process(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                      "--metrics.no_enable_tensorboard", "--training.steps", "20", "--training.seq_len", "128",
                      "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2",
                      "--job.dump_folder", str(tmp / "pre")])
    train_in_process(["--job.config_file", str(REPO / "train_configs" / "sft_debug.toml"),
                      "--metrics.no_enable_tensorboard", "--job.dump_folder", str(tmp / "sft"),
                      "--checkpoint.initial_load_path", str(tmp / "pre" / "checkpoint" / "step-20"),
                      "--training.steps", str(SFT_STEPS), "--checkpoint.last_save_model_only"])
    return tmp / "sft" / "checkpoint" / f"step-{SFT_STEPS}"


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_raises_the_held_out_accuracy_of_an_sft_model(loss_type, sft_model, tmp_path, monkeypatch):
    import titanlike
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.chat_template import load_chat_template

    monkeypatch.chdir(REPO)
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    template = load_chat_template("auto", tokenizer)
    held_out = reverse_task(60, seed=1, words=2)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(reverse_task(1000, seed=2, words=2)))
    before = exact_match(titanlike.load_model(sft_model), tokenizer, template, held_out)
    started = time.perf_counter()
    train_in_process([*GRPO, "--job.dump_folder", str(tmp_path / "grpo"), "--grpo.loss_type", loss_type,
                      "--checkpoint.initial_load_path", str(sft_model), "--training.dataset_path", str(prompts),
                      "--training.steps", str(GRPO_STEPS)])
    seconds = time.perf_counter() - started
    after = exact_match(titanlike.load_model(tmp_path / "grpo" / "checkpoint" / f"step-{GRPO_STEPS}"), tokenizer,
                        template, held_out)
    lines = read_metrics(tmp_path / "grpo")
    records = [r for r in lines if "loss" in r]
    # A few completions with their rewards every grpo.sample_freq steps (default 10).
    assert [r["step"] for r in lines if "samples" in r] == list(range(10, GRPO_STEPS + 1, 10))
    rewards = [round(r["reward/grpo_assets:exact_text/mean"], 2) for r in records]
    figures = (f"GRPO ({loss_type}) held-out greedy exact match {before:.0%} -> {after:.0%} in {GRPO_STEPS} steps "
               f"({seconds:.0f} s); sampled rewards every 10 steps {rewards}; completion length "
               f"{records[0]['completion_length/mean']:.1f} -> {records[-1]['completion_length/mean']:.1f}")
    print(figures)
    assert all(r["mismatch"] < 1e-5 for r in records), figures
    assert after >= before + RISE, figures
    assert sum(rewards[-3:]) > sum(rewards[:3]), figures  # the sampled reward rose as well
