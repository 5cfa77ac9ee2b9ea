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


# Compiled blocks under tensor parallelism (torch 2.13 failed both in the first backward: the token embedding's
# async output entering a compiled block, and a checkpointed block recomputing attention beside the DeviceMesh;
# models/common/parallel_styles.py WaitedRowwiseParallel, parallel/activation_checkpoint.py _seeded_kept_contexts).
# Inductor reorders fp32 sums, so the tolerances are test_compile_parity.py's.
COMPILED = ("--compile.enable", "--compile.components", "model,loss")


def assert_close_curve(got, ref):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-4), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-3), (g, r)


@pytest.mark.train_run("--training.local_batch_size", "8", *TP2, *COMPILED, "--activation_checkpoint.mode", "full",
                       "--parallelism.disable_loss_parallel", nproc=2)
def test_tp2_compiled_with_full_activation_checkpointing(train_run, single_process_reference):
    assert_close_curve(train_run.metrics, single_process_reference)


@pytest.mark.train_run("--training.local_batch_size", "8", *TP2, *COMPILED, "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "op", nproc=2)
def test_tp2_compiled_with_op_level_activation_checkpointing(train_run, single_process_reference):
    assert_close_curve(train_run.metrics, single_process_reference)
