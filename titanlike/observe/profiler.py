"""torch.profiler traces every `profile_freq` steps ([profiling] enable_profiling, profile_freq,
save_traces_folder).

    with Profiler(enabled=..., freq=10, folder="outputs/profile_traces", rank=rank) as profiler:
        for step in ...:
            train_step()
            profiler.step()

Like torchtitan, the schedule is wait = freq - 2, warmup 1, active 1: one step in every `freq` is
recorded (steps freq, 2 freq, ...; with freq 1 every step, without warm-up), and each capture is
written as a Chrome trace (chrome://tracing, Perfetto) to
`<folder>/iteration_<step>/rank<rank>_trace.json`. CPU activity is always recorded, CUDA activity
when CUDA is available: on a CPU-only machine the trace holds the host's operators with their
shapes and times. (No operator table from `key_averages()` beside it: that cost 20x the export.)
Disabled, the object does nothing and costs nothing.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import torch

logger = logging.getLogger("titanlike")


class Profiler:
    """Captures one training step every `freq` steps; call `step()` after every training step.

    start_step: the training step the loop starts after (a resumed job), so that captures keep
    falling on multiples of `freq` and their folders carry the real step numbers.
    """

    def __init__(self, *, enabled: bool, freq: int, folder: str, rank: int = 0, start_step: int = 0):
        if enabled and freq < 1:
            raise ValueError(f"profiling.profile_freq must be at least 1, got {freq}")
        self.enabled, self.freq, self.folder, self.rank = enabled, freq, folder, rank
        self.start_step = start_step
        self.traces: list[str] = []  # files written, in order
        self._prof: torch.profiler.profile | None = None
        self._closing = False

    def __enter__(self) -> Profiler:
        if not self.enabled:
            return self
        warmup = 1 if self.freq >= 2 else 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # torch warns that freq 1 has no warm-up, and (in step) that each capture's events are
            # dropped once written: both are what this schedule means to do.
            warnings.filterwarnings("ignore", message=".*(warmup|clears events).*", category=UserWarning)
            base = torch.profiler.schedule(wait=self.freq - 1 - warmup, warmup=warmup, active=1)
            # The profiler counts step() calls from 0; offset by start_step so a resumed job
            # records the same steps as an uninterrupted one.
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=lambda n: base(n + self.start_step),
                on_trace_ready=self._write,
                record_shapes=True,
            )
        self._closing = False
        self._prof.__enter__()
        return self

    def step(self) -> None:
        """Call after every training step."""
        if self._prof is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*clears events.*", category=UserWarning)
                self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        # step() ran after the last training step, so a window open now holds no training step:
        # stopping it must not write a trace.
        self._closing = True
        prof.__exit__(*exc)

    def _write(self, prof: torch.profiler.profile) -> None:
        if self._closing:
            return
        step = self.start_step + prof.step_num
        folder = os.path.join(self.folder, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        begin = time.monotonic()
        prof.export_chrome_trace(path)
        self.traces.append(path)
        if self.rank == 0:
            logger.info(f"profiler: trace of step {step} written to {path} in {time.monotonic() - begin:.2f} s")


__all__ = ["Profiler"]
