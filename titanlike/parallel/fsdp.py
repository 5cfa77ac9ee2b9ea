"""FSDP2 / HSDP: shard each transformer block, then the root.

Gradients are reduced with a plain sum (divide factor 1): the loss is already
normalized by the global count of target tokens, so averaging over ranks again
would scale gradients by 1/dp. This is what makes every data-parallel degree
produce the same update as one process.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    mesh_named: Callable[[str], DeviceMesh | None] | None = None,
) -> None:
    """fully_shard every block of model.layers, then the whole model (in place).

    reshard_after_forward: "default" frees gathered block parameters after forward
    (the root keeps them: backward needs them right away), "always" / "never" force it.
    A submodule of a block that declares `fsdp_mesh = "<name>"` (e.g. experts: "expert_fsdp")
    becomes its own FSDP unit over mesh_named(name) first; if that mesh is None (degree 1) its
    parameters stay unsharded and replicated.
    """
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    reshard = reshard_after_forward != "never"
    for block in model.layers.values():
        for module in block.modules():
            own = getattr(module, "fsdp_mesh", None)
            if own is not None and mesh_named is not None and mesh_named(own) is not None:
                fully_shard(module, mesh=mesh_named(own), mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root holds embeddings, final norm and output; its parameters are needed first in
    # backward, so by default they stay gathered after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A factor of 1 needs no pre-scaling: plain SUM collectives (gloo has no PREMUL_SUM).
            module.set_force_sum_reduction_for_comms(True)
