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


def build_frozen_model(plan: JobPlan, path: str, device: torch.device, *, seed: int) -> list[nn.Module]:
    """This rank's parts of another model, frozen: the model of checkpoint `path` (a DCP checkpoint
    or a Hugging Face folder, checkpoint/hf.py checkpoint_model), built and parallelized with the
    job's layout (its own pipeline split over the same stages) and loaded sharded, as the job's own
    initial load (checkpoint/loading.py load_frozen_model): no rank holds a full copy of a DCP
    checkpoint's model, and only rank 0 one of a Hugging Face folder's."""
    from titanlike.checkpoint.hf import checkpoint_model
    from titanlike.checkpoint.loading import load_frozen_model
    from titanlike.models.converters import build_model_converters
    from titanlike.train.plan import other_model_plan

    folder, spec, args = checkpoint_model(path)
    other = other_model_plan(plan, spec, args, model=folder)
    parts = build_model_parts(other, build_model_converters([], plan.cfg))
    for part in parts:
        part.to_empty(device=device)
        part.init_weights(seed=seed)  # the non-persistent buffers (RoPE tables); every weight is loaded below
    with torch.no_grad():
        load_frozen_model(parts, folder, spec, other.model_args)
    for part in parts:
        part.requires_grad_(False)
        part.eval()
    return parts
