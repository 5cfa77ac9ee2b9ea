"""DeepSeek-V3 (multi-head latent attention + sigmoid group-limited MoE with shared experts) under
every parallelism reproduces its single-process run through train.py (fp32, same global batch,
the debugmodel: q_lora path on, layer 0 dense, 8 experts in 4 groups, one multi-token-prediction
module, the sequence-wise balance loss and aux-loss-free bias updates on, raised so that a wrong
statistic would show). Every run
trains on short documents with document masking (test_document_masking_parity.py's data: several
documents per 64-token sample), so that one reference serves all and context parallelism runs
with masks.

What the runs here check beyond the dense and MoE matrices (test_fsdp_parity.py, test_moe_parity.py)
and the model-level layouts (tests/layouts: every gradient under TP 2, CP 2 (ring), EP 2,
PP 2, for the debugmodel and the debugmodel_nolora, each against one process):
- resuming an FSDP 2 x EP 2 checkpoint at CP 2 (allgather) x TP 2 (replicated and head-split
  DTensors resharded by DCP) is exact;
- PP 2 x CP 2 (alltoall) x EP 2 with a stage holding only the dense layer 0;
- multi-token prediction everywhere: its targets cut for CP after being rolled on the whole
  sequence, its module and its tied copy of the embedding table on the last pipeline stage, its
  loss (logged apart as mtp_loss) equal to one process's.
Tolerances: test_fsdp_parity.py (losses rel 2e-5, grad norms rel 5e-4) and the MoE statistics as in
test_moe_parity.py.
"""

from __future__ import annotations

import pytest

import test_document_masking_parity as masking
from conftest import saving_every_2_steps, train_metrics
from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed
short_documents = masking.short_documents  # the fixture: short documents, several per 64-token sample

DEEPSEEK = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.steps", "4",
            "--moe.seq_aux_loss_coeff", "0.01", "--moe.bias_update_rate", "0.01", *masking.DOC_MASKING)


@pytest.fixture(scope="module")
def run(short_documents):
    def launch(tmp_path, name, *extra, nproc=1):
        return train_metrics(tmp_path, name, *DEEPSEEK, "--training.dataset", "text", "--training.dataset_path",
                             short_documents, *extra, nproc=nproc)

    return launch


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run):
    return run(tmp_path_factory.mktemp("ds_ref"), "single", "--training.local_batch_size", "8")


def check(got, ref, layout):
    assert_same_curve(got, ref)
    for g, r in zip(got, ref):
        for key in ("moe/seq_aux_loss", "moe/load_cv", "mtp_loss"):
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-9), (layout, key, g[key], r[key])


def test_reference_balances_and_learns(reference):
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert all(r["moe/seq_aux_loss"] > 0 for r in reference)
    # the multi-token-prediction module (one, as DeepSeek-V3) trains and is logged apart
    assert all(r["mtp_loss"] > 0 for r in reference) and reference[-1]["mtp_loss"] < reference[0]["mtp_loss"]


POOLED = (*DEEPSEEK, *masking.SHORT_DOCUMENTS)  # the jobs below run in the shared launches of their world size
SAVE = saving_every_2_steps("deepseek_v3_fsdp2ep2")


# Steps 3-4 from step 2's checkpoint: MLA under CP (allgather) x TP, MoE's statistics over cp x tp.
@pytest.mark.train_run(*POOLED, "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4",
                       *SAVE, name="fsdp2ep2", nproc=2)
@pytest.mark.train_run(*POOLED, "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
                       "2", "--training.local_batch_size", "8", *SAVE, "--checkpoint.load_step", "2",
                       name="resume_cp2tp2", nproc=4, after="fsdp2ep2")
def test_fsdp2_ep2_then_resume_at_cp2_tp2(train_runs, reference):
    got = train_runs["fsdp2ep2"].metrics
    check(got, reference, "FSDP2 x EP2")
    check(train_runs["resume_cp2tp2"].metrics, got[2:], "resume FSDP2 x EP2 -> CP2 (allgather) x TP2")


@pytest.mark.train_run(*POOLED, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method",
                       "alltoall", "--parallelism.expert_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                       "--parallelism.pipeline_parallel_layers_per_stage", "1", "--training.local_batch_size", "8",
                       "--parallelism.pipeline_parallel_microbatch_size", "2", nproc=4)
def test_pp2_cp2_ring_ep2_with_a_stage_without_moe(train_run, reference):
    # 4 stages of one layer, 2 per rank: stage 0 holds only the dense layer 0.
    check(train_run.metrics, reference, "PP2 x CP2 (alltoall) x EP2")
