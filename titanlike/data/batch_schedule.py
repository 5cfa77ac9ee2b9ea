"""The global batch size of every step: constant, or ramped up as Megatron's --rampup-batch-size does.

Megatron's rule (its RampupBatchsizeNumMicroBatchesCalculator), a function of the samples consumed
before a step: with ``start, increment, ramp_samples`` and ``n = (global - start) / increment``
increments, a step that begins after ``c`` samples has the batch

    global                                   if c > ramp_samples
    start + floor(c * n / ramp_samples) * increment   otherwise

(Megatron computes ``int(c / (ramp_samples / n))`` in floating point; the integer form is the same
number without its rounding at exact boundaries.) So the batch grows by ``increment`` every
``ramp_samples / n`` samples and reaches ``global`` after ``ramp_samples``. The samples before step
``k`` are the sum of the batches of steps ``0..k-1``: a pure function of ``k``, so the step count
alone (which a checkpoint stores) fixes the data position, the batch and the learning rate.

The schedule is kept as a few segments of constant batch (one per increment, then the final
batch forever), so every lookup costs a bisection whatever the run's length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class _Segment:
    first_step: int
    first_sample: int  # samples consumed before first_step
    batch: int


class BatchSchedule:
    """Global batch sizes by step (0-based). rampup: [] (constant) or [start, increment, samples]."""

    def __init__(self, global_batch_size: int, rampup: list[int] | tuple[int, ...] = ()):
        self.global_batch_size = global_batch_size
        self.rampup = tuple(rampup)
        if not self.rampup:
            self._segments = [_Segment(0, 0, global_batch_size)]
        else:
            self._segments = _ramp_segments(global_batch_size, *self.rampup)
        self._steps = [s.first_step for s in self._segments]
        self._samples = [s.first_sample for s in self._segments]

    @property
    def ramps(self) -> bool:
        return len(self._segments) > 1

    @property
    def ramp_steps(self) -> int:
        """Steps before the batch reaches global_batch_size."""
        return self._segments[-1].first_step

    def _segment_of_step(self, step: int) -> _Segment:
        if step < 0:
            raise ValueError(f"steps count from 0, got {step}")
        return self._segments[bisect.bisect_right(self._steps, step) - 1]

    def batch_size(self, step: int) -> int:
        """The global batch of step `step` (0-based)."""
        return self._segment_of_step(step).batch

    def samples_before(self, step: int) -> int:
        """Samples consumed by steps 0..step-1."""
        seg = self._segment_of_step(step)
        return seg.first_sample + (step - seg.first_step) * seg.batch

    def step_of_sample(self, sample: int) -> int:
        """The step that consumes global sample `sample` (0-based)."""
        if sample < 0:
            raise ValueError(f"samples count from 0, got {sample}")
        seg = self._segments[bisect.bisect_right(self._samples, sample) - 1]
        return seg.first_step + (sample - seg.first_sample) // seg.batch

    def describe(self) -> str:
        if not self.ramps:
            return f"global batch {self.global_batch_size}"
        start, increment, samples = self.rampup
        return (f"global batch ramped from {start} by {increment} over the first {samples:,} samples to "
                f"{self.global_batch_size} (reached at step {self.ramp_steps + 1})")


def _ramp_segments(global_batch: int, start: int, increment: int, ramp_samples: int) -> list[_Segment]:
    if not (0 < start < global_batch and increment > 0 and ramp_samples > 0):
        raise ValueError(f"a batch ramp-up needs 0 < start < global batch ({global_batch}), a positive increment "
                         f"and positive samples, got {start}, {increment}, {ramp_samples}")
    if (global_batch - start) % increment:
        raise ValueError(f"the batch ramp-up's increment {increment} must divide global batch {global_batch} - "
                         f"start {start}")
    n = (global_batch - start) // increment

    def batch_after(consumed: int) -> int:
        if consumed > ramp_samples:
            return global_batch
        return start + (consumed * n // ramp_samples) * increment

    segments, step, consumed = [], 0, 0
    while True:
        batch = batch_after(consumed)
        segments.append(_Segment(step, consumed, batch))
        if batch == global_batch:
            return segments
        # The first sample count that reaches the next increment: ceil((i + 1) * ramp_samples / n).
        i = (batch - start) // increment
        threshold = -(-(i + 1) * ramp_samples // n)
        steps = -(-(threshold - consumed) // batch)
        step, consumed = step + steps, consumed + steps * batch
