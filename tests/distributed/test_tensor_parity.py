"""Tensor + sequence parallel (with loss parallel) and its 2-D/3-D compositions with FSDP/HSDP
reproduce the single-process run. Tolerances and their rationale: test_fsdp_parity.py."""

import pytest

from conftest import train_metrics
from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed


def test_tp2(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "tp2", "--training.local_batch_size", "8",
                        "--parallelism.tensor_parallel_degree", "2", nproc=2)
    assert_same_curve(got, single_process_reference)


def test_tp2_without_loss_parallel(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "tp2_nolp", "--training.local_batch_size", "8",
                        "--parallelism.tensor_parallel_degree", "2",
                        "--parallelism.disable_loss_parallel", nproc=2)
    assert_same_curve(got, single_process_reference)


def test_tp4(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "tp4", "--training.local_batch_size", "8",
                        "--parallelism.tensor_parallel_degree", "4", nproc=4)
    assert_same_curve(got, single_process_reference)


def test_fsdp2_x_tp2(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "fsdp2tp2", "--training.local_batch_size", "4",
                        "--parallelism.tensor_parallel_degree", "2", nproc=4)
    assert_same_curve(got, single_process_reference)


def test_hsdp_2x2_x_tp2(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "hsdp_tp", "--training.local_batch_size", "2",
                        "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "2",
                        "--parallelism.tensor_parallel_degree", "2", nproc=8)
    assert_same_curve(got, single_process_reference)
