"""The configuration's own rules: each value in range, each section consistent with itself.

This module depends on nothing above config/. Rules that need the world size, the model, the
machine or the files a job names live next to what they protect (ParallelDims, the pipeline, the
converters, the model family, the checkpoint manager, the data loader) and are called, in order,
by titanlike/train/plan.py (plan_job). Every rule raises ConfigError with one sentence that names the
option and what would make it valid.
"""

from __future__ import annotations

from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.config.sections import dataset_kind_rules, registered_sections


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_values(cfg: JobConfig) -> None:
    """Rules that need nothing but the config itself."""
    p, t = cfg.parallelism, cfg.training
    if cfg.validation.enable:
        _validate_validation(cfg)
    _validate_samples(cfg)

    # Batch and sequence.
    _check(t.seq_len >= 1, f"training.seq_len must be at least 1, got {t.seq_len}")
    _check(t.local_batch_size >= 1, f"training.local_batch_size must be at least 1, got {t.local_batch_size}")
    _check(t.steps >= 1, f"training.steps must be at least 1, got {t.steps}")
    _check(t.max_norm > 0, f"training.max_norm must be positive, got {t.max_norm}")
    _check(t.skip_nonfinite_steps >= 0,
           f"training.skip_nonfinite_steps must be 0 (stop on the first) or more, got {t.skip_nonfinite_steps}")
    _check(t.gc_freq >= 1, f"training.gc_freq must be at least 1, got {t.gc_freq}")
    _check(cfg.debug.seed >= 0, f"debug.seed must be 0 or more, got {cfg.debug.seed}")
    _check(not (cfg.model.tokenizer_path and cfg.model.hf_assets_path),
           "model.tokenizer_path and model.hf_assets_path both name a tokenizer; set only one")
    _check(cfg.debug.deterministic or not cfg.debug.deterministic_warn_only,
           "debug.deterministic_warn_only only applies with debug.deterministic")
    if t.rampup_batch_size:
        _check(len(t.rampup_batch_size) == 3 and min(t.rampup_batch_size) >= 1,
               "training.rampup_batch_size must be three positive integers start,increment,samples (Megatron's "
               f"--rampup-batch-size), got {','.join(map(str, t.rampup_batch_size))}")
    _validate_loss_scaling(cfg)
    _validate_registered_sections(cfg)

    # Optimizer and schedule.
    o, s = cfg.optimizer, cfg.lr_scheduler
    _check(o.lr > 0, f"optimizer.lr must be positive, got {o.lr}")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1 and optimizer.beta2 must lie in [0, 1)")
    _check(o.eps > 0, f"optimizer.eps must be positive, got {o.eps}")
    _check(o.weight_decay >= 0, f"optimizer.weight_decay must be non-negative, got {o.weight_decay}")
    _check(0 <= o.momentum < 1, f"optimizer.momentum must lie in [0, 1), got {o.momentum}")
    _check(1 <= o.ns_steps <= 99, f"optimizer.ns_steps must be 1 to 99 Newton-Schulz iterations, got {o.ns_steps}")
    _check(len(o.ns_coefficients) == 3,
           f"optimizer.ns_coefficients must be three numbers a,b,c, got {len(o.ns_coefficients)}")
    _check(o.muon_eps > 0, f"optimizer.muon_eps must be positive, got {o.muon_eps}")
    for name in ("muon_include", "muon_exclude"):
        long = [pattern for pattern in getattr(o, name) if not 0 < len(pattern) <= 200]
        _check(not long, f"optimizer.{name} patterns must hold 1 to 200 characters, got {len(long[0]) if long else 0}")
    _check(o.name == "Muon" or not (o.muon_include or o.muon_exclude),
           f"optimizer.muon_include and muon_exclude only apply with optimizer.name Muon, not {o.name}")
    _check(o.qk_clip_threshold is None or o.qk_clip_threshold >= 0,
           f"optimizer.qk_clip_threshold must be positive (or 0 or empty: off), got {o.qk_clip_threshold}")
    _check(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be non-negative, got {s.warmup_steps}")
    _check(s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
           f"lr_scheduler.decay_ratio must lie in [0, 1], got {s.decay_ratio}")
    _check(0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor must lie in [0, 1], got {s.min_lr_factor}")
    _check(s.total_steps is None or s.total_steps >= 1,
           f"lr_scheduler.total_steps must be at least 1 (or empty: training.steps), got {s.total_steps}")

    # Activation checkpointing and compile.
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        _check(ac.selective_ac_option == "op" or (ac.selective_ac_option.isdigit()
                                                  and int(ac.selective_ac_option) >= 1),
               f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, "
               f"got {ac.selective_ac_option!r}")
    if ac.mode == "memory_budget":
        _check(0 <= ac.memory_budget <= 1,
               f"activation_checkpoint.memory_budget must lie in [0, 1], got {ac.memory_budget}")
        _check(cfg.compile.enable and "model" in cfg.compile.components,
               "activation_checkpoint.mode memory_budget is decided by torch.compile's partitioner, so it needs "
               "compile.enable with model in compile.components")
    unknown = set(cfg.compile.components) - {"model", "loss"}
    _check(not unknown, f"compile.components may only contain model and loss, got {', '.join(sorted(unknown))}")
    _check(bool(cfg.compile.backend), "compile.backend must name a torch.compile backend (e.g. inductor)")
    for end in ("first", "last"):
        n = getattr(p, f"pipeline_parallel_{end}_stage_less_layers")
        _check(n is None or n >= 0, f"parallelism.pipeline_parallel_{end}_stage_less_layers must be 0 or more, got {n}")

    _check(cfg.comm.init_timeout_seconds >= 1,
           f"comm.init_timeout_seconds must be at least 1, got {cfg.comm.init_timeout_seconds}")
    _check(cfg.comm.train_timeout_seconds >= 1,
           f"comm.train_timeout_seconds must be at least 1, got {cfg.comm.train_timeout_seconds}")
    _check(cfg.comm.trace_buf_size >= 0,
           f"comm.trace_buf_size must be 0 (no flight recorder) or more, got {cfg.comm.trace_buf_size}")
    _check(cfg.metrics.log_freq >= 1, f"metrics.log_freq must be at least 1, got {cfg.metrics.log_freq}")
    _check(cfg.metrics.straggler_factor == 0 or cfg.metrics.straggler_factor > 1,
           f"metrics.straggler_factor must be 0 (off) or above 1, got {cfg.metrics.straggler_factor}")
    if cfg.profiling.enable_profiling or cfg.profiling.enable_memory_snapshot:
        _check(cfg.profiling.profile_freq >= 1,
               f"profiling.profile_freq must be at least 1, got {cfg.profiling.profile_freq}")


def _validate_loss_scaling(cfg: JobConfig) -> None:
    s = cfg.loss_scaling
    _check(s.initial_scale > 0, f"loss_scaling.initial_scale must be positive, got {s.initial_scale}")
    _check(0 < s.min_scale <= s.initial_scale,
           f"loss_scaling.min_scale must be positive and at most initial_scale {s.initial_scale}, got {s.min_scale}")
    _check(s.window >= 1, f"loss_scaling.window must be at least 1, got {s.window}")
    _check(s.hysteresis >= 1, f"loss_scaling.hysteresis must be at least 1, got {s.hysteresis}")


def _validate_validation(cfg: JobConfig) -> None:
    v, t = cfg.validation, cfg.training
    _check(v.freq >= 1, f"validation.freq must be at least 1, got {v.freq}")
    _check(v.steps == -1 or v.steps >= 1, f"validation.steps must be -1 (the whole split) or at least 1, got {v.steps}")
    _check(v.local_batch_size == -1 or v.local_batch_size >= 1,
           f"validation.local_batch_size must be -1 (training's) or at least 1, got {v.local_batch_size}")
    _check(v.seq_len == -1 or 1 <= v.seq_len <= t.seq_len,
           f"validation.seq_len must be -1 (training's) or 1 to training.seq_len {t.seq_len} (the model's positions "
           f"are sized for training), got {v.seq_len}")
    # Whether the training data hold out a split is the objective's rule (Objective.validate: its _check_held_out).
    kind = t.dataset if v.dataset is None else v.dataset
    rule = dataset_kind_rules().get(kind)
    if rule is None:  # an unknown kind in a JobConfig built in code: the data loader refuses it by name
        return
    if v.dataset is not None:
        _check(rule.path != "none" or not v.dataset_path, f"validation.dataset {kind} takes no dataset_path")
        _check(rule.path != "required" or bool(v.dataset_path), f"validation.dataset {kind} needs "
               "validation.dataset_path")
    _check(not rule.streaming or v.steps >= 1,
           f"validation.steps must be set (>= 1) for a streaming {kind} dataset, which has no end to run to")


def _validate_samples(cfg: JobConfig) -> None:
    v = cfg.validation
    _check(v.sample_freq >= 0, f"validation.sample_freq must be 0 (validation.freq) or at least 1, got {v.sample_freq}")
    _check(v.sample_max_tokens >= 1, f"validation.sample_max_tokens must be at least 1, got {v.sample_max_tokens}")
    _check(all(isinstance(p, str) and p.strip() for p in v.sample_prompts),
           "validation.sample_prompts must be non-empty texts")


def _validate_registered_sections(cfg: JobConfig) -> None:
    """Each section an objective or a model family registered checks its own values (its `check()`)."""
    for name in registered_sections():
        check = getattr(getattr(cfg, name), "check", None)  # optional (config/sections.py)
        try:
            if check is not None:
                check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
