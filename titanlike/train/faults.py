"""Faults the training loop survives or reports in one sentence: stop signals, a dead launcher,
non-finite gradients.

Stop protocol (SIGTERM / SIGUSR1, e.g. Kubernetes or SLURM preemption; see scripts/slurm_train.sbatch):

* `StopRequest.install()` (at the start of `Trainer.train`) replaces the SIGTERM and SIGUSR1
  handlers by one that only records the signal: the step in progress is never interrupted.
* After every step each rank calls `StopRequest.agreed()`: one all-reduce (MAX) of a scalar over
  the world group, so a signal that reached some ranks (or reached them at different steps)
  stops every rank after the same step. The trainer then saves a full checkpoint of that step
  (`CheckpointManager.save(step, force=True)`), says so, and `train()` returns normally: the
  process exits 0 after the usual `close()`. The stop costs at most one step and one full
  synchronous save; the launcher's grace time must cover that (torchrun: `--shutdown_timeout`
  or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s; SLURM: the lead time of `--signal`, KillWait;
  Kubernetes: terminationGracePeriodSeconds, default 30 s).
* `Trainer.close()` restores the previous handlers.

A rank under torchrun also asks the kernel for SIGTERM when its launcher dies
(`set_parent_death_signal`, Linux prctl PR_SET_PDEATHSIG): a SIGKILLed torchrun no longer leaves
ranks training and saving on their own; they stop through the same path (and since the all-reduce
is over the world group, ranks on other nodes stop after the same step). PR_SET_PDEATHSIG fires
when the *thread* that forked the rank exits; torchrun's agent starts its workers with
subprocess.Popen from its main thread, so the rank is signalled when torchrun exits. Where prctl
is unavailable (not Linux), `StopRequest` also notices a changed parent pid after each step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titanlike")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def under_torchrun() -> bool:
    """Whether this process is a worker started by torchrun's agent (torchelastic)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` to this process when its parent (thread) dies; False elsewhere.

    Only for ranks started by a launcher that supervises them (torchrun): a plain `python train.py`
    started from a shell (nohup, screen) must outlive that shell, so the caller decides.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return True


class StopRequest:
    """Records stop signals and, after each step, agrees with the other ranks on stopping.

    `code` is the signal number received (0: none). `agreed()` returns the largest code over all
    ranks, so every rank takes the same decision after the same step.
    """

    def __init__(self, *, watch_parent: bool = False):
        self.code = 0
        self.agreed_code = 0  # the result of the last agreed()
        self._previous: dict[int, object] = {}
        self._parent = os.getppid() if watch_parent else None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("stop signals are not handled: the trainer does not run in the main thread")
            return
        for sig in STOP_SIGNALS:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Only record: the step in progress (or a save) finishes; the loop stops after it.
        if self.code:
            return
        self.code = int(signum)

    def local(self) -> int:
        if not self.code and self._parent is not None and os.getppid() != self._parent:
            logger.warning(f"the launcher (pid {self._parent}) is gone: stopping as on SIGTERM")
            self.code = int(signal.SIGTERM)
        return self.code

    def agreed(self) -> int:
        """The largest stop code of all ranks (a collective: every rank calls it after every step)."""
        code = self.local()
        if dist.is_available() and dist.is_initialized():
            # A CPU scalar: gloo (also under "cpu:gloo,cuda:nccl"), so no device synchronization.
            flag = torch.tensor([code], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        self.agreed_code = code
        return code

    @staticmethod
    def describe(code: int) -> str:
        try:
            return signal.Signals(code).name
        except ValueError:
            return f"signal {code}"


@torch.no_grad()
def first_nonfinite_grad(model_parts) -> tuple[str | None, bool]:
    """(name of this rank's first parameter whose local gradient holds inf or nan, whether every
    local gradient does). Only called once the global norm is non-finite, so a healthy run never
    pays for the scan. Under FSDP/TP the name is that of a parameter whose shard on this rank is
    non-finite."""
    first, total, bad = None, 0, 0
    for part in model_parts:
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            if not local.numel():
                continue
            total += 1
            if not bool(torch.isfinite(local).all()):
                bad += 1
                first = first or name
    return first, total > 1 and bad == total


def name_nonfinite_grad(model_parts) -> str:
    """The first parameter with a non-finite gradient over all ranks, e.g. 'layers.1.w1.weight'
    or 'layers.1.w1.weight (rank 1's shard)'. A collective: every rank calls it (they all saw the
    same global norm, so they all take this path)."""
    mine = first_nonfinite_grad(model_parts)
    found = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    if all(every for _, every in found):
        # clip_grad_norm_ scales every gradient by max_norm / norm: a nan norm turns all of them nan.
        return "unknown: clipping by the nan norm made every gradient nan"
    for rank, (name, _) in enumerate(found):
        if name is not None:
            return name if len(found) == 1 else f"{name} (rank {rank}'s shard)"
    return "none found"
