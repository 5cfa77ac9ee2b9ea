"""LLaVA's tensor + sequence parallelism: the language model by its own family's plan, the vision
tower's blocks and the projector split like a decoder's, the image splice on this rank's tokens.

  vision blocks  attention split by heads (wq, wk, wv colwise, wo rowwise), the MLP by hidden units
                 (w1 colwise, w2 rowwise). Sequence parallel over the image's positions where they
                 divide by the TP degree (SigLIP's 16 of the debug tower; CLIP's class token makes
                 most towers' counts odd, 577 at 336 px): the stream is cut to this rank's positions
                 entering the first block and gathered leaving the last, so the patch embedding and
                 what reads the features work on whole images. Otherwise the stream between the
                 blocks stays whole (each rowwise linear all-reduces).
  projector      linear_1 colwise, linear_2 rowwise into whole features on every rank.
  splice         under sequence parallelism the text embeddings are this rank's slice of the
                 sequence: it takes the image index of that slice, and the features' gradient, which
                 each rank then holds for its own placeholders only, is summed over the ranks in
                 backward (without sequence parallelism every rank splices every token: the gradient
                 is already whole).
  language model its family's `shard` (ModelSpec.shard, looked up by the args' language_model).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titanlike.models.common.sharding import (
    ShardingPlan,
    colwise,
    decoder_sharding,
    replicated,
    rowwise,
    shard_modules,
)
from titanlike.models.registry import ShardOptions, get_model_spec

# A ViT block is a decoder block without RoPE: norms, attention and MLP as every decoder's. Without
# sequence parallelism its norms run whole on every rank, on Replicate DTensors of their weights.
_vision_blocks = ShardingPlan(block=decoder_sharding(mlp_inputs=("w1",)).block)
_vision_blocks_whole = _vision_blocks.with_changes(block={"attention_norm": replicated, "ffn_norm": replicated})


class SplicedSlice(ParallelStyle):
    """The splice's style under sequence parallelism: its inputs (embeddings of this rank's slice of
    the sequence, the index of the whole sequence, whole features) become (the slice, the index of
    the slice, the features with a backward that sums their gradient over the TP ranks)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            h, index, features = args
            index = DTensor.from_local(index, mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(1)]).to_local()
            # Identity forward; backward reads the local gradient as a partial sum (Partial) and
            # from_local's backward redistributes it to Replicate: an all-reduce.
            features = DTensor.from_local(features, mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return h, index, features

        return distribute_module(module, device_mesh, input_fn=inputs)


class ReplicatedTowerEnds(ParallelStyle):
    """The tower's modules outside its blocks (the patch embedding, CLIP's class token and pre-norm,
    the position table) computed whole on every rank on Replicate DTensors of their parameters, so
    that every parameter the optimizer steps is a DTensor; the blocks are left to their own styles."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in args)

        # Without a partition function distribute_module replicates every parameter not yet a DTensor:
        # the blocks, sharded before this, keep theirs.
        return distribute_module(module, device_mesh, None, inputs)


def _tower_ends(tower: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The whole stream entering the first block as a plain tensor, cut to this rank's positions
    under sequence parallelism (whose backward gathers the gradient), and gathered leaving the last."""
    keys = list(tower.layers.keys())
    enter = dict(input_layouts=(Replicate(), None), use_local_output=True,
                 desired_input_layouts=(Shard(1) if sequence_parallel else Replicate(), None))
    styles = {f"layers.{keys[0]}": PrepareModuleInput(**enter)}
    if sequence_parallel:
        leave = dict(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
        if len(keys) == 1:
            enter["use_local_input"] = enter.pop("use_local_output")
            styles[f"layers.{keys[0]}"] = PrepareModuleInputOutput(**enter, **leave)
        else:
            styles[f"layers.{keys[-1]}"] = PrepareModuleOutput(**leave)
    return styles


def llava_sharding(model: nn.Module, tp_mesh: DeviceMesh, opts: ShardOptions) -> None:
    """ModelSpec.shard of llava: a whole model, or a pipeline stage without the tower or projector."""
    args = model.model_args
    tp = tp_mesh.size()
    tower, projector = model.vision_tower, model.projector  # None on a pipeline stage without them
    if tower is not None:
        vision_sp = opts.sequence_parallel and args.vision.num_positions % tp == 0
        plan = _vision_blocks if vision_sp else _vision_blocks_whole
        plan(tower, tp_mesh, dataclasses.replace(opts, sequence_parallel=vision_sp))
        parallelize_module(tower, tp_mesh, _tower_ends(tower, vision_sp))
        parallelize_module(tower, tp_mesh, ReplicatedTowerEnds())
    if projector is not None:
        whole = dataclasses.replace(opts, sequence_parallel=False)  # rowwise then all-reduces: whole features
        shard_modules(projector, tp_mesh, {"linear_1": colwise, "linear_2": rowwise}, whole)
    if opts.sequence_parallel:
        shard_modules(model, tp_mesh, {"splice": lambda module, opts: SplicedSlice()}, opts)
    get_model_spec(args.language_model).shard(model.language_model, tp_mesh, opts)


__all__ = ["ReplicatedTowerEnds", "SplicedSlice", "llava_sharding"]
