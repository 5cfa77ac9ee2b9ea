"""training.objective grpo through train.py (issue 42): the generating companion rolls out G completions
per prompt through the engine on the policy's weights, scores them and trains the GRPO loss.

- A run is deterministic and resumes exactly without saved sampler state (seeds of (debug.seed, step,
  the microbatch's place in the global batch)); the engine's log-probabilities equal the trainer's (mismatch) within 1e-5 in fp32.
- beta > 0 builds the reference (KL 0 at the first step), num_iterations > 1 keeps the old policy's
  log-probabilities (a generated batch trains that many steps).
- Plan-time refusals, one sentence each, before any process group.
The loss itself against TRL: tests/unit/test_grpo_loss.py; learning: tests/integration/test_grpo.py."""

from __future__ import annotations

import pytest

from conftest import REPO, read_metrics, train_in_process
from grpo_assets import prompt_rows
from sft_assets import reverse_task, write_jsonl

PRESET = ["--job.config_file", str(REPO / "train_configs" / "grpo_debug.toml"), "--model.flavor", "debugmodel_tiny",
          "--metrics.log_freq", "1", "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard",
          "--grpo.reward_funcs", "grpo_assets:length_reward", "--optimizer.lr", "1e-3"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rows = prompt_rows(reverse_task(40, seed=0, words=2))
    return write_jsonl(tmp_path_factory.mktemp("grpo") / "prompts.jsonl", rows)


def _run(tmp_path, name, prompts, *extra) -> list[dict]:
    train_in_process([*PRESET, "--training.dataset_path", str(prompts), "--job.dump_folder", str(tmp_path / name),
                      *map(str, extra)])
    return read_metrics(tmp_path / name)


def test_a_run_is_deterministic_and_resumes_exactly(tmp_path, prompts):
    whole = _run(tmp_path, "whole", prompts, "--training.steps", "4")
    again = _run(tmp_path, "again", prompts, "--training.steps", "4")
    assert [r["loss"] for r in whole] == [r["loss"] for r in again]
    assert [r["reward/mean"] for r in whole] == [r["reward/mean"] for r in again]
    assert whole[-1]["grad_norm"] > 0 and whole[0]["reward/std"] > 0  # the rewards vary: real gradients
    for r in whole:
        assert r["mismatch"] < 1e-5  # the engine's log-probabilities are the trainer's
        assert 0 < r["generation_share"] < 1 and r["rollout_tokens_per_second"] > 0
        assert r["completion_length/max"] <= 8 and 0 <= r["completion_length/clipped_fraction"] <= 1
        assert "reward/grpo_assets:length_reward/mean" in r
    # Stopped after step 2, then resumed: steps 3 and 4 draw and train what the whole run did.
    _run(tmp_path, "resumed", prompts, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
         "--checkpoint.no_last_save_model_only")
    resumed = _run(tmp_path, "resumed", prompts, "--training.steps", "4", "--checkpoint.enable",
                   "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only")
    assert [(r["loss"], r["reward/mean"]) for r in resumed[-2:]] == [(r["loss"], r["reward/mean"]) for r in whole[-2:]]


@pytest.mark.parametrize("lora", [False, True], ids=["frozen_copy", "lora_adapters_off"])
def test_a_reference_and_several_iterations_per_generation(tmp_path, prompts, lora):
    """The reference is a frozen copy, or (LoRA) the policy with its adapters off: KL 0 at first either way."""
    extra = ["--model.converters", "lora", "--optimizer.lr", "1e-2"] if lora else []
    runs = _run(tmp_path, "kl", prompts, "--training.steps", "4", "--grpo.beta", "0.1", "--grpo.num_iterations", "2",
                *extra)
    assert runs[0]["kl"] == 0.0 and runs[-1]["kl"] > 0  # the frozen copy is the policy at first
    # A generated batch trains two steps: steps 1 and 2 share their rollouts (rewards), step 3 draws anew.
    assert runs[0]["reward/mean"] == runs[1]["reward/mean"]
    assert runs[0]["clip_ratio"] == 0.0  # the first step on a batch: the policy is the old policy
    assert all(r["mismatch"] < 1e-5 for r in runs)  # the old policy's, the one that generated, on every step


@pytest.mark.parametrize("old_logprobs", ["trainer", "engine"])
def test_the_engines_log_probabilities_stand_in_for_the_old_policys_forward(tmp_path, prompts, monkeypatch,
                                                                             old_logprobs):
    """num_iterations 2: the trainer's old policy is one forward per generated batch (2 steps, 1 microbatch,
    so 1 forward); old_logprobs engine skips it and trains against the engine's log-probabilities."""
    from titanlike.train.companions import Companions

    forwards = []
    run = Companions._run
    monkeypatch.setattr(Companions, "_run", lambda self, *a: forwards.append(a[0].role) or run(self, *a))
    runs = _run(tmp_path, old_logprobs, prompts, "--training.steps", "2", "--grpo.num_iterations", "2",
                "--grpo.old_logprobs", old_logprobs)
    assert forwards == ([] if old_logprobs == "engine" else ["generator"])
    assert runs[0]["reward/mean"] == runs[1]["reward/mean"] and runs[1]["grad_norm"] > 0
    assert runs[0]["clip_ratio"] == 0.0  # pi / pi_engine is 1 within 1e-5 at first: nothing clipped


def _resumed(tmp_path, name, prompts, stop: int, steps: int, *extra) -> list[dict]:
    """A run stopped after step `stop` (a checkpoint), then resumed to `steps`: the resumed steps' metrics."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(stop), "--checkpoint.no_last_save_model_only"]
    _run(tmp_path, name, prompts, "--training.steps", str(stop), *ckpt, *extra)
    return _run(tmp_path, name, prompts, "--training.steps", str(steps), *ckpt, *extra)[-(steps - stop):]


@pytest.mark.parametrize("extra,stop,lags", [
    (["--grpo.max_offpolicy_steps", "1"], 2, [0, 1, 1, 1]),
    (["--grpo.num_iterations", "2"], 1, [0, 0, 0, 0]),  # stopped inside a generation: its second step waits
    (["--grpo.max_offpolicy_steps", "2", "--grpo.num_iterations", "2"], 2, [0, 0, 2, 2]),
], ids=["ahead1", "iterations2", "ahead2_iterations2"])
def test_rollouts_in_flight_resume_exactly(tmp_path, prompts, extra, stop, lags):
    """Generation runs ahead of training (a batch first trained at step t made with the weights before
    step t - lag), its old log-probabilities the generating policy's (mismatch: the engine's against them
    within 1e-5); the batches made and not yet trained are saved, so a resumed run trains what the
    uninterrupted one did."""
    whole = _run(tmp_path, "whole", prompts, "--training.steps", "4", *extra)
    assert [r["rollout/lag"] for r in whole] == lags
    assert all(r["mismatch"] < 1e-5 for r in whole) and whole[-1]["grad_norm"] > 0
    resumed = _resumed(tmp_path, "resumed", prompts, stop, 4, *extra)
    for name in ("loss", "reward/trained_mean", "grad_norm", "rollout/lag", "mismatch"):
        assert [r[name] for r in resumed] == [r[name] for r in whole[stop:]], name
    # The rollouts' figures where the resumed run generated (a step on restored rollouts has none).
    assert [r["reward/mean"] for r in resumed if "reward/mean" in r] == [
        w["reward/mean"] for r, w in zip(resumed, whole[stop:]) if "reward/mean" in r]


DYNAMIC = ["--grpo.reward_funcs", "grpo_assets:odd_answer_length_reward", "--grpo.dynamic_sampling"]


def test_dynamic_sampling_refills_and_resumes_exactly(tmp_path, prompts):
    """Groups with equal rewards (about half: odd_answer_length_reward) are dropped and refilled from more
    prompts until the batch is full; the rounds and the dropped prompts are logged; a resumed run draws
    the same prompts (the loader's position counts the refills)."""
    whole = _run(tmp_path, "whole", prompts, "--training.steps", "3", *DYNAMIC)
    assert all(r["rollout/missing_prompts"] == 0 for r in whole)
    assert max(r["rollout/rounds"] for r in whole) > 1 and sum(r["rollout/dropped_prompts"] for r in whole) > 0
    resumed = _resumed(tmp_path, "resumed", prompts, 1, 3, *DYNAMIC)
    for name in ("loss", "reward/mean", "grad_norm", "rollout/rounds", "rollout/dropped_prompts"):
        assert [r[name] for r in resumed] == [r[name] for r in whole[1:]], name
    # At most two rounds for 8 prompts of which about half teach: a batch still short trains on the groups it
    # kept, and says how many it lacks.
    bound = _run(tmp_path, "bound", prompts, "--training.steps", "1", "--training.local_batch_size", "8", *DYNAMIC,
                 "--grpo.dynamic_sampling_max_rounds", "2")
    assert bound[0]["rollout/rounds"] == 2 and bound[0]["rollout/missing_prompts"] > 0 and bound[0]["grad_norm"] > 0


@pytest.mark.parametrize("extra,words", [
    (["--grpo.num_generations", "1"], "grpo.num_generations must be at least 2"),
    (["--parallelism.pipeline_parallel_degree", "2"], "which pipeline parallelism splits over stages"),
    (["--grpo.reward_funcs", "exact_answer"], "reward exact_answer needs the dataset column 'answer'"),
    (["--training.seq_len", "12"], "less grpo.max_completion_length"),
    (["--validation.enable"], "training.objective grpo has no validation loss"),
    (["--grpo.max_offpolicy_steps", "-1"], "grpo.max_offpolicy_steps must not be negative"),
    (["--grpo.dynamic_sampling_max_rounds", "0"], "grpo.dynamic_sampling_max_rounds must be at least 1"),
    (["--grpo.reward_funcs", "no_such_module:f"], "module no_such_module does not import"),
])
def test_bad_jobs_are_one_sentence_at_plan_time(tmp_path, extra, words):
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    rows = [{"prompt": "reverse: red dog", "solution": "dog red"}] * 4
    if "exact_answer" not in extra:
        rows = [dict(r, answer="dog red") for r in rows]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    world = 2 if "--parallelism.pipeline_parallel_degree" in extra else 1
    cfg = load_job_config([*PRESET, "--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "o"),
                           *extra])
    with pytest.raises(ValueError) as e:
        plan_job(cfg, world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_generating_companion_reads_the_policy():
    from titanlike.objectives.companion import Companion, Source
    from titanlike.train.companions import rollout_seed

    with pytest.raises(ValueError, match="reads the policy"):
        Companion("generator", "x", Source.FROZEN_COPY, None, rollout=lambda plan: None)
    with pytest.raises(ValueError, match="unless it generates"):
        Companion("reference", "x", Source.FROZEN_COPY, None)
    # Positions in the global batch: 2 data-parallel ranks x 2 microbatches.
    seeds = {rollout_seed(0, step, position) for step in range(3) for position in range(4)}
    assert len(seeds) == 12


def test_rollout_figures_trained_figures_and_sample_completions(tmp_path, prompts):
    """reward/mean and completion_length/* are over every completion generated, before dynamic sampling
    drops the groups whose rewards are all equal (no refill here); reward/trained_mean over the rows
    trained (per completion with loss_type grpo). A few completions with their rewards reach metrics.jsonl every
    grpo.sample_freq steps."""
    records = _run(tmp_path, "figures", prompts, "--training.steps", "3", "--training.local_batch_size", "8",
                   "--grpo.reward_funcs", "grpo_assets:length_unless_red", "--grpo.dynamic_sampling",
                   "--grpo.dynamic_sampling_max_rounds", "1", "--grpo.loss_type", "grpo", "--grpo.sample_freq", "2")
    steps, samples = [r for r in records if "loss" in r], [r for r in records if "samples" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert min(r["kept_fraction"] for r in steps) < 1  # some groups (the red prompts') were dropped
    for r in steps:
        # The dropped groups' rewards are 0: the rollout's mean is the trained rows' times the kept share.
        assert r["reward/mean"] == pytest.approx(r["kept_fraction"] * r["reward/trained_mean"], rel=1e-5)
        assert r["reward/mean"] == pytest.approx(r["reward/grpo_assets:length_unless_red/mean"])
        assert r["completion_length/trained_mean"] <= r["completion_length/max"] <= 8
    assert [r["step"] for r in samples] == [2]
    shown = samples[0]["samples"]
    assert len(shown) == 4
    for s in shown:
        assert s["prompt"].startswith("reverse: ") and isinstance(s["text"], str)
        assert s["reward"] == s["reward/grpo_assets:length_unless_red"] == pytest.approx(
            0.0 if "red" in s["prompt"] else len(s["text"]) / 10)


def test_samples_with_scores_reach_the_console_tensorboard_and_jsonl(tmp_path, caplog):
    import json
    import logging

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titanlike.observe.metrics import MetricsLogger

    metrics = MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step_per_device=64,
                            log_freq=1, is_writer=True, tb_folder=str(tmp_path / "tb"),
                            jsonl_path=str(tmp_path / "metrics.jsonl"))
    logging.getLogger("titanlike").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="titanlike"):
            metrics.log_samples(5, [("reverse: red dog", "dog red", {"reward": 1.0, "reward/exact": 1.0}),
                                    ("reverse: sun", "sun", {"reward": 0.0, "reward/exact": 0.0})])
    finally:
        logging.getLogger("titanlike").removeHandler(caplog.handler)
    metrics.close()
    assert "[0] 'reverse: red dog' -> 'dog red'  reward: 1  reward/exact: 1" in caplog.text
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {"step": 5, "samples": [
        {"prompt": "reverse: red dog", "text": "dog red", "reward": 1.0, "reward/exact": 1.0},
        {"prompt": "reverse: sun", "text": "sun", "reward": 0.0, "reward/exact": 0.0}]}
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    text = acc.Tensors("samples/0/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("**reverse: red dog**dog red") and "reward: 1" in text
def test_rollouts_in_flight_resume_on_their_data_parallel_degree():
    """A checkpoint's generations not yet trained belong to its data-parallel ranks: another degree is one
    sentence naming the way out; with nothing in flight (a finished generation) any layout resumes."""
    import torch

    from titanlike.train.companions import Generation, InFlight

    saved = InFlight(2)
    saved.generations, saved.served = [Generation(3, 4, 3, [{"inputs": torch.zeros(2, 3, dtype=torch.long)}])], 3
    with pytest.raises(ValueError, match="generated for 2 data-parallel ranks and this run has 1: .* "
                                         "--checkpoint.exclude_from_loading rollouts"):
        InFlight(1).load_state_dict(saved.state_dict())
    saved.served = 4
    fresh = InFlight(1)
    fresh.load_state_dict(saved.state_dict())
    assert fresh.generations == []
