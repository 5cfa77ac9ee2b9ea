"""The job configuration: one dataclass per TOML section.

Key names follow torchtitan's TOML-era configs so existing configs and habits
carry over. Every field carries a one-line doc (shown by `train.py --help`)
and, where the value is an enumeration, its allowed choices, which the loader
enforces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from titanlike.config.sections import dataset_kinds, section_default


def opt(default: Any, doc: str, *, choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None) -> Any:
    """A config field with its help text (and allowed values, if an enumeration: a tuple, or a
    function giving the values registered by their owners, asked when a value is checked)."""
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file to load before applying command-line overrides")
    dump_folder: str = opt("./outputs", "folder for checkpoints, TensorBoard events and other run outputs")
    description: str = opt("", "free-form description of the job, printed at start")
    print_config: bool = opt(False, "print the resolved configuration at start")
    save_config_file: str | None = opt(
        None, "write the resolved configuration as JSON to this file, relative to job.dump_folder (rank 0)")
    validate_only: bool = opt(
        False, "check the configuration, plan the job for WORLD_SIZE ranks and check its memory, then exit 0 "
        "without training (launchers run it once before starting torchrun)")


@dataclass
class Model:
    name: str = opt("llama3", "model family registered in titanlike.models")
    flavor: str = opt("debugmodel", "size preset of the model family (e.g. debugmodel, 8B, 405B); not used when "
                      "checkpoint.initial_load_in_hf gives a Hugging Face folder, whose config.json sizes the model")
    args: dict = opt({}, "the flavor's model args to change ([model.args] table, or --model.args.KEY VALUE): the "
                     "family's own names (dim, n_layers, n_heads, n_kv_heads, vocab_size, moe.num_experts, ...) or "
                     "Megatron's (hidden_size, num_layers, num_attention_heads, num_query_groups, ffn_hidden_size, "
                     "kv_channels, max_position_embeddings) where the family has them; checked by the family's rules")
    tokenizer_path: str | None = opt(
        None, "tiktoken BPE file; empty means the debug tokenizer shipped with titanlike (or model.hf_assets_path's)"
    )
    hf_assets_path: str | None = opt(
        None, "Hugging Face assets folder (torchtitan's): its tokenizer.json (+ tokenizer_config.json) is the "
        "tokenizer, and with checkpoint.initial_load_in_hf and no initial_load_path its weights are loaded"
    )
    converters: list[str] = opt([], "module swaps applied after construction (e.g. float8)")
    print_after_conversion: bool = opt(
        False, "print the model as built (rank 0): after the converters swapped its modules and parallelize wrapped it")
    attention_backend: str = opt(
        "auto",
        "kernel for document-masked attention: auto (FlexAttention on CUDA, SDPA with a dense mask "
        "elsewhere), flex, sdpa; plain causal attention always uses SDPA's fused kernels",
        choices=("auto", "sdpa", "flex"),
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer; Muon steps the blocks' matrices (2-D, and each expert's of a 3-D stack) with "
                    "Muon and every other parameter (embeddings, output projection, norms, biases) with AdamW",
                    choices=("AdamW", "Adam", "Muon"))
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay")
    implementation: str = opt(
        "fused", "optimizer kernel implementation; fused skips a non-finite step on the device, foreach and "
        "for-loop make the host read every step's verdict first", choices=("foreach", "fused", "for-loop")
    )
    state_dtype: str = opt(
        "float32", "dtype of the optimizer's state tensors (AdamW's moments, Muon's momentum); bfloat16 halves "
        "them and rounds them stochastically, unbiased where round-to-nearest would drop small updates",
        choices=("float32", "bfloat16"))
    momentum: float = opt(0.95, "Muon: momentum of the matrices' update")
    nesterov: bool = opt(True, "Muon: Nesterov momentum")
    ns_steps: int = opt(5, "Muon: Newton-Schulz iterations that orthogonalise each update")
    ns_coefficients: list[float] = opt([3.4445, -4.775, 2.0315], "Muon: the quintic Newton-Schulz iteration's "
                                       "coefficients a,b,c (Keller Jordan's, torch.optim.Muon's default)")
    muon_eps: float = opt(1e-7, "Muon: floor of the update's norm before Newton-Schulz")
    adjust_lr_fn: str = opt(
        "match_rms_adamw", "Muon: the update's scale; match_rms_adamw (Moonlight, Kimi K2: 0.2 x sqrt(max(rows, "
        "cols)), the RMS of an AdamW update) lets one optimizer.lr and weight_decay, tuned for AdamW, serve both "
        "the matrices and the AdamW parameters, so it is the default; original (Keller Jordan's, torch's "
        "default: sqrt(max(1, rows/cols))) wants a learning rate near 0.02 for the matrices",
        choices=("match_rms_adamw", "original"))
    muon_include: list[str] = opt(
        [], "Muon: fnmatch patterns of parameter names (layers.*.attention.wq.weight) to step with Muon as well, "
        "2-D or 3-D ones outside the blocks")
    muon_exclude: list[str] = opt(
        [], "Muon: fnmatch patterns of parameter names to step with AdamW instead (they win over muon_include)")
    qk_clip_threshold: float | None = opt(
        None, "QK-clip (MuonClip, Kimi K2 used 100): after each step, the query and key projections of every "
        "attention head whose largest attention logit in the step's forward exceeded this are scaled down so "
        "that it would not have; empty or 0 turns it off")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warm-up steps from near zero to the peak learning rate")
    total_steps: int | None = opt(
        None, "steps the schedule spans (warm-up, stable, decay); empty means training.steps, so a shorter "
        "run can follow a longer run's curve"
    )
    decay_ratio: float | None = opt(
        None,
        "fraction of the steps spent decaying at the end (warmup-stable-decay); "
        "empty means decay over all steps after warm-up",
    )
    decay_type: str = opt("linear", "shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "final learning rate as a fraction of the peak")


@dataclass
class Training:
    dataset: str = opt(
        "default",
        "data source: default (embedded corpus), text (.txt/.jsonl files), "
        "huggingface (datasets, streaming), megatron (.bin/.idx prefix or weighted blend); torchtitan's "
        "c4 and c4_validation (allenai/c4 streamed, or from dataset_path) and c4_test (a small local test set: "
        "the embedded corpus's first 100 chapters)",
        choices=dataset_kinds,
    )
    dataset_path: str | None = opt(
        None, "file or folder, Hugging Face NAME[:CONFIG[:SPLIT]], or Megatron prefix / '0.7 a 0.3 b' blend"
    )
    objective: str = opt(
        "", "training objective; empty means the model family's own (next-token prediction for decoders), sft "
        "fine-tunes a decoder on conversations ([sft]), dpo on preference pairs ([dpo])")
    local_batch_size: int = opt(8, "samples per microbatch on each data-parallel rank")
    global_batch_size: int = opt(
        -1, "samples per optimizer step across all ranks; -1 means local_batch_size x data-parallel degree"
    )
    seq_len: int = opt(2048, "tokens per sample")
    document_masking: bool = opt(
        False,
        "attend only to earlier tokens of the same packed document and restart RoPE positions at each "
        "document; a document ends at the tokenizer's EOS token",
    )
    eod_mask_loss: bool = opt(False, "no loss on the prediction made from an EOS token (the next document's start)")
    split: str = opt(
        "969,30,1", "Megatron train,valid,test split of megatron datasets (validation uses 'valid'); sft, dpo and "
        "reward rows hold out 'valid' and 'test' only when validation reads the held-out split"
    )
    gc_freq: int = opt(
        50, "Python's garbage collector runs every gc_freq steps (on every rank at the same step) instead of "
        "at random points"
    )
    gc_debug: bool = opt(False, "collect garbage at every step, to find reference cycles that hold tensors")
    max_norm: float = opt(1.0, "gradient clipping max norm (total L2 norm over all parameters)")
    steps: int = opt(10000, "optimizer steps to train")
    skip_nonfinite_steps: int = opt(
        0,
        "steps with a non-finite loss or gradient norm that may be skipped per launch (grads dropped, "
        "no optimizer update; the step count, the data and the learning-rate schedule still advance, so "
        "step N keeps its learning rate); 0 stops the job at the first one, before anything is updated "
        "or saved",
    )
    mixed_precision_param: str = opt(
        "bfloat16",
        "dtype of parameters in forward/backward (fp32 master weights either way); float16 turns on dynamic "
        "loss scaling ([loss_scaling])",
        choices=("bfloat16", "float16", "float32"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "dtype of gradient reduction across data-parallel ranks", choices=("float32",)
    )
    enable_cpu_offload: bool = opt(
        False, "FSDP keeps the sharded parameters, gradients and optimizer state in host memory and runs the "
        "optimizer step there (needs data_parallel_shard_degree > 1)")
    rampup_batch_size: list[int] = opt(
        [], "Megatron's batch-size ramp-up start,increment,samples: the global batch starts at start and grows by "
        "increment at even intervals until it reaches global_batch_size after samples samples (start and increment "
        "multiples of local_batch_size x data-parallel degree); the learning-rate schedule then counts samples, in "
        "units of global_batch_size; empty means no ramp-up")


@dataclass
class LossScaling:
    """Loss scaling for float16 training, as Megatron's --fp16 does it (DynamicGradScaler): the loss is
    multiplied by the scale before backward, gradients are divided by it after; a step whose
    gradients overflow is skipped on every rank (no update, learning rate held) and, once
    `hysteresis` overflows have been seen since the last growth, the scale halves; after `window`
    steps without overflow it doubles."""

    mode: str = opt(
        "auto", "auto: dynamic with training.mixed_precision_param float16, none otherwise; dynamic; static "
        "(always initial_scale, overflowing steps still skipped); none", choices=("auto", "dynamic", "static", "none"))
    initial_scale: float = opt(
        2.0**16, "the loss scale to start from (dynamic) or to keep (static); Megatron's --initial-loss-scale "
        "defaults to 2^32, which spends more skipped steps halving down at the start")
    min_scale: float = opt(1.0, "dynamic: the scale never halves below this (Megatron --min-loss-scale)")
    window: int = opt(1000, "dynamic: steps without overflow before the scale doubles (Megatron --loss-scale-window)")
    hysteresis: int = opt(
        2, "dynamic: the scale halves at the hysteresis-th overflow since it last grew, and at every one after "
        "(Megatron --hysteresis)")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "replicas of the model (DDP-style dimension of HSDP)")
    data_parallel_shard_degree: int = opt(
        -1, "ranks one FSDP shard group spans; -1 means the rest of the world size"
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "free gathered parameters after forward: default (yes, except for the root; no under pipeline "
        "parallelism), always, never",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = opt(1, "tensor (and sequence) parallel degree")
    disable_loss_parallel: bool = opt(False, "gather the vocab-sharded logits before the loss under TP")
    enable_async_tensor_parallel: bool = opt(False, "micro-pipelined tensor parallel (GPU + compile)")
    pipeline_parallel_degree: int = opt(1, "ranks the model's layers are split over (pipeline parallelism)")
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "pipeline schedule: GPipe, 1F1B (one stage per rank), Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (several stages per rank)",
    )
    pipeline_parallel_microbatch_size: int = opt(
        1, "samples per pipeline microbatch; local_batch_size / this = microbatches per schedule step"
    )
    pipeline_parallel_layers_per_stage: int | None = opt(
        None,
        "transformer layers per pipeline stage (the first and last stages may get fewer); empty means "
        "one stage per rank for GPipe/1F1B, two otherwise, with the layers split evenly",
    )
    pipeline_parallel_first_stage_less_layers: int | None = opt(
        None, "layers the embedding counts as when stages are planned (torchtitan's rule: the first stage "
        "gets that many fewer); empty: titanlike's rule, spare layers go to the middle stages"
    )
    pipeline_parallel_last_stage_less_layers: int | None = opt(
        None, "layers the output projection counts as when stages are planned (torchtitan's rule); empty: "
        "titanlike's rule"
    )
    context_parallel_degree: int = opt(1, "context (sequence) parallel degree for attention")
    context_parallel_rotate_method: str = opt(
        "allgather", "how K/V move between context-parallel ranks", choices=("allgather", "alltoall")
    )
    expert_parallel_degree: int = opt(1, "expert parallel degree for mixture-of-experts models")
    expert_tensor_parallel_degree: int = opt(
        1, "ranks each expert's hidden units are split over (Megatron's expert tensor parallelism); "
        "ep x etp must divide dp_shard x cp x tp")


@dataclass
class MoE:
    """Run-time settings of mixture-of-experts layers; empty values keep the model flavor's."""

    token_dispatcher: str = opt(
        "alltoall", "how tokens reach experts on other expert-parallel ranks: alltoall (uneven splits) or "
        "allgather (every rank sees all tokens of its expert group)", choices=("alltoall", "allgather"))
    experts_impl: str = opt("grouped_mm", "expert matmuls: grouped_mm (torch._grouped_mm) or loop (one per "
                            "expert, the reference)", choices=("grouped_mm", "loop"))
    capacity_factor: float | None = opt(
        None, "token dropping: an expert takes at most capacity_factor x seq_len x top_k / experts routes of "
        "each sequence; empty means the flavor's (dropless unless it says otherwise)")
    drop_policy: str = opt("probs", "which routes over capacity are dropped: the lowest-probability ones "
                           "(probs) or the latest in the sequence (position)", choices=("probs", "position"))
    pad_to_capacity: bool = opt(False, "pad every expert's input to its capacity (static shapes; needs "
                                "capacity_factor)")
    aux_loss_coeff: float | None = opt(None, "Switch/GShard load-balancing loss coefficient (per micro-batch); "
                                       "empty means the flavor's")
    seq_aux_loss_coeff: float | None = opt(None, "sequence-wise load-balancing loss coefficient (DeepSeek-V3); "
                                           "empty means the flavor's")
    z_loss_coeff: float | None = opt(None, "router z-loss coefficient; empty means the flavor's")
    bias_update_rate: float | None = opt(
        None, "aux-loss-free balancing: step of the per-expert routing bias after each optimizer step "
        "(0 turns it off); empty means the flavor's")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save and load distributed checkpoints")
    folder: str = opt("checkpoint", "checkpoint folder, relative to job.dump_folder")
    interval: int = opt(500, "steps between checkpoints")
    async_mode: str = opt(
        "disabled", "background saving", choices=("disabled", "async", "async_with_pinned_mem")
    )
    keep_latest_k: int = opt(10, "checkpoints kept; older ones are purged (0 keeps all)")
    load_step: int = opt(-1, "step to load; -1 means the latest")
    initial_load_path: str | None = opt(None, "checkpoint to start from when the run has none")
    initial_load_model_only: bool = opt(
        True, "load only the model from initial_load_path; false resumes its whole training state (optimizer, "
        "schedule, data position, step)"
    )
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face safetensors folder")
    last_save_model_only: bool = opt(True, "the final checkpoint holds the model only")
    last_save_in_hf: bool = opt(False, "write the final checkpoint in Hugging Face format")
    export_dtype: str = opt("float32", "dtype of model-only exports", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "write the initialized model as step 0 and exit")
    load_only: bool = opt(False, "load checkpoints but never save one")
    enable_first_step_checkpoint: bool = opt(
        False, "also save after the first step, to find a broken checkpoint setup early")
    exclude_from_loading: list[str] = opt([], "state-dict keys not loaded (e.g. optimizer,lr_scheduler)")
    allow_partial_load: bool = opt(
        False, "load a checkpoint written for another model family or flavor, or holding tensors this model "
               "lacks: only the tensors this model has (same names and shapes) are loaded, the others are ignored")
    fallback_on_corruption: bool = opt(
        False, "resume from the newest checkpoint that verifies when the latest is corrupt (checksum, truncated "
               "or missing file, damaged index) instead of stopping; never with an explicit load_step")


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "none", "recompute activations in backward; memory_budget lets torch.compile's partitioner choose "
        "(compiled blocks only)", choices=("none", "full", "selective", "memory_budget"))
    selective_ac_option: str = opt(
        "2", "for selective: checkpoint every N-th block, or 'op' for op-level selection"
    )
    memory_budget: float = opt(
        0.5, "for memory_budget: activation memory kept, from 0 (recompute all) to 1 (the compiler's default)")
    preserve_rng_state: bool = opt(False, "replay the RNG state in recomputation (needed with dropout)")
    determinism_check: str = opt("default", "torch.utils.checkpoint's check that recomputation matches: "
                                 "default (shapes, dtypes, devices) or none", choices=("default", "none"))
    debug: bool = opt(False, "record the recomputed ops to explain a determinism_check failure (slower)")
    early_stop: bool = opt(True, "stop recomputing a block once the tensors backward needs are back")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below")
    components: list[str] = opt(["model", "loss"], "what to compile: model (per block), loss")
    backend: str = opt("inductor", "torch.compile backend (inductor; aot_eager and eager for debugging)")


@dataclass
class Float8:
    recipe_name: str | None = opt(None, "torchao float8 recipe (tensorwise, rowwise); empty means tensorwise")
    enable_fsdp_float8_all_gather: bool = opt(False, "all-gather FSDP parameters in float8 (tensorwise recipe)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "compute the float8 all-gather scales of all parameters in one all-reduce after each optimizer step"
    )
    filter_fqns: list[str] = opt(
        ["output"], "linear layers left in high precision: names matching whole dot-separated parts of a module "
        "name (layers.1 is not layers.10); linears with features not multiples of 16 are always left"
    )
    emulate: bool = opt(False, "emulate float8 matmuls in high precision (testing without an SM 8.9+ GPU)")


@dataclass
class Metrics:
    log_freq: int = opt(10, "steps between metric logs")
    enable_tensorboard: bool = opt(False, "write TensorBoard events")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder")
    enable_wandb: bool = opt(False, "log to Weights & Biases (needs the wandb extra), with the config")
    wandb_mode: str = opt(
        "auto", "auto: online when wandb can log in (WANDB_MODE, WANDB_API_KEY or a saved login), else offline "
        "into job.dump_folder/wandb for a later `wandb sync`", choices=("auto", "online", "offline"))
    enable_jsonl: bool = opt(
        True, "also write each logged step as a JSON line to job.dump_folder/metrics.jsonl (read by "
        "scripts/plot_metrics.py)"
    )
    straggler_factor: float = opt(
        1.5, "at each log, name the ranks whose data-loading or optimizer-step time exceeds this factor x "
        "the median over ranks (Megatron's straggler detector); 0 turns the per-rank timing off"
    )


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "capture a torch.profiler trace of one step in every profile_freq, per rank")
    save_traces_folder: str = opt("profile_traces", "trace folder, relative to job.dump_folder")
    profile_freq: int = opt(10, "steps between traces and memory snapshots")
    enable_memory_snapshot: bool = opt(
        False, "write a memory snapshot every profile_freq steps and on out-of-memory: CUDA allocator history "
        "(for pytorch.org/memory_viz), or on CPU the process and tensor memory as JSON")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder, relative to job.dump_folder")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "timeout for process-group initialization and the first step")
    train_timeout_seconds: int = opt(
        100, "collective timeout after the first step: a hung rank makes every rank fail, naming the step")
    trace_buf_size: int = opt(
        20000, "flight-recorder entries (recent collectives) kept per rank, dumped to "
        "job.dump_folder/comm_traces when a collective times out (0 disables)")


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate loss and perplexity on held-out data during training")
    dataset: str | None = opt(
        None,
        "validation data source, a training.dataset kind; empty means the held-out 'valid' split of the "
        "training data (default: the embedded corpus's last 1%; megatron: training.split)",
        choices=dataset_kinds,
    )
    dataset_path: str | None = opt(
        None, "validation data path (as training.dataset_path); empty with a megatron dataset means the "
        "training prefixes' 'valid' split"
    )
    freq: int = opt(500, "steps between validations (also run after the last step)")
    steps: int = opt(-1, "batches per validation; -1 means the whole split (not for streaming datasets)")
    local_batch_size: int = opt(-1, "samples per validation batch on each data-parallel rank; -1 means "
                                "training.local_batch_size")
    seq_len: int = opt(-1, "tokens per validation sample, at most training.seq_len; -1 means training.seq_len")
    sample_prompts: list[str] = opt(
        [], "prompts whose greedy continuations (KV cache, every rank running them, rank 0 reporting) go to the "
        "console, TensorBoard (text), W&B and metrics.jsonl every sample_freq steps and after the last; empty: "
        "none. Independent of enable; not under pipeline, tensor, context or expert parallelism or compile")
    sample_freq: int = opt(0, "steps between samples of sample_prompts; 0 means validation.freq")
    sample_max_tokens: int = opt(32, "new tokens per sample at most (a sample also ends at the tokenizer's EOS)")


@dataclass
class Debug:
    seed: int = opt(0, "seed for weight initialization, data order and dropout")
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    deterministic_warn_only: bool = opt(False, "with deterministic: warn about ops without a deterministic "
                                        "implementation instead of stopping")


@dataclass
class JobConfig:
    """Every section of a job. Besides the fields below, the sections that objectives and model families
    register (titanlike/config/sections.py) are attributes too: `cfg.masked_lm`, `cfg.hybrid`."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    # The registered sections the job set (the loader fills every one); a section missing here reads
    # as its defaults.
    registered: dict[str, Any] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> Any:
        # Only reached when `name` is not a field: a registered section.
        registered = self.__dict__.get("registered")
        if registered is None or name.startswith("__"):
            raise AttributeError(name)
        if name not in registered:
            try:
                registered[name] = section_default(name)
            except KeyError:
                raise AttributeError(f"JobConfig has no section {name!r}") from None
        return registered[name]
