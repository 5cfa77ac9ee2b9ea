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
``FOREIGN_FLAGS`` is the same for the bare flags of Megatron-LM, Hugging Face and TRL: each is refused
naming the option it is here. This module holds data (and its wording); the loader applies it.
"""

from __future__ import annotations

import os
import re
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
# its float8 linear converter as "quantize.linear.float8"; its presets write "float8", as we do. Its
# two MX converters (linears, experts' grouped GEMMs) are our one mx, which the loader names once.
ITEM_ALIASES: dict[str, dict[str, str]] = {"model.converters": {
    "quantize.linear.float8": "float8", "quantize.linear.mx": "mx", "quantize.grouped_mm.mx": "mx"}}

_NOT_YET = "not implemented in titanlike yet"
_NO_CODE = "titanlike never imports code a config names (model families register in titanlike.models)"
_NO_FT = "titanlike has no TorchFT integration"
_MX_KERNELS = "torchao's MXFP8 linear picks its own cast kernels"
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
    # torchtitan's two MX converters are one here, [mx] (titanlike/models/mx.py); v0.1.0's [mx] is ours.
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": NotHere("triton", _MX_KERNELS, note=True),
    "quantize.linear.mx.recipe_name": Alias("mx.recipe_name"),
    "quantize.linear.mx.filter_fqns": Alias("mx.filter_fqns"),
    "quantize.grouped_mm.float8.fqns": NotHere(
        [], "float8 grouped GEMMs for experts are " + _NOT_YET + " (model.converters refuses "
        "quantize.grouped_mm.float8)", note=True),
    "quantize.grouped_mm.mx.recipe_name": NotHere(
        "mxfp8", "the experts' grouped GEMMs use mx.recipe_name, as the linear layers do", note=True),
    "quantize.grouped_mm.mx.fqns": Alias("mx.grouped_mm_fqns"),
    "mx.use_fp8_dim1_cast_triton_kernel": NotHere(True, _MX_KERNELS, note=True),
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

@dataclass(frozen=True)
class ForeignFlag:
    """Another trainer's command-line flag and what to write here instead (train.py takes --section.key
    options only, so the flag is refused with this spelling)."""

    instead: str  # titanlike's options as typed ("--training.steps"; a fixed value when the flag implies one)
    whose: str  # "Megatron", "Hugging Face", "TRL" (the trainers whose users type it, comma-separated)
    switch: bool = False  # the flag takes no value (--bf16): the word after it is not its value
    note: str = ""  # what differs, when the mapping is not one to one
    many: bool = False  # the flag takes every word up to the next flag (Megatron's --data-path 0.7 a 0.3 b)


def _megatron(instead: str, *, switch: bool = False, note: str = "", many: bool = False) -> ForeignFlag:
    return ForeignFlag(instead, "Megatron", switch, note, many)


def _hf(instead: str, *, switch: bool = False, note: str = "", whose: str = "Hugging Face",
        many: bool = False) -> ForeignFlag:
    return ForeignFlag(instead, whose, switch, note, many)


_FROM_DATA = "global_batch_size / (local_batch_size x data-parallel degree)"
_EPOCHS = "titanlike counts optimizer steps, not epochs"
_HF_FOLDER = "a local folder; a Hub id is downloaded first with titanlike-download-hf-assets"

# The flags Megatron-LM's pretrain_gpt.py and Hugging Face's Trainer / TRL's scripts are run with daily, in
# the order of their --help. The model's sizes are [model.args], where each family accepts Megatron's and
# Hugging Face's names (its args' ARG_ALIASES) beside its own field names. README.md's table of them is
# generated from this one (foreign_flags_markdown; tests/unit/test_foreign_flags.py checks it is).
FOREIGN_FLAGS: dict[str, ForeignFlag] = {
    # Megatron: model
    **{f"--{flag}": _megatron(f"--model.args.{flag.replace('-', '_')}") for flag in (
        "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups", "kv-channels",
        "max-position-embeddings", "norm-epsilon", "rotary-base", "encoder-num-layers", "decoder-num-layers")},
    "--group-query-attention": _megatron("--model.args.num_query_groups", switch=True,
                                         note="grouped-query attention is on when it is below num_attention_heads"),
    "--num-experts": _megatron("--model.args.moe.num_experts"),
    "--hybrid-layer-pattern": _megatron("--hybrid.layer_pattern"),
    **{f"--{flag}": _megatron("--model.name", switch=switch, note="the family fixes the architecture "
                              "(llama3: RoPE, RMSNorm, SwiGLU, no biases, untied; gpt2: learned positions, "
                              "LayerNorm, GELU)") for flag, switch in (
        ("position-embedding-type", False), ("normalization", False), ("swiglu", True),
        ("untie-embeddings-and-output-weights", True), ("disable-bias-linear", True))},
    "--use-mcore-models": _megatron("nothing", switch=True, note="there is one model implementation per family"),
    "--openai-gelu": _megatron("--model.args.gelu_approximate tanh", switch=True,
                               note="gpt2's default; without the flag Megatron computes the exact GELU: "
                                    "--model.args.gelu_approximate none"),
    # Megatron: data and tokenizer
    "--data-path": _megatron("--training.dataset megatron --training.dataset_path",
                             note="a prefix or a '0.7 a 0.3 b' blend, as Megatron reads it", many=True),
    "--split": _megatron("--training.split"),
    "--seq-length": _megatron("--training.seq_len"),
    "--tokenizer-type": _megatron("--model.hf_assets_path",
                                  note="a folder with tokenizer.json, or a tiktoken file in --model.tokenizer_path"),
    "--tokenizer-model": _megatron("--model.hf_assets_path",
                                   note="a folder with tokenizer.json, or a tiktoken file in --model.tokenizer_path"),
    "--vocab-file": _megatron("--model.hf_assets_path", note="a folder with tokenizer.json"),
    "--merge-file": _megatron("--model.hf_assets_path", note="a folder with tokenizer.json"),
    "--num-workers": _megatron("nothing", note="the data loader reads in the training process"),
    "--fim-data": _megatron("--fim.rate", switch=True, note="FIM is on when fim.rate is above 0"),
    **{f"--fim-{flag}": _megatron(f"--fim.{flag.replace('-', '_')}") for flag in (
        "rate", "spm-rate", "split-sample", "fragment-rate", "no-prefix", "prefix-token", "middle-token",
        "suffix-token", "pad-token")},
    "--fim-eod-token": _megatron("--fim.eod_token", note="empty by default: the tokenizer's EOS"),
    # Megatron: batch and steps
    "--micro-batch-size": _megatron("--training.local_batch_size"),
    "--global-batch-size": _megatron("--training.global_batch_size"),
    "--rampup-batch-size": _megatron("--training.rampup_batch_size"),
    "--train-iters": _megatron("--training.steps"),
    "--train-samples": _megatron("--training.steps", note="steps = samples / global_batch_size"),
    # Megatron: optimizer and schedule
    "--optimizer": _megatron("--optimizer.name"),
    "--lr": _megatron("--optimizer.lr"),
    "--min-lr": _megatron("--lr_scheduler.min_lr_factor", note="min_lr / lr, a fraction of the peak"),
    "--lr-decay-style": _megatron("--lr_scheduler.decay_type"),
    "--lr-warmup-iters": _megatron("--lr_scheduler.warmup_steps"),
    "--lr-warmup-fraction": _megatron("--lr_scheduler.warmup_steps", note="a number of steps"),
    "--lr-decay-iters": _megatron("--lr_scheduler.total_steps"),
    "--weight-decay": _megatron("--optimizer.weight_decay"),
    "--adam-beta1": _megatron("--optimizer.beta1"),
    "--adam-beta2": _megatron("--optimizer.beta2"),
    "--adam-eps": _megatron("--optimizer.eps"),
    "--clip-grad": _megatron("--training.max_norm"),
    # Megatron: precision
    "--bf16": ForeignFlag("--training.mixed_precision_param bfloat16", "Megatron, Hugging Face", switch=True,
                          note="the default"),
    "--fp16": ForeignFlag("--training.mixed_precision_param float16", "Megatron, Hugging Face", switch=True,
                          note="with dynamic loss scaling, [loss_scaling]"),
    "--initial-loss-scale": _megatron("--loss_scaling.initial_scale"),
    "--loss-scale": _megatron("--loss_scaling.mode static --loss_scaling.initial_scale"),
    "--attention-softmax-in-fp32": _megatron("nothing", switch=True, note="attention's softmax is always float32"),
    # Megatron: parallelism
    "--tensor-model-parallel-size": _megatron("--parallelism.tensor_parallel_degree"),
    "--pipeline-model-parallel-size": _megatron("--parallelism.pipeline_parallel_degree"),
    "--context-parallel-size": _megatron("--parallelism.context_parallel_degree"),
    "--expert-model-parallel-size": _megatron("--parallelism.expert_parallel_degree"),
    "--expert-tensor-parallel-size": _megatron("--parallelism.expert_tensor_parallel_degree"),
    "--num-layers-per-virtual-pipeline-stage": _megatron("--parallelism.pipeline_parallel_layers_per_stage"),
    "--sequence-parallel": _megatron("--parallelism.tensor_parallel_degree", switch=True,
                                     note="tensor parallelism always shards the sequence between blocks"),
    "--use-distributed-optimizer": _megatron("--parallelism.data_parallel_shard_degree", switch=True,
                                             note="FSDP shards optimizer state by default"),
    "--overlap-grad-reduce": _megatron("nothing", switch=True, note="FSDP overlaps its reductions"),
    "--overlap-param-gather": _megatron("nothing", switch=True, note="FSDP overlaps its gathers"),
    "--distributed-backend": _megatron("nothing", note="NCCL on GPUs, gloo on CPU"),
    # Megatron: memory
    "--recompute-activations": _megatron("--activation_checkpoint.mode selective", switch=True),
    "--recompute-granularity": _megatron("--activation_checkpoint.mode"),
    "--use-flash-attn": _megatron("--model.attention_backend", switch=True),
    # Megatron: checkpoints
    "--save": _megatron("--checkpoint.enable --checkpoint.folder"),
    "--load": _megatron("--checkpoint.enable --checkpoint.folder",
                        note="resumes from it; --checkpoint.initial_load_path starts a new run from one (a "
                             "Megatron-LM checkpoint after `titanlike-convert from-megatron`)"),
    "--save-interval": _megatron("--checkpoint.interval"),
    "--finetune": _megatron("--checkpoint.initial_load_path", switch=True,
                            note="a new run from the loaded model (initial_load_model_only, the default); a "
                                 "Megatron-LM checkpoint converts with `titanlike-convert from-megatron`"),
    "--no-load-optim": _megatron("--checkpoint.exclude_from_loading optimizer", switch=True),
    "--ckpt-format": _megatron("nothing", note="checkpoints are DCP (torch_dist), or Hugging Face with "
                               "--checkpoint.last_save_in_hf"),
    # Megatron: logging and validation
    "--log-interval": _megatron("--metrics.log_freq"),
    "--tensorboard-dir": _megatron("--metrics.enable_tensorboard --metrics.save_tb_folder"),
    "--wandb-project": _megatron("--metrics.enable_wandb", note="the project is WANDB_PROJECT"),
    "--eval-interval": _megatron("--validation.enable --validation.freq"),
    "--eval-iters": _megatron("--validation.steps"),
    "--seed": ForeignFlag("--debug.seed", "Megatron, Hugging Face"),
    "--exit-duration-in-mins": _megatron("nothing", note="SIGTERM or SIGUSR1 saves and stops the run"),
    # Hugging Face Trainer (TrainingArguments) and TRL's scripts
    "--model_name_or_path": _hf("--checkpoint.enable --checkpoint.initial_load_path --checkpoint.initial_load_in_hf "
                                "--model.hf_assets_path", note=_HF_FOLDER),
    "--tokenizer_name": _hf("--model.hf_assets_path", note=_HF_FOLDER),
    "--output_dir": _hf("--job.dump_folder"),
    "--dataset_name": _hf("--training.dataset_path", note="a local file or folder; for pre-training also "
                          "--training.dataset huggingface"),
    "--dataset_config_name": _hf("--training.dataset_path", note="NAME:CONFIG"),
    "--learning_rate": _hf("--optimizer.lr"),
    "--max_steps": _hf("--training.steps"),
    "--num_train_epochs": _hf("--training.steps", note=_EPOCHS),
    "--per_device_train_batch_size": _hf("--training.local_batch_size"),
    "--per_device_eval_batch_size": _hf("--validation.local_batch_size"),
    "--gradient_accumulation_steps": _hf("--training.global_batch_size", note="accumulation is " + _FROM_DATA),
    "--warmup_steps": _hf("--lr_scheduler.warmup_steps"),
    "--warmup_ratio": _hf("--lr_scheduler.warmup_steps", note="a number of steps"),
    "--lr_scheduler_type": _hf("--lr_scheduler.decay_type"),
    "--weight_decay": _hf("--optimizer.weight_decay"),
    "--adam_beta1": _hf("--optimizer.beta1"),
    "--adam_beta2": _hf("--optimizer.beta2"),
    "--adam_epsilon": _hf("--optimizer.eps"),
    "--optim": _hf("--optimizer.name"),
    "--max_grad_norm": _hf("--training.max_norm"),
    "--logging_steps": _hf("--metrics.log_freq"),
    "--save_steps": _hf("--checkpoint.enable --checkpoint.interval"),
    "--save_total_limit": _hf("--checkpoint.keep_latest_k"),
    "--resume_from_checkpoint": _hf("--checkpoint.enable", note="a run resumes from its latest checkpoint"),
    "--eval_steps": _hf("--validation.enable --validation.freq"),
    "--eval_strategy": _hf("--validation.enable"),
    "--do_eval": _hf("--validation.enable", switch=True),
    "--do_train": _hf("nothing", switch=True, note="train.py trains"),
    "--report_to": _hf("--metrics.enable_tensorboard or --metrics.enable_wandb", many=True),
    "--logging_dir": _hf("--metrics.save_tb_folder"),
    "--gradient_checkpointing": _hf("--activation_checkpoint.mode full", switch=True),
    "--torch_dtype": _hf("--training.mixed_precision_param"),
    "--dtype": _hf("--training.mixed_precision_param"),
    "--attn_implementation": _hf("--model.attention_backend"),
    "--torch_compile": _hf("--compile.enable", switch=True),
    "--fsdp": _hf("--parallelism.data_parallel_shard_degree", note="FSDP is on by default over every rank"),
    "--deepspeed": _hf("--parallelism.data_parallel_shard_degree", note="FSDP shards like ZeRO-3, by default"),
    "--max_seq_length": _hf("--training.seq_len", whose="TRL"),
    "--max_length": _hf("--training.seq_len", whose="TRL"),
    "--packing": _hf("--sft.packing", whose="TRL", switch=True),
    "--assistant_only_loss": _hf("--sft.assistant_only_loss", whose="TRL", switch=True),
    "--dataset_text_field": _hf("--sft.format", whose="TRL", note="rows of {\"text\": ...} are read as TRL reads them"),
    "--use_peft": _hf("--model.converters lora", whose="TRL", switch=True),
    "--lora_r": _hf("--lora.rank", whose="TRL"),
    "--lora_alpha": _hf("--lora.alpha", whose="TRL"),
    "--lora_dropout": _hf("--lora.dropout", whose="TRL"),
    "--lora_target_modules": _hf("--lora.target_modules", whose="TRL", many=True),
    "--beta": _hf("--dpo.beta", whose="TRL"),
    "--loss_type": _hf("--dpo.loss_type", whose="TRL"),
    "--label_smoothing": _hf("--dpo.label_smoothing", whose="TRL"),
    "--teacher_model_name_or_path": _hf("--training.objective distill --distill.teacher", whose="TRL",
                                        note=_HF_FOLDER),
}


def foreign_flag_hint(flag: str) -> str | None:
    """What `flag` (another trainer's, as typed: --lr or --lr=3e-4) is here, in one clause; None when the
    table does not hold it."""
    name = flag.partition("=")[0]
    entry = FOREIGN_FLAGS.get(name)
    if entry is None:
        return None
    whose = " and ".join(f"{w}'s" for w in entry.whose.split(", "))
    if entry.instead == "nothing":
        return f"{whose} {name} has no counterpart here: {entry.note}"
    return f"{whose} {name} is {entry.instead} here" + (f": {entry.note}" if entry.note else "")


def foreign_flags_markdown() -> str:
    """The README's table of FOREIGN_FLAGS, one row per flag (README.md holds this text verbatim)."""
    rows = ["| Flag | Whose | titanlike | Note |", "|---|---|---|---|"]
    for flag, e in FOREIGN_FLAGS.items():
        instead = "(none)" if e.instead == "nothing" else " or ".join(f"`{part}`" for part in e.instead.split(" or "))
        rows.append(f"| `{flag}` | {e.whose} | {instead} | {e.note} |")
    return "\n".join(rows)


# A Hugging Face Hub repository id: organization/name, no more slashes (huggingface_hub's rule, loosely).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a model folder needs to train or load: tokenizer, config and weights (titanlike/cli/download_hf_assets.py).
MODEL_ASSETS = "tokenizer config safetensors index"


def hub_id_hint(path: str, option: str | None = None, *, assets: str = MODEL_ASSETS) -> str:
    """For `path`, given as `option` (None: the caller names it), that is no file or folder here but
    reads as a Hub id (a Hugging Face user's habit: HuggingFaceTB/SmolLM2-135M): a clause saying so with
    the exact download command, to append to the message that refuses it ("; ..."); else "". titanlike
    reads local folders only."""
    # organization/name whose organization is a folder here is a local path with a typo, not a Hub id.
    if not path or os.path.exists(path) or not _HUB_ID.fullmatch(path) or os.path.isdir(path.split("/")[0]):
        return ""
    folder = f"assets/hf/{path.split('/')[1]}"
    return (f"; it looks like a Hugging Face Hub id (titanlike reads local folders only): download it with "
            f"`titanlike-download-hf-assets --repo_id {path} --assets {assets}` (into {folder}) and " + (f"pass --{option} {folder}" if option else f"give {folder} instead"))
