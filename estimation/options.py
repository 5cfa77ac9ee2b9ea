"""The `--estimate.*` options, and turning a training JobConfig into one that can be estimated.

The estimate options are parsed here, not added to the training schema: they mean
nothing to `train.py`, and keeping them out of `JobConfig` keeps `train.py --help`
and the config files about training. Everything else on the command line goes to
the training config loader unchanged, so an estimate reads exactly the job that
`train.py` would run.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, field
from typing import Sequence

from titanlike.config.loader import ConfigError, parse_section_options, section_help
from titanlike.config.schema import JobConfig, opt
from titanlike.train.plan import JobPlan, plan_job
from titanlike.parallel.parallel_dims import ParallelDims



@dataclass
class EstimateOptions:
    world_size: int | None = opt(
        None, "ranks to estimate for; empty means the smallest world the config's parallel degrees allow")
    device_memory_gib: float | None = opt(None, "GPU memory in GiB; with it, a verdict says whether the job fits")
    reserved_gib: float = opt(
        2.0, "GPU memory the tensors cannot use: CUDA context, NCCL communicators, cuBLAS workspaces")
    fragmentation: float = opt(
        0.05, "caching-allocator overhead as a fraction of peak tensor memory (reserved over allocated)")
    mode: str = opt("both", "which estimates to run (mixture-of-experts models: analytic only)",
                    choices=("both", "traced", "analytic"))
    json: bool = opt(False, "print one JSON object instead of the report")
    per_module: bool = opt(False, "also report the traced peak of every module during its forward and backward")
    module_depth: int = opt(2, "deepest module level listed by per_module (1 = the model's children)")
    alloc_granularity: int = opt(
        512, "bytes every tensor is rounded up to, as the CUDA caching allocator does; 1 counts exact bytes")
    # Planner.
    plan: bool = opt(False, "rank layouts for this model, world size, GPU memory and sequence length "
                            "(and expert-parallel degree for mixture-of-experts models)")
    plan_top: int = opt(5, "layouts the planner prints")
    plan_verify: int = opt(0, "planner: trace this many of the best layouts and drop those the trace says do not fit")
    plan_ac_modes: list[str] = opt(["none", "op", "full"], "planner: activation checkpointing modes to try")
    plan_mfu: float = opt(0.5, "planner: fraction of the dense bf16 peak that matmuls reach (before comm and bubbles)")
    device_tflops: float = opt(989.0, "planner: dense bf16 peak of one GPU in TFLOP/s (H100 SXM: 989)")
    gpus_per_node: int = opt(8, "planner: GPUs sharing one NVLink domain")
    nvlink_gbps: float = opt(
        360.0, "planner: achievable collective bus bandwidth inside a node, GB/s per GPU (H100 NVLink 4)")
    ib_gbps: float = opt(
        40.0, "planner: achievable collective bus bandwidth across nodes, GB/s per GPU (400 Gb/s NDR per GPU)")


def parse_estimate_args(argv: Sequence[str]) -> tuple[EstimateOptions, list[str]]:
    """Split argv into the `--estimate.*` options and the rest (for `load_job_config`).

    Same conventions as the training options: `--estimate.key value`, `--estimate.key=value`,
    booleans as flags or `--estimate.no_key`, lists comma-separated.
    """
    opts, rest = parse_section_options(argv, "estimate", EstimateOptions)
    if opts.world_size is not None and opts.world_size < 1:
        raise ConfigError(f"estimate.world_size must be at least 1, got {opts.world_size}")
    if opts.alloc_granularity < 1:
        raise ConfigError(f"estimate.alloc_granularity must be at least 1, got {opts.alloc_granularity}")
    unknown = set(opts.plan_ac_modes) - {"none", "op", "full", "selective"}
    if unknown:
        raise ConfigError(f"estimate.plan_ac_modes may only hold none, op, selective and full, "
                          f"got {', '.join(sorted(unknown))}")
    return opts, rest


def estimate_help() -> str:
    return ("\n" + section_help("estimate", EstimateOptions, title="(estimation/estimate.py and plan.py, not train.py)")
            + "\n\nEstimates every layout train.py runs (FSDP/HSDP, TP, CP, PP, float8, activation checkpointing)"
            "; mixture-of-experts models with expert parallelism by the analytic estimate (the trace refuses"
            " them), reporting total and active parameters; the planner searches expert_parallel_degree"
            " for MoE models.")


@dataclass
class Float8Adjustment:
    """What the float8 converter changes. The analytic estimate applies it as a formula; the trace
    runs the converter itself (`traced`), unless torchao is missing, when the trace runs in bf16 and
    is adjusted by the same formula."""

    fsdp_float8_all_gather: bool
    filter_fqns: list[str]
    traced: bool = False


@dataclass
class PreparedJob:
    """A job ready to estimate: its plan (titanlike/train/plan.py, made from the config the trace runs,
    features it cannot trace removed) and what was changed."""

    plan: JobPlan
    notes: list[str] = field(default_factory=list)
    float8: Float8Adjustment | None = None

    @property
    def cfg(self) -> JobConfig:
        return self.plan.cfg

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def model_args(self):
        return self.plan.model_args

    @property
    def objective(self):
        return self.plan.objective


@functools.lru_cache(maxsize=8)
def _vocab_size(tokenizer_path: str | None, hf_assets_path: str | None) -> int:
    # The planner prepares thousands of layouts of one job: load its tokenizer once.
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.data.tokenizer import job_tokenizer

    try:
        return job_tokenizer(tokenizer_path, hf_assets_path, DEFAULT_TOKENIZER_PATH).vocab_size
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _torchao_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def default_world_size(cfg: JobConfig) -> int:
    p = cfg.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return (p.data_parallel_replicate_degree * shard * p.context_parallel_degree
            * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def prepare_plan(plan: JobPlan) -> PreparedJob:
    """A job already planned for training (train.py's memory check): estimated as it is, with float8
    as the analytic formula (no re-planning: the analytic estimate reads nothing a trace cannot run)."""
    f = plan.cfg.float8
    float8 = (Float8Adjustment(f.enable_fsdp_float8_all_gather, list(f.filter_fqns))
              if any(name.lower() == "float8" for name in plan.cfg.model.converters) else None)
    return PreparedJob(plan, float8=float8)


def prepare_job(cfg: JobConfig, world_size: int | None = None) -> PreparedJob:
    """Plan cfg for world_size with the training rules (plan_job), after taking out what an
    estimate cannot run (each removal is recorded in `notes`).

    Raises ConfigError (one sentence, from the same planning train.py does) for layouts
    that cannot run at all.
    """
    from titanlike.models.registry import get_model_spec, model_names

    est = copy.deepcopy(cfg)
    notes: list[str] = []
    world_size = world_size or default_world_size(cfg)

    float8 = None
    converters, est.model.converters = list(est.model.converters), []
    for name in converters:
        if name.lower() == "float8":
            float8 = Float8Adjustment(est.float8.enable_fsdp_float8_all_gather, list(est.float8.filter_fqns),
                                      traced=_torchao_available())
            if float8.traced:
                # The trace applies the trainer's own converter (torchao's Float8Linear) to the meta model.
                est.model.converters.append(name)
                if not est.float8.emulate:
                    # Validation refuses float8 without an SM 8.9+ GPU here; the sizes do not depend on it.
                    est.float8.emulate = True
                notes.append(
                    "float8: traced with the trainer's converter (torchao Float8Linear, float8 casts and, with "
                    "enable_fsdp_float8_all_gather, float8 all-gather buffers and scales as real tensors); "
                    "matmuls emulated, which changes kernels inside torchao's tensor subclass, not the tensors "
                    "the trace counts; casts run eager (unfused fp32 temporaries), as without compile. The "
                    "analytic estimate stays a formula: with enable_fsdp_float8_all_gather the gathered weights "
                    "of converted linears take 1 byte instead of 2, activations unchanged")
            else:
                notes.append(
                    "float8: torchao is not installed here, so traced in bf16, then adjusted analytically: with "
                    "enable_fsdp_float8_all_gather the gathered weights of converted linears take 1 byte instead "
                    "of 2; torchao keeps high-precision inputs for backward, so activations are unchanged")
        else:
            notes.append(f"model converter {name!r} is not modeled; estimated without it")
    if est.compile.enable:
        est.compile.enable = False
        notes.append("compile: estimated in eager mode (a trace cannot compile); compiled blocks usually "
                     "save some activation memory by fusing elementwise ops, so this errs high")
    p = est.parallelism
    if p.enable_async_tensor_parallel:
        p.enable_async_tensor_parallel = False
        notes.append("async tensor parallel: estimated as plain tensor parallel (same tensors, different overlap)")
    if p.expert_parallel_degree != 1 or p.expert_tensor_parallel_degree != 1:
        spec = get_model_spec(est.model.name) if est.model.name in model_names() else None
        flavor = spec.flavors.get(est.model.flavor) if spec is not None else None
        if flavor is not None and flavor.moe_args() is None:
            notes.append(f"expert parallelism: {est.model.name} is a dense model, so expert degrees change "
                         "nothing; estimated with 1")
            p.expert_parallel_degree = p.expert_tensor_parallel_degree = 1
    # Where data comes from, checkpoints and logging change no GPU tensor of a training step.
    est.training.dataset, est.training.dataset_path = "default", None
    c = est.checkpoint
    c.enable, c.initial_load_path, c.initial_load_in_hf = False, None, False
    c.create_seed_checkpoint = c.last_save_in_hf = False
    est.validation.enable = False
    est.metrics.enable_wandb = est.metrics.enable_tensorboard = False
    est.profiling.enable_memory_snapshot = est.profiling.enable_profiling = False

    # The trainer sizes the embedding by the tokenizer it loads (the debug one by default); without
    # the tokenizer, the flavor's own vocabulary stands in for it.
    path = est.model.tokenizer_path
    if path and not os.path.isfile(path):
        notes.append(f"tokenizer {path} not found: vocab_size taken from the {est.model.flavor} flavor")
        est.model.tokenizer_path = None
        spec = get_model_spec(est.model.name) if est.model.name in model_names() else None
        flavor = spec.flavors.get(est.model.flavor) if spec is not None else None
        vocab_size = flavor.vocab_size if flavor is not None else 1  # an unknown model: planning says so
    else:
        vocab_size = _vocab_size(path, est.model.hf_assets_path)
    return PreparedJob(plan_job(est, world_size, vocab_size=vocab_size), notes=notes, float8=float8)
