"""Activation checkpointing per transformer block: full, every N-th block, or op-level.

Op-level (selective_ac_option = "op") keeps the outputs of the expensive ops
(matmuls and attention) and recomputes the cheap elementwise rest, trading a
little memory for most of the recompute cost of full AC.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Outputs worth keeping: recomputing them costs FLOPs, storing them costs memory once.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_contexts():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Wrap blocks of model.layers in place. mode: none | full | selective."""
    if mode == "none":
        return
    for index, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif selective_ac_option == "op":
            wrapped = checkpoint_wrapper(
                block, context_fn=partial(_op_level_contexts), preserve_rng_state=False
            )
        else:
            every = int(selective_ac_option)
            if index % every:
                continue
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped
