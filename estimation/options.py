"""The `--estimate.*` options (not in the training schema: they mean nothing to train.py), and the plan
an estimate runs: everything else on the command line goes to the training config loader unchanged, so
an estimate plans exactly the job train.py would run (`plan_job`), less what a probe on fake tensors
cannot run (each removal is noted).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from titanlike.config.loader import ConfigError, parse_section_options, section_help
from titanlike.config.schema import JobConfig, opt

if TYPE_CHECKING:
    from titanlike.train.plan import JobPlan


@dataclass
class EstimateOptions:
    world_size: int | None = opt(
        None, "ranks to estimate for; empty means the smallest world the config's parallel degrees allow")
    device_memory_gib: float | None = opt(None, "GPU memory in GiB; with it, a verdict says whether the job fits")
    reserved_gib: float = opt(
        2.0, "GPU memory outside PyTorch's allocator: CUDA context, NCCL's buffers, cuBLAS workspaces")
    device: str = opt("cuda", "whose kernels to count: cuda (fused attention, as on a GPU) or cpu (torch's CPU "
                              "kernels, to compare with steps measured on this machine)", choices=("cuda", "cpu"))
    json: bool = opt(False, "print one JSON object instead of the report")
    alloc_granularity: int = opt(
        512, "bytes every tensor is rounded up to, as the CUDA caching allocator does; 1 counts exact bytes")
    plan: bool = opt(False, "rank layouts for this model, world size, GPU memory and sequence length "
                            "(and expert-parallel degree for mixture-of-experts models)")
    plan_top: int = opt(5, "layouts the planner prints")
    plan_probes: int = opt(24, "planner: most layouts whose memory it estimates, fastest first")
    plan_ac_modes: list[str] = opt(["none", "op", "full"], "planner: activation checkpointing modes to try",
                                   choices=("none", "op", "selective", "full"))
    plan_mfu: float = opt(0.5, "planner: fraction of the dense bf16 peak that matmuls reach (before comm and bubbles)")
    device_tflops: float = opt(989.0, "planner: dense bf16 peak of one GPU in TFLOP/s (H100 SXM: 989)")
    gpus_per_node: int = opt(8, "planner: GPUs sharing one NVLink domain")
    nvlink_gbps: float = opt(
        360.0, "planner: achievable collective bus bandwidth inside a node, GB/s per GPU (H100 NVLink 4)")
    ib_gbps: float = opt(
        40.0, "planner: achievable collective bus bandwidth across nodes, GB/s per GPU (400 Gb/s NDR per GPU)")


def parse_estimate_args(argv: Sequence[str]) -> tuple[EstimateOptions, list[str]]:
    """Split argv into the `--estimate.*` options and the rest (for `load_job_config`), with the training
    options' conventions (`--estimate.key value`, `=value`, booleans as flags or `--estimate.no_key`)."""
    opts, rest = parse_section_options(argv, "estimate", EstimateOptions)
    for name in ("world_size", "alloc_granularity", "plan_top", "plan_probes", "gpus_per_node"):
        if (value := getattr(opts, name)) is not None and value < 1:
            raise ConfigError(f"estimate.{name} must be at least 1, got {value}")
    return opts, rest


GiB = 2**30


def verdict(reserved_bytes: int, opts: EstimateOptions) -> dict | None:
    """Whether what the allocator reserves, plus the memory outside it, fits the device."""
    if opts.device_memory_gib is None:
        return None
    needed, capacity = reserved_bytes + opts.reserved_gib * GiB, opts.device_memory_gib * GiB
    headroom = capacity - needed
    text = (f"fits in {opts.device_memory_gib:g} GiB with {headroom / GiB:.1f} GiB headroom" if headroom >= 0 else
            f"does NOT fit in {opts.device_memory_gib:g} GiB: {-headroom / GiB:.1f} GiB short")
    return {"fits": headroom >= 0, "device_memory_bytes": int(capacity), "needed_bytes": int(needed),
            "headroom_bytes": int(headroom),
            "text": f"{text} ({reserved_bytes / GiB:.1f} GiB reserved by the allocator + {opts.reserved_gib:g} GiB "
                    "outside it for the CUDA context and NCCL)"}


# run(job_config, options) -> (result, format): the result as a dict, and what turns it into the report.
Run = Callable[[JobConfig, EstimateOptions], tuple[dict, Callable[[dict], str]]]


def command_line(argv: Sequence[str], prog: str, run: Run) -> int:
    """The command line of estimation/estimate.py and plan.py (each passes its own `run`): --help, the
    options, the job's config, then the result as JSON or the report; exit 2 on a config error."""
    from titanlike.config import help_text, load_job_config

    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text().replace("usage: train.py", f"usage: {prog} [--estimate.key VALUE ...]", 1) + "\n\n"
              + section_help("estimate", EstimateOptions, title="(estimation/estimate.py and plan.py, not train.py)")
              + "\n\nEstimates every layout train.py runs (FSDP/HSDP, TP, CP, PP, EP, float8, activation "
              "checkpointing) by running the job's own training step on fake tensors, one block of each kind.")
        return 0
    try:
        opts, rest = parse_estimate_args(argv)
        result, text = run(load_job_config(rest), opts)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if opts.json else text(result))
    return 0


class PreparedJob(NamedTuple):
    """A job ready to estimate: its plan (made from the config the probe runs) and what was changed."""

    plan: JobPlan
    notes: list[str]


def prepare_job(cfg: JobConfig, world_size: int | None = None, *, vocab_size: int | None = None) -> PreparedJob:
    """Plan cfg for world_size with the training rules (plan_job), after taking out what a probe cannot
    run, each removal noted. Raises ConfigError (one sentence) for layouts that cannot run at all."""
    est = copy.deepcopy(cfg)
    notes: list[str] = []
    if any(name.lower() == "float8" for name in est.model.converters):
        # Validation refuses float8 without an SM 8.9+ GPU here; the probe runs the GPU's float8 matmul.
        est.float8.emulate = True
        notes.append("float8: probed with the trainer's converter (torchao Float8Linear, float8 casts, float8 "
                     "all-gather buffers and scales as real tensors) and the GPU's float8 matmul")
    if "mx" in est.model.converters and not est.mx.emulate:
        # Validation refuses mx without a Blackwell GPU here; torchao's MXFP8 kernels have no fake kernels.
        est.mx.emulate = True
        notes.append("mx: probed with the trainer's converter on torchao's emulated MXFP8 path (the same casts, "
                     "bf16 matmuls): its temporaries stand in for the Blackwell kernels'")
    if est.compile.enable:
        # estimation.fake registers it on import; imported here, not at the top, so that a command's --help
        # does not pay for torch._dynamo (docs/performance.md).
        import estimation.fake  # noqa: F401

        est.compile.backend = "estimate_partitioned"  # estimation.fake.partitioned_backend
        notes.append("compile: compiled graphs traced with AOT autograd and inductor's decompositions, split by its "
                     "min-cut partitioner (what they save for backward) and run allocating what inductor's fusion "
                     f"would (pointwise chains fused); compile.backend {cfg.compile.backend} itself is not run")
    if est.activation_checkpoint.mode == "memory_budget":
        est.activation_checkpoint.mode = "none"
        notes.append("activation_checkpoint.mode memory_budget is a compiler decision: estimated without checkpointing")
    p = est.parallelism
    if p.enable_async_tensor_parallel:
        p.enable_async_tensor_parallel = False
        notes.append("async tensor parallel: estimated as plain tensor parallel (same tensors, different overlap)")
    # Checkpoints, validation and logging change no GPU tensor of a training step (plan_job given a
    # vocabulary checks no data source).
    est.checkpoint, est.validation, est.metrics.enable_wandb = type(cfg.checkpoint)(), type(cfg.validation)(), False
    vocab_size, note = _job_vocab_size(est, vocab_size)
    # The trainer's planning modules import torch.distributed's pipelining (and torch._dynamo): here, not at
    # the top, so that --help skips them.
    from titanlike.parallel.parallel_dims import ParallelDims
    from titanlike.train.plan import plan_job

    world = world_size or ParallelDims.smallest_world(cfg.parallelism)
    return PreparedJob(plan_job(est, world, vocab_size=vocab_size), notes + ([note] if note else []))


def _job_vocab_size(cfg: JobConfig, known: int | None) -> tuple[int, str | None]:
    """(the vocabulary to size the model by, a note when it is not the one train.py would load). The
    trainer sizes the embedding by its tokenizer; where that is a file or folder not found here, or the debug
    tokenizer (none given) whose vocabulary would change a real flavor's size by more than 5%, the
    flavor's own vocabulary, said in one line."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.data.tokenizer import job_tokenizer
    from titanlike.models.registry import get_model_spec, model_names

    if known is not None:
        return known, None
    m = cfg.model
    flavor = get_model_spec(m.name).flavors.get(m.flavor) if m.name in model_names() else None
    missing = ("tokenizer_path", m.tokenizer_path) if m.tokenizer_path and not os.path.isfile(m.tokenizer_path) else \
        ("hf_assets_path", m.hf_assets_path) if m.hf_assets_path and not os.path.isdir(m.hf_assets_path) else None
    if missing:
        m.tokenizer_path = m.hf_assets_path = None
        return (flavor.vocab_size if flavor is not None else 1,  # an unknown model: planning says so
                f"model.{missing[0]} {missing[1]} not found here: vocab_size taken from the {m.flavor} flavor")
    try:
        vocab = job_tokenizer(m.tokenizer_path, m.hf_assets_path, DEFAULT_TOKENIZER_PATH).vocab_size
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.tokenizer_path or m.hf_assets_path or flavor is None or flavor.vocab_size == vocab:
        return vocab, None
    ours, debug = (flavor.update_from_config(vocab_size=v, seq_len=cfg.training.seq_len).num_params()
                   for v in (flavor.vocab_size, vocab))
    if abs(ours - debug) <= 0.05 * ours:
        return vocab, None
    return flavor.vocab_size, (
        f"no tokenizer given (model.tokenizer_path, model.hf_assets_path): estimated with the {m.flavor} flavor's own "
        f"vocabulary of {flavor.vocab_size:,} ({ours / 1e9:.2f}B parameters), where train.py would size the model by "
        f"the debug tokenizer's {vocab:,} ({debug / 1e9:.2f}B)")
