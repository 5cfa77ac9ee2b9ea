"""Companions (objectives/companion.py, train/companions.py): an objective declares the models it runs
beside the trained one and the trainer builds and runs them.

The test-only toy family (tests/toy_family.py) has a test-only objective with a frozen companion,
`toy_anchored_copy`: the copy loss plus a KL to the model as it started. It is written outside
titanlike/ and needs no change there: the trainer builds its frozen copy, runs it on every microbatch
and hands its log-probabilities to the loss by name."""

from __future__ import annotations

import pytest

from conftest import read_metrics, train_in_process
from titanlike.objectives.base import Objective
from titanlike.objectives.companion import Companion, Source

TOY = ["--model.name", "toy", "--model.flavor", "tiny", "--training.seq_len", "64", "--training.steps", "3",
       "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2",
       "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--metrics.enable_jsonl",
       "--metrics.no_enable_tensorboard", "--checkpoint.no_enable"]


def test_an_objective_with_a_frozen_companion_trains_without_touching_the_library(tmp_path):
    train_in_process([*TOY, "--job.dump_folder", str(tmp_path / "copy")])
    train_in_process([*TOY, "--job.dump_folder", str(tmp_path / "anchored"), "--training.objective",
                      "toy_anchored_copy", "--toy_anchor.weight", "2"])
    plain, anchored = ([r for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("copy", "anchored"))
    # Step 1: the frozen copy is the model, so the KL is 0 and the loss the copy task's alone.
    assert anchored[0]["anchor_kl"] == 0.0
    assert anchored[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-6)
    assert anchored[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=1e-5)
    # Later the model moves away from its frozen copy: the KL is positive and pulls the run elsewhere.
    assert anchored[-1]["anchor_kl"] > 1e-6
    assert abs(anchored[-1]["loss"] - plain[-1]["loss"]) > 1e-5


def test_the_objective_base_keeps_a_small_public_surface():
    """What generic code may use of an objective (issue 41: at most 12 public members)."""
    public = sorted(n for n in dir(Objective) if not n.startswith("_"))
    assert public == ["attention_mask", "companions", "generation", "loss", "model_args", "name", "prepare",
                      "reported_terms", "sample_fields", "samples", "validate", "vocab_parallel_loss"]


def test_a_companion_names_its_checkpoint_exactly_when_it_reads_one():
    def outputs(output, targets):
        return {}

    assert "another checkpoint" not in Companion("ref", "x", Source.FROZEN_COPY, outputs).describe()
    assert Companion("teacher", "x", Source.CHECKPOINT, outputs, path="/t").describe() == "teacher: /t"
    with pytest.raises(ValueError, match="path exactly when"):
        Companion("teacher", "x", Source.CHECKPOINT, outputs)
    with pytest.raises(ValueError, match="path exactly when"):
        Companion("ref", "x", Source.POLICY, outputs, path="/t")


def test_companions_need_a_schedule_with_a_forward_only_pass():
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    cfg = load_job_config([*TOY, "--training.objective", "toy_anchored_copy", "--parallelism.pipeline_parallel_degree",
                           "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                           "--training.local_batch_size", "8"])
    with pytest.raises(ValueError, match="training.objective toy_anchored_copy needs a forward-only pass, which the "
                                         "ZBVZeroBubble"):
        plan_job(cfg, 2)
