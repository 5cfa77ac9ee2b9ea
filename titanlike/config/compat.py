"""torchtitan's config keys that titanlike's schema does not hold under the same name.

A torchtitan TOML (v0.2.2, and the older spellings of v0.1.0 / v0.2.0) must run here unchanged,
and every key it holds must either do what it says or say why it does not. The loader resolves
a key in the schema first, then here:

* ``Alias``: torchtitan's current spelling of one of our options (``[quantize.linear.float8]``
  is our ``[float8]``); read silently.
* ``Renamed``: an older torchtitan spelling (``training.compile``); read as the new key with a
  one-line deprecation note naming it. titanlike's own older spellings (``training.mask_prob``) are
  registered with the section that now holds them (titanlike/config/sections.py) and read the same way.
* ``NotHere``: an option titanlike has no counterpart for. ``value`` is what titanlike does
  (mostly torchtitan's default, "off"): that value is accepted silently since it is what
  happens, any other is refused in one sentence saying why. With ``note=True`` another value is
  accepted with a one-line note saying the key has no effect here, and why (for knobs whose
  absence changes nothing a user relies on, e.g. console colors).

Keys are full dotted names; nested torchtitan tables (``[training.dataloader]``) are dotted too.
This module holds data only; the loader applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    target: str


@dataclass(frozen=True)
class Renamed:
    target: str
    release: str  # the last release that spelled it this way
    by: str = "torchtitan"  # whose release: torchtitan's, or titanlike's own (config/sections.py)
    also: tuple[str, ...] = ()  # further keys the value is read as (one old key feeding several sections)


@dataclass(frozen=True)
class NotHere:
    value: Any  # what titanlike does; its type is the option's type
    why: str  # completes "... is not supported: " (refused) or "... has no effect here: " (note)
    note: bool = False


# Whole tables torchtitan names differently: (torchtitan prefix, our section).
SECTION_ALIASES: dict[str, str] = {"quantize.linear.float8": "float8"}

# List items torchtitan names differently: option -> {torchtitan's item: ours}. v0.2.2 registers
# its float8 linear converter as "quantize.linear.float8"; its presets write "float8", as we do.
ITEM_ALIASES: dict[str, dict[str, str]] = {"model.converters": {"quantize.linear.float8": "float8"}}

_NOT_YET = "not implemented in titanlike yet"
_NO_CODE = "titanlike never imports code a config names (model families register in titanlike.models)"
_NO_FT = "titanlike has no TorchFT integration"
_NO_MX = "titanlike has no MX (microscaling) converter; model.converters refuses 'mx'"
_IN_PROCESS = "titanlike's data loader reads in the training process (its samples are cheap to cut from packed tokens)"

TORCHTITAN_KEYS: dict[str, Alias | Renamed | NotHere] = {
    # [job]
    "job.print_args": Renamed("job.print_config", "v0.1.0"),
    "job.use_for_integration_test": NotHere(False, "it marks configs for torchtitan's own test suite", note=True),
    "job.custom_config_module": NotHere("", _NO_CODE),
    # [profiling]: one step traced per profile_freq, after one warm-up step
    "profiling.profiler_active": NotHere(1, "titanlike's profiler traces one step per profiling.profile_freq",
                                         note=True),
    "profiling.profiler_warmup": NotHere(1, "titanlike's profiler warms up one step before each traced step",
                                         note=True),
    # [metrics]
    "metrics.disable_color_printing": NotHere(True, "titanlike's console log is never colored", note=True),
    "metrics.save_for_all_ranks": NotHere(
        False, "rank 0 writes the metrics (it holds the global loss under every layout, pipelines included)"),
    # [optimizer]
    "optimizer.early_step_in_backward": NotHere(False, _NOT_YET),
    # [lr_scheduler]
    "lr_scheduler.lr_min": Renamed("lr_scheduler.min_lr_factor", "v0.1.0"),
    # [training]
    "training.compile": Renamed("compile.enable", "v0.1.0"),
    "training.seed": Renamed("debug.seed", "v0.2.0"),
    "training.deterministic": Renamed("debug.deterministic", "v0.2.0"),
    "training.debug_moe_force_load_balance": Renamed("debug.moe_force_load_balance", "v0.2.0"),
    "training.dtype": NotHere("float32", "parameters and optimizer state stay float32 here (bfloat16 compute "
                                         "is training.mixed_precision_param)"),
    "training.dataloader.num_workers": NotHere(0, _IN_PROCESS),
    "training.dataloader.persistent_workers": NotHere(False, _IN_PROCESS),
    "training.dataloader.pin_memory": NotHere(False, _IN_PROCESS),
    "training.dataloader.prefetch_factor": NotHere(None, _IN_PROCESS),
    # [parallelism]
    "parallelism.enable_compiled_autograd": NotHere(False, "compiled autograd was dropped by torchtitan v0.2.0 "
                                                           "and is not implemented here"),
    "parallelism.pipeline_parallel_split_points": NotHere(
        [], "torchtitan v0.2.0 dropped split points; use parallelism.pipeline_parallel_layers_per_stage"),
    "parallelism.module_fqns_per_model_part": NotHere(
        None, "stages are planned from parallelism.pipeline_parallel_layers_per_stage and the first/last "
              "stage weights"),
    "parallelism.pipeline_parallel_schedule_csv": NotHere("", "pipeline schedules come from torch by name "
                                                              "(parallelism.pipeline_parallel_schedule)"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": NotHere(
        False, "titanlike's DualPipeV does not overlap expert-parallel communication", note=True),
    "parallelism.context_parallel_load_balancer": NotHere(
        "headtail", "titanlike's context parallelism always balances head-tail (rank i holds chunks i and "
                    "2 x cp - 1 - i)"),
    "parallelism.expert_parallel_comm_backend": NotHere("standard", "DeepEP kernels are not supported"),
    # [checkpoint]
    "checkpoint.enable_checkpoint": Renamed("checkpoint.enable", "v0.1.0"),
    "checkpoint.initial_load_model_weights_only": Renamed("checkpoint.initial_load_model_only", "v0.1.0"),
    "checkpoint.last_save_model_weights_only": Renamed("checkpoint.last_save_model_only", "v0.1.0"),
    "checkpoint.initial_load_in_hf_quantized": NotHere(False, _NOT_YET),
    "checkpoint.enable_ft_dataloader_checkpoints": NotHere(True, _NO_FT),
    # [activation_checkpoint]
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": NotHere(
        [], "titanlike's op-level policy keeps every matmul output, a router's too", note=True),
    "activation_checkpoint.visualize_memory_budget_pareto": NotHere(False, _NOT_YET),
    # [float8] of v0.1.0 (ours) and [quantize.*] of v0.2
    "float8.force_recompute_fp8_weight_in_bwd": NotHere(False, "torchtitan v0.2.0 dropped it; " + _NOT_YET),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": NotHere("triton", _NO_MX, note=True),
    "quantize.linear.mx.recipe_name": NotHere("mxfp8_cublas", _NO_MX, note=True),
    "quantize.linear.mx.filter_fqns": NotHere(["output"], _NO_MX, note=True),
    "quantize.grouped_mm.float8.fqns": NotHere(
        [], "float8 grouped GEMMs for experts are " + _NOT_YET + " (model.converters refuses "
        "quantize.grouped_mm.float8)", note=True),
    "quantize.grouped_mm.mx.recipe_name": NotHere("mxfp8", _NO_MX, note=True),
    "quantize.grouped_mm.mx.fqns": NotHere([], _NO_MX, note=True),
    "mx.use_fp8_dim1_cast_triton_kernel": NotHere(True, _NO_MX, note=True),
    "mx.recipe_name": Renamed("quantize.linear.mx.recipe_name", "v0.1.0"),
    "mx.filter_fqns": Renamed("quantize.linear.mx.filter_fqns", "v0.1.0"),
    # [comm]: NCCL's flight recorder writes <dump_folder>/comm_traces/rank_<r>
    "comm.save_traces_folder": NotHere("comm_traces", "the flight recorder's folder is job.dump_folder/comm_traces"),
    "comm.save_traces_file_prefix": NotHere("rank_", "the flight recorder's files are named rank_<rank>"),
    "comm.mode": NotHere("default", "a dry run without GPUs is estimation/estimate.py"),
    # [memory_estimation]: torchtitan's train.py does not read it either
    "memory_estimation.enable": NotHere(False, "train.py trains; the estimator is estimation/estimate.py"),
    "memory_estimation.enabled": Renamed("memory_estimation.enable", "v0.1.0"),
    "memory_estimation.disable_fake_mode": NotHere(False, "train.py trains; the estimator is estimation/estimate.py"),
    # [fault_tolerance]: v0.2.2's JobConfig and its TorchFT component's (components/ft/config/job_config.py)
    "fault_tolerance.enable": NotHere(False, _NO_FT),
    "fault_tolerance.process_group": NotHere("gloo", _NO_FT),
    "fault_tolerance.process_group_timeout_ms": NotHere(10000, _NO_FT),
    "fault_tolerance.replica_id": NotHere(0, _NO_FT),
    "fault_tolerance.group_size": NotHere(0, _NO_FT),
    "fault_tolerance.min_replica_size": NotHere(1, _NO_FT),
    "fault_tolerance.semi_sync_method": NotHere(None, _NO_FT),
    "fault_tolerance.sync_steps": NotHere(5, _NO_FT),
    "fault_tolerance.should_quantize": NotHere(False, _NO_FT),
    "fault_tolerance.fragment_sync_delay": NotHere(0, _NO_FT),
    "fault_tolerance.fragment_update_alpha": NotHere(0.0, _NO_FT),
    "fault_tolerance.module_fqns_per_model_fragment": NotHere([], _NO_FT),
    "fault_tolerance.num_fragments": NotHere(1, _NO_FT),
    # [experimental]
    "experimental.custom_import": NotHere("", _NO_CODE),
    "experimental.custom_args_module": Renamed("job.custom_config_module", "v0.1.0"),
    # [validation]
    "validation.dataloader.num_workers": NotHere(0, _IN_PROCESS),
    "validation.dataloader.persistent_workers": NotHere(False, _IN_PROCESS),
    "validation.dataloader.pin_memory": NotHere(False, _IN_PROCESS),
    "validation.dataloader.prefetch_factor": NotHere(None, _IN_PROCESS),
    # [debug]
    "debug.moe_force_load_balance": NotHere(False, _NOT_YET),
}

# Megatron-LM's model-size flags (pretrain_gpt.py --hidden-size 4096 ...): train.py takes --section.key
# options only, so a bare flag is refused with its spelling here. The model's sizes are [model.args],
# where each family accepts these names (its args' ARG_ALIASES) beside its own field names.
MEGATRON_FLAGS: dict[str, str] = {
    **{flag: f"model.args.{flag.replace('-', '_')}" for flag in (
        "hidden-size", "num-layers", "num-attention-heads", "num-query-groups", "ffn-hidden-size", "kv-channels",
        "max-position-embeddings", "norm-epsilon", "rotary-base", "encoder-num-layers", "decoder-num-layers")},
    "hybrid-layer-pattern": "hybrid.layer_pattern",
    "seq-length": "training.seq_len",
    "micro-batch-size": "training.local_batch_size",
    "global-batch-size": "training.global_batch_size",
    "train-iters": "training.steps",
}
