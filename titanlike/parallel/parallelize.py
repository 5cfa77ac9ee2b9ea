"""Apply every parallelism to one model (or one pipeline stage) as ordered steps.

The order matters:
  1. tensor parallel: replaces parameters by DTensors on the tp mesh;
  2. context parallel: swaps the attention that checkpointing and compile are about to wrap;
  3. mixture of experts: shards experts over the ep and etp meshes, sets each MoE layer's dispatcher and
     sequence group, and names the meshes FSDP shards its parts over (parallel/expert_parallel.py);
  4. activation checkpointing and 5. compile: wrap blocks;
  6. data parallel (FSDP/HSDP) last, so it shards the already TP-sharded parameters over the
     data mesh (a module whose `fsdp_mesh` hook names a mesh is sharded over that mesh
     instead, e.g. experts over expert_fsdp).
Nothing here is specific to a model family: family differences live in the ModelSpec (its
`shard` function) and in the module hooks the steps read (models/protocol.py). The options are
plain values the trainer derives from its config; this module does not read a JobConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.models import protocol
from titanlike.models.spec_types import ShardFn
from titanlike.parallel.activation_checkpoint import CheckpointOptions, apply_activation_checkpointing
from titanlike.parallel.context import apply_context_parallel
from titanlike.parallel.expert_parallel import apply_expert_parallel
from titanlike.parallel.fsdp import apply_fsdp
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel


@dataclass(frozen=True)
class ParallelizeOptions:
    loss_parallel: bool = True
    async_tensor_parallel: bool = False
    context_parallel_rotate_method: str = "allgather"
    activation_checkpoint_mode: str = "none"  # none | full | selective | memory_budget
    selective_ac_option: str = "2"  # every N-th block, or "op"
    checkpoint_options: CheckpointOptions = CheckpointOptions()
    memory_budget: float = 0.5  # activation_checkpoint_mode memory_budget: compiled blocks keep this share
    compile_blocks: bool = False
    compile_backend: str = "inductor"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    cpu_offload: bool = False  # FSDP keeps shards, gradients and optimizer state in host memory
    token_dispatcher: str = "alltoall"  # alltoall | allgather (expert parallelism)


def parallelize_model(model: nn.Module, shard: ShardFn | None, dims: ParallelDims,
                      opts: ParallelizeOptions) -> nn.Module:
    """model (a whole model or a pipeline stage of one) through every step, in place; shard: the
    family's ModelSpec.shard."""
    for step in (_tensor_parallel, _context_parallel, _expert_parallel, _activation_checkpointing, _compile,
                 _data_parallel):
        step(model, shard, dims, opts)
    return model


def _tensor_parallel(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    if not dims.tp_enabled:
        return
    if shard is None:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan")
    apply_tensor_parallel(model, dims.mesh("tp"), shard, loss_parallel=opts.loss_parallel)
    if opts.async_tensor_parallel:
        enable_async_tensor_parallel(dims.mesh("tp"))


def _context_parallel(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    if dims.cp_enabled:
        apply_context_parallel(model, dims.mesh("cp"), opts.context_parallel_rotate_method)


def _expert_parallel(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    apply_expert_parallel(model, ep_mesh=dims.mesh("ep"), sequence_mesh=dims.mesh("sequence"),
                          token_dispatcher=opts.token_dispatcher, etp_mesh=dims.mesh("etp"),
                          experts_mesh=dims.mesh("experts"))


def _activation_checkpointing(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    apply_activation_checkpointing(model, opts.activation_checkpoint_mode, opts.selective_ac_option,
                                   opts.checkpoint_options, opts.memory_budget,
                                   keep_seeded=opts.compile_blocks and dims.tp_enabled)


def _compile(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    if opts.compile_blocks:
        # Per block and in place: parameter names stay unchanged, and every block of the same
        # shape reuses one compiled graph. A vision tower's blocks (extra_layers) too.
        for block in [block for layers in protocol.layer_stacks(model) for block in layers.values()]:
            eager = [m for m in block.modules() if protocol.skips_compile(m)]
            if not eager:
                block.compile(fullgraph=True, backend=opts.compile_backend)
                continue
            # A block holding a module that must stay eager (an MoE layer: data-dependent token
            # counts, collectives with Python-int splits): compile its other children one by one,
            # through their forward. torch 2.13's Module.compile traces from Module._call_impl, which
            # Dynamo skips, so a child of torch.nn's own (the norms) compiled nothing and fullgraph
            # failed the first step ('found no compiled frames'): expert parallelism with compile did.
            _compile_around(block, eager, opts.compile_backend)


def _compile_around(module: nn.Module, eager: list[nn.Module], backend: str) -> None:
    """Compile module's children that hold no module of eager, descending into those that hold one
    but are not one (a checkpoint wrapper around the block)."""
    for child in module.children():
        if any(child is m for m in eager):
            continue
        if any(c is m for c in child.modules() for m in eager):
            _compile_around(child, eager, backend)
        else:
            child.forward = torch.compile(child.forward, fullgraph=True, backend=backend)


def _data_parallel(model, shard, dims: ParallelDims, opts: ParallelizeOptions) -> None:
    reshard = opts.fsdp_reshard_after_forward
    if dims.pp_enabled and reshard == "default":
        # A stage runs the forwards of several microbatches before their backwards: resharding
        # would all-gather every block again per microbatch, and the split-backward (zero-bubble)
        # schedules compute wrong or missing gradients on resharded parameters.
        reshard = "never"
    # Without data parallelism the blocks stay whole, but a module with its own mesh (an MoE layer's
    # experts and router under TP or EP) is still sharded over it.
    apply_fsdp(model, dims.mesh("fsdp") if dims.fsdp_enabled else None, param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype,
               reshard_after_forward=reshard, mesh_named=dims.mesh, cpu_offload=opts.cpu_offload)


def validate_compile_backend(backend: str) -> None:
    """compile.backend must be a backend torch.compile knows: ValueError, one sentence."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"compile.backend {backend!r} is not a torch.compile backend; known: {', '.join(known)}")
