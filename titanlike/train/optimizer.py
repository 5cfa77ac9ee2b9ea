"""Optimizer and learning-rate schedule (warmup, stable, decay: WSD).

The schedule advances once per optimizer update: a step skipped for a float16 overflow
(train/loss_scaling.py) does not move it, as in Megatron. Under a batch ramp-up
(training.rampup_batch_size) it counts samples, as Megatron's does: the k-th update is at
samples_before(k) / global_batch_size "full steps", so warmup_steps and the decay are measured in
full global batches and the schedule ends at the samples training.steps consume.
"""

from __future__ import annotations

import math
from fnmatch import fnmatch
from functools import partial

import torch
import torch.nn as nn

from titanlike.config.schema import LRScheduler, Optimizer
from titanlike.data.batch_schedule import BatchSchedule
from titanlike.models.common.init import canonical_fqn
from titanlike.models.protocol import layer_stacks
from titanlike.train.muon import BLOCK_DIMS, MuonAdamW


def build_optimizer(model_parts: list[nn.Module], cfg: Optimizer, *, seed: int = 0) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (pipeline stages on this rank).

    seed: the stochastic rounding's of bfloat16 states (train/muon.py)."""
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    if cfg.name != "Muon" and cfg.state_dtype == "float32":
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
    groups = []
    if cfg.name == "Muon":
        chosen = {id(p) for part in model_parts for _, p in muon_parameters(part, cfg)}
        matrices = [p for p in params if id(p) in chosen]
        params = [p for p in params if id(p) not in chosen]
        if matrices:
            groups.append(dict(params=matrices, muon=True, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               ns_steps=cfg.ns_steps, ns_coefficients=tuple(cfg.ns_coefficients),
                               muon_eps=cfg.muon_eps, adjust_lr_fn=cfg.adjust_lr_fn))
    if params:
        groups.append(dict(params=params, muon=False))
    return MuonAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                     weight_decay=0.0 if cfg.name == "Adam" else cfg.weight_decay, decoupled=cfg.name != "Adam",
                     implementation=cfg.implementation, state_dtype=getattr(torch, cfg.state_dtype), seed=seed)


def muon_parameters(model: nn.Module, cfg: Optimizer) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of what Muon steps: the trainable 2-D and 3-D (stacked experts') parameters of
    the blocks (models/protocol.py: layer_stacks), plus those optimizer.muon_include names, less those
    optimizer.muon_exclude names (fnmatch patterns over canonical names)."""
    in_blocks = {id(p) for stack in layer_stacks(model) for p in stack.parameters()}
    out = []
    for name, p in model.named_parameters():
        name = canonical_fqn(name)
        if not p.requires_grad or p.ndim not in BLOCK_DIMS or any(fnmatch(name, x) for x in cfg.muon_exclude):
            continue
        if id(p) in in_blocks or any(fnmatch(name, x) for x in cfg.muon_include):
            out.append((name, p))
    return out


def validate_optimizer(cfg: Optimizer, model: nn.Module) -> None:
    """Plan-time rules of optimizer.name Muon against the model (built on the meta device): it has
    matrices for Muon, and every name pattern matches a parameter."""
    if cfg.name != "Muon":
        return
    names = [canonical_fqn(n) for n, p in model.named_parameters() if p.requires_grad]
    for option in ("muon_include", "muon_exclude"):
        for pattern in getattr(cfg, option):
            if not any(fnmatch(n, pattern) for n in names):
                raise ValueError(f"optimizer.{option} pattern {pattern!r} matches no parameter of the model "
                                 f"(names look like {names[len(names) // 2]!r})")
    flat = [n for n, p in model.named_parameters()
            if p.requires_grad and p.ndim not in BLOCK_DIMS and any(fnmatch(canonical_fqn(n), x)
                                                                      for x in cfg.muon_include)]
    if flat:
        raise ValueError(f"optimizer.muon_include names {canonical_fqn(flat[0])!r}, which is not a matrix; Muon "
                         "steps 2-D and 3-D (stacked experts') parameters only")
    if not muon_parameters(model, cfg):
        raise ValueError("optimizer.name Muon finds no matrix to step in the model's blocks (none is 2-D or 3-D, "
                         "or optimizer.muon_exclude excludes them all); use optimizer.name AdamW")


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
