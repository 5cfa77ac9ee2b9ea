"""The bert family reproduces its single-process run under every layout it supports, through
train.py (fp32, same global batch, the tiny job of conftest with --model.name bert), on masked-LM
samples of the embedded corpus (sentence pairs with the sentence-order label, padding at the end).

What is specific to BERT and what each layout checks:
- bidirectional attention with a padding mask built from the samples' document ids (real tokens
  never attend to padding): under CP the mask's ids travel whole and each rank attends its rows
  both ways; under PP the mask and the token types reach every stage per pipeline microbatch;
- the binary (sentence-order) head reads position 0, which only cp rank 0 holds: its loss, weighted
  by each sample's masked-token count, must be counted once (reported as binary_loss);
- the MLM head's output projection tied to the word embeddings, across pipeline stages;
- validation: masked-token loss and accuracy, the same for every layout.

Tolerances: test_fsdp_parity.py's (the layouts differ only in the order of floating-point sums).
FSDP x TP and HSDP compositions are the generic ones the Llama and GPT-2 matrices test; the
4-rank job here composes what is BERT's: the padding mask through pipeline stages and CP's ring.
"""

import pytest

from conftest import train_metrics
from test_fsdp_parity import RTOL, assert_same_curve
from test_validation_runs import assert_same_validation, split_records

pytestmark = pytest.mark.distributed

BERT = ("--model.name", "bert", "--model.flavor", "debugmodel", "--training.steps", "6",
        "--validation.enable", "--validation.freq", "3", "--validation.steps", "1")


def check(records, reference, layout):
    train, valid = split_records(records)
    ref_train, ref_valid = split_records(reference)
    print(f"\n[bert parity] {layout}: losses {[round(r['loss'], 5) for r in train]}")
    assert_same_curve(train, ref_train)
    for g, r in zip(train, ref_train):
        assert g["binary_loss"] == pytest.approx(r["binary_loss"], rel=RTOL), (layout, g, r)
    assert [r["step"] for r in valid] == [3, 6]
    assert_same_validation(valid, ref_valid)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_metrics(tmp_path_factory.mktemp("bert_ref"), "single", *BERT, "--training.local_batch_size", "8")


def test_reference_learns_both_objectives(reference):
    train, valid = split_records(reference)
    assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"] - 0.5, train
    # The binary loss starts near ln 2 per sample; weighted by ~10 masked tokens per sample it is a
    # visible share of the loss, not a rounding error.
    assert 0.05 < train[0]["binary_loss"] < train[0]["loss"], train[0]
    # Masked tokens are scored at every position of the vocabulary: accuracy is a fraction, above chance.
    assert all(0 <= r["validation_accuracy"] <= 1 for r in valid)
    assert valid[-1]["validation_accuracy"] > 1 / 2048


@pytest.mark.train_run(*BERT, "--training.local_batch_size", "2", "--training.global_batch_size", "8",
                       "--validation.local_batch_size", "4", nproc=2)  # validation: 8 samples, as one process
def test_fsdp2_with_accumulation(train_run, reference):
    check(train_run.metrics, reference, "FSDP2 (+ accumulation)")


@pytest.mark.train_run(*BERT, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8",
                       nproc=2)
def test_tp2_with_loss_parallel(train_run, reference):
    check(train_run.metrics, reference, "TP2 (SP + loss parallel)")


@pytest.mark.train_run(*BERT, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8",
                       nproc=2)
def test_cp2_bidirectional(train_run, reference):
    check(train_run.metrics, reference, "CP2 (all-gather, bidirectional with padding)")


@pytest.mark.train_run(*BERT, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                       "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2", "--training.local_batch_size",
                       "8", nproc=2)
def test_pp2_1f1b(train_run, reference):
    check(train_run.metrics, reference, "PP2 1F1B")


@pytest.mark.train_run(*BERT, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                       "GPipe", "--parallelism.context_parallel_degree", "2",
                       "--parallelism.context_parallel_rotate_method", "alltoall",
                       "--parallelism.pipeline_parallel_microbatch_size", "4", "--training.local_batch_size", "8",
                       nproc=4)
def test_pp2_x_cp2_ring(train_run, reference):
    check(train_run.metrics, reference, "PP2 GPipe x CP2 (ring)")


def test_fsdp2_then_resume_at_cp2(tmp_path, reference):
    save = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
            "--checkpoint.folder", str(tmp_path / "ckpt"))
    got = train_metrics(tmp_path, "fsdp2", *BERT, "--training.local_batch_size", "4", *save, nproc=2)
    check(got, reference, "FSDP2 (saving)")
    resumed = train_metrics(tmp_path, "resume", *BERT, "--parallelism.context_parallel_degree", "2",
                            "--training.local_batch_size", "8", *save, "--checkpoint.load_step", "2", nproc=2)
    train, _ = split_records(resumed)
    # The data position, the RNG and the optimizer come back: steps 3-6 equal the uninterrupted run's.
    assert_same_curve(train, split_records(got)[0][2:])
