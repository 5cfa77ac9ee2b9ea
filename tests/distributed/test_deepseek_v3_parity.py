"""DeepSeek-V3 (multi-head latent attention + sigmoid group-limited MoE with shared experts) under
every parallelism reproduces its single-process run through train.py (fp32, same global batch,
the debugmodel: q_lora path on, layer 0 dense, 8 experts in 4 groups, one multi-token-prediction
module, the sequence-wise balance loss and aux-loss-free bias updates on, raised so that a wrong
statistic would show). Every run
trains on short documents with document masking (test_document_masking_parity.py's data: several
documents per 64-token sample), so that one reference serves all and context parallelism runs
with masks.

What the layouts check beyond the dense and MoE matrices (test_fsdp_parity.py, test_moe_parity.py):
- TP: MLA's down projections run whole on every rank (styles replicated / replicated_to_heads);
  the gradient of every parameter equals one process's (the direct check below: a wrong rule for
  the RoPE key's gradient leaves the loss almost unchanged but moves its gradient by ~1e-2);
- CP: values narrower than keys (v_head_dim 32, qk_head_dim 48) through both rotate methods;
- resuming an FSDP 2 x EP 2 checkpoint at CP 2 (allgather) x TP 2 (replicated and head-split
  DTensors resharded by DCP) is exact;
- PP 2 x CP 2 (alltoall) x EP 2 with a stage holding only the dense layer 0, and the 8-rank
  PP 2 x TP 2 x FSDP 2 x EP 2;
- multi-token prediction everywhere: its targets cut for CP after being rolled on the whole
  sequence, its module and its tied copy of the embedding table on the last pipeline stage, its
  loss (logged apart as mtp_loss) equal to one process's.
Tolerances: test_fsdp_parity.py (losses rel 2e-5, grad norms rel 5e-4) and the MoE statistics as in
test_moe_parity.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import test_document_masking_parity as masking
from conftest import train_metrics
from family_checks import materialize, run_on_gloo_ranks
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


def test_fsdp2_ep2_then_resume_at_cp2_tp2(tmp_path, run, reference):
    save = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
            "--checkpoint.folder", str(tmp_path / "ckpt"))
    got = run(tmp_path, "fsdp2ep2", "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4",
              *save, nproc=2)
    check(got, reference, "FSDP2 x EP2")
    # Steps 3-4 from step 2's checkpoint: MLA under CP (allgather) x TP, MoE's statistics over cp x tp.
    resumed = run(tmp_path, "resume_cp2tp2", "--parallelism.context_parallel_degree", "2",
                  "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8",
                  *save, "--checkpoint.load_step", "2", nproc=4)
    check(resumed, got[2:], "resume FSDP2 x EP2 -> CP2 (allgather) x TP2")


POOLED = (*DEEPSEEK, *masking.SHORT_DOCUMENTS)  # the jobs below run in the shared launches of their world size


@pytest.mark.train_run(*POOLED, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method",
                       "alltoall", "--parallelism.expert_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                       "--parallelism.pipeline_parallel_layers_per_stage", "1", "--training.local_batch_size", "8",
                       "--parallelism.pipeline_parallel_microbatch_size", "2", nproc=4)
def test_pp2_cp2_ring_ep2_with_a_stage_without_moe(train_run, reference):
    # 4 stages of one layer, 2 per rank: stage 0 holds only the dense layer 0.
    check(train_run.metrics, reference, "PP2 x CP2 (alltoall) x EP2")


@pytest.mark.train_run(*POOLED, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                       "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "2",
                       nproc=8)
def test_8_ranks_pp2_tp2_fsdp2_ep2(train_run, reference):
    check(train_run.metrics, reference, "PP2 x TP2 x FSDP2 x EP2")


# Tensor parallel gradients, parameter by parameter (spawned gloo ranks) --------------------------

GRAD_ATOL, GRAD_RTOL = 2e-5, 1e-4  # measured: max |difference| 6e-6 (fp32 summation order)
TIMEOUT_S = 180


def _check_tp_gradients(mesh, q_lora_rank: int) -> None:
    """Logits and the gradient of every parameter of a TP-2 model (the family's plan, sequence
    parallel) equal one process's. Parameters TP leaves plain (the MoE router and shared experts,
    fed this rank's sequence slice) hold a partial gradient that data parallelism sums over the TP
    ranks (token_fsdp); summed here by hand."""
    from torch.distributed.tensor import DTensor

    from titanlike.models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_sharding
    from titanlike.models.deepseek_v3.model import DeepSeekV3
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    debug = deepseek_v3_flavors["debugmodel"]
    # The sequence-wise loss needs whole sequences (the trainer gives MoE layers their sequence group).
    args = dataclasses.replace(debug, dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32, ffn_hidden_dim=96,
                               q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=24, moe=dataclasses.replace(debug.moe, hidden_dim=32, seq_aux_loss_coeff=0.0))

    def build():
        return materialize(DeepSeekV3, args, seed=0)

    from titanlike.objectives.causal_lm import lookahead_targets

    torch.manual_seed(0)  # the same tokens and output gradient on every rank
    stream, grad_logits = torch.randint(0, args.vocab_size, (2, 17)), torch.randn(2, 16, args.vocab_size)
    # The multi-token-prediction module (debugmodel: one) trains too: its loss joins the backward.
    tokens, lookahead = stream[:, :-1], lookahead_targets(stream[:, 1:], stream[:, 1:], args.mtp_num_layers)
    ref = build()
    want = ref(tokens, lookahead=lookahead)
    want.backward(grad_logits)
    model = build()
    apply_tensor_parallel(model, mesh, deepseek_v3_sharding, loss_parallel=False)
    got = model(tokens, lookahead=lookahead)
    got.backward(grad_logits)
    what = f"q_lora_rank {q_lora_rank}, tp rank {mesh.get_local_rank()}"
    torch.testing.assert_close(got, want.detach(), atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m: f"logits, {what}: {m}")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            grad = p.grad.full_tensor()
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=mesh.get_group())
        torch.testing.assert_close(grad, grads[name].grad, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")


def _tp_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for q_lora_rank in (48, 0):
        _check_tp_gradients(mesh, q_lora_rank)


def test_tp2_gradients_of_every_parameter_equal_one_process():
    run_on_gloo_ranks(_tp_worker, world=2, timeout_s=TIMEOUT_S, what="tensor-parallel gradient workers")
