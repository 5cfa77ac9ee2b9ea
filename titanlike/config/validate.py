"""Validate a JobConfig against the world size and the model, before any process group exists.

Every rule raises ConfigError with one sentence that names the option and what
would make it valid. A rule that needs the model reads the flavor's arguments
(no tensors are built).
"""

from __future__ import annotations

import os

import torch

from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.parallel.parallel_dims import ParallelDims

# Features whose options exist (so configs written for them parse) but which this
# release does not implement yet: refused rather than silently ignored.
_NOT_YET = "is not implemented in this release of titanlike"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def resolve_parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    try:
        return ParallelDims.resolve(
            world_size=world_size,
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate_config(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Check the whole job; returns the resolved ParallelDims."""
    from titanlike.models.registry import get_model_spec, model_names

    dims = resolve_parallel_dims(cfg, world_size)
    p, t = cfg.parallelism, cfg.training

    # Features not built yet.
    _check(dims.ep == 1, f"expert parallelism (parallelism.expert_parallel_degree) {_NOT_YET}")
    _check(p.expert_tensor_parallel_degree == 1,
           f"parallelism.expert_tensor_parallel_degree {_NOT_YET}")
    if p.enable_async_tensor_parallel:
        _check(dims.tp > 1, "parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")
        _check(cfg.compile.enable and "model" in cfg.compile.components,
               "parallelism.enable_async_tensor_parallel works through torch.compile: "
               "also set compile.enable with the model component")
        _check(torch.cuda.is_available(),
               "parallelism.enable_async_tensor_parallel needs CUDA GPUs (symmetric memory); "
               "this machine has none")
    _validate_converters(cfg, dims)
    if cfg.validation.enable:
        _validate_validation(cfg)

    # Attention.
    if cfg.model.attention_backend == "flex":
        _check(torch.cuda.is_available(),
               "model.attention_backend flex needs a CUDA GPU (FlexAttention has no backward on CPU); "
               "use auto or sdpa")
    _check(not cfg.metrics.enable_wandb, f"Weights & Biases logging (metrics.enable_wandb) {_NOT_YET}")
    _check(not cfg.profiling.enable_memory_snapshot,
           f"memory snapshots (profiling.enable_memory_snapshot) {_NOT_YET}")

    # Model.
    _check(cfg.model.name in model_names(),
           f"model.name {cfg.model.name!r} is unknown; known models: {', '.join(model_names())}")
    spec = get_model_spec(cfg.model.name)
    _check(cfg.model.flavor in spec.flavors,
           f"model.flavor {cfg.model.flavor!r} is unknown for {cfg.model.name}; "
           f"known flavors: {', '.join(spec.flavors)}")
    args = spec.flavors[cfg.model.flavor]
    if cfg.model.tokenizer_path:
        _check(os.path.isfile(cfg.model.tokenizer_path),
               f"model.tokenizer_path {cfg.model.tokenizer_path} does not exist")

    # Tensor parallelism.
    if dims.tp > 1:
        _check(spec.tensor_parallel_plan is not None,
               f"model {cfg.model.name} has no tensor-parallel plan, so tensor_parallel_degree must be 1")
        n_kv = args.n_kv_heads or args.n_heads
        _check(args.n_heads % dims.tp == 0,
               f"{cfg.model.name} {cfg.model.flavor} has {args.n_heads} attention heads, "
               f"not divisible by tensor_parallel_degree {dims.tp}")
        _check(n_kv % dims.tp == 0,
               f"{cfg.model.name} {cfg.model.flavor} has {n_kv} key/value heads, "
               f"not divisible by tensor_parallel_degree {dims.tp}")
        # Sequence parallelism shards the residual stream along the sequence between blocks.
        _check(cfg.training.seq_len % dims.tp == 0,
               f"training.seq_len {cfg.training.seq_len} must be divisible by tensor_parallel_degree {dims.tp} "
               f"(sequence parallelism splits the sequence)")

    # Batch and sequence.
    _check(t.seq_len >= 1, f"training.seq_len must be at least 1, got {t.seq_len}")
    if dims.cp > 1:
        # Load balancing cuts each sequence into 2 x cp equal chunks and sequence parallel splits a
        # rank's share over tp. Asking for chunks that tp splits evenly is slightly stricter than
        # needed (lcm(2 cp, cp tp)) but is the rule torchtitan users know, and real lengths meet it.
        cp_unit = 2 * dims.cp * dims.tp
        _check(t.seq_len % cp_unit == 0,
               f"training.seq_len {t.seq_len} must be divisible by 2 x context_parallel_degree {dims.cp} x "
               f"tensor_parallel_degree {dims.tp} = {cp_unit}, so that context parallelism can cut it into "
               f"2 x {dims.cp} equal chunks that tensor parallelism splits evenly")
    _check(t.local_batch_size >= 1, f"training.local_batch_size must be at least 1, got {t.local_batch_size}")
    per_pass = t.local_batch_size * dims.dp_degree
    if t.global_batch_size != -1:
        _check(t.global_batch_size >= 1 and t.global_batch_size % per_pass == 0,
               f"training.global_batch_size {t.global_batch_size} must be a positive multiple of "
               f"local_batch_size {t.local_batch_size} x data-parallel degree {dims.dp_degree} = {per_pass}")
    _check(t.steps >= 1, f"training.steps must be at least 1, got {t.steps}")
    _check(t.max_norm > 0, f"training.max_norm must be positive, got {t.max_norm}")
    if t.dataset in ("text", "huggingface", "megatron"):
        _check(bool(t.dataset_path), f"training.dataset {t.dataset} needs training.dataset_path")
    if t.dataset == "text":
        _check(os.path.exists(t.dataset_path), f"training.dataset_path {t.dataset_path} does not exist")
    if t.dataset == "megatron":
        from titanlike.data.blend import parse_blend
        from titanlike.data.indexed import data_file_path, index_file_path

        try:
            prefixes, _ = parse_blend(t.dataset_path)
        except ValueError as e:
            raise ConfigError(f"training.dataset_path: {e}") from None
        for prefix in prefixes:
            for path in (data_file_path(prefix), index_file_path(prefix)):
                _check(os.path.isfile(path), f"training.dataset_path names the Megatron prefix {prefix}, "
                       f"but {path} does not exist")

    if dims.pp > 1:
        _validate_pipeline(cfg, dims, spec, args)

    # Optimizer and schedule.
    o, s = cfg.optimizer, cfg.lr_scheduler
    _check(o.lr > 0, f"optimizer.lr must be positive, got {o.lr}")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1 and optimizer.beta2 must lie in [0, 1)")
    _check(o.eps > 0, f"optimizer.eps must be positive, got {o.eps}")
    _check(o.weight_decay >= 0, f"optimizer.weight_decay must be non-negative, got {o.weight_decay}")
    _check(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be non-negative, got {s.warmup_steps}")
    _check(s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
           f"lr_scheduler.decay_ratio must lie in [0, 1], got {s.decay_ratio}")
    _check(0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor must lie in [0, 1], got {s.min_lr_factor}")

    # Activation checkpointing and compile.
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        _check(ac.selective_ac_option == "op" or (ac.selective_ac_option.isdigit()
                                                  and int(ac.selective_ac_option) >= 1),
               f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, "
               f"got {ac.selective_ac_option!r}")
    unknown = set(cfg.compile.components) - {"model", "loss"}
    _check(not unknown, f"compile.components may only contain model and loss, got {', '.join(sorted(unknown))}")

    _validate_checkpoint(cfg, spec)

    _check(cfg.metrics.log_freq >= 1, f"metrics.log_freq must be at least 1, got {cfg.metrics.log_freq}")
    if cfg.profiling.enable_profiling:
        _check(cfg.profiling.profile_freq >= 1,
               f"profiling.profile_freq must be at least 1, got {cfg.profiling.profile_freq}")
    return dims


def _validate_pipeline(cfg: JobConfig, dims: ParallelDims, spec, args) -> None:
    from titanlike.parallel import pipeline

    p, t = cfg.parallelism, cfg.training
    model = f"{cfg.model.name} {cfg.model.flavor}"
    _check(spec.pipeline_stage is not None,
           f"model {cfg.model.name} has no pipeline split rule, so pipeline_parallel_degree must be 1")
    _check(not getattr(args, "tie_word_embeddings", False),
           f"{model} ties its embedding to its output projection, which would live on different pipeline "
           f"stages; pipeline parallelism does not support tied embeddings, so pipeline_parallel_degree must be 1")
    try:
        name = pipeline.schedule_name(p.pipeline_parallel_schedule)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        layout = pipeline.plan_layout(args.n_layers, dims.pp, name, p.pipeline_parallel_layers_per_stage)
    except ValueError as e:
        raise ConfigError(f"{model}: {e}") from None
    mbs = p.pipeline_parallel_microbatch_size
    _check(mbs >= 1, f"parallelism.pipeline_parallel_microbatch_size must be at least 1, got {mbs}")
    _check(t.local_batch_size % mbs == 0,
           f"training.local_batch_size {t.local_batch_size} must be divisible by "
           f"parallelism.pipeline_parallel_microbatch_size {mbs}, which cuts it into pipeline microbatches")
    n_microbatches = t.local_batch_size // mbs
    if cfg.validation.enable:
        _check(name not in pipeline.V_SCHEDULES,
               f"validation.enable does not work with the {name} pipeline schedule (torch's V-shaped schedules "
               "have no forward-only mode); use another schedule or disable validation")
        _check(cfg.validation.local_batch_size in (-1, t.local_batch_size),
               "under pipeline parallelism validation.local_batch_size must equal training.local_batch_size "
               "(the schedule runs a fixed number of microbatches)")
    problem = pipeline.microbatch_problem(name, n_microbatches, layout)
    _check(problem is None,
           f"{problem}, but local_batch_size {t.local_batch_size} / pipeline_parallel_microbatch_size {mbs} "
           f"gives {n_microbatches}")
    if name in pipeline.SPLIT_BACKWARD_SCHEDULES:
        _check(not (dims.fsdp_enabled and p.fsdp_reshard_after_forward == "always"),
               f"{name} computes weight gradients apart from input gradients, which gives wrong gradients "
               f"with parameters resharded after forward, so it needs fsdp_reshard_after_forward default or never")
        _check(not (cfg.compile.enable and "model" in cfg.compile.components),
               f"{name} splits the backward of each stage, which torch does not support for compiled "
               f"blocks, so it needs compile.enable off or compile.components without model")
        ac = cfg.activation_checkpoint
        _check(not (ac.mode == "selective" and ac.selective_ac_option == "op"),
               f"{name} runs two backward passes over each stage (input, then weight gradients), which op-level "
               f"selective activation checkpointing forbids, so use activation_checkpoint.mode full or a "
               f"block interval for selective_ac_option")


def _importable(module: str) -> bool:
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_float8_gpu() -> bool:
    """A CUDA GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _gpu_description() -> str:
    if not torch.cuda.is_available():
        return "this machine has none"
    major, minor = torch.cuda.get_device_capability()
    return f"this machine's {torch.cuda.get_device_name()} has compute capability {major}.{minor}"


def _validate_converters(cfg: JobConfig, dims: ParallelDims) -> None:
    from titanlike.models.converters import FLOAT8_RECIPES, converter_names

    names = cfg.model.converters
    for name in names:
        _check(name in converter_names(),
               f"model.converters names an unknown converter {name!r}; "
               f"known converters: {', '.join(converter_names())}")
    _check(len(set(names)) == len(names), f"model.converters names a converter twice: {', '.join(names)}")
    _check(not {"float8", "te"} <= set(names),
           "model.converters float8 and te both replace the linear layers; name one of them")
    f = cfg.float8
    if "float8" in names:
        _check(not f.recipe_name or f.recipe_name in FLOAT8_RECIPES,
               f"float8.recipe_name must be {' or '.join(FLOAT8_RECIPES)} (empty means tensorwise), "
               f"got {f.recipe_name!r}")
        _check(_importable("torchao"),
               "model.converters float8 needs torchao, which is not installed: pip install torchao "
               "(or pip install -e '.[float8]')")
        if not (f.emulate or _has_float8_gpu()):
            raise ConfigError(f"float8 needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090), but "
                              f"{_gpu_description()}; set float8.emulate to test the swap on CPU")
        _check(not (f.enable_fsdp_float8_all_gather and f.recipe_name == "rowwise"),
               "float8.enable_fsdp_float8_all_gather works with the tensorwise recipe only, not rowwise; "
               "unset it or set float8.recipe_name tensorwise")
        _check(not f.precompute_float8_dynamic_scale_for_fsdp or f.enable_fsdp_float8_all_gather,
               "float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the float8 "
               "all-gather, so it needs float8.enable_fsdp_float8_all_gather")
    if "te" in names:
        _check(_importable("transformer_engine"),
               "model.converters te needs NVIDIA Transformer Engine, which is not installed "
               "(pip install transformer-engine[pytorch] on a CUDA machine), or use the float8 converter")
        if not _has_float8_gpu():
            raise ConfigError(f"model.converters te needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090), "
                              f"but {_gpu_description()}; the float8 converter with float8.emulate tests float8 on CPU")
        _check(dims.tp == 1,
               "model.converters te does not work with tensor parallelism (the tensor-parallel plan shards "
               "nn.Linear layers), so tensor_parallel_degree must be 1")


CHECKPOINT_COMPONENTS = ("model", "optimizer", "lr_scheduler", "dataloader", "rng", "train_state")


def _validate_checkpoint(cfg: JobConfig, spec) -> None:
    c = cfg.checkpoint
    for name, on in (("initial_load_path", bool(c.initial_load_path)),
                     ("create_seed_checkpoint", c.create_seed_checkpoint),
                     ("last_save_in_hf", c.last_save_in_hf)):
        _check(c.enable or not on, f"checkpoint.{name} needs checkpoint.enable")
    _check(bool(c.folder), "checkpoint.folder must not be empty")
    _check(c.interval >= 1, f"checkpoint.interval must be at least 1, got {c.interval}")
    _check(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {c.keep_latest_k}")
    _check(c.load_step >= -1, f"checkpoint.load_step must be -1 (the latest) or a step >= 0, got {c.load_step}")
    unknown = [n for n in c.exclude_from_loading if n not in CHECKPOINT_COMPONENTS]
    _check(not unknown, f"checkpoint.exclude_from_loading may only name {', '.join(CHECKPOINT_COMPONENTS)}; "
                        f"got {', '.join(unknown)}")
    _check(not c.initial_load_in_hf or bool(c.initial_load_path),
           "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder)")
    if c.initial_load_path:
        path = c.initial_load_path
        _check(os.path.isdir(path), f"checkpoint.initial_load_path {path} does not exist or is not a folder")
        if c.initial_load_in_hf:
            _check(os.path.isfile(os.path.join(path, "config.json")),
                   f"checkpoint.initial_load_path {path} has no config.json, so it is not a Hugging Face "
                   "model folder")
        else:
            _check(os.path.isfile(os.path.join(path, ".metadata")),
                   f"checkpoint.initial_load_path {path} has no .metadata, so it is not a DCP checkpoint "
                   "(add --checkpoint.initial_load_in_hf for a Hugging Face folder)")
    if c.initial_load_in_hf or c.last_save_in_hf:
        _check(spec.hf_adapter is not None, f"model {spec.name} has no Hugging Face adapter, so "
                                            "checkpoint.initial_load_in_hf and last_save_in_hf are unavailable")
    _check(not c.last_save_in_hf or c.last_save_model_only,
           "checkpoint.last_save_in_hf writes the model only, so it needs checkpoint.last_save_model_only")


def _validate_validation(cfg: JobConfig) -> None:
    v, t = cfg.validation, cfg.training
    _check(v.freq >= 1, f"validation.freq must be at least 1, got {v.freq}")
    _check(v.steps == -1 or v.steps >= 1, f"validation.steps must be -1 (the whole split) or at least 1, got {v.steps}")
    _check(v.local_batch_size == -1 or v.local_batch_size >= 1,
           f"validation.local_batch_size must be -1 (training's) or at least 1, got {v.local_batch_size}")
    if v.dataset is None:
        _check(t.dataset in ("default", "megatron"),
               f"validation needs validation.dataset and validation.dataset_path: a {t.dataset} training "
               "dataset has no held-out split (only the embedded corpus and megatron datasets do)")
        kind = t.dataset
    else:
        kind = v.dataset
        if kind == "default":
            _check(not v.dataset_path, "validation.dataset default (the embedded corpus) takes no dataset_path")
        else:
            _check(bool(v.dataset_path), f"validation.dataset {kind} needs validation.dataset_path")
    _check(kind != "huggingface" or v.steps >= 1,
           "validation.steps must be set (>= 1) for a streaming huggingface dataset, which has no end to run to")

