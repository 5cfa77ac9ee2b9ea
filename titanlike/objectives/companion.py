"""Companions: the models an objective runs beside the one it trains, as the objective declares them.

A companion is a model (a frozen copy of the trained one as the run started, the trained one itself
as it is now, or another checkpoint) and what its forward adds to each microbatch's targets (DPO's
reference log-probabilities, a distillation teacher's distribution). The objective declares them
(Objective.companions); the trainer builds, loads and runs them with the job's layout, pipeline
stages included (train/companions.py), and the estimator counts their memory. The objective's loss
then reads what they added by name, as it reads any other target.

A companion may also generate (RL): its `rollout` turns each loader batch of prompts into a batch of
rollouts sampled from the policy's current weights, and its `outputs` (the old policy's
log-probabilities) are computed once per generated batch, before any update on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    import torch.nn as nn

Targets = dict[str, torch.Tensor]


class Rollout(Protocol):
    """What a generating companion builds (titanlike/rl/rollout.py): `generate` turns one loader batch
    of prompts into a loader-like batch of rollouts (named tensors the objective's `prepare` takes)
    with the policy's whole module, sampling from `seed`; each generated batch trains `iterations`
    optimizer steps; generation may run `ahead` optimizer steps before training (0: synchronous);
    `metrics` are the host-side figures of the rollouts since its last call; `samples` a few (prompt,
    completion, scores) of its latest rollouts as text, which the trainer logs every `sample_freq` steps
    (0: never).

    A batch may come out short (RL's dynamic sampling drops prompts that teach nothing): then, up to
    `rounds` rounds in all, the companion draws another loader batch and calls `generate(..., joining=
    the batch so far)`, which adds what it keeps; `missing(batch)` is how many prompts it still lacks."""

    iterations: int
    ahead: int
    rounds: int
    sample_freq: int

    def generate(self, prompts: Targets, policy: nn.Module, *, seed: int, joining: Targets | None = None
                 ) -> Targets: ...

    def missing(self, batch: Targets) -> int: ...

    def complete(self, batches: list[Targets], total: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Called once every batch of a generation (the microbatches of its steps) is made, on every rank:
        statistics over the whole generation go here (GRPO's batch-scaled advantages); total(t) sums a
        tensor over the data-parallel ranks."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def samples(self) -> list[tuple[str, str, dict[str, float]]]: ...


class Source(enum.Enum):
    """Which weights a companion runs."""

    FROZEN_COPY = "a frozen copy of the model as the run started"  # sharded like it; DPO's reference
    POLICY = "the model being trained, as it is now"  # no copy: RL's old policy, DPO's base without adapters
    CHECKPOINT = "another checkpoint"  # a DCP checkpoint or a Hugging Face folder: a distillation teacher


@dataclass(frozen=True)
class Companion:
    """role: its name in the log ("reference", "teacher"); option: the job option that chose it, for
    messages ("dpo.reference model"); source, and path for a CHECKPOINT;
    outputs(output, targets): what its forward's output adds to the targets, computed where the loss
    runs (the last pipeline stage), without gradients (the estimator, which runs no companion, traces
    the loss with outputs of the trained model's own output: the same names, shapes and dtypes);
    converters_off: run with the
    model's converters switched off (ModelConverters.disabled: LoRA's adapters, so the policy's base is
    the reference); rollout(plan): a generating companion's Rollout (module docstring), which reads the
    policy (source POLICY), its outputs then computed once per generated batch (None: no forward);
    completions, max_new_tokens: what a generating companion samples per prompt, at most how long (each
    loader sample becomes `completions` rows of the microbatch the step trains: the estimator sizes the
    step and the generator's cache from them)."""

    role: str
    option: str
    source: Source
    outputs: Callable[[object, Targets], Targets] | None
    path: str | None = None
    converters_off: bool = False
    rollout: Callable[[object], Rollout] | None = None
    completions: int = 1
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        if (self.source is Source.CHECKPOINT) != (self.path is not None):
            raise ValueError("a companion has a path exactly when its source is a checkpoint")
        if self.rollout is not None and self.source is not Source.POLICY:
            raise ValueError("a companion that generates reads the policy: its source is POLICY")
        if self.outputs is None and self.rollout is None:
            raise ValueError("a companion adds outputs to the targets unless it generates")

    def describe(self) -> str:
        what = f"{self.path}" if self.source is Source.CHECKPOINT else self.source.value
        return f"{self.role}: {what}" + (" with the converters off" if self.converters_off else "")


__all__ = ["Companion", "Rollout", "Source", "Targets"]
