"""The gpt2 family's smoke run through train.py: one process, 10 steps, the loss falls.

Its layouts (learned position table under TP and CP, biases under SP and FSDP, tied embeddings
across pipeline stages for a looped and a V-shaped schedule) are checked at model level, every
gradient against one process: tests/layouts/test_family_layouts.py; the schedules and compositions
themselves on Llama (test_pipeline_parity.py ...). tests/MAP.md maps the runs that were here.
"""

import pytest

from conftest import train_metrics

pytestmark = pytest.mark.distributed

GPT2 = ("--model.name", "gpt2", "--model.flavor", "debugmodel")


def run(tmp_path, name, *extra, nproc=1):
    return train_metrics(tmp_path, name, *GPT2, *extra, nproc=nproc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("gpt2_ref"), "single", "--training.local_batch_size", "8", "--training.steps", "10")


def test_reference_loss_falls(reference):
    losses = [r["loss"] for r in reference]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
