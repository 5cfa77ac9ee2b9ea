"""Fault injection for checkpoint and hang tests, in-process or around train.py.

In a test: ``disk_full(monkeypatch, "step-6.tmp", budget)`` makes DCP's file writes under that
folder fail with ENOSPC once ``budget`` bytes are written, as a full disk does;
``poison_index`` / ``poison_entry`` turn a checkpoint into one that runs ``touch MARKER`` when
unpickled freely; ``flip_two_bytes`` corrupts a tensor's data in place.

Around train.py: ``python tests/faults.py <train.py args>`` with TITANLIKE_FAULT set to a JSON
object (or a list of them) runs train.main() with the fault(s) installed:

  {"kind": "disk_full", "where": "step-6.tmp", "budget": 10000}
  {"kind": "full_while_tmp", "folder": DIR}   the metrics writers fail with ENOSPC while DIR holds
                                               a step-N.tmp (the disk is full until it is removed)
  {"kind": "nan_param", "step": 6, "rank": 1}  after step 6's optimizer step, rank 1 writes a NaN
                                               into its shard of the first parameter it holds
  {"kind": "slow_optimizer", "rank": 1, "seconds": 0.3}   each optimizer step of rank 1 first sleeps
                                               (a straggler: a slow GPU or a busy core)
  {"kind": "stall", "step": 4, "rank": 1, "seconds": 9}   rank 1 sleeps before step 4's work (a
                                               hung rank that comes back)
  {"kind": "kill_at_step", "step": 5}         SIGKILL (kill -9) after step 5's optimizer step, before it
                                               is logged or saved
  {"kind": "kill_while_saving", "where": "step-4.tmp", "budget": 10000}   SIGKILL once DCP has written
                                               `budget` bytes to a file under that folder (a save half done)
  {"kind": "inf_grad", "step": 3, "rank": 1}   at step 3, after backward and before the gradient norm,
                                               rank 1 finds an inf in its shard of the first gradient
                                               (as a float16 overflow leaves one); every rank then
                                               prints INF_GRAD_STEP_KEPT_PARAMETERS <rank> <True/False>:
                                               whether its parameter shards came out of that step unchanged
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_space():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _kill_9():
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


class FullDisk(io.RawIOBase):
    """A write stream over `raw` that raises ENOSPC once `budget` bytes are written (or calls `when_full`)."""

    def __init__(self, raw, budget: int, when_full=_no_space):
        super().__init__()
        self.raw, self.budget, self.when_full = raw, budget, when_full

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        if n > self.budget:
            self.when_full()
        self.budget -= n
        return self.raw.write(b)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return self.raw.seekable()

    def seek(self, *args) -> int:
        return self.raw.seek(*args)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


def _full_disk_create_stream(where: str, budget: int, when_full=_no_space):
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield FullDisk(stream, budget, when_full) if "w" in mode and where in os.fspath(path) else stream

    return FileSystem, create_stream


def disk_full(monkeypatch, where: str, budget: int = 10_000) -> None:
    """pytest: DCP writes to paths containing `where` fail with ENOSPC after `budget` bytes."""
    cls, create_stream = _full_disk_create_stream(where, budget)
    monkeypatch.setattr(cls, "create_stream", create_stream)


class Evil:
    """Unpickled freely, it runs `touch marker` (os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def reseal(path: str) -> None:
    """Rewrite the sidecar's checksums for the files as they are now (an attacker can too)."""
    from titanlike.checkpoint import format as fmt

    info = fmt.read_sidecar(path) or {}
    for key in ("checksums", "format_version"):
        info.pop(key, None)
    fmt.write_sidecar(path, info)


def poison_index(path: str, marker) -> None:
    """A valid index that also runs code when unpickled with pickle.load (as DCP's reader does)."""
    import pickle

    from titanlike.checkpoint import format as fmt

    metadata = fmt.read_dcp_metadata(path)
    metadata.planner_data = Evil(marker)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    reseal(path)


def poison_entry(path: str, key: str, marker) -> None:
    """Rewrite checkpoint path with entry `key` replaced by a pickle that runs code (DCP pickles
    any non-tensor value; its loader unpickles it with torch.load(weights_only=False))."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from titanlike.checkpoint import format as fmt

    metadata = fmt.read_dcp_metadata(path)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    fmt.dcp_load(state, path, no_dist=True)
    sidecar = fmt.read_sidecar(path)
    shutil.rmtree(path)
    state[key] = Evil(marker)
    dcp.save(state, checkpoint_id=path, no_dist=True)
    sidecar.pop("checksums")
    fmt.write_sidecar(path, sidecar)


def flip_two_bytes(path: str, key: str = "model.layers.1.attention.wq.weight") -> str:
    """Flip two bytes in the middle of entry key's data in checkpoint path; returns the file."""
    from titanlike.checkpoint import format as fmt

    info = next(v for k, v in fmt.read_dcp_metadata(path).storage_data.items() if k.fqn == key)
    file = os.path.join(path, info.relative_path)
    with open(file, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = bytearray(f.read(2))
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0x10 for b in data))
    return file


def install(fault: dict) -> None:
    kind = fault["kind"]
    if kind == "disk_full":
        cls, create_stream = _full_disk_create_stream(fault["where"], fault.get("budget", 10_000))
        cls.create_stream = create_stream
    elif kind == "kill_while_saving":
        cls, create_stream = _full_disk_create_stream(fault["where"], fault.get("budget", 10_000), _kill_9)
        cls.create_stream = create_stream
    elif kind == "kill_at_step":
        from titanlike.train.trainer import Trainer

        run_step = Trainer._run_step

        def killed(self, data):
            out = run_step(self, data)
            if self.step == fault["step"]:
                _kill_9()
            return out

        Trainer._run_step = killed
    elif kind == "full_while_tmp":
        from titanlike.observe.metrics import MetricsLogger

        init = MetricsLogger.__init__

        def full_init(self, *args, **kwargs):
            folder = fault["folder"]
            if os.path.isdir(folder) and any(n.endswith(".tmp") for n in os.listdir(folder)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "events"))
            init(self, *args, **kwargs)

        MetricsLogger.__init__ = full_init
    elif kind == "nan_param":
        import torch
        from torch.distributed.tensor import DTensor

        from titanlike.train.trainer import Trainer

        run_step = Trainer._run_step

        def poisoned(self, data):
            out = run_step(self, data)
            if self.step == fault["step"] and self.rank == fault.get("rank", 0):
                with torch.no_grad():
                    for part in self.model_parts:
                        for p in part.parameters():
                            local = p.to_local() if isinstance(p, DTensor) else p
                            if local.numel():
                                local.view(-1)[0] = float("nan")
                                return out
            return out

        Trainer._run_step = poisoned
    elif kind == "slow_optimizer":
        from titanlike.train.trainer import Trainer

        init = Trainer.__init__

        def slowed(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self.rank == fault["rank"]:
                # After the trainer's own hooks, so the straggler detector's timer is already running.
                self.optimizer.register_step_pre_hook(lambda *_: time.sleep(fault["seconds"]))

        Trainer.__init__ = slowed
    elif kind == "stall":
        from titanlike.train.trainer import Trainer

        run_step = Trainer._run_step

        def stalled(self, data):
            if self.step == fault["step"] and self.rank == fault["rank"]:
                time.sleep(fault["seconds"])
            return run_step(self, data)

        Trainer._run_step = stalled
    elif kind == "inf_grad":
        import torch
        from torch.distributed.tensor import DTensor

        import titanlike.train.step as step_module
        from titanlike.train.trainer import Trainer

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        at = {}
        run_step = Trainer._run_step
        clip_grad_norm_ = step_module.clip_grad_norm_

        def step_with_check(self, data):
            at["self"] = self
            if self.step != fault["step"]:
                return run_step(self, data)
            before = [local(p).detach().clone() for part in self.model_parts for p in part.parameters()]
            out = run_step(self, data)
            after = [local(p).detach() for part in self.model_parts for p in part.parameters()]
            kept = all(torch.equal(b, a) for b, a in zip(before, after))
            print(f"INF_GRAD_STEP_KEPT_PARAMETERS {self.rank} {kept}", flush=True)
            return out

        def poisoned_clip(params, *args, **kwargs):
            # The gradients as backward left them on this rank, before they are scaled and clipped.
            # None: not a training step (train.py's memory check probes the step on fake tensors first).
            trainer = at.get("self")
            if trainer is not None and trainer.step == fault["step"] and trainer.rank == fault.get("rank", 0):
                grad = next(local(p.grad) for p in params if p.grad is not None and local(p.grad).numel())
                grad.view(-1)[0] = float("inf")
            return clip_grad_norm_(params, *args, **kwargs)

        Trainer._run_step = step_with_check
        step_module.clip_grad_norm_ = poisoned_clip
    else:
        raise ValueError(f"unknown fault {kind!r}")


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    faults = json.loads(os.environ["TITANLIKE_FAULT"])
    for fault in faults if isinstance(faults, list) else [faults]:
        install(fault)
    sys.argv = [os.path.join(REPO, "train.py"), *sys.argv[1:]]
    import train

    sys.exit(train.main(sys.argv[1:]))
