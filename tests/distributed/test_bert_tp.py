"""BERT under tensor + sequence parallelism (the family's plan, two spawned gloo ranks): MLM logits,
the binary loss and the gradient of every parameter equal one process's, for post-norm and
pre-norm blocks. Parity through train.py (FSDP, PP, CP, TP layouts) lives with the trainer's tests."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ATOL, RTOL = 2e-5, 1e-4  # fp32 summation order
TIMEOUT_S = 120


def _check(mesh, pre_norm: bool) -> None:
    from torch.distributed.tensor import DTensor

    from titanlike.models.bert import Bert, bert_flavors, bert_tp_plan
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    args = dataclasses.replace(bert_flavors["debugmodel_tiny"], vocab_size=96, max_seq_len=32, pre_norm=pre_norm)

    def build():
        with torch.device("meta"):
            model = Bert(args)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        with torch.no_grad():  # norms and biases off their init, so a wrong gradient rule shows
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        return model.train()

    torch.manual_seed(0)  # the same batch and output gradient on every rank
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    fields = dict(token_types=(torch.arange(16) >= 7).long().expand(2, 16),
                  binary_labels=torch.tensor([1, 0]), binary_weights=torch.tensor([2.0, 5.0]))
    grad_logits = torch.randn(2, 16, args.vocab_size)
    ref = build()
    want = ref(tokens, **fields)
    want.backward(grad_logits)
    model = build()
    apply_tensor_parallel(model, mesh, bert_tp_plan(), loss_parallel=False)
    assert model.output.weight is model.tok_embeddings.weight
    got = model(tokens, **fields)
    got.backward(grad_logits)
    what = f"pre_norm {pre_norm}, tp rank {mesh.get_local_rank()}"
    torch.testing.assert_close(got, want.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"logits, {what}: {m}")
    assert not isinstance(model.binary_head.reported_loss_sum, DTensor)  # the trainer sums it with plain tensors
    torch.testing.assert_close(model.binary_head.reported_loss_sum, ref.binary_head.reported_loss_sum,
                               atol=ATOL, rtol=RTOL)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name} is not sharded or replicated by the plan"
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}, {what}: {m}")


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for pre_norm in (False, True):
            _check(mesh, pre_norm)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp2_logits_binary_loss_and_gradients_equal_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(os.path.join(tmp, "store"),), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail(f"tensor-parallel workers did not finish within {TIMEOUT_S} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
