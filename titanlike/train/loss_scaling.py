"""Loss scaling for float16 training, with Megatron's semantics (--fp16, --loss-scale, --hysteresis).

float16 keeps 10 mantissa bits but only 5 exponent bits: small activation gradients underflow to
zero in backward. Multiplying the objective by a scale S before backward lifts them into range;
the gradients come out S times too large and are divided by S before clipping and the step. Too
large an S overflows instead: then some gradient is inf or nan, the step is skipped on every rank
and, for the dynamic scaler, S is lowered.

How the trainer uses it (titanlike/train/trainer.py, train_step): backward differentiates
S / global_tokens x the summed loss (the loss is a sum over target tokens, so that is S times the
mean the step optimizes, Megatron's scaled loss), and the single multiplication that unscales the
gradients replaces the division by the token count made without scaling. An overflow shows as a
non-finite gradient norm, which every rank already agrees on: the norm is reduced over every mesh a
gradient lives on and over the pipeline stages (parallel/utils.clip_grad_norm_), so no extra
collective is needed to skip together.

Why not torch.amp.GradScaler (or FSDP's ShardedGradScaler): they scale the loss and unscale each
optimizer's gradients in a pass of their own, with a found-inf all-reduce over one process group,
and have no hysteresis, so a single overflow always halves the scale. Here the overflow verdict
comes for free from the global gradient norm the step computes anyway (over FSDP, TP, EP and PP
meshes alike), unscaling folds into the token-count division, and the update rule is Megatron's
DynamicGradScaler: at an overflow the growth count restarts and the hysteresis count drops by one;
once it reaches zero the scale halves (never below min_scale), at that overflow and every later one
until the scale next grows; after `window` steps in a row without overflow the scale doubles and
the hysteresis count is restored. The state is a few plain numbers, saved in the checkpoint.
"""

from __future__ import annotations

from typing import Any


GROWTH_FACTOR = 2.0  # Megatron's, fixed: powers of two scale and unscale without rounding
BACKOFF_FACTOR = 0.5


class LossScaler:
    """The loss scale and its update after each step. dynamic=False keeps initial_scale (Megatron's
    --loss-scale), still skipping steps whose gradients overflow."""

    def __init__(self, *, initial_scale: float, dynamic: bool = True, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"the loss scale needs 0 < min_scale <= initial_scale, got {min_scale}, {initial_scale}")
        if window < 1 or hysteresis < 1:
            raise ValueError(f"window and hysteresis must be at least 1, got {window}, {hysteresis}")
        self.scale = float(initial_scale)
        self.dynamic = dynamic
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.growth_tracker = 0  # steps in a row without overflow
        self.hysteresis_tracker = hysteresis  # overflows left before the scale halves
        self.skipped_steps = 0  # steps skipped for an overflow over the whole run (saved with the state)

    def update(self, overflow: bool) -> None:
        """After a step: overflow says whether its gradients held an inf or nan (the step was skipped)."""
        if overflow:
            self.skipped_steps += 1
        if not self.dynamic:
            return
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * BACKOFF_FACTOR, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= GROWTH_FACTOR

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state["skipped_steps"])

    def describe(self) -> str:
        if not self.dynamic:
            return f"static loss scale {self.scale:g}"
        return (f"dynamic loss scale from {self.scale:g} (min {self.min_scale:g}; doubles after {self.window} steps "
                f"without overflow; halves at overflow number {self.hysteresis} since it last grew, and at each "
                "one after)")


def build_loss_scaler(section, mode: str) -> LossScaler | None:
    """The job's scaler from its [loss_scaling] section, or None when the loss is not scaled. mode:
    the plan's resolved loss_scaling.mode (titanlike/train/plan.py PrecisionPlan: "auto" is dynamic
    scaling with float16 parameters, none otherwise, since bfloat16 has float32's exponent range)."""
    if mode == "none":
        return None
    return LossScaler(initial_scale=section.initial_scale, dynamic=mode == "dynamic", min_scale=section.min_scale,
                      window=section.window, hysteresis=section.hysteresis)
