"""Tensor + sequence parallel (with loss parallel) and its 2-D/3-D compositions with FSDP/HSDP
reproduce the single-process run. Tolerances and their rationale: test_fsdp_parity.py."""

import pytest

from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed

TP2 = ("--parallelism.tensor_parallel_degree", "2")


@pytest.mark.train_run("--training.local_batch_size", "8", *TP2, nproc=2)
def test_tp2(train_run, single_process_reference):
    assert_same_curve(train_run.metrics, single_process_reference)


@pytest.mark.train_run("--training.local_batch_size", "8", *TP2, "--parallelism.disable_loss_parallel", nproc=2)
def test_tp2_without_loss_parallel(train_run, single_process_reference):
    assert_same_curve(train_run.metrics, single_process_reference)


@pytest.mark.train_run("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "4", nproc=4)
def test_tp4(train_run, single_process_reference):
    assert_same_curve(train_run.metrics, single_process_reference)


@pytest.mark.train_run("--training.local_batch_size", "4", *TP2, nproc=4)
def test_fsdp2_x_tp2(train_run, single_process_reference):
    assert_same_curve(train_run.metrics, single_process_reference)
