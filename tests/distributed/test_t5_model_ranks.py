"""T5 on two spawned gloo ranks (family_checks.run_on_gloo_ranks): tensor parallelism and FSDP give the
init, loss and gradients of one process. The one-process checks: tests/unit/test_t5_model.py."""

from __future__ import annotations

import torch

from family_checks import run_on_gloo_ranks
from t5_checks import build, tiny_args
from titanlike.models.common.attention import DocumentMask
from titanlike.models.registry import get_model_spec
from titanlike.models.t5 import T5

SPEC = get_model_spec("t5")


# ---------------------------------------------------------------- two ranks: TP (+SP) and FSDP


def test_tensor_parallel_and_fsdp_match_single_process():
    """Two gloo ranks: tensor parallelism (with and without sequence parallelism and loss
    parallelism, both variants, padded encoder inputs), then FSDP: the same init, loss and
    gradients as one process."""
    run_on_gloo_ranks(_check_parallel, world=2, timeout_s=180, what="T5 TP and FSDP on 2 ranks")


def _check_parallel(rank: int) -> None:
    from contextlib import nullcontext

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from titanlike.parallel.fsdp import apply_fsdp
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 320, (2, 16), generator=g)
    decoder_inputs = torch.randint(0, 320, (2, 8), generator=g)
    labels = torch.randint(0, 320, (2, 8), generator=g)
    doc = torch.zeros(2, 16, dtype=torch.long)
    doc[1, 11:] = 1
    mask = DocumentMask.from_document_ids(doc, "sdpa", causal=False)
    cases = [("tp", False, True, True), ("tp", True, False, False), ("tp", True, True, True),
             ("fsdp", False, False, False)]
    for how, tied, sp, lp in cases:
        tag = f"{how} tied={tied} sequence_parallel={sp} loss_parallel={lp}"
        args = tiny_args(tie_word_embeddings=tied, scale_decoder_outputs=tied,
                         feed_forward="relu" if tied else "gated-gelu")
        reference = build(args, seed=21).train()
        with torch.device("meta"):
            model = T5(args)
        if how == "tp":
            apply_tensor_parallel(model, mesh, SPEC.shard, loss_parallel=lp, sequence_parallel=sp)
        else:
            apply_fsdp(model, mesh, param_dtype="float32", reduce_dtype="float32", reshard_after_forward="default")
        model.to_empty(device="cpu")
        model.init_weights(seed=21)
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(full(p), ref_params[name]), f"{tag}: init of {name} differs"
        ref_loss = F.cross_entropy(reference(tokens, mask=mask, decoder_inputs=decoder_inputs).flatten(0, 1),
                                   labels.flatten())
        ref_loss.backward()
        with loss_parallel_ctx() if lp else nullcontext():
            logits = model(tokens, mask=mask, decoder_inputs=decoder_inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        torch.testing.assert_close(full(loss), ref_loss, rtol=1e-5, atol=1e-6, msg=tag)
        # FSDP sums gradients over its ranks (divide factor 1), which both saw the same batch here.
        scale = dist.get_world_size() if how == "fsdp" else 1
        for name, p in model.named_parameters():
            torch.testing.assert_close(full(p.grad) / scale, ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{tag}: grad of {name}: {m}")
