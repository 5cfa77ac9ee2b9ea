"""What a group of completions is worth relative to its members: GRPO's group-normalised advantages,
DAPO's dynamic-sampling filter and its soft overlong punishment (TRL 1.16's formulas; the loss that uses
them is titanlike/objectives/grpo.py, the rollout that computes them titanlike/rl/rollout.py)."""

from __future__ import annotations

import math

import torch

SCALE_REWARDS = ("group", "batch", "none")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected) ignoring NaN; NaN with fewer than two values."""
    if dim is None:
        x, dim = x.flatten(), 0
    count = (~x.isnan()).sum(dim)
    squares = torch.nansum((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return torch.where(count > 1, std, torch.full_like(std, math.nan))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """(B,) advantages of (B,) rewards in consecutive groups of num_generations: the reward minus its
    group's mean, divided by the group's std (group), the std of all of `rewards` (batch: the rollout
    scales by the whole generation's instead, rl/rollout.py complete()), or not (none), std + 1e-4.
    A NaN reward (every reward function returned None) is left out of its group's statistics and gets
    advantage 0, as TRL does."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (_nanstd(groups, dim=1).repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (_nanstd(rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def kept_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B // G,) bool: the groups DAPO's dynamic sampling keeps, those whose rewards are not all equal
    (NaN rewards ignored, so a group with fewer than two rewards is dropped)."""
    groups = rewards.view(-1, num_generations)
    finite = ~groups.isnan()
    high = torch.where(finite, groups, torch.full_like(groups, -math.inf)).amax(dim=1)
    low = torch.where(finite, groups, torch.full_like(groups, math.inf)).amin(dim=1)
    return high > low


def overlong_penalty(lengths: torch.Tensor, max_completion_length: int, buffer_length: int,
                     factor: float = 1.0) -> torch.Tensor:
    """(B,) DAPO's soft overlong punishment of completions of `lengths` tokens (a reward, <= 0): 0 up to
    max_completion_length - buffer_length tokens, then falling linearly to -factor at
    max_completion_length, -factor beyond (TRL's get_soft_overlong_punishment, times factor)."""
    if buffer_length == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_completion_length - buffer_length
    ramp = (start - lengths.float()) / buffer_length
    return factor * torch.where(lengths <= start, 0.0, torch.where(lengths <= max_completion_length, ramp, -1.0))


__all__ = ["SCALE_REWARDS", "group_advantages", "kept_groups", "overlong_penalty"]
