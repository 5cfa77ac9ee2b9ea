"""Llama 3 on spawned gloo ranks (family_checks.run_on_gloo_ranks), real process groups: FSDP2, FSDP x TP
and TP give the init, logits, loss and gradients of one process. The one-process checks:
tests/unit/test_llama3_model.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from family_checks import run_on_gloo_ranks
from llama3_checks import build, tiny_args
from titanlike.models.llama3 import Transformer
from titanlike.models.registry import get_model_spec

SPEC = get_model_spec("llama3")


# ---------------------------------------------------------------- spawned gloo ranks: FSDP2, FSDP x TP, TP


TIMEOUT_S = 240


def test_sharded_init_and_tensor_parallelism_equal_one_process():
    """One world of 4 spawned ranks (started once): FSDP2 over the 4 ranks with uneven shards, FSDP x TP
    (2 x 2, _StridedShard placements), then TP over each pair of ranks, tied or not, with and without
    sequence and loss parallelism: the init, the logits, the loss and every gradient of one process."""
    run_on_gloo_ranks(_check_on_four_ranks, world=4, timeout_s=TIMEOUT_S, what="FSDP2, FSDP x TP and TP on 4 ranks")


def _check_on_four_ranks(rank: int) -> None:
    _check_fsdp_init(rank)
    _check_fsdp_tp_init(rank)
    _check_tp(rank)


def _check_fsdp_init(rank: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # An odd vocab and ffn size make FSDP's dim-0 shards uneven.
    for tied in (False, True):
        args = tiny_args(vocab_size=333, multiple_of=1, ffn_dim_multiplier=1.01, tie_word_embeddings=tied)
        reference = build(args, seed=1234)
        with torch.device("meta"):
            model = Transformer(args)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(seed=1234)
        ref_params = dict(reference.named_parameters())
        names = [n for n, _ in model.named_parameters()]
        assert names == list(ref_params), (names, list(ref_params))
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            assert torch.equal(p.full_tensor(), ref_params[name]), f"rank {rank}: {name} differs"
        if tied:
            assert model.output.weight is model.tok_embeddings.weight
        # The sharded model must also compute what the reference computes.
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def _check_tp(rank: int) -> None:
    from contextlib import nullcontext

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    g = torch.Generator().manual_seed(0)
    for tied, sp, lp in [(False, True, True), (False, False, False), (False, True, False), (True, True, True)]:
        tag = f"tied={tied} sequence_parallel={sp} loss_parallel={lp}"
        args = tiny_args(n_layers=2, tie_word_embeddings=tied)
        reference = build(args, seed=21)
        with torch.device("meta"):
            model = Transformer(args)
        apply_tensor_parallel(model, mesh, SPEC.shard, loss_parallel=lp, sequence_parallel=sp)
        if tied:
            assert model.output.weight is model.tok_embeddings.weight
        model.to_empty(device="cpu")
        model.init_weights(seed=21)
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(full(p), ref_params[name]), f"{tag}: init of {name} differs"
        if tied:
            assert model.output.weight is model.tok_embeddings.weight

        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        with loss_parallel_ctx() if lp else nullcontext():
            logits = model(tokens)
            assert isinstance(logits, DTensor) == lp, tag
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6, msg=tag)
        for name, p in model.named_parameters():
            torch.testing.assert_close(full(p.grad), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{tag}: grad of {name}: {m}")


def _check_fsdp_tp_init(rank: int) -> None:
    # FSDP over TP shards dim 0 twice (_StridedShard): the init must still slice correctly.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    args = tiny_args(n_layers=2, vocab_size=333)
    reference = build(args, seed=5)
    with torch.device("meta"):
        model = Transformer(args)
    apply_tensor_parallel(model, mesh["tp"], SPEC.shard, loss_parallel=False)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    ref_params = dict(reference.named_parameters())
    strided = 0
    for name, p in model.named_parameters():
        strided += "_StridedShard" in str(p.placements)
        assert torch.equal(p.full_tensor(), ref_params[name]), name
    assert strided > 0, "expected FSDP x TP to produce _StridedShard placements"
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
