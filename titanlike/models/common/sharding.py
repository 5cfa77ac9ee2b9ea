"""Tensor + sequence parallelism (Megatron-style): the shared pieces a family's `shard` is built from.

A family's `shard(model, tp_mesh, opts)` (ModelSpec.shard) shards a whole model, or a pipeline stage
of one, over the 1-D TP mesh in place. Most are a `ShardingPlan`: module name -> style, one table
for the top-level modules (embeddings, final norm, output projection) and one for the modules of
every block of `model.layers`; names a model or a stage does not hold are skipped (a dense block's
`moe`, a MoE block's `feed_forward.w1`, a stage without the output projection). A style is a
function (module, ShardOptions) -> torch ParallelStyle, or None to leave the module alone; the
shared ones:

  vocab_embedding     rows (the vocabulary) split over ranks; each rank looks up its rows and the
                      partial sums are reduced straight into the layout between blocks
  position_embedding  a learned position table, replicated; its output is cut to this rank's
                      slice of the sequence (no communication)
  colwise             a linear split by output features (attention heads, MLP hidden units)
  rowwise             a linear split by input features, its output reduced into the layout
                      between blocks
  sequence_norm       a norm between the parallel regions, run on this rank's slice of the
                      sequence (sequence parallelism)
  gather_input(...)   a module whose first input is all-gathered from sequence slices on entry
                      (attention and the MLP need the whole sequence); `readers` names the linears
                      that read it, so a float8 all-gather can be used when all of them are float8
  vocab_output        the output projection split by vocabulary; with loss parallel its logits
                      stay sharded (Shard(-1)) for a vocabulary-parallel cross-entropy
  head_norm           a norm over each attention head's features (QK-norm) applied to this rank's
                      heads; its weight stays whole and its gradient is summed over the ranks
  sequence_local      a module that works token by token on this rank's slice of the sequence as a
                      plain tensor, in and out (a mixture of experts routes each token on its own;
                      its experts are split by expert parallelism, and its replicated router is
                      data-parallel over the TP ranks, see parallel/expert_parallel.py)
  sequence_replicated a per-token module (norm or linear) run on this rank's slice of the sequence
                      with replicated weights, plain tensors in and out (multi-token prediction's
                      input norms and projection, BERT's post-norm LayerNorms)
  replicated          a small module computed whole on every rank from the gathered input (BERT's
                      pooler, MLA's down projections): parameters Replicate DTensors, plain tensors
                      in and out (ReplicatedModule says when its output's gradient is whole)
  split_heads         the parameters a module names in `head_split_parameters` (models/protocol.py)
                      split on dim 0 with its heads and read with to_local(); inputs left alone
                      (T5's relative-bias tables, lengths in, a per-head bias out)

Styles of one family's layers live with the family (DeepSeek-V3's models/deepseek_v3/sharding.py,
the Mamba-2 mixer's in models/common/mamba2.py): a new kind of layer brings its own style.

With sequence parallelism the activations between the parallel regions stay sharded along the
sequence (Shard(1)), which turns each all-reduce into a reduce-scatter + all-gather pair and
divides norm and residual activation memory by the TP degree.

Linears the float8 converter swapped (tensorwise recipe) get torchao's float8 styles, so
activations are cast to float8 before their all-gathers and output gradients before theirs in
backward; plain linears and the rowwise recipe keep the high-precision styles (as torchtitan).

A plan is data, built when a family registers; the styles it names build their ParallelStyles when a
job is parallelized. So the style functions import torch.distributed.tensor when they run (about
0.6 s of CPU at every start otherwise, `--help` included: docs/performance.md), and the
ParallelStyle subclasses live in models/common/parallel_styles.py, imported then too.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import torch.nn as nn

from titanlike.models import protocol
from titanlike.models.spec_types import ShardOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel.style import ParallelStyle

# A style: how one module is sharded, given the job's options; None leaves it alone.
Style = Callable[[nn.Module, ShardOptions], "ParallelStyle | None"]


def between_blocks(opts: ShardOptions) -> Placement:
    """The residual stream's layout between the parallel regions: sequence slices, or whole."""
    from torch.distributed.tensor import Replicate, Shard

    return Shard(1) if opts.sequence_parallel else Replicate()


@dataclass(frozen=True)
class ShardingPlan:
    """Module name -> style for the top-level modules (`top`) and for those of every block of
    `model.layers` (`block`). Called as a family's `shard(model, tp_mesh, opts)`."""

    top: Mapping[str, Style] = field(default_factory=dict)
    block: Mapping[str, Style] = field(default_factory=dict)

    def __call__(self, model: nn.Module, tp_mesh: DeviceMesh, opts: ShardOptions) -> None:
        shard_modules(model, tp_mesh, self.top, opts)
        for block in model.layers.values():
            shard_modules(block, tp_mesh, self.block, opts)

    def with_changes(self, *, top: Mapping[str, Style] | None = None, block: Mapping[str, Style] | None = None,
                     drop: tuple[str, ...] = ()) -> ShardingPlan:
        """This plan with entries added or replaced and the names in `drop` removed (from either table)."""
        def merged(table, extra):
            return {name: style for name, style in {**table, **(extra or {})}.items() if name not in drop}

        return dataclasses.replace(self, top=merged(self.top, top), block=merged(self.block, block))


def shard_modules(root: nn.Module, tp_mesh: DeviceMesh, table: Mapping[str, Style], opts: ShardOptions) -> None:
    """parallelize_module over the entries of `table` that root holds and whose style applies."""
    styles = {}
    for name, style in table.items():
        module = _submodule(root, name)
        if module is not None and (built := style(module, opts)) is not None:
            styles[name] = built
    if styles:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(root, tp_mesh, styles)


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    """root's submodule `name`, or None where a module on the path is absent (set to None by a
    pipeline split, or a block kind without it)."""
    module = root
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


# The shared styles -----------------------------------------------------------------------------


def vocab_embedding(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from torch.distributed.tensor import Replicate

    from titanlike.models.common.parallel_styles import WaitedRowwiseParallel

    return WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks(opts))


def position_embedding(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from titanlike.models.common.parallel_styles import ReplicatedPositionEmbedding

    return ReplicatedPositionEmbedding(output_layout=between_blocks(opts))


def colwise(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return (_float8_styles()[0] if _is_float8(module) else ColwiseParallel)()


def rowwise(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from torch.distributed.tensor.parallel import RowwiseParallel

    return (_float8_styles()[1] if _is_float8(module) else RowwiseParallel)(output_layouts=between_blocks(opts))


def sequence_norm(module: nn.Module, opts: ShardOptions) -> ParallelStyle | None:
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel() if opts.sequence_parallel else None


def sequence_replicated(module: nn.Module, opts: ShardOptions) -> ParallelStyle | None:
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(use_local_output=True) if opts.sequence_parallel else None


def head_norm(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from torch.distributed.tensor.parallel import SequenceParallel

    # (batch, seq, heads, head_dim) with this rank's heads: dim 2 is the sharded one.
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def sequence_local(module: nn.Module, opts: ShardOptions) -> ParallelStyle | None:
    if not opts.sequence_parallel:
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                    use_local_input=True, output_layouts=(Shard(1),),
                                    desired_output_layouts=(Shard(1),), use_local_output=True)


def vocab_output(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    from titanlike.models.common.parallel_styles import ScoreHead

    if module.out_features == 1:  # a reward model's score head: nothing to split over the vocabulary
        return ScoreHead(input_layout=between_blocks(opts))
    return ColwiseParallel(input_layouts=between_blocks(opts),
                           output_layouts=Shard(-1) if opts.loss_parallel else Replicate(),
                           use_local_output=not opts.loss_parallel)


def replicated(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from titanlike.models.common.parallel_styles import ReplicatedModule

    return ReplicatedModule()


def split_heads(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    from titanlike.models.common.parallel_styles import HeadSplitParameters

    return HeadSplitParameters(protocol.head_split_parameters(module))


@dataclass(frozen=True)
class GatherInput:
    """The style of a module whose sequence-sharded inputs (its first `sequence_inputs`) are
    all-gathered on entry. readers: its linears that read them (colwise ones); when every one of
    them it has is a tensorwise float8 linear, the all-gather itself moves float8. None are named
    where other readers take the input in high precision (MLA's replicated down projections)."""

    readers: tuple[str, ...] = ()

    def __call__(self, module: nn.Module, opts: ShardOptions) -> ParallelStyle | None:
        if not opts.sequence_parallel:
            return None
        layouts = gather_layouts(module)
        present = [name for name in self.readers if _submodule(module, name) is not None]
        if present and all(_is_float8(module.get_submodule(name)) for name in present):
            return _float8_styles()[2](fwd_config_submodule_fqn=present[0], **layouts)
        from torch.distributed.tensor.parallel import PrepareModuleInput

        return PrepareModuleInput(**layouts)


def gather_input(*readers: str) -> GatherInput:
    return GatherInput(readers)


def gather_layouts(module: nn.Module) -> dict:
    """PrepareModuleInput's layouts that all-gather a module's first input (its first
    `sequence_inputs`) from sequence slices; the other inputs (RoPE angles, document mask) are
    plain values left alone."""
    from torch.distributed.tensor import Replicate, Shard

    n_inputs = _positional_inputs(module)
    n_seq = protocol.sequence_inputs(module)
    return dict(input_layouts=(Shard(1),) * n_seq + (None,) * (n_inputs - n_seq),
                desired_input_layouts=(Replicate(),) * n_seq + (None,) * (n_inputs - n_seq))


def _positional_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def decoder_sharding(*, mlp_inputs: tuple[str, ...] = ("w1",), position_embeddings: tuple[str, ...] = (),
                     qk_norm: bool = False) -> ShardingPlan:
    """The plan of a Decoder built from common blocks: attention split by heads, the MLP by hidden
    units (mlp_inputs read the block's input, w2 writes back), norms sequence parallel, the
    vocabulary split in the embedding and the output projection. A MoE block's `moe` routes the
    tokens of this rank's sequence slice (its experts are split by expert parallelism, not by TP).
    qk_norm: the attention has q_norm and k_norm, which normalize each of this rank's heads (their
    weights stay whole)."""
    top = {"tok_embeddings": vocab_embedding, **{name: position_embedding for name in position_embeddings},
           "norm": sequence_norm, "output": vocab_output}
    block = {
        "attention_norm": sequence_norm,
        "attention": gather_input("wq", "wk", "wv"),
        "attention.wq": colwise, "attention.wk": colwise, "attention.wv": colwise,
        "attention.wo": rowwise,
        "ffn_norm": sequence_norm,
        "feed_forward": gather_input(*mlp_inputs),
        **{f"feed_forward.{name}": colwise for name in mlp_inputs},
        "feed_forward.w2": rowwise,
        "moe": sequence_local,
        **({"attention.q_norm": head_norm, "attention.k_norm": head_norm} if qk_norm else {}),
    }
    return ShardingPlan(top=top, block=block)


def _is_float8(module: nn.Module) -> bool:
    from titanlike.models.converters import is_float8_tensorwise_linear

    return is_float8_tensorwise_linear(module)


def _float8_styles():
    from titanlike.models.converters import float8_tensor_parallel_styles

    return float8_tensor_parallel_styles()


__all__ = ["GatherInput", "ShardingPlan", "Style", "between_blocks", "colwise", "decoder_sharding", "gather_input",
           "gather_layouts", "head_norm", "position_embedding", "replicated", "rowwise", "sequence_local",
           "sequence_norm", "sequence_replicated", "shard_modules", "split_heads", "vocab_embedding", "vocab_output"]
