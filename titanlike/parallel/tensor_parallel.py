"""Tensor + sequence parallelism (Megatron-style) from a family's declarative plan.

A family's plan is a table of module names and style names (TensorParallelPlan): one table for
the top-level modules (embeddings, final norm, output projection) and one for the modules of
every block. This module turns style names into torch's ParallelStyles:

  vocab_embedding     rows (the vocabulary) split over ranks; each rank looks up its rows and the
                      partial sums are reduced straight into the layout between blocks
  position_embedding  a learned position table, replicated; its output is cut to this rank's
                      slice of the sequence (no communication)
  colwise             a linear split by output features (attention heads, MLP hidden units)
  rowwise             a linear split by input features, its output reduced into the layout
                      between blocks
  sequence_norm       a norm between the parallel regions, run on this rank's slice of the
                      sequence (sequence parallelism)
  gather_input        a module whose first input is all-gathered from sequence slices on entry
                      (attention and the MLP need the whole sequence)
  vocab_output        the output projection split by vocabulary; with loss parallel its logits
                      stay sharded (Shard(-1)) for a vocabulary-parallel cross-entropy
  head_norm           a norm over each attention head's features (QK-norm) applied to this rank's
                      heads; its weight stays whole and its gradient is summed over the ranks
  sequence_local      a module that works token by token on this rank's slice of the sequence as a
                      plain tensor, in and out (the residual stream between blocks is local too) (a mixture of experts routes each token on its own; its experts
                      are split by expert parallelism, and its replicated router is data-parallel
                      over the TP ranks, see parallel/expert_parallel.py)
  sequence_replicated a per-token module (norm or linear) run on this rank's slice of the sequence
                      with replicated weights, plain tensors in and out (multi-token prediction's
                      input norms and projection, which feed a block's residual stream)
  replicated          a small module computed whole on every rank from the gathered input (MLA's
                      down projections and latent norms): parameters Replicate DTensors, plain
                      tensors in and out; its output's gradient must come back whole, which it
                      does when colwise linears read it (their backward sums it over the ranks)
  replicated_to_heads as replicated, for an output each rank's local heads read directly (MLA's
                      RoPE key, shared by all heads): each rank holds its heads' share of the
                      output's gradient, so backward sums it over the ranks (forward: identity)
  head_split          a sequence mixer split by heads other than attention (a Mamba-2 mixer): the
                      parameters it names in `head_split_parameters` (per-head vectors, per-channel
                      conv filters, norm weights, laid out head by head) are split on dim 0 with
                      its heads, and it reads them with to_local(); its input is all-gathered
                      from sequence slices on entry as gather_input does; its linears take their
                      own entries (colwise in, rowwise out)
  head_table          a per-head lookup table (T5's relative position bias, stored (heads, buckets)):
                      the parameters it names in `head_split_parameters` are split on dim 0 with the
                      heads, as head_split does, and read with to_local(); its inputs are not
                      activations (lengths) and are left alone; gradients are complete per rank.

A module whose first N positional inputs are all sequence-sharded activations (cross-attention
reads its own stream and the encoder's output) says so with a class attribute `sequence_inputs = N`;
gather_input and head_split then all-gather each of them (default 1: only the first).

Entries of the block table that a block does not have (a dense block's `moe`, a MoE block's
`feed_forward.w1`) are skipped.

With sequence parallelism the activations between the parallel regions stay sharded along the
sequence (Shard(1)), which turns each all-reduce into a reduce-scatter + all-gather pair and
divides norm and residual activation memory by the TP degree.

Linears the float8 converter swapped (tensorwise recipe) get torchao's float8 styles, so
activations are cast to float8 before their all-gathers and output gradients before theirs in
backward; plain linears and the rowwise recipe keep the high-precision styles (as torchtitan).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

STYLES = ("vocab_embedding", "position_embedding", "colwise", "rowwise", "sequence_norm", "gather_input",
          "vocab_output", "head_norm", "sequence_local", "replicated", "replicated_to_heads",
          "sequence_replicated", "head_split", "head_table")


@dataclass(frozen=True)
class TensorParallelPlan:
    """Module name -> style name, for the top-level modules and for the modules of every block
    (`model.layers`). Top-level modules a pipeline stage does not hold are skipped."""

    top: dict[str, str] = field(default_factory=dict)
    block: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, style in {**self.top, **self.block}.items():
            if style not in STYLES:
                raise ValueError(f"tensor-parallel plan: {name!r} has unknown style {style!r}; known: {STYLES}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, *,
                          loss_parallel: bool, sequence_parallel: bool = True) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) over the 1-D tp_mesh in place.

    With loss_parallel the logits stay sharded over the vocabulary as a DTensor (Shard(-1));
    compute the loss inside torch.distributed.tensor.parallel.loss_parallel(). Otherwise they
    are gathered into a plain replicated tensor. With sequence_parallel the sequence length must
    be divisible by the TP degree.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    styles = _Styles(between, loss_parallel, sequence_parallel)
    top = {name: styles.build(style, model, name, plan.top)
           for name, style in plan.top.items() if _present(model, name)}
    top = {name: style for name, style in top.items() if style is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        block_plan = {name: styles.build(style, block, name, plan.block) for name, style in plan.block.items()
                      if _present(block, name)}
        parallelize_module(block, tp_mesh, {n: s for n, s in block_plan.items() if s is not None})
    # parallelize_module replaced tied weights (embedding and output) by two separate DTensors
    # of the same layout; make them one parameter again.
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def validate_tensor_parallel(*, tp: int, seq_len: int, has_plan: bool, model: str, async_tp: bool,
                             compile_blocks: bool, cuda: bool) -> None:
    """The TP rules that are not a family's (its head counts are): ValueError, one sentence."""
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
    if not has_plan:
        raise ValueError(f"model {model} has no tensor-parallel plan, so tensor_parallel_degree must be 1")
    # Sequence parallelism shards the residual stream along the sequence between blocks.
    if seq_len % tp:
        raise ValueError(f"training.seq_len {seq_len} must be divisible by tensor_parallel_degree {tp} "
                         "(sequence parallelism splits the sequence)")


def _present(model: nn.Module, name: str) -> bool:
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


class _Styles:
    """Style names -> ParallelStyle objects, float8-aware."""

    def __init__(self, between, loss_parallel: bool, sequence_parallel: bool):
        self.between, self.loss_parallel, self.sequence_parallel = between, loss_parallel, sequence_parallel

    def build(self, style: str, root: nn.Module, name: str, table: dict[str, str]) -> ParallelStyle | None:
        module = root.get_submodule(name)
        if style == "vocab_embedding":
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=self.between)
        if style == "position_embedding":
            return ReplicatedPositionEmbedding(output_layout=self.between)
        if style == "colwise":
            return (_float8_styles()[0] if _is_float8(module) else ColwiseParallel)()
        if style == "rowwise":
            return (_float8_styles()[1] if _is_float8(module) else RowwiseParallel)(output_layouts=self.between)
        if style == "sequence_norm":
            return SequenceParallel() if self.sequence_parallel else None
        if style == "head_split":
            if not hasattr(module, "head_split_parameters"):
                raise ValueError(f"tensor-parallel plan: {name!r} ({type(module).__name__}) has style head_split but "
                                 "names no head_split_parameters")
            return HeadSplitModule(module.head_split_parameters,
                                   gather=self._gather_layouts(module) if self.sequence_parallel else None)
        if style == "head_table":
            return HeadSplitModule(module.head_split_parameters, gather=None)
        if style == "gather_input":
            if not self.sequence_parallel:
                return None
            layouts = self._gather_layouts(module)
            # The linears that read this input: the plan's colwise entries under this module that
            # it has. Replicated ones (MLA's down projections) take it in high precision, and the
            # colwise ones there read latents instead: the float8 gather is for plain MLPs/attention.
            styles = {n[len(name) + 1:]: s for n, s in table.items()
                      if n.startswith(f"{name}.") and _present(module, n[len(name) + 1:])}
            readers = [n for n, s in styles.items() if s == "colwise"]
            if (readers and not {"replicated", "replicated_to_heads"} & set(styles.values())
                    and all(_is_float8(module.get_submodule(r)) for r in readers)):
                return _float8_styles()[2](fwd_config_submodule_fqn=readers[0], **layouts)
            return PrepareModuleInput(**layouts)
        if style == "sequence_replicated":
            return SequenceParallel(use_local_output=True) if self.sequence_parallel else None
        if style == "head_norm":
            # (batch, seq, heads, head_dim) with this rank's heads: dim 2 is the sharded one.
            return SequenceParallel(sequence_dim=2, use_local_output=True)
        if style == "sequence_local":
            if not self.sequence_parallel:
                return None
            return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                            use_local_input=True, output_layouts=(Shard(1),),
                                            desired_output_layouts=(Shard(1),), use_local_output=True)
        if style in ("replicated", "replicated_to_heads"):
            return ReplicatedModule(sum_output_grad=style == "replicated_to_heads")
        if style == "vocab_output":
            return ColwiseParallel(input_layouts=self.between,
                                   output_layouts=Shard(-1) if self.loss_parallel else Replicate(),
                                   use_local_output=not self.loss_parallel)
        raise ValueError(f"unknown tensor-parallel style {style!r}")

    @staticmethod
    def _gather_layouts(module: nn.Module) -> dict:
        """PrepareModuleInput's layouts that all-gather a module's first input (its first
        `sequence_inputs`) from sequence slices; the other inputs (RoPE angles, document mask) are
        plain values left alone."""
        n_inputs, n_seq = _positional_inputs(module), getattr(module, "sequence_inputs", 1)
        return dict(input_layouts=(Shard(1),) * n_seq + (None,) * (n_inputs - n_seq),
                    desired_input_layouts=(Replicate(),) * n_seq + (None,) * (n_inputs - n_seq))


def _positional_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


class ReplicatedPositionEmbedding(ParallelStyle):
    """A learned position table kept whole on every TP rank (as Megatron does: it is small), whose
    output (batch or 1, seq, dim) is cut to this rank's sequence slice to match the token
    embeddings' reduce-scattered output. The backward of the cut all-gathers the gradient, so every
    rank's table gets the full, identical gradient."""

    def __init__(self, *, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_as_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def output_slice(mod, output, mesh):
            return output.redistribute(placements=[self.output_layout]).to_local()

        return distribute_module(module, device_mesh, _replicate_params, inputs_as_dtensor, output_slice)


class ReplicatedModule(ParallelStyle):
    """A module every TP rank computes whole on the same (gathered) input, with its parameters as
    Replicate DTensors: one value on every rank, which FSDP shards like any TP parameter and
    checkpoints see once. Inputs may be plain or Replicate DTensors; the output is plain.

    The gradient rule is the point. The output's readers are head-split, so in backward each rank
    holds only its heads' share of the output's gradient. A colwise linear reading the output sums
    its input gradient over the ranks itself; then the gradient arriving here is whole, and so are
    the weight and input gradients computed from it. Where the local heads read the output
    directly, sum_output_grad makes the output an identity whose backward all-reduces the
    gradient first (Megatron's copy to the tensor-parallel region). Summing a gradient a colwise
    reader already summed would multiply it by the TP degree, hence two styles.
    """

    def __init__(self, *, sum_output_grad: bool):
        super().__init__()
        self.sum_output_grad = sum_output_grad

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_as_dtensor(mod, inputs, mesh):
            return tuple(x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor)
                         else DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def output_local(mod, output, mesh):
            out = output.to_local()  # its gradient: Replicate, i.e. whole on every rank
            if self.sum_output_grad:
                # Identity forward; backward reads the local gradient as a partial sum (Partial)
                # and from_local's backward redistributes it to Replicate: an all-reduce.
                out = DTensor.from_local(out, mesh, [Replicate()], run_check=False).to_local(
                    grad_placements=[Partial()])
            return out

        return distribute_module(module, device_mesh, _replicate_params, inputs_as_dtensor, output_local)


class HeadSplitModule(ParallelStyle):
    """The `head_split` style: the named parameters of a mixer split on dim 0 (Shard(0)) over the TP
    ranks with its heads; gather: PrepareModuleInput layouts for its input (sequence parallel), or
    None. Parameters it names but does not have (an optional bias) are skipped. Their gradients
    are complete on each rank (a rank's heads are the only readers of its slice), so nothing is
    summed over the ranks."""

    def __init__(self, names: tuple[str, ...], *, gather: dict | None):
        super().__init__()
        self.names, self.gather = names, gather

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


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))


def _is_float8(module: nn.Module) -> bool:
    from titanlike.models.converters import is_float8_tensorwise_linear

    return is_float8_tensorwise_linear(module)


def _float8_styles():
    from titanlike.models.converters import float8_tensor_parallel_styles

    return float8_tensor_parallel_styles()


__all__ = ["STYLES", "HeadSplitModule", "ReplicatedModule", "ReplicatedPositionEmbedding", "TensorParallelPlan",
           "apply_tensor_parallel"]
