"""Tensor-parallel plan for the Llama 3 Transformer (Megatron-style, with sequence parallelism).

Within a block, wq/wk/wv and w1/w3 are split by output features (heads / hidden
units: ColwiseParallel) and wo/w2 by input features (RowwiseParallel), so each
rank runs attention on its own heads and the SwiGLU on its own hidden units, with
one reduction after each. With sequence parallelism the activations between those
regions (norms, residual adds) stay sharded along the sequence (Shard(1)), which
turns each all-reduce into a reduce-scatter + all-gather pair and divides the norm
and residual activation memory by the TP degree.

The plan only names modules, so it also applies to pipeline stages whose
tok_embeddings / norm / output are None or that hold a subset of layers. Linears the
float8 converter swapped (tensorwise recipe) get torchao's float8 styles: _styles_for.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool,
                          sequence_parallel: bool = True) -> None:
    """Shard `model` (a llama3 Transformer or a pipeline stage of one) over the 1-D tp_mesh in place.

    With loss_parallel the logits stay sharded over the vocabulary as a DTensor
    (Shard(-1)); compute the cross-entropy inside
    torch.distributed.tensor.parallel.loss_parallel(). Otherwise they are gathered
    into a plain replicated tensor.
    With sequence_parallel the sequence length must be divisible by the TP degree.
    """
    args = model.model_args
    tp = tp_mesh.size()
    # A head cannot be split across ranks; checking here gives a clear message
    # instead of a reshape error deep inside the first forward.
    if args.n_heads % tp or args.num_kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_degree {tp} must divide n_heads ({args.n_heads}) and "
            f"n_kv_heads ({args.num_kv_heads})"
        )

    # Layout of activations between the parallel regions.
    between = Shard(1) if sequence_parallel else Replicate()

    top_plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        # Each rank holds a slice of the vocabulary and contributes its rows; the
        # partial sums are reduced straight into the layout between blocks.
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    if model.output is not None:
        top_plan["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)

    for block in model.layers.values():
        colwise, rowwise, prepare_input = _styles_for(block)
        block_plan: dict[str, object] = {
            "attention.wq": colwise("attention.wq"),
            "attention.wk": colwise("attention.wk"),
            "attention.wv": colwise("attention.wv"),
            "attention.wo": rowwise("attention.wo", output_layouts=between),
            "feed_forward.w1": colwise("feed_forward.w1"),
            "feed_forward.w2": rowwise("feed_forward.w2", output_layouts=between),
            "feed_forward.w3": colwise("feed_forward.w3"),
        }
        if sequence_parallel:
            block_plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # Attention and the MLP need the whole sequence: all-gather it on entry.
                # The other attention inputs (RoPE angles, document mask) are plain values left alone.
                "attention": prepare_input("attention", ("wq", "wk", "wv"), input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": prepare_input("feed_forward", ("w1", "w3"), input_layouts=(Shard(1),),
                                              desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, block_plan)

    # parallelize_module replaced the embedding's and the output's weights with two
    # separate DTensors (same Shard(0) layout); make them one parameter again.
    model.tie_weights()


def _styles_for(block: nn.Module):
    """Style factories for one block: torchao's float8 styles for the linears the float8 converter
    swapped with the tensorwise recipe (activations are cast to float8 before their all-gathers, and
    output gradients before theirs in backward, so that traffic is float8 too), the plain styles
    otherwise: for nn.Linear and for the rowwise recipe, whose all-gathers stay in high precision
    (as in torchtitan).

    colwise(name, **kw) / rowwise(name, **kw) build the style for block.<name>; prepare_input(name,
    linears, **kw) builds the input preparation of block.<name>, in float8 only when all of `linears`
    (its submodules that read that input) are float8.
    """
    from titanlike.models.converters import float8_tensor_parallel_styles, is_float8_tensorwise_linear

    def float8(name: str) -> bool:
        return is_float8_tensorwise_linear(block.get_submodule(name))

    def colwise(name: str, **kw):
        return (float8_tensor_parallel_styles()[0] if float8(name) else ColwiseParallel)(**kw)

    def rowwise(name: str, **kw):
        return (float8_tensor_parallel_styles()[1] if float8(name) else RowwiseParallel)(**kw)

    def prepare_input(name: str, linears: tuple[str, ...], **kw):
        if all(float8(f"{name}.{linear}") for linear in linears):
            return float8_tensor_parallel_styles()[2](fwd_config_submodule_fqn=linears[0], **kw)
        return PrepareModuleInput(**kw)

    return colwise, rowwise, prepare_input
