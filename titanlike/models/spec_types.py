"""The parts of a ModelSpec that the parallelisms read: the pipeline's ends and the options a
family's `shard` takes. Apart from the registry (titanlike/models/registry.py) so that
titanlike/parallel/ and the shared sharding code import these types without the family registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch.nn as nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class PipelineEnds:
    """Which top-level modules belong to the first pipeline stage (inputs) and to the last (outputs).

    The generic split (parallel/pipeline.py) keeps `inputs` on stage 0, `outputs` on the last
    stage, sets them to None elsewhere, and hands every stage its share of `layers`. A name is a
    dotted path where an end sits inside a submodule (LLaVA: `language_model.tok_embeddings`).
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ShardOptions:
    """What the job asks of a family's `shard`. loss_parallel: the output projection leaves its logits
    sharded over the vocabulary (a DTensor, Shard(-1)) for a vocabulary-parallel loss, otherwise
    they are gathered into a plain replicated tensor. sequence_parallel: the activations between
    the parallel regions stay split along the sequence (the sequence length is divisible by the
    TP degree)."""

    loss_parallel: bool
    sequence_parallel: bool = True


# shard(model, tp_mesh, opts): shard a whole model or a pipeline stage of one (skipping the modules it
# does not hold) over the 1-D tp_mesh in place, with torch ParallelStyles (models/common/sharding.py).
ShardFn = Callable[[nn.Module, "DeviceMesh", ShardOptions], None]

__all__ = ["PipelineEnds", "ShardFn", "ShardOptions"]
