"""The job, planned once: `plan_job(cfg, world_size) -> JobPlan`.

A JobPlan is everything a job derives from its configuration before any process group exists:
the layout (ParallelDims), the model family's spec and the objective, the model args sized for
the job, the tokenizer, the batch arithmetic (global batch, microbatches per rank and step,
ramp-up, pipeline microbatches), the pipeline layout, the parallelize options and the precision
policy. Each value is computed here once; the trainer, the estimator and the tests build from it.

Every rule lives with the piece it protects (the config's own values in config/validate.py, the
layout's in ParallelDims, the family's in its args, the objective's, the pipeline's, the
converters', the checkpoint's, the data's, the batch's below) and plan_job calls them in the order
a user meets them: a configuration that cannot run is a plan that cannot be built, a ConfigError
of one sentence naming the option, raised before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.config.validate import validate_values
from titanlike.data.batch_schedule import BatchSchedule
from titanlike.models.args import BaseModelArgs
from titanlike.models.registry import ModelSpec
from titanlike.objectives.base import Objective
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.parallel.parallelize import ParallelizeOptions
from titanlike.parallel.pipeline import PipelineLayout

_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BatchPlan:
    """How the samples of a step are cut. A step of `batch` samples gives every data-parallel rank
    batch / (local_batch_size x dp_degree) microbatches of local_batch_size samples; under pipeline
    parallelism the schedule cuts each microbatch into pipeline microbatches."""

    local_batch_size: int
    global_batch_size: int  # training.global_batch_size, -1 resolved: one microbatch per rank
    dp_degree: int
    schedule: BatchSchedule  # the batch of every step: a ramp-up's (training.rampup_batch_size) or the full one
    pipeline_microbatch_size: int | None  # None without pipeline parallelism

    @classmethod
    def build(cls, t, dims: ParallelDims, pipeline_microbatch_size: int | None) -> BatchPlan:
        """From the [training] section; ValueError, one sentence, for a batch the ranks cannot split."""
        from titanlike.data.loader import validate_rampup

        per_pass = t.local_batch_size * dims.dp_degree
        if t.global_batch_size != -1 and (t.global_batch_size < 1 or t.global_batch_size % per_pass):
            raise ValueError(f"training.global_batch_size {t.global_batch_size} must be a positive multiple of "
                             f"local_batch_size {t.local_batch_size} x data-parallel degree {dims.dp_degree} = "
                             f"{per_pass}")
        global_batch = t.global_batch_size if t.global_batch_size != -1 else per_pass
        if t.rampup_batch_size:
            validate_rampup(t.rampup_batch_size, global_batch, per_pass, option="training.rampup_batch_size")
        return cls(t.local_batch_size, global_batch, dims.dp_degree, BatchSchedule(global_batch, t.rampup_batch_size),
                   pipeline_microbatch_size)

    @property
    def grad_accum_steps(self) -> int:
        """Microbatches per rank at the full batch."""
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    def batch_size(self, step: int) -> int:
        """The global batch of step `step` (1-based): a ramp-up's, else global_batch_size."""
        return self.schedule.batch_size(step - 1)

    def microbatches(self, step: int) -> int:
        """Microbatches each data-parallel rank runs at step `step` (1-based)."""
        return self.batch_size(step) // (self.local_batch_size * self.dp_degree)

    @property
    def pipeline_microbatches(self) -> int | None:
        """Pipeline microbatches per microbatch (the schedule's n_microbatches), None without PP."""
        if self.pipeline_microbatch_size is None:
            return None
        return self.local_batch_size // self.pipeline_microbatch_size


@dataclass(frozen=True)
class PrecisionPlan:
    """param_dtype / reduce_dtype: FSDP's mixed precision (training.mixed_precision_*). Without FSDP
    there is no MixedPrecisionPolicy, and autocast (autocast_dtype) gives the same bf16 / fp16 compute.
    loss_scaling: "none", "dynamic" or "static" (loss_scaling.mode with "auto" resolved: dynamic
    scaling for float16 parameters, none otherwise, since bfloat16 has float32's exponent range)."""

    param_dtype: str
    reduce_dtype: str
    autocast_dtype: torch.dtype | None
    loss_scaling: str


@dataclass(frozen=True)
class JobPlan:
    cfg: JobConfig
    dims: ParallelDims
    spec: ModelSpec
    objective: Objective
    model_args: BaseModelArgs  # the model's args sized for this job (vocabulary, sequence lengths)
    # The model's own context (positions it has a table or angles for), recorded by checkpoints: the
    # job's args carry training.seq_len instead.
    context_len: int
    # model.flavor when the model is that flavor; None when its sizes came from a Hugging Face
    # folder's config.json or [model.args] changed them (checkpoints then record no flavor).
    flavor: str | None
    # Where the sizes came from, for the log: "flavor debugmodel", "<folder>/config.json", ...
    model_source: str
    tokenizer: object | None  # None only for plans made without one (the estimator, given vocab_size)
    batch: BatchPlan
    pipeline: PipelineLayout | None
    parallelize: ParallelizeOptions
    precision: PrecisionPlan

    @property
    def generates(self) -> bool:
        """Whether the model continues text (scripts/generate.py samples it): models/protocol.py."""
        from titanlike.models import protocol

        return protocol.no_text_reason(self.spec.model_cls, self.model_args) is None

    @property
    def model_name(self) -> str:
        return f"{self.cfg.model.name} {self.flavor}" if self.flavor else f"{self.cfg.model.name} ({self.model_source})"


def plan_job(cfg: JobConfig, world_size: int, *, vocab_size: int | None = None) -> JobPlan:
    """The plan of `cfg` on `world_size` ranks, or ConfigError (one sentence). vocab_size: size the
    model for this vocabulary instead of building the job's tokenizer (the estimator, which plans
    layouts of a job by the thousand; the plan then holds no tokenizer)."""
    try:
        return _plan(cfg, world_size, vocab_size)
    except ConfigError:
        raise
    except ValueError as e:  # every piece's rules raise ValueError (DataError is one)
        raise ConfigError(str(e)) from None


def _plan(cfg: JobConfig, world_size: int, vocab_size: int | None) -> JobPlan:
    from titanlike.checkpoint.manager import validate_checkpoint_config
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.data.tokenizer import job_tokenizer
    from titanlike.models.common.attention import validate_attention_backend
    from titanlike.models.common.moe import validate_moe_job
    from titanlike.models.converters import validate_converter_targets, validate_converters
    from titanlike.models.registry import check_other_families_sections, resolve_model
    from titanlike.objectives.registry import job_objective
    from titanlike.observe.run_lock import check_output_folders
    from titanlike.parallel.context import validate_context_parallel
    from titanlike.parallel.fsdp import validate_cpu_offload
    from titanlike.parallel.parallelize import validate_compile_backend
    from titanlike.parallel.tensor_parallel import validate_tensor_parallel
    from titanlike.models import protocol
    from titanlike.parallel.pipeline import check_forward_only
    from titanlike.train.evaluate import validate_samples_layout, validate_validation_layout

    m, p, t = cfg.model, cfg.parallelism, cfg.training
    cuda = torch.cuda.is_available()
    validate_values(cfg)
    if vocab_size is None:  # the job itself (the estimator's layouts write nothing)
        check_output_folders(cfg)
    dims = ParallelDims.from_config(p, world_size)
    validate_converters(m.converters, cfg, tp=dims.tp)
    validate_attention_backend(m.attention_backend, cuda=cuda)

    # The model, its family's rules, the objective's.
    folder = hf_model_folder(cfg)
    spec = resolve_model(m.name, None if folder else m.flavor)
    source = ModelSource.of(cfg, spec, folder)
    model = f"{m.name} {m.flavor}" if source.flavor else f"{m.name} ({source.description})"
    tokenizer = job_tokenizer(m.tokenizer_path, m.hf_assets_path, DEFAULT_TOKENIZER_PATH) if vocab_size is None \
        else None
    validate_moe_job(cfg.moe, has_experts=source.args.moe_args() is not None, ep=dims.ep, etp=dims.etp,
                     model=model)
    check_other_families_sections(cfg, spec)
    try:
        args = model_args(cfg, spec, source.args)
        args.validate(dims, seq_len=t.seq_len)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None
    objective = job_objective(cfg, spec, args, model=model)
    # The estimator reads no data (it plans with the embedded corpus named).
    objective.validate(cfg, dims, model=model, data=vocab_size is None, tokenizer=tokenizer)
    vocab = source.vocab_size or vocab_size or tokenizer.vocab_size
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                         f"({source.description}) holds {vocab}; use the model's own tokenizer (model.tokenizer_path "
                         "or model.hf_assets_path)")
    context_len = args.context_len
    try:
        args = objective.model_args(args, vocab_size=vocab, seq_len=t.seq_len)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None
    validate_converter_targets(m.converters, cfg, spec, args, model=model)
    if cfg.optimizer.name == "Muon" or cfg.optimizer.qk_clip_threshold:  # the parameters they step and scale
        from titanlike.train.optimizer import validate_optimizer
        from titanlike.train.qk_clip import validate_qk_clip

        with torch.device("meta"):
            meta = spec.model_cls(args)
        validate_optimizer(cfg.optimizer, meta)
        if cfg.optimizer.qk_clip_threshold:
            validate_qk_clip(meta, cp=dims.cp)

    # The layout.
    parallelize = parallelize_options(cfg, objective)
    validate_tensor_parallel(tp=dims.tp, seq_len=t.seq_len, shardable=spec.shard is not None, model=m.name,
                             async_tp=p.enable_async_tensor_parallel, compile_blocks=parallelize.compile_blocks,
                             cuda=cuda)
    if dims.cp_enabled:
        validate_context_parallel(t.seq_len, dims.cp, dims.tp)
    batch = BatchPlan.build(t, dims, p.pipeline_parallel_microbatch_size if dims.pp_enabled else None)
    validate_cpu_offload(t.enable_cpu_offload, fsdp_enabled=dims.fsdp_enabled, dp_shard=dims.dp_shard)
    if cfg.validation.enable:
        validate_validation_layout(cfg.validation, t, dims)
    if cfg.validation.sample_prompts:
        # The class and args answer whether the model generates (models/protocol.py: BERT sets
        # init_cache None; a reward model's args have a score head).
        validate_samples_layout(cfg.validation, dims, no_text=protocol.no_text_reason(spec.model_cls, args),
                                compile_blocks=parallelize.compile_blocks, model=model, tokenizer=tokenizer,
                                context_len=args.context_len)
    if cfg.compile.enable:
        validate_compile_backend(cfg.compile.backend)
    pipeline = _pipeline(cfg, dims, spec, args, model, parallelize.compile_blocks)
    if dims.pp_enabled:
        for companion in objective.companions:  # run forward-only through their own stages
            check_forward_only(p.pipeline_parallel_schedule, companion.option)
    validate_checkpoint_config(cfg.checkpoint, spec, hf_assets_path=m.hf_assets_path)
    if cfg.metrics.enable_wandb:
        from titanlike.observe.wandb_run import validate_wandb

        validate_wandb()
    return JobPlan(cfg, dims, spec, objective, args, context_len, source.flavor, source.description, tokenizer, batch,
                   pipeline, parallelize, _precision(cfg, dims))


def other_model_plan(plan: JobPlan, spec: ModelSpec, args: BaseModelArgs, *, model: str) -> JobPlan:
    """The plan of another model the job runs frozen beside the one it trains (a distillation
    teacher): sized for the job's sequences, under the job's layout, with its own pipeline split over
    the same stages, no activation checkpointing (it runs without gradients). ValueError (one
    sentence naming `model`) when the layout cannot hold it."""
    import dataclasses

    cfg, dims = plan.cfg, plan.dims
    try:
        args.validate(dims, seq_len=cfg.training.seq_len)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None
    args = args.update_from_config(vocab_size=args.vocab_size, seq_len=cfg.training.seq_len)
    if dims.tp > 1 and spec.shard is None:
        raise ValueError(f"{model}: the {spec.name} family has no tensor parallelism, which this job's layout needs")
    pipeline = _pipeline(cfg, dims, spec, args, model, plan.parallelize.compile_blocks)
    if pipeline is not None and pipeline.num_stages != plan.pipeline.num_stages:
        raise ValueError(f"{model}: its {args.num_layers} layers make {pipeline.num_stages} pipeline stages where the "
                         f"trained model has {plan.pipeline.num_stages}; set parallelism.pipeline_parallel_layers_per_stage "
                         "so that both split alike, or leave it unset")
    parallelize = dataclasses.replace(plan.parallelize, activation_checkpoint_mode="none")
    return dataclasses.replace(plan, spec=spec, model_args=args, pipeline=pipeline, parallelize=parallelize,
                               flavor=None, model_source=model)


def hf_model_folder(cfg: JobConfig) -> str | None:
    """The Hugging Face folder the job's model starts from (checkpoint.initial_load_in_hf: its
    initial_load_path, else model.hf_assets_path), whose config.json sizes the model; else None,
    also for a [checkpoint] section that cannot load one (validate_checkpoint_config says why)."""
    import os

    from titanlike.checkpoint.manager import initial_load_path

    c = cfg.checkpoint
    if not (c.enable and c.initial_load_in_hf and c.initial_load_model_only):
        return None
    folder = initial_load_path(c, cfg.model.hf_assets_path)
    return folder if folder and os.path.isfile(os.path.join(folder, "config.json")) else None


@dataclass(frozen=True)
class ModelSource:
    """The model's sizes before the job's settings: a flavor's, or a Hugging Face folder's config.json
    read by the family's adapter (checkpoint/hf.py hf_folder_args), then [model.args]."""

    args: BaseModelArgs
    flavor: str | None  # the flavor the args are, unchanged
    description: str  # for messages and the log
    vocab_size: int | None  # the vocabulary the weights fix (a Hugging Face folder's, or [model.args]'s)

    @classmethod
    def of(cls, cfg: JobConfig, spec: ModelSpec, folder: str | None) -> ModelSource:
        """ValueError, one sentence, for a folder or a [model.args] setting the family refuses."""
        from titanlike.checkpoint.format import PLANNING_LIMIT, CheckpointError, check_model_size
        from titanlike.checkpoint.hf import hf_folder_args

        overrides = cfg.model.args
        if folder is not None:
            import os

            try:
                _, args = hf_folder_args(folder, spec)
                # Planning allocates nothing: only an absurd size is refused here; loading checks the device.
                check_model_size(args, os.path.join(folder, "config.json"), limit=PLANNING_LIMIT)
            except CheckpointError as e:
                raise ValueError(str(e)) from None
            description = f"sized by {os.path.join(folder, 'config.json')}"
            vocab = args.vocab_size
            flavor = None
        else:
            flavor_args_ = spec.flavors[cfg.model.flavor]
            args, description, vocab, flavor = flavor_args_, f"flavor {cfg.model.flavor}", None, cfg.model.flavor
        if overrides:
            before = args
            args = args.with_overrides(overrides)
            shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
            description += f" with model.args {shown}"
            flavor = None
            if args.vocab_size != before.vocab_size:  # the job asked for this vocabulary (Megatron's padded one)
                vocab = args.vocab_size
        return cls(args, flavor, description, vocab)


def model_args(cfg: JobConfig, spec: ModelSpec, args: BaseModelArgs) -> BaseModelArgs:
    """The model's args (a flavor's or a Hugging Face folder's, with [model.args]) under the family's
    own section (spec.options: the hybrid's layer pattern) and the [moe] settings (a
    mixture-of-experts model only). ValueError (one sentence) when a setting is out of range."""
    if spec.options is not None:
        args = spec.options.apply(args, getattr(cfg, spec.options.section))
    moe = args.moe_args()
    return args if moe is None else args.with_moe_args(moe.with_run_settings(cfg.moe))


def flavor_args(cfg: JobConfig, spec: ModelSpec) -> BaseModelArgs:
    """The job's model args before it sizes them (ModelSource.of, then model_args)."""
    return model_args(cfg, spec, ModelSource.of(cfg, spec, hf_model_folder(cfg)).args)


def parallelize_options(cfg: JobConfig, objective: Objective) -> ParallelizeOptions:
    """What parallelize_model applies, from the job's sections; logits stay vocabulary-parallel under
    TP unless the job or the objective's loss (Objective.vocab_parallel_loss) says otherwise."""
    from titanlike.parallel.activation_checkpoint import CheckpointOptions

    p, ac, t = cfg.parallelism, cfg.activation_checkpoint, cfg.training
    return ParallelizeOptions(
        loss_parallel=not p.disable_loss_parallel and objective.vocab_parallel_loss,
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


def _pipeline(cfg: JobConfig, dims: ParallelDims, spec: ModelSpec, args: BaseModelArgs, model: str,
              compile_blocks: bool) -> PipelineLayout | None:
    """The stages and their layers (parallel/pipeline.py), checked against the schedule's rules; None
    without pipeline parallelism."""
    from titanlike.parallel.pipeline import plan_pipeline

    if not dims.pp_enabled:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint
    return plan_pipeline(cfg.parallelism, model=model, n_layers=args.num_layers, layer_costs=args.layer_costs(t.seq_len),
                         has_pipeline_ends=spec.pipeline_ends is not None, local_batch_size=t.local_batch_size,
                         fsdp_enabled=dims.fsdp_enabled, compile_blocks=compile_blocks, ac_mode=ac.mode,
                         ac_option=ac.selective_ac_option, validation_enabled=cfg.validation.enable,
                         validation_batch_size=cfg.validation.local_batch_size)


def _precision(cfg: JobConfig, dims: ParallelDims) -> PrecisionPlan:
    t = cfg.training
    mode = cfg.loss_scaling.mode
    if mode == "auto":
        mode = "dynamic" if t.mixed_precision_param == "float16" else "none"
    autocast = None if dims.fsdp_enabled else _HALF.get(t.mixed_precision_param)
    return PrecisionPlan(t.mixed_precision_param, t.mixed_precision_reduce, autocast, mode)


__all__ = ["BatchPlan", "JobPlan", "ModelSource", "PrecisionPlan", "flavor_args", "hf_model_folder", "model_args",
           "parallelize_options", "plan_job"]
