"""Reward models and knowledge distillation through train.py: every layout equals one process step by
step (4 steps, pooled jobs), and a distilled student beats the same student trained without its
teacher."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, train_in_process

DATA = str(REPO / "tests" / "assets" / "dpo" / "prefer_reverse.jsonl")
STUDENT = ("--model.flavor", "debugmodel_tiny", "--model.args.n_layers", "2", "--optimizer.lr", "3e-3",
           "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "4", "--training.global_batch_size", "8")
REWARD = (*STUDENT, "--training.objective", "reward", "--training.dataset", "text", "--training.dataset_path", DATA,
          "--checkpoint.no_enable", "--validation.enable", "--validation.freq", "2", "--validation.steps", "2",
          "--training.split", "90,10")
LAYOUTS = {"fsdp": (), "tp": ("--parallelism.tensor_parallel_degree", "2"),
           "pp": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2")}


def table(run, keys):
    return [[r[k] for k in keys] for r in run.metrics if "loss" in r]


def assert_same(one, got, name):
    assert len(got) == len(one) == 4, name
    for want, have in zip(one, got):
        assert have == pytest.approx(want, abs=5e-5, rel=1e-4), name


@pytest.mark.distributed
@pytest.mark.train_run(*REWARD, name="one")
@pytest.mark.train_run(*REWARD, *LAYOUTS["fsdp"], name="fsdp", nproc=2)
@pytest.mark.train_run(*REWARD, *LAYOUTS["tp"], name="tp", nproc=2)
@pytest.mark.train_run(*REWARD, *LAYOUTS["pp"], name="pp", nproc=2)
def test_reward_model_layouts_match_one_process(train_runs):
    """The scalar head under FSDP2, TP2 (sequence parallel; the head replicated, its input gathered)
    and PP2: loss per pair, gradient norm, margin and accuracy equal one process, and so does
    validation on held-out pairs (loss per pair, preference accuracy) where the ranks read the same
    pairs (TP, PP)."""
    keys = ("loss", "grad_norm", "reward_margin", "reward_accuracy")
    checks = ("validation_loss", "validation_accuracy", "validation_tokens")
    one = table(train_runs["one"], keys)
    assert one[-1][0] < one[0][0] and one[-1][2] > one[0][2]  # it learns
    validation = [[r[k] for k in checks] for r in train_runs["one"].metrics if "validation_loss" in r]
    assert len(validation) == 2 and validation[0][2] == 8
    for name in ("fsdp", "tp", "pp"):
        assert_same(one, table(train_runs[name], keys), name)
        if name != "fsdp":  # validation batches are per data-parallel rank
            got = [[r[k] for k in checks] for r in train_runs[name].metrics if "validation_loss" in r]
            assert len(got) == 2, name
            for want, have in zip(validation, got):
                assert have == pytest.approx(want, abs=5e-5, rel=1e-4), name


# The teacher: another family (Qwen3, 2 layers of width 256) with the student's tokenizer, trained 4 steps.
TEACHER = ("--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.args.n_layers", "2",
           "--optimizer.lr", "3e-3", "--checkpoint.enable", "--checkpoint.folder", lambda root: root / "teacher")
DISTILL = (*STUDENT, "--training.objective", "distill", "--distill.teacher", lambda root: root / "teacher",
           "--distill.temperature", "2", "--distill.kl_weight", "0.5", "--checkpoint.no_enable")
TOP_K = ("--distill.top_k", "16")


@pytest.mark.distributed
@pytest.mark.train_run(*TEACHER, name="teacher")
@pytest.mark.train_run(*DISTILL, name="one", after="teacher")
@pytest.mark.train_run(*DISTILL, *TOP_K, name="one_top_k", after="teacher")
@pytest.mark.train_run(*DISTILL, *LAYOUTS["fsdp"], name="fsdp", nproc=2, after="teacher")
@pytest.mark.train_run(*DISTILL, *LAYOUTS["tp"], name="tp", nproc=2, after="teacher")
@pytest.mark.train_run(*DISTILL, *LAYOUTS["tp"], *TOP_K, name="tp_top_k", nproc=2, after="teacher")
@pytest.mark.train_run(*DISTILL, *LAYOUTS["pp"], name="pp", nproc=2, after="teacher")
@pytest.mark.train_run(*DISTILL, "--parallelism.context_parallel_degree", "2", name="cp", nproc=2, after="teacher")
def test_distillation_layouts_match_one_process(train_runs):
    """A Qwen3 teacher distilled into a Llama student (forward KL at temperature 2, half hard labels):
    FSDP2, TP2 (the KL summed over vocabulary shards, the teacher's log-probabilities kept on their
    shard; top-k from every shard's best k), PP2 (the teacher's own stages through a forward-only
    schedule) and CP2 (the teacher attends over the cp ranks like the student) equal one process:
    loss per token, gradient norm, KL and hard loss. The teacher is a DCP checkpoint, loaded from
    each rank's shards (checkpoint/loading.py load_frozen_model)."""
    keys = ("loss", "grad_norm", "distill_kl", "hard_loss")
    one, one_top_k = table(train_runs["one"], keys), table(train_runs["one_top_k"], keys)
    assert one[-1][0] < one[0][0] and one[-1][2] < one[0][2]  # it learns
    for name in ("fsdp", "tp", "pp", "cp"):
        assert_same(one, table(train_runs[name], keys), name)
    assert_same(one_top_k, table(train_runs["tp_top_k"], keys), "tp_top_k")


def held_out_loss(checkpoint, samples: int = 32) -> float:
    """Cross-entropy per token of a saved model on the embedded corpus' held-out samples."""
    import numpy as np

    import titanlike
    from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.text_datasets import packed_text_corpus

    held_out = packed_text_corpus(DEFAULT_CORPUS_PATH, build_tokenizer(DEFAULT_TOKENIZER_PATH), 64).split("99,1", "valid")
    tokens = torch.as_tensor(np.stack([held_out[i] for i in range(samples)])).long()
    with torch.no_grad():
        logits = titanlike.load_model(checkpoint)(tokens[:, :-1])
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def test_a_distilled_student_beats_the_same_student_without_its_teacher(tmp_path):
    """A 4-layer teacher trained 24 steps; a 2-layer student trained 12 steps on the same batches with
    it (forward KL) and without it (cross-entropy): the distilled student's held-out cross-entropy is
    clearly lower."""
    import time

    started = time.perf_counter()
    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_tiny",
            "--training.seq_len", "64", "--training.mixed_precision_param", "float32", "--metrics.log_freq", "8",
            "--metrics.no_enable_tensorboard", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3"]
    train_in_process([*base, "--model.args.n_layers", "4", "--training.steps", "24",
                      "--job.dump_folder", str(tmp_path / "teacher")])
    student = [*base, "--model.args.n_layers", "2", "--training.steps", "12"]
    train_in_process([*student, "--job.dump_folder", str(tmp_path / "alone")])
    train_in_process([*student, "--job.dump_folder", str(tmp_path / "distilled"), "--training.objective", "distill",
                      "--distill.teacher", str(tmp_path / "teacher" / "checkpoint")])
    teacher, alone, distilled = (held_out_loss(tmp_path / name / "checkpoint") for name in ("teacher", "alone", "distilled"))
    figures = (f"held-out cross-entropy: teacher {teacher:.3f}, student alone {alone:.3f}, distilled {distilled:.3f} "
               f"({time.perf_counter() - started:.0f} s)")
    print(figures)
    assert teacher < distilled < alone - 0.1, figures
