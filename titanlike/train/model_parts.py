"""Model assembly from a JobPlan: args -> meta model -> converters -> pipeline split -> parallelize.

The parts stay on the meta device; the caller materializes them (the trainer on its device with
init_weights, the estimator under FakeTensorMode).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlike.models.converters import ModelConverters
from titanlike.parallel.context import require_context_parallel_hooks
from titanlike.parallel.parallelize import parallelize_model
from titanlike.parallel.pipeline import build_stage_modules
from titanlike.train.plan import JobPlan


def build_model_parts(plan: JobPlan, converters: ModelConverters) -> list[nn.Module]:
    """This rank's model parts (one, or one per pipeline stage it holds), parallelized, on meta.
    The plan's ParallelDims must have built its mesh."""
    spec, dims = plan.spec, plan.dims
    with torch.device("meta"):
        model = spec.model_cls(plan.model_args)
    # Converters (float8, te) swap modules of the whole meta model, before any pipeline split.
    converters.convert(model)
    if dims.cp_enabled:
        require_context_parallel_hooks(model)
    parts = [model]
    if plan.pipeline is not None:
        # This rank's stages are cut out of the meta model first; each part then goes through the
        # same parallelize as a whole model.
        parts = build_stage_modules(model, spec, plan.pipeline, dims.mesh("pp").get_local_rank())
    return [parallelize_model(part, spec.shard, dims, plan.parallelize) for part in parts]
