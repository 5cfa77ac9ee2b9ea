"""The t5 family through train.py (fp32, the tiny job of conftest with --model.name t5), on
span-corruption samples of the embedded corpus (encoder 64 tokens, decoder 16): the single-process
run learns, and an FSDP 2 run (full activation checkpointing) saving checkpoints resumes exactly
at TP 2. Its layouts (FSDP 2, TP 2 with and without loss parallel) are checked at model level, every
gradient against one process, in tests/layouts/test_family_layouts.py (tests/MAP.md).

What is specific to T5: encoder and decoder blocks in one `layers` (FSDP units and TP plans per
block, cross-attention split by heads like self-attention), the relative-position bias table of
each stack's first block cut by heads under TP, the encoder's padding mask reaching the encoder's
self-attention and the decoder's cross-attention, and the decoder's own length (its labels count
the tokens). Pipeline and context parallelism are refused for T5 (tests/unit/test_t5_model.py).

Tolerances: test_fsdp_parity.py's.
"""

import pytest

from conftest import saving_every_2_steps, train_metrics
from test_fsdp_parity import assert_same_curve
from test_validation_runs import assert_same_validation, split_records

pytestmark = pytest.mark.distributed

T5 = ("--model.name", "t5", "--model.flavor", "debugmodel", "--training.steps", "6",
      "--span_corruption.decoder_seq_len", "16",
      "--validation.enable", "--validation.freq", "3", "--validation.steps", "1")


def check(records, reference, layout):
    train, valid = split_records(records)
    ref_train, ref_valid = split_records(reference)
    print(f"\n[t5 parity] {layout}: losses {[round(r['loss'], 5) for r in train]}")
    assert_same_curve(train, ref_train)
    assert [r["step"] for r in valid] == [3, 6]
    assert_same_validation(valid, ref_valid)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_metrics(tmp_path_factory.mktemp("t5_ref"), "single", *T5, "--training.local_batch_size", "8")


def test_reference_learns(reference):
    train, valid = split_records(reference)
    assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"] - 0.5, train
    # Decoder targets only: at most 16 per sample, padding excluded.
    assert 0 < valid[0]["validation_tokens"] <= 8 * 16


SAVE = saving_every_2_steps("t5_fsdp2")


@pytest.mark.train_run(*T5, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full", *SAVE,
                       name="fsdp2", nproc=2)
@pytest.mark.train_run(*T5, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8", *SAVE,
                       "--checkpoint.load_step", "2", name="resume", nproc=2, after="fsdp2")
def test_fsdp2_then_resume_at_tp2(train_runs, reference):
    got = train_runs["fsdp2"].metrics
    check(got, reference, "FSDP2 + full AC (saving)")
    resumed = train_runs["resume"].metrics
    assert_same_curve(split_records(resumed)[0], split_records(got)[0][2:])
