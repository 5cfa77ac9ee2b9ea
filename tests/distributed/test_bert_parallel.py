"""BERT's layouts within the model, on two spawned gloo ranks, against one process:
  - tensor + sequence parallelism (the family's plan): MLM logits, the loss (MLM cross-entropy,
    vocabulary-parallel or not, plus the attached binary loss) and every parameter's gradient, for
    post-norm and pre-norm blocks;
  - context parallelism (load-balanced chunks, bidirectional CP attention with a padding mask,
    both rotate methods): the binary loss is counted once (on the rank holding position 0) and
    loss and gradients summed over the ranks equal one process's.
Parity through train.py (FSDP, PP, CP, TP layouts) lives with the trainer's tests."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from family_checks import materialize, run_on_gloo_ranks

ATOL, RTOL = 2e-5, 1e-4  # fp32 summation order
TIMEOUT_S = 120


def _build(args):
    from titanlike.models.bert import Bert

    model = materialize(Bert, args, seed=0)
    with torch.no_grad():  # norms and biases off their init, so a wrong gradient rule shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.train()


def _check_tp(mesh, pre_norm: bool, loss_parallel: bool) -> None:
    """The trainer's objective: the MLM cross-entropy summed over masked positions (vocabulary
    parallel with loss_parallel) plus the binary loss the model attaches."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel_loss

    from titanlike.models.bert import bert_flavors, bert_sharding
    from titanlike.models.outputs import IGNORE_INDEX, cross_entropy_sum
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    args = dataclasses.replace(bert_flavors["debugmodel_tiny"], vocab_size=96, max_seq_len=32, pre_norm=pre_norm)

    torch.manual_seed(0)  # the same batch and output gradient on every rank
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    fields = dict(token_types=(torch.arange(16) >= 7).long().expand(2, 16),
                  binary_labels=torch.tensor([1, 0]), binary_weights=torch.tensor([2.0, 5.0]))
    labels = torch.where(torch.rand(2, 16) < 0.3, torch.randint(0, args.vocab_size, (2, 16)), IGNORE_INDEX)
    ref = _build(args)
    want = ref(tokens, **fields)
    want_loss = cross_entropy_sum(want, labels)
    want_loss.backward()
    model = _build(args)
    apply_tensor_parallel(model, mesh, bert_sharding, loss_parallel=loss_parallel)
    assert model.output.weight is model.tok_embeddings.weight
    got = model(tokens, **fields)
    with vocab_parallel_loss() if loss_parallel else contextlib.nullcontext():
        loss = cross_entropy_sum(got, labels)
        loss.backward()
    what = f"pre_norm {pre_norm}, loss_parallel {loss_parallel}, tp rank {mesh.get_local_rank()}"
    if loss_parallel:
        got, loss = got.full_tensor(), loss.full_tensor()
    torch.testing.assert_close(got, want.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"logits, {what}: {m}")
    torch.testing.assert_close(loss, want_loss.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"loss, {what}: {m}")
    assert not isinstance(model.binary_head.reported_loss_sum, DTensor)  # the trainer sums it with plain tensors
    torch.testing.assert_close(model.binary_head.reported_loss_sum, ref.binary_head.reported_loss_sum,
                               atol=ATOL, rtol=RTOL)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name} is not sharded or replicated by the plan"
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")


def _check_cp(mesh, rotate_method: str) -> None:
    from titanlike.models.bert import bert_flavors
    from titanlike.models.common.attention import DocumentMask
    from titanlike.models.outputs import IGNORE_INDEX, cross_entropy_sum
    from titanlike.parallel.context import apply_context_parallel, load_balanced_positions, shard_sequence

    args = dataclasses.replace(bert_flavors["debugmodel_tiny"], vocab_size=96, max_seq_len=32)
    torch.manual_seed(0)  # the same batch on every rank
    seq = 16
    tokens = torch.randint(0, args.vocab_size, (2, seq))
    token_types = (torch.arange(seq) >= 7).long().expand(2, seq)
    labels = torch.where(torch.rand(2, seq) < 0.3, torch.randint(0, args.vocab_size, (2, seq)), IGNORE_INDEX)
    document_ids = (torch.arange(seq) >= torch.tensor([[13], [16]])).long()  # sample 0 ends in 3 padding tokens
    mask = DocumentMask.from_document_ids(document_ids, "sdpa", causal=False)
    binary = dict(binary_labels=torch.tensor([1, 0]), binary_weights=torch.tensor([2.0, 5.0]))

    ref = _build(args)
    want = cross_entropy_sum(ref(tokens, mask=mask, token_types=token_types, **binary), labels)
    want.backward()
    model = _build(args)
    apply_context_parallel(model, mesh, rotate_method)
    positions = load_balanced_positions(seq, mesh.size(), mesh.get_local_rank())
    local = cross_entropy_sum(model(shard_sequence(tokens, positions), positions=positions, mask=mask,
                                    token_types=shard_sequence(token_types, positions), **binary),
                              shard_sequence(labels, positions))
    local.backward()
    what = f"cp 2, {rotate_method}, rank {mesh.get_local_rank()}"
    reported = model.binary_head.reported_loss_sum.clone()
    assert (reported.item() > 0) == (mesh.get_local_rank() == 0), what  # position 0 is on rank 0 only
    for total, expected in ((local.detach(), want.detach()), (reported, ref.binary_head.reported_loss_sum)):
        dist.all_reduce(total, group=mesh.get_group())
        torch.testing.assert_close(total, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"loss, {what}: {m}")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()  # every rank has one, the binary head's included (zero off rank 0)
        dist.all_reduce(grad, group=mesh.get_group())
        torch.testing.assert_close(grad, grads[name].grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.parallel.context import ROTATE_METHODS

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    _check_tp(mesh, pre_norm=False, loss_parallel=True)
    _check_tp(mesh, pre_norm=True, loss_parallel=False)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    for rotate_method in ROTATE_METHODS:
        _check_cp(mesh, rotate_method)


def test_tp2_and_cp2_loss_and_gradients_equal_one_process():
    run_on_gloo_ranks(_worker, world=2, timeout_s=TIMEOUT_S, what="parallel workers")
