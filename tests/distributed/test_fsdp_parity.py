"""Every data-parallel layout reproduces the single-process run (fp32, same global batch).

Tolerance: the layouts differ from one process only in the order of floating-point
sums (per-rank partial gradients summed by the reduce-scatter, the token count and
the loss summed over ranks). That is ~1e-7 relative per operation; over 10 AdamW
steps it stays below ~1e-5 relative. A real bug — a wrong data slice, gradients
averaged instead of summed, a missing or duplicated sample — moves the loss or
the grad norm by more than 1e-2 within the first steps. Grad norms are compared
too because AdamW is almost invariant to a global gradient scale: losses alone
would not catch a gradient divided by the data-parallel degree.
"""

import pytest

from conftest import train_metrics

RTOL = 2e-5


def assert_same_curve(got, ref):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL * 10), (g, r)


def test_reference_loss_falls(single_process_reference):
    losses = [r["loss"] for r in single_process_reference]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 0.5


def test_gradient_accumulation_equals_one_big_batch(tmp_path, single_process_reference):
    # 8 = 4 microbatches x 2 samples in one process.
    got = train_metrics(tmp_path, "accum", "--training.local_batch_size", "2", "--training.global_batch_size", "8")
    assert_same_curve(got, single_process_reference)


@pytest.mark.distributed
def test_fsdp2_with_accumulation(tmp_path, single_process_reference):
    # 8 = 2 ranks x 2 microbatches x 2 samples.
    got = train_metrics(tmp_path, "fsdp2", "--training.local_batch_size", "2",
                        "--training.global_batch_size", "8", nproc=2)
    assert_same_curve(got, single_process_reference)


@pytest.mark.distributed
def test_fsdp4(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "fsdp4", "--training.local_batch_size", "2", nproc=4)
    assert_same_curve(got, single_process_reference)


@pytest.mark.distributed
def test_hsdp_2x2(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "hsdp", "--training.local_batch_size", "2",
                        "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "2", nproc=4)
    assert_same_curve(got, single_process_reference)


@pytest.mark.distributed
def test_pure_replication_ddp(tmp_path, single_process_reference):
    got = train_metrics(tmp_path, "ddp", "--training.local_batch_size", "4",
                        "--parallelism.data_parallel_replicate_degree", "2", nproc=2)
    assert_same_curve(got, single_process_reference)
