#!/usr/bin/env python
"""Checkpoint save/load throughput and the training loop's blocking time, per async mode.

    python scripts/bench_checkpoint.py [--flavor 1B] [--layers 16] [--steps 6] [--interval 2]
                                       [--compute-s 2.0] [--folder /tmp/bench_ckpt]

Builds the model from a flavor (fp32, random init) in one process and runs a stand-in
training loop through the real CheckpointManager: each step is an in-place update of every
parameter (what an optimizer step touches) followed by --compute-s seconds of idle "compute"
(on a GPU the host mostly waits for the device; background saving uses that time). A save
every --interval steps; per mode it reports

  blocking   time the loop spent inside save() and waiting for staging, per save
  save       bytes written / (save started -> published), GB/s, per save
  load       bytes / load() time, with the files evicted from the page cache first (cold)
             and again with them cached (warm)

The state saved is the model's weights plus the small states (loader, RNG, schedule): the
update is stateless, so the optimizer adds no tensors. A 1-rank gloo process group is
created so that async_with_pinned_mem runs DCP's checkpoint process as it does under torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("disabled", "async", "async_with_pinned_mem")


class _Loader:
    """The loader interface the manager needs (a position to save and restore)."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def evict(path: str) -> None:
    """Drop the checkpoint's (fsynced, so clean) pages from the page cache: a cold read."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="1B")
    p.add_argument("--layers", type=int, default=None, help="override the flavor's n_layers (smaller model)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--compute-s", type=float, default=2.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--folder", default=None, help="where checkpoints go (default: a temporary folder)")
    args = p.parse_args(argv)

    import logging

    import torch.distributed as dist

    from titanlike.checkpoint import CheckpointManager
    from titanlike.config import load_job_config
    from titanlike.models.registry import get_model_spec

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)

    spec = get_model_spec("llama3")
    model_args = spec.flavors[args.flavor]
    if args.layers:
        model_args = dataclasses.replace(model_args, n_layers=args.layers)
    model_args = model_args.with_context_len(2048)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
            # No grads: DCP would otherwise allocate zero grads for a stateless optimizer on every save.
            param.requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    root = args.folder or tempfile.mkdtemp(prefix="bench_ckpt_")
    print(f"model: llama3 {args.flavor}" + (f" with {args.layers} layers" if args.layers else "")
          + f", {n_params / 1e9:.3f} B parameters, fp32 ({n_params * 4 / 1e9:.2f} GB); checkpoints in {root}")
    print(f"loop: {args.steps} steps of an in-place update + {args.compute_s:.1f} s idle compute, "
          f"a save every {args.interval} steps; {os.cpu_count()} CPU cores, torch {torch.__version__}")

    rows = []
    for mode in args.modes.split(","):
        folder = os.path.join(root, mode)
        shutil.rmtree(folder, ignore_errors=True)
        cfg = load_job_config([
            "--job.dump_folder", folder, "--checkpoint.enable", "--checkpoint.async_mode", mode,
            "--checkpoint.interval", str(args.interval), "--checkpoint.keep_latest_k", "1",
            "--training.steps", str(10 ** 9),  # never the last step: only interval saves
        ])
        optimizer = Decay(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        loader = _Loader()
        manager = CheckpointManager(cfg, dims=None, model_parts=[model], optimizer=optimizer,
                                    lr_scheduler=scheduler, dataloader=loader, model_args=model_args)
        manager.load()
        blocking = []
        begin = time.monotonic()
        for step in range(1, args.steps + 1):
            optimizer.step()
            time.sleep(args.compute_s)
            loader.position = step
            before = manager.blocked_s
            manager.save(step)
            if step % args.interval == 0:
                blocking.append(manager.blocked_s - before)
        manager.close()
        loop_s = time.monotonic() - begin
        # Staging waits happen inside the next optimizer step; count them with their save.
        staging_wait = manager.blocked_s - sum(blocking)
        latest = os.path.join(manager.folder, sorted(os.listdir(manager.folder))[-1])
        size = folder_bytes(latest)
        saves = [s for _, s in manager.save_seconds]

        loads = {}
        for kind in ("cold", "warm"):
            if kind == "cold":
                evict(latest)
            reader = CheckpointManager(cfg, dims=None, model_parts=[model], optimizer=optimizer,
                                       lr_scheduler=scheduler, dataloader=_Loader(), model_args=model_args)
            t = time.monotonic()
            reader.load()
            loads[kind] = time.monotonic() - t
            reader.close()
        rows.append((mode, size, blocking, staging_wait, saves, loads, loop_s))
        print(f"\n[{mode}] checkpoint {size / 1e9:.2f} GB")
        print("  blocking per save: " + ", ".join(f"{b:.2f} s" for b in blocking)
              + (f" (+{staging_wait:.2f} s waiting for staging in optimizer steps)" if staging_wait > 0.005 else ""))
        print("  save, start -> published: " + ", ".join(f"{s:.2f} s ({size / s / 1e9:.2f} GB/s)" for s in saves))
        print(f"  load: cold {loads['cold']:.2f} s ({size / loads['cold'] / 1e9:.2f} GB/s), "
              f"warm {loads['warm']:.2f} s ({size / loads['warm'] / 1e9:.2f} GB/s)")
        print(f"  loop: {loop_s:.1f} s for {args.steps} steps "
              f"(no checkpointing: ~{args.steps * args.compute_s:.1f} s + updates)")
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()

    print("\nmode                    GB     block/save (mean, first)   save GB/s (mean)   load cold / warm GB/s")
    for mode, size, blocking, staging_wait, saves, loads, _ in rows:
        mean_block = (sum(blocking) + staging_wait) / len(blocking)
        mean_save = sum(size / s for s in saves) / len(saves) / 1e9
        print(f"{mode:22s} {size / 1e9:5.2f}   {mean_block:6.2f} s, {blocking[0]:6.2f} s          "
              f"{mean_save:6.2f}             {size / loads['cold'] / 1e9:5.2f} / {size / loads['warm'] / 1e9:5.2f}")
    if not args.folder:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0


class Decay(torch.optim.Optimizer):
    """A stateless in-place update of every parameter: the memory traffic of an optimizer step."""

    def __init__(self, params, lr=1e-4):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                param.mul_(1.0 - group["lr"])


if __name__ == "__main__":
    sys.exit(main())
