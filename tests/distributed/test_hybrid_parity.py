"""The hybrid family (Mamba-2, attention and MLP layers by pattern) under every parallelism reproduces
its single-process run through train.py: the debugmodel_tiny flavor ("M-M*M-": two Mamba groups,
chunks of 16 tokens), fp32, same global batch, 4 steps, on short documents with document masking
(test_document_masking_parity.py's data), so that the Mamba layers' state and conv resets at
document starts are exercised in every layout.

What the layouts check:
- FSDP 2 (full activation checkpointing), then resuming its step-2 checkpoint at TP 2 x CP 2 (op-level
  selective checkpointing): the Mamba-2 mixer split by head groups
  (in_proj colwise, out_proj rowwise, conv filters, per-head vectors and gated norm head_split),
  sequence parallel between; context parallelism carrying the conv inputs and the scan's state
  across the load-balanced pieces of the sequence (exact); the resumed steps equal the uninterrupted;
- PP 2 by cost (1F1B) and PP 2 x CP 2 with one-layer stages, two of them a lone MLP;
the model-level layouts of every flavor (tests/layouts) check TP 2 alone (the former test_tp2 here).
And directly, on spawned gloo ranks: the gradient of every parameter under TP 2 equals one process's
(a wrong split of a per-head parameter leaves the loss almost unchanged), and a model under CP 2
gives one process's logits and gradients, with and without document masks.
Tolerances: test_fsdp_parity.py's (losses rel 2e-5, grad norms rel 5e-4).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import test_document_masking_parity as masking
from conftest import saving_every_2_steps, train_metrics
from family_checks import materialize, run_on_gloo_ranks
from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed
short_documents = masking.short_documents  # the fixture: short documents, several per 64-token sample

HYBRID = ("--model.name", "hybrid", "--model.flavor", "debugmodel_tiny", "--training.steps", "4",
          *masking.DOC_MASKING)


@pytest.fixture(scope="module")
def run(short_documents):
    def launch(tmp_path, name, *extra, nproc=1):
        return train_metrics(tmp_path, name, *HYBRID, "--training.dataset", "text", "--training.dataset_path",
                             short_documents, *extra, nproc=nproc)

    return launch


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run):
    return run(tmp_path_factory.mktemp("hybrid_ref"), "single", "--training.local_batch_size", "8")


def test_reference_learns(reference):
    assert reference[-1]["loss"] < reference[0]["loss"]


POOLED = (*HYBRID, *masking.SHORT_DOCUMENTS)  # the jobs below run in the shared launches of their world size
SAVE = saving_every_2_steps("hybrid_fsdp2")


# Activation checkpointing wraps blocks of three kinds (recomputation changes no number).
@pytest.mark.train_run(*POOLED, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full", *SAVE,
                       name="fsdp2", nproc=2)
@pytest.mark.train_run(*POOLED, "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree",
                       "2", "--training.local_batch_size", "8", "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "op", *SAVE, "--checkpoint.load_step", "2",
                       name="resume_tp2cp2", nproc=4, after="fsdp2")
def test_fsdp2_then_resume_at_tp2_cp2(train_runs, reference):
    got = train_runs["fsdp2"].metrics
    assert_same_curve(got, reference)
    assert_same_curve(train_runs["resume_tp2cp2"].metrics, got[2:])


@pytest.mark.train_run(*POOLED, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_microbatch_size", "2", "--training.local_batch_size", "8",
                       nproc=2)
def test_pp2_1f1b_by_cost(train_run, reference):
    assert_same_curve(train_run.metrics, reference)


@pytest.mark.train_run(*POOLED, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                       "--parallelism.pipeline_parallel_layers_per_stage", "1",
                       "--parallelism.pipeline_parallel_microbatch_size", "2",
                       "--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8", nproc=4)
def test_pp2_one_layer_stages_x_cp2(train_run, reference):
    # Six one-layer stages, two of them a lone MLP ("-"): nothing for CP to switch there, which is
    # fine; the whole model's hooks are checked once, before the split.
    assert_same_curve(train_run.metrics, reference)


# Direct checks on spawned gloo ranks ------------------------------------------------------------

ATOL, RTOL = 2e-5, 1e-4  # fp32 summation order
TIMEOUT_S = 180
VOCAB, SEQ = 128, 32
EOS = 7  # a token that ends documents in the data below


def _build(args):
    from titanlike.models.hybrid import HybridModel

    model = materialize(HybridModel, args, seed=0)
    with torch.no_grad():  # per-head parameters away from their init, so a wrong split shows
        for name, p in model.named_parameters():
            if name.endswith((".D", "dt_bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def _data():
    torch.manual_seed(0)  # the same on every rank
    tokens = torch.randint(8, VOCAB, (2, SEQ))
    tokens[0, [5, 6, 19]] = EOS  # documents of 6, 1, 13 and 12 tokens; one sample without a boundary
    return tokens, torch.randn(2, SEQ, VOCAB)


def _grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor()
        else:  # plain parameters hold this rank's share of the gradient
            grad = p.grad.clone()
            dist.all_reduce(grad)
            out[name] = grad
    return out


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _tp_gradients(mesh, args, masked: bool) -> None:
    from titanlike.models.common.attention import DocumentMask
    from titanlike.models.hybrid import hybrid_sharding
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    tokens, grad_logits = _data()
    mask = DocumentMask.from_tokens(tokens, EOS, "sdpa") if masked else None
    ref = _build(args)
    want = ref(tokens, mask=mask)
    want.backward(grad_logits)
    model = _build(args)
    apply_tensor_parallel(model, mesh, hybrid_sharding, loss_parallel=False)
    got = model(tokens, mask=mask)
    got.backward(grad_logits)
    what = f"TP 2, masked {masked}, rank {mesh.get_local_rank()}"
    _check(got, want.detach(), f"logits, {what}")
    reference = dict(ref.named_parameters())
    for name, grad in _grads(model).items():
        _check(grad, reference[name].grad, f"grad {name}, {what}")


def _cp_exact(mesh, args, masked: bool, rotate: str) -> None:
    from titanlike.models.common.attention import DocumentMask
    from titanlike.parallel.context import apply_context_parallel, load_balanced_positions, shard_sequence

    tokens, grad_logits = _data()
    ref = _build(args)
    want = ref(tokens, mask=DocumentMask.from_tokens(tokens, EOS, "sdpa") if masked else None)
    want.backward(grad_logits)
    model = _build(args)
    assert apply_context_parallel(model, mesh, rotate) == 4  # 1 attention, 3 Mamba-2 mixers
    positions = load_balanced_positions(SEQ, 2, mesh.get_local_rank())
    # CP's mask: document ids of the whole sequence, no kernel (the CP attention builds its own).
    mask = DocumentMask.from_tokens(tokens, EOS, None) if masked else None
    got = model(shard_sequence(tokens, positions), positions=positions, mask=mask)
    got.backward(shard_sequence(grad_logits, positions))
    what = f"CP 2 ({rotate}), masked {masked}, rank {mesh.get_local_rank()}"
    _check(got, shard_sequence(want.detach(), positions), f"logits, {what}")
    reference = dict(ref.named_parameters())
    for name, grad in _grads(model).items():
        _check(grad, reference[name].grad, f"grad {name}, {what}")


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.models.hybrid import hybrid_flavors

    # Chunks of 8: several per CP piece (8 tokens) and a remainder in none; two groups of two heads.
    args = dataclasses.replace(hybrid_flavors["debugmodel_tiny"], vocab_size=VOCAB,
                               mamba=dataclasses.replace(hybrid_flavors["debugmodel_tiny"].mamba, chunk_size=8))
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for masked in (False, True):
        _tp_gradients(tp, args, masked)
    cp = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    _cp_exact(cp, args, masked=False, rotate="allgather")
    _cp_exact(cp, args, masked=True, rotate="alltoall")


def test_tp2_gradients_and_cp2_outputs_equal_one_process():
    run_on_gloo_ranks(_worker, world=2, timeout_s=TIMEOUT_S, what="hybrid TP/CP workers")
