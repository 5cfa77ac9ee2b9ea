"""FSDP2 / HSDP: shard each transformer block, then the root.

Gradients are reduced with a plain sum (divide factor 1): the loss is already
normalized by the global count of target tokens, so averaging over ranks again
would scale gradients by 1/dp. This is what makes every data-parallel degree
produce the same update as one process.

CPU offload (training.enable_cpu_offload, FSDP2's CPUOffloadPolicy): every FSDP unit keeps its
sharded parameters and gradients in host memory; they are copied to the device for each all-gather
and back after each reduce-scatter, and the optimizer (its state created next to its parameters)
steps on the host. Pinned host memory makes those copies asynchronous; it needs CUDA.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titanlike.models import protocol

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    mesh_named: Callable[[str], DeviceMesh | None] | None = None,
    cpu_offload: bool = False,
) -> None:
    """fully_shard every block of model.layers (and of its extra_layers: a vision tower's), then the
    whole model (in place).

    reshard_after_forward: "default" frees gathered block parameters after forward
    (the root keeps them: backward needs them right away), "always" / "never" force it.
    A submodule of a block whose `fsdp_mesh` hook names a mesh (an MoE layer's experts:
    "expert_fsdp", its router: "token_fsdp") becomes its own FSDP unit over mesh_named(name) first,
    innermost first. If that mesh is None (degree 1) its parameters stay whole; parameters that are
    already DTensors on another mesh (experts split by expert parallelism) are then left out of the
    enclosing units. mesh None: no data parallelism; only those submodules are sharded.
    cpu_offload: every unit keeps its shards in host memory (see the module docstring).
    """
    # torch warns when a wrapped module returns a view (a linear with bias over (batch, seq, dim)
    # inputs does: BERT's output projection), because an in-place op on it would skip FSDP's
    # pre-backward hook. The trainer and the pipeline loss only read model outputs, never write them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    reshard = reshard_after_forward != "never"
    ignored: set[nn.Parameter] = set()
    for block in [block for layers in protocol.layer_stacks(model) for block in layers.values()]:
        # reversed pre-order: every submodule comes before the modules that contain it.
        for module in reversed(list(block.modules())):
            own = protocol.fsdp_mesh(module)
            if own is None:
                continue
            own_mesh = mesh_named(own) if mesh_named is not None else None
            if own_mesh is None:
                ignored.update(p for p in module.parameters(recurse=False) if isinstance(p, DTensor))
            elif own_mesh is not mesh:
                fully_shard(module, mesh=own_mesh, mp_policy=mp, reshard_after_forward=reshard,
                            shard_placement_fn=_expert_placement(own_mesh), ignored_params=ignored or None,
                            offload_policy=offload)
        if mesh is not None:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None,
                        offload_policy=offload)
    if mesh is not None:
        # The root holds embeddings, final norm and output; its parameters are needed first in
        # backward, so by default they stay gathered after forward.
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always",
                    ignored_params=ignored or None, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A factor of 1 needs no pre-scaling: plain SUM collectives (gloo has no PREMUL_SUM).
            module.set_force_sum_reduction_for_comms(True)


def _expert_placement(mesh: DeviceMesh):
    """Shard dim 0 when it splits evenly over the mesh's shard dimension, else dim 1 (an expert
    group of fewer experts than ranks: sharding within each expert keeps every rank busy)."""
    shards = mesh.size(-1)

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(0) if local.shape[0] % shards == 0 or local.ndim < 2 else Shard(1)

    return placement


def validate_cpu_offload(enabled: bool, *, fsdp_enabled: bool, dp_shard: int) -> None:
    """training.enable_cpu_offload offloads FSDP's shards: ValueError, one sentence, without FSDP."""
    if enabled and not fsdp_enabled:
        raise ValueError("training.enable_cpu_offload offloads FSDP's shards, so it needs data_parallel_shard_degree > 1 "
                         f"(this layout has {dp_shard})")
