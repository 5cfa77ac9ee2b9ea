"""Optimizer and learning-rate schedule (warmup, stable, decay: WSD).

The schedule advances once per optimizer update: a step skipped for a float16 overflow
(train/loss_scaling.py) does not move it, as in Megatron. Under a batch ramp-up
(training.rampup_batch_size) it counts samples, as Megatron's does: the k-th update is at
samples_before(k) / global_batch_size "full steps", so warmup_steps and the decay are measured in
full global batches and the schedule ends at the samples training.steps consume.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn

from titanlike.config.schema import LRScheduler, Optimizer
from titanlike.data.batch_schedule import BatchSchedule


def build_optimizer(model_parts: list[nn.Module], cfg: Optimizer) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (pipeline stages on this rank)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    kwargs = dict(
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=cfg.implementation == "foreach",
        fused=cfg.implementation == "fused",
    )
    if cfg.name == "AdamW":
        return torch.optim.AdamW(params, **kwargs)
    kwargs.pop("weight_decay")
    return torch.optim.Adam(params, **kwargs)


def lr_factor(
    step: float,
    *,
    warmup_steps: int,
    total_steps: float,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak learning rate for the optimizer step with index `step` (0-based).

    Warm-up rises linearly to 1 and never starts at exactly 0 (a zero-lr first step
    would be wasted). The decay phase spans the last decay_ratio of the post-warm-up
    steps (all of them when decay_ratio is None) and ends at min_lr_factor.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    post_warmup = max(total_steps - warmup_steps, 0)
    decay_steps = post_warmup if decay_ratio is None else round(post_warmup * decay_ratio)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        curve = 1.0 - progress
    elif decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:  # cosine
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int,
                       batches: BatchSchedule | None = None):
    """LambdaLR over lr_factor; batches: the job's batch schedule, whose ramp-up (if any) makes the
    schedule count samples (see the module docstring)."""
    shape = dict(warmup_steps=cfg.warmup_steps, decay_ratio=cfg.decay_ratio, decay_type=cfg.decay_type,
                 min_lr_factor=cfg.min_lr_factor)
    if batches is None or not batches.ramps:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, total_steps=total_steps, **shape))
    full = batches.global_batch_size
    total = batches.samples_before(total_steps) / full

    def by_samples(update: int) -> float:
        return lr_factor(batches.samples_before(update) / full, total_steps=total, **shape)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, by_samples)
