"""Validate a whole job before any process group exists: the config's own rules, then each rule
where it lives (the layout's in ParallelDims, the family's in its args, the pipeline's, the
converters', the checkpoint manager's, the data's), in the order a user meets them.

Every failure is one ConfigError sentence naming the option and what would make it valid.

`check_memory=True` (train.py, for the job it is about to run) adds one rule about this machine
rather than the job: the analytic estimate of the peak memory per rank must fit in this GPU's
memory (or, on CPU, in this host's memory shared by its local ranks). It stays off by default:
the estimator and the tests validate jobs meant for other machines.
"""

from __future__ import annotations

import logging
import os

import torch

from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.config.validate import validate_values
from titanlike.parallel.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)
GiB = 2**30


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


def validate_config(cfg: JobConfig, world_size: int, *, check_memory: bool = False) -> ParallelDims:
    """Check the whole job; returns the resolved ParallelDims. check_memory: also refuse a job
    whose estimated peak per rank exceeds this machine's memory (see the module docstring)."""
    dims = resolve_parallel_dims(cfg, world_size)
    try:
        _validate(cfg, dims)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if check_memory:
        validate_memory(cfg, dims)
    return dims


def machine_memory() -> tuple[int, str]:
    """(bytes one rank may use, what they are) on this machine: the GPU this rank will use, or on
    CPU the host's memory (its cgroup limit if lower) shared by LOCAL_WORLD_SIZE ranks."""
    if torch.cuda.is_available():
        # get_device_properties reads the total without creating a CUDA context (mem_get_info
        # would create one on device 0 in every rank, before each picks its own device).
        device = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"GPU {device} ({props.name}) has"
    total = host_memory()
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    if local > 1:
        return total // local, f"this host's {total / GiB:.1f} GiB of memory shared by {local} local ranks leave"
    return total, "this host has"


def host_memory() -> int:
    """Bytes of physical memory, or the container's (cgroup v2) limit where that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def estimate_peak_memory(cfg: JobConfig, dims: ParallelDims) -> tuple[int, str] | None:
    """(peak bytes of the busiest rank, its largest parts) from the analytic estimator, or None
    where it cannot say (estimation/ not importable outside a checkout, a model it does not know)."""
    try:
        from estimation.analytic import estimate_analytic
        from estimation.options import prepare_job
    except ImportError:
        return None
    try:
        estimates, _ = estimate_analytic(prepare_job(cfg, dims.world_size), granularity=1)
    except (ValueError, NotImplementedError) as e:  # UnknownBlockError, a family without formulas
        logger.debug("no memory estimate for this job: %s", e)
        return None
    top = max(estimates, key=lambda r: r.peak_bytes)
    b = top.peak
    state = b.parameters + b.gathered_parameters + b.gradients + b.optimizer_state
    parts = (f"{state / GiB:.1f} GiB of weights, gradients and optimizer state, "
             f"{(b.activations + b.transient) / GiB:.1f} GiB of activations")
    return top.peak_bytes, parts


def validate_memory(cfg: JobConfig, dims: ParallelDims) -> None:
    """Refuse a job whose analytic peak per rank exceeds what this machine has for one rank."""
    estimate = estimate_peak_memory(cfg, dims)
    if estimate is None:
        return
    peak, parts = estimate
    memory, where = machine_memory()
    if peak > memory:
        raise ConfigError(
            f"the job needs about {peak / GiB:.1f} GiB per rank ({parts}, by the analytic estimate) but "
            f"{where} {memory / GiB:.1f} GiB; lower training.local_batch_size or training.seq_len, set "
            "activation_checkpoint.mode full, spread the model over more ranks (parallelism degrees) or pick a "
            "smaller model.flavor")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(cfg: JobConfig, dims: ParallelDims) -> None:
    from titanlike.checkpoint.manager import validate_checkpoint_config
    from titanlike.data.loader import validate_dataset, validate_rampup
    from titanlike.models.common.attention import validate_attention_backend
    from titanlike.models.converters import validate_converters
    from titanlike.models.registry import get_model_spec, model_names
    from titanlike.parallel.context import validate_context_parallel
    from titanlike.parallel.pipeline import validate_pipeline
    from titanlike.parallel.tensor_parallel import validate_tensor_parallel
    from titanlike.train.model_parts import flavor_args

    p, t = cfg.parallelism, cfg.training
    cuda = torch.cuda.is_available()
    compile_blocks = cfg.compile.enable and "model" in cfg.compile.components
    validate_values(cfg)
    validate_converters(cfg.model.converters, cfg.float8, tp=dims.tp)
    validate_attention_backend(cfg.model.attention_backend, cuda=cuda)

    # The model and its family's own rules.
    _check(cfg.model.name in model_names(),
           f"model.name {cfg.model.name!r} is unknown; known models: {', '.join(model_names())}")
    spec = get_model_spec(cfg.model.name)
    _check(cfg.model.flavor in spec.flavors,
           f"model.flavor {cfg.model.flavor!r} is unknown for {cfg.model.name}; "
           f"known flavors: {', '.join(spec.flavors)}")
    if cfg.model.tokenizer_path:
        _check(os.path.isfile(cfg.model.tokenizer_path), f"model.tokenizer_path {cfg.model.tokenizer_path} does not exist")
    if cfg.model.hf_assets_path:
        _validate_hf_assets(cfg.model.hf_assets_path)
    model = f"{cfg.model.name} {cfg.model.flavor}"
    _validate_experts(cfg, dims, spec.flavors[cfg.model.flavor].moe_args() is not None, model)
    _validate_family_options(cfg, spec)
    try:
        args = flavor_args(cfg, spec)
        args.validate(dims, seq_len=t.seq_len)
    except ValueError as e:
        raise ConfigError(f"{model}: {e}") from None
    # The objective's own rules (the data it can read, the options that apply to its samples).
    spec.objective(cfg, args).validate(cfg, dims, model=model)

    # Layout.
    validate_tensor_parallel(tp=dims.tp, seq_len=t.seq_len, shardable=spec.shard is not None, model=cfg.model.name,
                             async_tp=p.enable_async_tensor_parallel, compile_blocks=compile_blocks, cuda=cuda)
    if dims.cp_enabled:
        validate_context_parallel(t.seq_len, dims.cp, dims.tp)
    per_pass = t.local_batch_size * dims.dp_degree
    if t.global_batch_size != -1:
        _check(t.global_batch_size >= 1 and t.global_batch_size % per_pass == 0,
               f"training.global_batch_size {t.global_batch_size} must be a positive multiple of "
               f"local_batch_size {t.local_batch_size} x data-parallel degree {dims.dp_degree} = {per_pass}")
    if t.rampup_batch_size:
        validate_rampup(t.rampup_batch_size, t.global_batch_size if t.global_batch_size != -1 else per_pass, per_pass,
                        option="training.rampup_batch_size")
    _check(not t.enable_cpu_offload or dims.fsdp_enabled,
           "training.enable_cpu_offload offloads FSDP's shards, so it needs data_parallel_shard_degree > 1 "
           f"(this layout has {dims.dp_shard})")
    validate_dataset(t.dataset, t.dataset_path)
    v = cfg.validation
    if v.enable and v.seq_len not in (-1, t.seq_len):
        _check(not dims.cp_enabled and not dims.pp_enabled,
               f"validation.seq_len {v.seq_len} must be -1 or training.seq_len {t.seq_len} under "
               f"{'context' if dims.cp_enabled else 'pipeline'} parallelism, which is set up for training's "
               "sequence length")
        _check(v.seq_len % dims.tp == 0,
               f"validation.seq_len {v.seq_len} must be divisible by tensor_parallel_degree {dims.tp} "
               "(sequence parallelism cuts it)")
    if cfg.compile.enable:
        _validate_compile_backend(cfg.compile.backend)
    if v.enable and v.dataset not in (None, "default") and v.dataset_path:
        validate_dataset(v.dataset, v.dataset_path, option="validation")
    if dims.pp_enabled:
        ac = cfg.activation_checkpoint
        validate_pipeline(p, model=model, n_layers=args.num_layers, has_pipeline_ends=spec.pipeline_ends is not None,
                          local_batch_size=t.local_batch_size, fsdp_enabled=dims.fsdp_enabled,
                          compile_blocks=compile_blocks, ac_mode=ac.mode, ac_option=ac.selective_ac_option,
                          validation_enabled=cfg.validation.enable,
                          validation_batch_size=cfg.validation.local_batch_size)
    validate_checkpoint_config(cfg.checkpoint, spec, hf_assets_path=cfg.model.hf_assets_path)
    if cfg.metrics.enable_wandb:
        from titanlike.observe.wandb_run import validate_wandb

        validate_wandb()


def _validate_hf_assets(path: str) -> None:
    """model.hf_assets_path: a folder whose tokenizer.json the tokenizer reads."""
    from titanlike.data.tokenizer import build_tokenizer
    from titanlike.data.tokenizer_json import TOKENIZER_JSON, is_tokenizer_folder

    _check(os.path.isdir(path), f"model.hf_assets_path {path} does not exist or is not a folder")
    _check(is_tokenizer_folder(path),
           f"model.hf_assets_path {path} has no {TOKENIZER_JSON} (torchtitan's scripts/download_hf_assets.py "
           "--assets tokenizer fetches it; a tiktoken tokenizer.model goes in model.tokenizer_path)")
    try:
        build_tokenizer(path)
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"model.hf_assets_path: {e}") from None


def _validate_compile_backend(backend: str) -> None:
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    _check(backend in known, f"compile.backend {backend!r} is not a torch.compile backend; known: {', '.join(known)}")


def _validate_family_options(cfg: JobConfig, spec) -> None:
    """A model family's own section (ModelSpec.options) is read only when that family is trained: one
    set for another family is refused rather than ignored."""
    import dataclasses

    from titanlike.models.registry import get_model_spec, model_names

    for name in model_names():
        options = get_model_spec(name).options
        if options is None or name == spec.name or (spec.options and spec.options.section == options.section):
            continue
        section = getattr(cfg, options.section)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            _check(value == getattr(options.options_cls(), field.name),
                   f"{options.section}.{field.name} {value!r} is set, but it configures the {name} family and "
                   f"model.name is {cfg.model.name}; remove it or set model.name {name}")


def _validate_experts(cfg: JobConfig, dims: ParallelDims, has_experts: bool, model: str) -> None:
    """Expert parallelism and the [moe] settings need a mixture-of-experts model."""
    if has_experts:
        return
    _check(not dims.ep_enabled, f"parallelism.expert_parallel_degree {dims.ep} needs a mixture-of-experts model, "
                                f"and {model} is dense; set it to 1")
    m = cfg.moe
    for name in ("capacity_factor", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        _check(getattr(m, name) is None, f"moe.{name} is set but {model} has no mixture-of-experts layers; "
                                         "remove it or pick an MoE model")
    _check(not m.pad_to_capacity, f"moe.pad_to_capacity is set but {model} has no mixture-of-experts layers")
