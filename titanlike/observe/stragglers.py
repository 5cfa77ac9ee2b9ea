"""Straggler report: which ranks are slow, at every metrics log ([metrics] straggler_factor).

In synchronous training every rank waits for the slowest one inside the step's collectives, so
the wall time of a step is the same on every rank and cannot name the slow one. What differs is
the time of the work that waits for no other rank. Like Megatron-LM's straggler detector (which
times each rank's own compute), each rank times the parts of a step that hold no collective:

* data: fetching its batches from the data loader (host time): slow storage, a slow tokenizer;
* optimizer: the optimizer step on its local shards (device time on CUDA, from CUDA events;
  host time on CPU or when the optimizer runs on the host): a slow or throttled GPU, a busy core.

At each log step one all-gather of three floats per rank (over the default group; a CPU tensor,
so gloo even on CUDA jobs) brings the per-step means of every rank to rank 0, which names the
ranks whose data or optimizer time is above `straggler_factor` x the median over ranks. Gaps
worth less than 5% of a step are not reported: a rank 2x slower at a 0.1 ms phase costs nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

PHASES = ("data", "optimizer")
# A slow phase is reported only if it costs at least this fraction of a step.
MIN_STEP_FRACTION = 0.05


def slow_ranks(times: Sequence[float], factor: float, min_excess: float = 0.0) -> list[int]:
    """Ranks whose time is above factor x the median of `times` (one per rank) and above the
    median by at least min_excess."""
    if not times:
        return []
    median = statistics.median(times)
    return [rank for rank, t in enumerate(times) if t > factor * median and t - median >= min_excess]


class StragglerDetector:
    """Times this rank's data and optimizer phases and, at `report`, names the slow ranks.

    Use: `data = detector.timed(iter(loader))`, `detector.watch(optimizer)` (step hooks), and
    `detector.report(step)` on every rank at every log step. factor <= 0 turns it off (nothing is
    timed and report() makes no collective).
    """

    def __init__(self, *, factor: float, device: torch.device, group=None):
        self.factor = factor
        self.enabled = factor > 0
        self.group = group
        self.cuda = device.type == "cuda"
        self._host = dict.fromkeys(PHASES, 0.0)  # seconds since the last report
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # optimizer steps on the device
        self._started: dict[str, object] = {}
        self._last_report = time.perf_counter()
        self._last_step: int | None = None

    def timed(self, batches: Iterator) -> Iterator:
        """The batches of `batches`, each fetch timed as this rank's data phase."""
        if not self.enabled:
            yield from batches
            return
        while True:
            begin = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._host["data"] += time.perf_counter() - begin
            yield batch

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Time every optimizer step (through the optimizer's step hooks)."""
        if self.enabled:
            optimizer.register_step_pre_hook(lambda *_: self._start_optimizer())
            optimizer.register_step_post_hook(lambda *_: self._stop_optimizer())

    def _start_optimizer(self) -> None:
        self._started["host"] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._started["device"] = event

    def _stop_optimizer(self) -> None:
        self._host["optimizer"] += time.perf_counter() - self._started.pop("host")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started.pop("device"), end))

    def _device_optimizer_seconds(self) -> float:
        if not self._events:
            return 0.0
        self._events[-1][1].synchronize()  # at log steps only; the step's .item() synchronized most of it
        seconds = sum(start.elapsed_time(end) for start, end in self._events) / 1000
        self._events.clear()
        return seconds

    def report(self, step: int) -> list[tuple[int, str, float, float]]:
        """Gather every rank's mean step, data and optimizer seconds since the last report; returns
        the slow (rank, phase, seconds, median seconds), the same on every rank. Call on every rank."""
        if not self.enabled:
            return []
        steps = step - self._last_step if self._last_step is not None else step
        steps = max(steps, 1)
        now = time.perf_counter()
        # The optimizer may run on the device or on the host (CPU offload): whichever took longer.
        optimizer = max(self._host["optimizer"], self._device_optimizer_seconds())
        local = torch.tensor([now - self._last_report, self._host["data"], optimizer], dtype=torch.float64) / steps
        self._host = dict.fromkeys(PHASES, 0.0)
        self._last_report, self._last_step = now, step
        if dist.is_initialized():
            world = dist.get_world_size(self.group)
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local, group=self.group)
            table = torch.stack(gathered)
        else:
            table = local[None]
        step_seconds = statistics.median(table[:, 0].tolist())
        slow = []
        for column, phase in enumerate(PHASES, start=1):
            times = table[:, column].tolist()
            median = statistics.median(times)
            for rank in slow_ranks(times, self.factor, MIN_STEP_FRACTION * step_seconds):
                slow.append((rank, phase, times[rank], median))
        return slow


def format_stragglers(step: int, slow: list[tuple[int, str, float, float]], factor: float) -> str:
    """One line naming the slow ranks, e.g. 'stragglers at step 20 (> 1.5x the median over ranks):
    rank 3 optimizer 41.0 ms/step (median 12.2 ms, 3.4x)'."""
    parts = [f"rank {rank} {phase} {1000 * t:.1f} ms/step (median {1000 * median:.1f} ms"
             + (f", {t / median:.1f}x)" if median > 0 else ")") for rank, phase, t, median in slow]
    return f"stragglers at step {step} (> {factor:g}x the median over ranks): " + "; ".join(parts)


__all__ = ["PHASES", "StragglerDetector", "format_stragglers", "slow_ranks"]
