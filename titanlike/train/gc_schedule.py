"""Python garbage collection at fixed steps instead of whenever the allocator's counters say.

An automatic collection pauses one rank for tens of milliseconds at a moment no other rank
shares, and every collective after it waits for that rank. With automatic collection off and a
collection every `training.gc_freq` steps, all ranks pause at the same step. Only the young
generations are collected periodically (cheap); a full collection runs on entering the loop.
`training.gc_debug` collects everything at every step instead, to find reference cycles that keep
tensors alive (slow; for debugging).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


class PeriodicGC:
    """Context manager for the training loop: automatic collection is off inside, restored after."""

    def __init__(self, freq: int, *, debug: bool = False):
        if freq < 1:
            raise ValueError(f"training.gc_freq must be at least 1, got {freq}")
        self.freq = freq
        self.debug = debug
        self.collections = 0  # periodic collections run so far (for tests and logs)
        self._was_enabled = False

    def __enter__(self) -> "PeriodicGC":
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        return self

    def step_done(self, step: int) -> None:
        """Call after each training step (the same step on every rank)."""
        if self.debug:
            self._collect(2, step)
        elif step % self.freq == 0:
            self._collect(1, step)

    def _collect(self, generation: int, step: int) -> None:
        begin = time.monotonic()
        found = gc.collect(generation)
        self.collections += 1
        logger.debug("gc at step %d: generation %d, %d objects, %.3f s", step, generation, found,
                     time.monotonic() - begin)

    def __exit__(self, *exc) -> None:
        if self._was_enabled:
            gc.enable()
