"""Tensor-parallel plan for the Llama 3 Transformer (Megatron-style, with sequence parallelism).

Within a block, wq/wk/wv and w1/w3 are split by output features (heads / hidden
units: ColwiseParallel) and wo/w2 by input features (RowwiseParallel), so each
rank runs attention on its own heads and the SwiGLU on its own hidden units, with
one reduction after each. With sequence parallelism the activations between those
regions (norms, residual adds) stay sharded along the sequence (Shard(1)), which
turns each all-reduce into a reduce-scatter + all-gather pair and divides the norm
and residual activation memory by the TP degree.

The plan only names modules, so it also applies to pipeline stages whose
tok_embeddings / norm / output are None or that hold a subset of layers.
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
        block_plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            block_plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # Attention and the MLP need the whole sequence: all-gather it on entry.
                # The second attention input is the RoPE table, a plain tensor left alone.
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, block_plan)

    # parallelize_module replaced the embedding's and the output's weights with two
    # separate DTensors (same Shard(0) layout); make them one parameter again.
    model.tie_weights()
