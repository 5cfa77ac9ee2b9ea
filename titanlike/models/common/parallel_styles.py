"""The shared torch ParallelStyles of tensor + sequence parallelism that torch does not ship: what the
style functions of models/common/sharding.py build for the modules they name.

Imported when a job is parallelized, not when a family registers its plan: a ParallelStyle subclass
imports torch.distributed.tensor, about 0.6 s of CPU at every start, `train.py --help` included
(docs/performance.md). A family's own styles live in a module of its own for the same reason.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


def waited(output):
    """output, or for an AsyncCollectiveTensor (the local tensor of an async redistribute, as the linear
    styles' outputs are) a plain copy made once its collective is done. A copy, as autograd sees it:
    the collective's own wait (trigger_wait) returns a tensor whose gradient never reaches the module."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


class WaitedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose local output is a plain tensor. The token embedding's output is the first
    compiled block's input, and AOT autograd (torch 2.13) returns the gradient of an AsyncCollectiveTensor
    input as a plain tensor, where the redistribute's backward needs a DTensor: tensor parallelism with
    compiled blocks failed in the first backward ('Tensor' object has no attribute '_local_tensor'). The copy
    is of this rank's share of the embeddings. The output projection's gathered logits need none: the compiled
    loss takes them as they are (tests/distributed/test_tensor_parity.py, without loss parallelism)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return waited(RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh))


class ReplicatedPositionEmbedding(ParallelStyle):
    """A learned position table kept whole on every TP rank (as Megatron does: it is small), whose
    output (batch or 1, seq, dim) is cut to this rank's sequence slice to match the token
    embeddings' reduce-scattered output. The backward of the cut all-gathers the gradient, so every
    rank's table gets the full, identical gradient."""

    def __init__(self, *, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_as_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def output_slice(mod, output, mesh):
            return output.redistribute(placements=[self.output_layout]).to_local()

        return distribute_module(module, device_mesh, replicate_parameters, inputs_as_dtensor, output_slice)


class ReplicatedModule(ParallelStyle):
    """A module every TP rank computes whole on the same (gathered) input, with its parameters as
    Replicate DTensors: one value on every rank, which FSDP shards like any TP parameter and
    checkpoints see once. Inputs may be plain or Replicate DTensors; the output is plain.

    The output's gradient must come back whole on every rank, which it does when its readers are
    replicated too (BERT's classifier after its pooler) or colwise linears (their backward sums
    their input gradient over the ranks). A reader that consumes it head by head without such a
    linear (DeepSeek-V3's RoPE key, read by each rank's heads directly) holds only its heads' share
    of the gradient: `read_by_heads` makes the output an identity whose backward all-reduces that
    gradient first (Megatron's copy to the tensor-parallel region). Summing a gradient a colwise
    reader already summed would multiply it by the TP degree: that is why it is not the default.
    """

    def __init__(self, *, read_by_heads: bool = False):
        super().__init__()
        self.read_by_heads = read_by_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_as_dtensor(mod, inputs, mesh):
            return tuple(x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor)
                         else DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def output_local(mod, output, mesh):
            out = output.to_local()  # its gradient: Replicate, i.e. whole
            if not self.read_by_heads:
                return out
            # Identity forward; backward reads the local gradient as a partial sum (Partial) and
            # from_local's backward redistributes it to Replicate: an all-reduce.
            return DTensor.from_local(out, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

        return distribute_module(module, device_mesh, replicate_parameters, inputs_as_dtensor, output_local)


class ScoreHead(ParallelStyle):
    """An output projection of one feature (a reward model's score), too small to split: its weight
    is a Replicate DTensor, its input is gathered from the layout between blocks (sequence slices
    under sequence parallelism), and every rank computes the whole (batch, seq, 1) score, a plain
    tensor. The weight's gradient is then whole and equal on every rank, and the input's gradient
    is this rank's slice of it."""

    def __init__(self, *, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gathered(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

        def whole(mod, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, replicate_parameters, gathered, whole)


class HeadSplitParameters(ParallelStyle):
    """The named parameters of a module split on dim 0 (Shard(0)) over the TP ranks with its heads;
    the module reads them with to_local(). Parameters it names but does not have (an optional bias)
    are skipped. Their gradients are complete on each rank (a rank's heads are the only readers of
    its slice), so nothing is summed over the ranks. `gather`: PrepareModuleInput's layouts that
    all-gather the module's input from sequence slices on entry (a Mamba-2 mixer under sequence
    parallelism, models/common/mamba2.py), or None to leave inputs and outputs alone."""

    def __init__(self, names: tuple[str, ...], *, gather: dict | None = None):
        super().__init__()
        self.names = names
        self.gather = gather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path) if path else module
            param = getattr(owner, attr, None)
            if param is None:
                continue
            owner.register_parameter(attr, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))
        if self.gather is not None:
            PrepareModuleInput(**self.gather)._apply(module, device_mesh)
        return module


def replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """distribute_module's partition_fn: every parameter of `module` itself as a Replicate DTensor."""
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))


__all__ = ["HeadSplitParameters", "ReplicatedModule", "ReplicatedPositionEmbedding", "ScoreHead", "replicate_parameters"]
