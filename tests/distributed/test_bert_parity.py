"""The bert family through train.py (fp32, the tiny job of conftest with --model.name bert), on
masked-LM samples of the embedded corpus (sentence pairs with the sentence-order label, padding at
the end): the single-process run learns both objectives, and an FSDP 2 run saving checkpoints
reproduces it and resumes exactly at CP 2 (its data position, RNG and optimizer restored).

BERT's layouts (padding mask through pipeline stages and under CP, the binary head's loss counted
once on the rank holding position 0, the MLM projection tied to the word table across stages,
validation) are checked at model level, every gradient against one process, in
tests/layouts/test_family_layouts.py; tests/MAP.md maps the train.py runs that were here.
Tolerances: test_fsdp_parity.py's.
"""

import pytest

from conftest import saving_every_2_steps, train_metrics
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


SAVE = saving_every_2_steps("bert_fsdp2")


@pytest.mark.train_run(*BERT, "--training.local_batch_size", "4", *SAVE, name="fsdp2", nproc=2)
@pytest.mark.train_run(*BERT, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8", *SAVE,
                       "--checkpoint.load_step", "2", name="resume", nproc=2, after="fsdp2")
def test_fsdp2_then_resume_at_cp2(train_runs, reference):
    got = train_runs["fsdp2"].metrics
    check(got, reference, "FSDP2 (saving)")
    train, _ = split_records(train_runs["resume"].metrics)
    # The data position, the RNG and the optimizer come back: steps 3-6 equal the uninterrupted run's.
    assert_same_curve(train, split_records(got)[0][2:])
