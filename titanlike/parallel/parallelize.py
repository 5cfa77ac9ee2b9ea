"""Apply every parallelism to one model (or one pipeline stage) in the canonical order.

The order matters: tensor parallel first (it replaces parameters by DTensors on
the tp mesh), then context parallel (it swaps the attention of modules that
activation checkpointing and compile are about to wrap), then activation
checkpointing and compile (they wrap blocks), and
FSDP last so it shards the already TP-sharded parameters over the data mesh.
Nothing here is specific to a model family: family differences live in the
ModelSpec (its tensor-parallel plan).
"""

from __future__ import annotations

import torch.nn as nn

from titanlike.config.schema import JobConfig
from titanlike.models.registry import ModelSpec
from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing
from titanlike.parallel.context import apply_context_parallel
from titanlike.parallel.fsdp import apply_fsdp
from titanlike.parallel.parallel_dims import ParallelDims


def parallelize_model(model: nn.Module, spec: ModelSpec, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    if dims.tp_enabled:
        spec.tensor_parallel_plan(
            model,
            dims.mesh("tp"),
            loss_parallel=not cfg.parallelism.disable_loss_parallel,
        )
        if cfg.parallelism.enable_async_tensor_parallel:
            enable_async_tensor_parallel(dims.mesh("tp"))
    if dims.cp_enabled:
        apply_context_parallel(model, dims.mesh("cp"), cfg.parallelism.context_parallel_rotate_method)
    apply_activation_checkpointing(
        model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option
    )
    if cfg.compile.enable and "model" in cfg.compile.components:
        # Per block and in place: parameter names stay unchanged, and every block of the same
        # shape reuses one compiled graph.
        for block in model.layers.values():
            block.compile(fullgraph=True)
    if dims.fsdp_enabled:
        reshard = cfg.parallelism.fsdp_reshard_after_forward
        if dims.pp_enabled and reshard == "default":
            # A stage runs the forwards of several microbatches before their backwards: resharding
            # would all-gather every block again per microbatch, and the split-backward
            # (zero-bubble) schedules compute wrong or missing gradients on resharded parameters.
            reshard = "never"
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=cfg.training.mixed_precision_param,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=reshard,
        )
    return model


def enable_async_tensor_parallel(tp_mesh) -> None:
    """Micro-pipelined TP: inductor splits each TP matmul and overlaps the pieces with their
    all-gather / reduce-scatter. Its kernels exchange data through symmetric memory, so the TP
    group must be registered for it. Takes effect in compiled blocks only (validation requires
    compile and CUDA)."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
