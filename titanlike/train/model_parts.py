"""Model assembly shared by the trainer and the memory estimator: args -> meta model -> converters
-> pipeline split -> parallelize, so the estimator traces exactly what the trainer builds.

The parts stay on the meta device; the caller materializes them (the trainer on its device with
init_weights, the estimator under FakeTensorMode).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlike.config.schema import JobConfig
from titanlike.models.args import BaseModelArgs
from titanlike.models.converters import ModelConverters
from titanlike.models.registry import ModelSpec
from titanlike.objectives.base import Objective
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.parallel.activation_checkpoint import CheckpointOptions
from titanlike.parallel.context import require_context_parallel_hooks
from titanlike.parallel.parallelize import ParallelizeOptions, parallelize_model
from titanlike.parallel.pipeline import PipelineLayout, build_stage_modules, plan_layout


def flavor_args(cfg: JobConfig, spec: ModelSpec) -> BaseModelArgs:
    """The flavor's args under the family's own section (spec.options: the hybrid's layer pattern) and
    the [moe] settings (a mixture-of-experts model only). ValueError (one sentence) when a setting is
    out of range."""
    args = spec.flavors[cfg.model.flavor]
    if spec.options is not None:
        args = spec.options.apply(args, getattr(cfg, spec.options.section))
    moe = args.moe_args()
    return args if moe is None else args.with_moe_args(moe.with_run_settings(cfg.moe))


def job_objective(cfg: JobConfig, spec: ModelSpec) -> Objective:
    """The training objective of this job: the family's (spec.objective), for the flavor's args."""
    return spec.objective(cfg, flavor_args(cfg, spec))


def model_args_for_job(cfg: JobConfig, spec: ModelSpec, vocab_size: int, objective: Objective) -> BaseModelArgs:
    """The flavor's args sized for this job: the tokenizer's vocabulary, training.seq_len and the lengths
    the objective adds (an encoder-decoder's decoder tokens)."""
    return flavor_args(cfg, spec).update_from_config(vocab_size=vocab_size, seq_len=cfg.training.seq_len,
                                                     **objective.model_lengths())


def parallelize_options(cfg: JobConfig, dims: ParallelDims) -> ParallelizeOptions:
    p, ac, t = cfg.parallelism, cfg.activation_checkpoint, cfg.training
    return ParallelizeOptions(
        loss_parallel=not p.disable_loss_parallel,
        async_tensor_parallel=p.enable_async_tensor_parallel,
        context_parallel_rotate_method=p.context_parallel_rotate_method,
        activation_checkpoint_mode=ac.mode,
        selective_ac_option=ac.selective_ac_option,
        checkpoint_options=CheckpointOptions(preserve_rng_state=ac.preserve_rng_state,
                                             determinism_check=ac.determinism_check, debug=ac.debug,
                                             early_stop=ac.early_stop),
        memory_budget=ac.memory_budget,
        compile_blocks=cfg.compile.enable and "model" in cfg.compile.components,
        compile_backend=cfg.compile.backend,
        param_dtype=t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        cpu_offload=t.enable_cpu_offload,
        token_dispatcher=cfg.moe.token_dispatcher,
    )


def pipeline_layout(cfg: JobConfig, dims: ParallelDims, args: BaseModelArgs) -> PipelineLayout | None:
    if not dims.pp_enabled:
        return None
    p = cfg.parallelism
    return plan_layout(args.num_layers, dims.pp, p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage,
                       p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers,
                       layer_costs=args.layer_costs(cfg.training.seq_len))


def build_model_parts(cfg: JobConfig, dims: ParallelDims, spec: ModelSpec, args: BaseModelArgs,
                      converters: ModelConverters) -> tuple[list[nn.Module], PipelineLayout | None]:
    """This rank's model parts (one, or one per pipeline stage it holds), parallelized, on meta."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    # Converters (float8, te) swap modules of the whole meta model, before any pipeline split.
    converters.convert(model)
    if dims.cp_enabled:
        require_context_parallel_hooks(model)
    layout = pipeline_layout(cfg, dims, args)
    parts = [model]
    if layout is not None:
        # This rank's stages are cut out of the meta model first; each part then goes through the
        # same parallelize as a whole model.
        parts = build_stage_modules(model, spec, layout, dims.mesh("pp").get_local_rank())
    opts = parallelize_options(cfg, dims)
    return [parallelize_model(part, spec.shard, dims, opts) for part in parts], layout
