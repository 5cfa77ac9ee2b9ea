"""Activation checkpointing per transformer block: full, every N-th block, or op-level.

Op-level (selective_ac_option = "op") is torchtitan's policy: keep the outputs of attention, of
every second matmul, of reduce-scatters and of max (float8's scaling amax, a scalar; not the
full-size abs it is taken of, as torchtitan's own list no longer does), and recompute the rest (the
other matmuls and the cheap elementwise ops), trading a little memory for most of the recompute
cost of full AC.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlike.models import protocol

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
# Outputs worth keeping: recomputing them costs FLOPs (or a collective), storing them costs memory once.
_SAVE_OPS = {
    *_MATMULS,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_level_contexts():
    matmuls = {False: 0, True: 0}  # counted apart in the forward and in its recompute

    def policy(ctx, op, *args, **kwargs):
        if op in _MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _seeded_kept_contexts():
    """Full checkpointing that keeps the outputs of seeded operators (attention's SDPA kernels, tagged
    nondeterministic_seeded for their dropout; dropout itself) and recomputes everything else. A
    compiled block under tensor parallelism needs it: when such a block recomputes a seeded operator,
    AOT autograd (torch 2.13) saves its RNG state after the DeviceMesh it also saves, where the runtime
    expects tensors only ('expected all tensors_saved_with_vc_check to be Tensors'). Kept, the attention
    output costs about one more block input per block (its heads are this rank's)."""
    def policy(ctx, op, *args, **kwargs):
        seeded = isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
        return CheckpointPolicy.MUST_SAVE if seeded else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@dataclass(frozen=True)
class CheckpointOptions:
    """torch.utils.checkpoint's own settings for every wrapped block (activation_checkpoint.*)."""

    preserve_rng_state: bool = False  # replay RNG in recomputation: only dropout needs it
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_ac_option: str,
                                   options: CheckpointOptions = CheckpointOptions(),
                                   memory_budget: float = 0.5, keep_seeded: bool = False) -> None:
    """Wrap blocks of model.layers (and of its extra_layers, models/protocol.py) in place. mode: none | full | selective | memory_budget.
    keep_seeded: a block checkpointed whole keeps its seeded operators' outputs (_seeded_kept_contexts:
    compiled blocks under tensor parallelism).

    memory_budget wraps nothing: torch.compile's min-cut partitioner decides what each compiled
    block recomputes, keeping about `memory_budget` of the activations it would keep without
    recomputation. That budget is a process-wide torch setting, read when a block is compiled.
    """
    if mode == "none":
        return
    if mode == "memory_budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = memory_budget
        return
    wrap = partial(checkpoint_wrapper, preserve_rng_state=options.preserve_rng_state,
                   determinism_check=options.determinism_check, debug=options.debug, early_stop=options.early_stop)
    for layers in protocol.layer_stacks(model):  # model.layers, and a vision tower's blocks
        for name, block in list(layers.items()):
            how = checkpointing(name, mode, selective_ac_option)
            if how is not None:
                if how == "op":
                    layers[name] = wrap(block, context_fn=partial(_op_level_contexts))
                else:
                    layers[name] = wrap(block, context_fn=_seeded_kept_contexts) if keep_seeded else wrap(block)


def checkpointing(layer: str, mode: str, selective_ac_option: str) -> str | None:
    """How the block with layer id `layer` (its key in model.layers) is checkpointed: "full", "op" or
    None. "Every N-th block" counts layer ids, so a pipeline stage checkpoints the blocks it would
    checkpoint in the whole model."""
    if mode == "full":
        return "full"
    if mode != "selective":
        return None
    if selective_ac_option == "op":
        return "op"
    return "full" if int(layer) % int(selective_ac_option) == 0 else None
