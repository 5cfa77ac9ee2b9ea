"""Memory snapshots every `profile_freq` steps and when a step runs out of memory
([profiling] enable_memory_snapshot, save_memory_snapshot_folder).

    with MemorySnapshot(enabled=..., freq=10, folder="outputs/memory_snapshot", rank=rank,
                        footprint=lambda: tensor_footprint(model_parts, optimizer)) as snapshots:
        for step in ...:
            train_step()
            snapshots.step(step)

On CUDA, torch's allocator records every allocation with its stack from the start; each capture
writes `<folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle`, which
https://pytorch.org/memory_viz draws (timeline of allocations, what holds memory at the peak).
A step that runs out of memory writes `<folder>/iteration_<step>_exit/` before the error goes on.

On CPU there is no allocator history to record. Each capture writes
`rank<rank>_memory.json` instead: the process's resident and peak resident memory (from
/proc/self/status, or getrusage where there is no /proc) and the bytes held by this rank's
parameters, gradients and optimizer states (local shards), so a run's growth and its split
between weights, gradients and optimizer can still be read. An out-of-memory error writes the
same file under iteration_<step>_exit/.
"""

from __future__ import annotations

import json
import logging
import os
import resource
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titanlike")

# Allocation events kept by the CUDA allocator's history: the last 100k, several KB each (torchtitan's size).
_CUDA_HISTORY_ENTRIES = 100_000


def device_memory(device: str | torch.device = "cpu") -> tuple[int, str]:
    """(bytes, what they are) a tensor on `device` can use at most: a GPU's total memory, else the
    host's physical memory (its cgroup limit if lower). Reads no allocator state."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"GPU {index} ({props.name}) has"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total, "this host has"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an exception is an allocation failure: torch's OutOfMemoryError (CUDA), or the CPU
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def process_memory() -> dict[str, float]:
    """Resident and peak resident memory of this process, in GiB."""
    status = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    status[key] = int(value.split()[0]) / 2**20  # kB
    except OSError:
        pass
    # ru_maxrss is in KiB on Linux (bytes on macOS, where /proc is missing anyway).
    peak = status.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return {"rss_gib": status.get("VmRSS", peak), "peak_rss_gib": peak}


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def tensor_footprint(model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer states (its local shards)."""
    params = [p for part in model_parts for p in part.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters_bytes": _local_bytes(params),
        "gradients_bytes": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_states_bytes": _local_bytes(states),
    }


class MemorySnapshot:
    """Writes a memory snapshot every `freq` steps and on an out-of-memory error (see the module doc).

    footprint: returns the tensor bytes written into CPU snapshots (e.g. tensor_footprint).
    device: where the job's tensors live; CUDA gets allocator snapshots, anything else the JSON.
    """

    def __init__(self, *, enabled: bool, freq: int, folder: str, rank: int = 0,
                 device: torch.device = torch.device("cpu"),
                 footprint: Callable[[], dict[str, int]] | None = None):
        if enabled and freq < 1:
            raise ValueError(f"profiling.profile_freq must be at least 1, got {freq}")
        self.enabled, self.freq, self.folder, self.rank = enabled, freq, folder, rank
        self.cuda = device.type == "cuda"
        self.footprint = footprint
        self.step_num = 0  # the last finished step, for the name of an out-of-memory snapshot
        self.written: list[str] = []  # files written, in order

    def __enter__(self) -> MemorySnapshot:
        if self.enabled and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=_CUDA_HISTORY_ENTRIES)
        return self

    def step(self, step: int) -> None:
        """Call after training step `step` finished."""
        self.step_num = step
        if self.enabled and step % self.freq == 0:
            self.write(f"iteration_{step}")

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        try:
            if exc is not None and is_out_of_memory(exc):
                # The step that failed is the one after the last finished step.
                path = self.write(f"iteration_{self.step_num + 1}_exit")
                logger.error(f"rank {self.rank}: out of memory in step {self.step_num + 1}; memory snapshot "
                             f"written to {path}")
        finally:
            if self.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)

    def write(self, name: str) -> str:
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        if self.cuda:
            path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
        else:
            path = os.path.join(folder, f"rank{self.rank}_memory.json")
            record = {"step": self.step_num, "rank": self.rank, **process_memory()}
            if self.footprint is not None:
                record.update(self.footprint())
            with open(path, "w") as f:
                json.dump(record, f, indent=1)
        self.written.append(path)
        if self.rank == 0:
            logger.info(f"memory snapshot written to {path}")
        return path


__all__ = ["MemorySnapshot", "is_out_of_memory", "process_memory", "tensor_footprint"]
