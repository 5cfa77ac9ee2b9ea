"""Faults the training loop survives or reports in one sentence: stop signals, a dead launcher,
non-finite gradients.

Stop protocol (SIGTERM / SIGUSR1, e.g. Kubernetes or SLURM preemption; see scripts/slurm_train.sbatch):

* `StopRequest.install()` (at the start of `Trainer.train`) replaces the SIGTERM and SIGUSR1
  handlers by one that only records the signal: the step in progress is never interrupted.
* Every step carries each rank's `StopRequest.flags()` in the sum over all ranks it makes anyway
  (train/step.py), so agreeing costs no collective of its own. The loop reads the sums (one step
  later on steps it does not otherwise read, so the device is never waited for: see the trainer),
  and a signal that reached some ranks (or reached them at different steps) stops every rank after
  the same step. The trainer then saves a full checkpoint of that step
  (`CheckpointManager.save(step, force=True)`), says so, and `train()` returns normally: the
  process exits 0 after the usual `close()`. The stop costs at most two steps and one full
  synchronous save; the launcher's grace time must cover that (torchrun: `--shutdown_timeout`
  or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s; SLURM: the lead time of `--signal`, KillWait;
  Kubernetes: terminationGracePeriodSeconds, default 30 s).
* `Trainer.close()` restores the previous handlers.

A rank under torchrun also asks the kernel for SIGTERM when its launcher dies
(`set_parent_death_signal`, Linux prctl PR_SET_PDEATHSIG): a SIGKILLed torchrun no longer leaves
ranks training and saving on their own; they stop through the same path (and since the sum
is over every rank, ranks on other nodes stop after the same step). PR_SET_PDEATHSIG fires
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

# torch is imported where it is used: train.py installs StopRequest before anything heavy is
# imported, so that a stop signal in the first seconds of setup is recorded too.

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
        self._ended = False  # set by run_ended(): a signal now has nothing left to stop

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
        if self._ended:
            # After the run (its summary, the last save): the process exits as it would have, 0.
            logger.warning(f"received {self.describe(int(signum))} after the run ended: nothing left to save; "
                           "exiting as planned")
        if self.code:
            return
        self.code = int(signum)

    def run_ended(self) -> None:
        """The run is over (train.py keeps the handlers installed until the process exits): a stop
        signal from now on is only said, so that it cannot turn a finished job into a killed one."""
        self._ended = True

    def local(self) -> int:
        if not self.code and self._parent is not None and os.getppid() != self._parent:
            logger.warning(f"the launcher (pid {self._parent}) is gone: stopping as on SIGTERM")
            self.code = int(signal.SIGTERM)
        return self.code

    def flags(self) -> list[float]:
        """This rank's stop state, one 0/1 value per STOP_SIGNALS entry: the training step sums them
        over all ranks in the collective it makes anyway (train/step.py), then agree() reads the sums."""
        code = self.local()
        return [float(code == int(sig)) for sig in STOP_SIGNALS]

    def agree(self, counts) -> int:
        """The largest stop code any rank had, from the summed flags() (the same on every rank)."""
        self.agreed_code = max((int(sig) for sig, n in zip(STOP_SIGNALS, counts) if n > 0), default=0)
        return self.agreed_code

    def agreed(self) -> int:
        """The largest stop code of all ranks, by a collective of its own (before the first step)."""
        import torch
        import torch.distributed as dist

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


def name_nonfinite_grad(local: str | None) -> str:
    """The first parameter with a non-finite gradient over all ranks, e.g. 'layers.1.w1.weight' or
    'layers.1.w1.weight (rank 1's shard)', from each rank's own first one (None: none on that rank;
    train/step.py locates it on the device). A collective: every rank calls it (they all saw the
    same global norm, so they all take this path)."""
    import torch.distributed as dist

    found = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)
    for rank, name in enumerate(found):
        if name is not None:
            return name if len(found) == 1 else f"{name} (rank {rank}'s shard)"
    return "none found"
