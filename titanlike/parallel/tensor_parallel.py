"""Tensor + sequence parallelism: the generic mechanics around a family's own sharding.

What is split, and how, is the family's: its ModelSpec.shard (a ShardingPlan of
models/common/sharding.py for every built-in family) shards a whole model or a pipeline stage of
one over the TP mesh with torch ParallelStyles. This module applies it, makes tied weights one
parameter again afterwards, turns on async TP, and checks the rules that are no family's.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titanlike.models import protocol
from titanlike.models.spec_types import ShardFn, ShardOptions


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, shard: ShardFn, *, loss_parallel: bool,
                          sequence_parallel: bool = True) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) over the 1-D tp_mesh in place with
    the family's `shard`.

    With loss_parallel the logits stay sharded over the vocabulary as a DTensor (Shard(-1));
    compute the loss inside torch.distributed.tensor.parallel.loss_parallel(). Otherwise they
    are gathered into a plain replicated tensor. With sequence_parallel the sequence length must
    be divisible by the TP degree.
    """
    shard(model, tp_mesh, ShardOptions(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel))
    # Sharding replaced tied weights (embedding and output) by two separate DTensors of the same
    # layout; make them one parameter again.
    protocol.retie_weights(model)


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Micro-pipelined TP: inductor splits each TP matmul and overlaps the pieces with their
    all-gather / reduce-scatter. Its kernels exchange data through symmetric memory, so the TP
    group must be registered for it. Takes effect in compiled blocks only (validation requires
    compile and CUDA)."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def validate_tensor_parallel(*, tp: int, seq_len: int, shardable: bool, model: str, async_tp: bool,
                             compile_blocks: bool, cuda: bool) -> None:
    """The TP rules that are not a family's (its head counts are): ValueError, one sentence.
    shardable: the family has a shard function (ModelSpec.shard)."""
    if async_tp:
        if tp <= 1:
            raise ValueError("parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")
        if not compile_blocks:
            raise ValueError("parallelism.enable_async_tensor_parallel works through torch.compile: "
                             "also set compile.enable with the model component")
        if not cuda:
            raise ValueError("parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
                             "this machine has none")
    if tp <= 1:
        return
    if not shardable:
        raise ValueError(f"model {model} has no tensor-parallel plan, so tensor_parallel_degree must be 1")
    # Sequence parallelism shards the residual stream along the sequence between blocks.
    if seq_len % tp:
        raise ValueError(f"training.seq_len {seq_len} must be divisible by tensor_parallel_degree {tp} "
                         "(sequence parallelism splits the sequence)")


__all__ = ["apply_tensor_parallel", "enable_async_tensor_parallel", "validate_tensor_parallel"]
