"""Mixture of experts reproduces its single-process run under expert parallelism and every
composition with it, through train.py (fp32, same global batch, qwen3 debugmodel_moe: 8 experts,
top-2, a dense first layer, with all three balancing losses and aux-loss-free bias updates on).

What the layouts check beyond the dense matrix:
- expert gradients are not ep-times too large (FSDP's averaging trap): EP 2 / 4 equal EP 1;
- the router (whole on every rank, fed different tokens under sequence parallelism) gets its
  gradient summed over TP ranks (token_fsdp mesh), TP 2 x EP 2;
- balancing losses and capacity need whole sequences: their statistics are reduced over the
  cp x tp ranks of a sequence, CP 2 x EP 2 with token dropping (expert inputs padded to capacity
  through the all-to-all) equals one process dropping;
- the bias update's one all-reduce must not hang on a pipeline stage without MoE layers
  (Interleaved1F1B with one layer per stage: stage 0 holds the dense layer 0 only);
- experts FSDP-sharded over the efsdp ranks left beside ep (the 8-rank mix: efsdp 2);
- resuming an EP 2 checkpoint at EP 1 and at FSDP 4 (expert DTensors resharded by DCP) is exact;
- expert tensor parallelism (each expert's hidden units split over the etp ranks, which hold
  different tokens): FSDP 4 x ETP 2, the expert slices FSDP-sharded over the 2 ranks left (efsdp 2),
  dropping tokens with inputs padded to capacity, resumed at TP 2 x EP 2 x ETP 2, the experts 2-D
  DTensors over (ep, etp).

The aux losses are per micro-batch (Switch form), so every run keeps 2-sample micro-batches: the
reference accumulates 4 of them; PP uses pipeline microbatches of 2. Tolerances: test_fsdp_parity.py.
"""

import pytest

from conftest import saving_every_2_steps, train_metrics
from test_fsdp_parity import assert_same_curve
from test_tensor_parity import COMPILED, assert_close_curve

pytestmark = pytest.mark.distributed

MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.steps", "4",
       "--training.local_batch_size", "2", "--training.global_batch_size", "8",
       "--moe.seq_aux_loss_coeff", "0.001", "--moe.z_loss_coeff", "0.001", "--moe.bias_update_rate", "0.001")
DROPPING = ("--moe.capacity_factor", "1.0", "--moe.pad_to_capacity")


def run(tmp_path, name, *extra, nproc=1):
    return train_metrics(tmp_path, name, *MOE, *extra, nproc=nproc)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("moe_ref"), "single")


@pytest.fixture(scope="module")
def dropping_reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("moe_drop_ref"), "single", *DROPPING)


def check(got, ref, layout):
    assert_same_curve(got, ref)
    for g, r in zip(got, ref):
        for key in ("moe/aux_loss", "moe/seq_aux_loss", "moe/z_loss", "moe/load_cv", "moe/dropped"):
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-9), (layout, key, g[key], r[key])


def test_reference_balances_and_learns(reference):
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert all(r["moe/aux_loss"] > 0 and r["moe/seq_aux_loss"] > 0 and r["moe/z_loss"] > 0 for r in reference)
    assert all(r["moe/dropped"] == 0 for r in reference)


SAVE = saving_every_2_steps("moe_ep2")


# Resume step 2's checkpoint under other layouts: steps 3-4 must match the uninterrupted run.
@pytest.mark.train_run(*MOE, "--parallelism.expert_parallel_degree", "2", *SAVE, name="ep2", nproc=2)
@pytest.mark.train_run(*MOE, *SAVE, "--checkpoint.load_step", "2", name="resume_ep1", nproc=1, after="ep2")
@pytest.mark.train_run(*MOE, "--parallelism.expert_parallel_degree", "1", *SAVE, "--checkpoint.load_step", "2",
                       name="resume_fsdp4", nproc=4, after="ep2")
def test_ep2_alltoall_then_resume_at_ep1_and_fsdp4(train_runs, reference):
    got = train_runs["ep2"].metrics
    check(got, reference, "EP2")
    for name in ("ep1", "fsdp4"):
        check(train_runs[f"resume_{name}"].metrics, got[2:], f"resume EP2 -> {name}")


EP2 = ("--parallelism.expert_parallel_degree", "2")


@pytest.mark.train_run(*MOE, "--parallelism.expert_parallel_degree", "4", nproc=4)
def test_fsdp4_ep4(train_run, reference):
    check(train_run.metrics, reference, "FSDP4 x EP4")


@pytest.mark.train_run(*MOE, *EP2, "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2", "--moe.token_dispatcher", "allgather", nproc=4)
def test_hsdp_2x2_ep2_allgather_dispatcher(train_run, reference):
    check(train_run.metrics, reference, "HSDP 2x2 x EP2 (allgather)")


@pytest.mark.train_run(*MOE, *EP2, "--parallelism.tensor_parallel_degree", "2", nproc=2)
def test_tp2_ep2(train_run, reference):
    check(train_run.metrics, reference, "TP2 x EP2")


ETP2 = ("--parallelism.expert_tensor_parallel_degree", "2")
SAVE_ETP = saving_every_2_steps("moe_etp")


# Step 2's checkpoint of FSDP 4 x ETP 2 (expert slices FSDP-sharded over efsdp 2) resumes at TP 2 x EP 2 x ETP 2
# (the experts 2-D DTensors over (ep, etp), resharded by DCP): steps 3-4 match the uninterrupted run.
@pytest.mark.train_run(*MOE, *ETP2, *DROPPING, *SAVE_ETP, name="fsdp4_etp2", nproc=4)
@pytest.mark.train_run(*MOE, *EP2, *ETP2, "--parallelism.tensor_parallel_degree", "2", *DROPPING, *SAVE_ETP,
                       "--checkpoint.load_step", "2", name="resume_tp2_ep2_etp2", nproc=4, after="fsdp4_etp2")
def test_fsdp4_etp2_with_token_dropping_then_resume_at_tp2_ep2_etp2(train_runs, dropping_reference):
    got = train_runs["fsdp4_etp2"].metrics
    check(got, dropping_reference, "FSDP4 x ETP2, capacity 1.0")
    check(train_runs["resume_tp2_ep2_etp2"].metrics, got[2:], "resume FSDP4 x ETP2 -> TP2 x EP2 x ETP2")


# Compiled blocks beside eager experts: an MoE block under EP compiles its other children one by one
# (parallel/parallelize.py _compile), its norms among them, which torch 2.13's Module.compile failed.
@pytest.mark.train_run(*MOE, *EP2, *COMPILED, nproc=2)
def test_ep2_compiled(train_run, reference):
    got = train_run.metrics
    assert_close_curve(got, reference)
    for g, r in zip(got, reference):
        for key in ("moe/aux_loss", "moe/seq_aux_loss", "moe/z_loss", "moe/load_cv"):
            assert g[key] == pytest.approx(r[key], rel=1e-3, abs=1e-9), (key, g[key], r[key])


@pytest.mark.train_run(*MOE, *EP2, "--parallelism.context_parallel_degree", "2", *DROPPING, nproc=2)
def test_cp2_ep2_with_token_dropping(train_run, dropping_reference):
    assert any(r["moe/dropped"] > 0 for r in dropping_reference)
    check(train_run.metrics, dropping_reference, "CP2 x EP2, capacity 1.0")


@pytest.mark.train_run(*MOE, *EP2, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                       "--parallelism.pipeline_parallel_layers_per_stage", "1", "--training.local_batch_size", "4",
                       "--parallelism.pipeline_parallel_microbatch_size", "2", nproc=4)
def test_pp2_ep2_with_a_stage_without_moe(train_run, reference):
    # 8 stages of one layer, 4 per rank: stage 0 holds only the dense layer 0.
    check(train_run.metrics, reference, "PP2 x EP2")
