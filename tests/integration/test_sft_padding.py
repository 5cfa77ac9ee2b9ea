"""Packing against padding through train.py: the same conversations, packed (best-fit decreasing,
document masks) or one per sample padded to the longest of each microbatch, give the same loss and
gradient norm step after step.

Each step reads the whole data (12 conversations: 8 packed samples, or 12 padded ones), so the two
runs train on the same conversations at every step, in another order and grouping."""

from __future__ import annotations

import pytest

from sft_assets import reverse_task, write_jsonl


def _conversations(root):
    # Answers of 1 to 9 words: lengths of 22 to 50 tokens with the debug tokenizer and the llama3
    # template, which best-fit decreasing packs into 8 samples of 64 positions.
    rows = [r for i in range(12) for r in reverse_task(1, seed=i, words=1 + (i * 5) % 9)]
    return write_jsonl(root / "padding" / "mixed.jsonl", rows)


SFT = ("--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", _conversations,
       "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "1")


@pytest.mark.train_run(*SFT, "--training.local_batch_size", "8", "--training.global_batch_size", "8",
                       name="packed")
@pytest.mark.train_run(*SFT, "--sft.no_packing", "--sft.padding", "longest", "--sft.pad_to_multiple_of", "8",
                       "--training.local_batch_size", "4", "--training.global_batch_size", "12", name="padded")
def test_packed_and_padded_runs_give_the_same_loss(train_runs):
    packed, padded = train_runs["packed"], train_runs["padded"]
    assert "12 conversations" in packed.output and "in 8 samples of 64" in packed.output
    assert "in 12 samples of 64" in padded.output
    one = [(r["loss"], r["grad_norm"]) for r in packed.metrics]
    other = [(r["loss"], r["grad_norm"]) for r in padded.metrics]
    assert len(one) == len(other) == 4 and one[-1][0] < one[0][0]
    assert [loss for loss, _ in other] == pytest.approx([loss for loss, _ in one], abs=1e-5)
    assert [norm for _, norm in other] == pytest.approx([norm for _, norm in one], rel=1e-4)
