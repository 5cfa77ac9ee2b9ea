"""The gpt2 family reproduces its single-process run under every parallelism, through train.py
(fp32, same global batch, the tiny job of conftest with --model.name gpt2).

What is specific to GPT-2 and what each layout checks beyond the llama matrix:
- the learned position table: replicated under TP with its output cut to the rank's sequence
  slice (position_embedding style), indexed by global positions under CP (a wrong position
  shifts the inputs directly, unlike RoPE at near-uniform attention);
- biases on every linear and LayerNorm biases, under sequence parallelism and FSDP;
- tied embeddings under PP: the table lives on the first stage and, as output.weight, on the last,
  with gradients summed across the two (TiedWeightSync): across ranks for 1F1B / Interleaved1F1B,
  on rank 0 for ZBVZeroBubble's V placement.

Every layout runs in the shared launch of its world size (conftest.TrainJobPool). Tolerances and their
rationale: test_fsdp_parity.py.
"""

import pytest

from conftest import train_metrics
from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed

GPT2 = ("--model.name", "gpt2", "--model.flavor", "debugmodel")


def run(tmp_path, name, *extra, nproc=1):
    return train_metrics(tmp_path, name, *GPT2, *extra, nproc=nproc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("gpt2_ref"), "single", "--training.local_batch_size", "8")


def deviation(got, ref) -> str:
    loss = max(abs(g["loss"] - r["loss"]) / abs(r["loss"]) for g, r in zip(got, ref))
    grad = max(abs(g["grad_norm"] - r["grad_norm"]) / abs(r["grad_norm"]) for g, r in zip(got, ref))
    return f"max rel deviation: loss {loss:.1e}, grad_norm {grad:.1e}"


def check(got, ref, layout):
    print(f"\n[gpt2 parity] {layout}: {deviation(got, ref)}")
    assert_same_curve(got, ref)


def pp(degree, schedule, *extra):
    return ("--parallelism.pipeline_parallel_degree", str(degree),
            "--parallelism.pipeline_parallel_schedule", schedule, *extra)


def test_reference_loss_falls(reference):
    losses = [r["loss"] for r in reference]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.train_run(*GPT2, "--training.local_batch_size", "2", "--training.global_batch_size", "8", nproc=2)
def test_fsdp2_with_accumulation(train_run, reference):
    # 8 = 2 ranks x 2 microbatches x 2 samples.
    check(train_run.metrics, reference, "FSDP2 (+ accumulation)")


@pytest.mark.train_run(*GPT2, "--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2", nproc=4)
def test_hsdp_2x2(train_run, reference):
    check(train_run.metrics, reference, "HSDP 2x2")


@pytest.mark.train_run(*GPT2, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2", nproc=2)
def test_tp2_with_loss_parallel(train_run, reference):
    check(train_run.metrics, reference, "TP2 (SP + loss parallel)")


@pytest.mark.train_run(*GPT2, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2", nproc=4)
def test_fsdp2_x_tp2(train_run, reference):
    check(train_run.metrics, reference, "FSDP2 x TP2")


@pytest.mark.train_run(*GPT2, "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8", nproc=2)
def test_cp2(train_run, reference):
    check(train_run.metrics, reference, "CP2")


@pytest.mark.train_run(*GPT2, *pp(2, "1F1B"), "--parallelism.tensor_parallel_degree", "2",
                       "--training.local_batch_size", "8", nproc=4)
def test_pp2_1f1b_x_tp2(train_run, reference):
    # Tied table on pipeline rank 0 (stage 0) and rank 1 (stage 1), each split over TP 2. Without FSDP
    # torch leaves the embedding's gradient Replicate while its parameter is Shard(0): the tied-copy
    # sum must lay the gradient out like the parameter first (it crashed in gloo before).
    check(train_run.metrics, reference, "PP2 1F1B x TP2")


@pytest.mark.train_run(*GPT2, *pp(2, "Interleaved1F1B"), "--training.local_batch_size", "8", nproc=2)
def test_pp2_interleaved_1f1b(train_run, reference):
    # 4 one-layer stages, looped: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (the output).
    check(train_run.metrics, reference, "PP2 Interleaved1F1B")


@pytest.mark.train_run(*GPT2, *pp(2, "1F1B"), "--parallelism.tensor_parallel_degree", "2",
                       "--training.local_batch_size", "4", nproc=8)
def test_pp2_x_fsdp2_x_tp2(train_run, reference):
    check(train_run.metrics, reference, "PP2 1F1B x FSDP2 x TP2")


@pytest.mark.train_run(*GPT2, *pp(2, "ZBVZeroBubble"), "--training.local_batch_size", "4", nproc=4)
def test_pp2_zbv_zero_bubble_x_fsdp2(train_run, reference):
    # V placement: rank 0 holds stage 0 (embeddings) and stage 3 (output): the tied copies are summed locally.
    check(train_run.metrics, reference, "PP2 ZBVZeroBubble x FSDP2")



@pytest.mark.parametrize("schedule, nproc", [pytest.param(schedule, nproc, marks=pytest.mark.train_run(
    *GPT2, *pp(2, schedule), *extra, nproc=nproc)) for schedule, extra, nproc in [
    # The remaining schedules, each with another dimension: GPipe x CP2 (one stage per rank, the
    # position table indexed by global positions on the first stage), LoopedBFS (looped placement,
    # every forward first), InterleavedZeroBubble x FSDP2 (split backward on resharded-never FSDP),
    # DualPipeV x FSDP2 (V placement, both tied copies on rank 0).
    ("GPipe", ("--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"), 4),
    ("LoopedBFS", ("--training.local_batch_size", "8"), 2),
    ("InterleavedZeroBubble", ("--training.local_batch_size", "4"), 4),
    ("DualPipeV", ("--training.local_batch_size", "4"), 4),
]])
def test_pp2_other_schedules(train_run, reference, schedule, nproc):
    check(train_run.metrics, reference, f"PP2 {schedule} ({nproc} ranks)")
