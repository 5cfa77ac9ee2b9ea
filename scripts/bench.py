"""Benchmark a training config: tokens/s per device, MFU and peak memory, warm-up excluded.

    python scripts/bench.py --job.config_file train_configs/debug_model.toml [train.py overrides]
        [--bench-warmup 3] [--bench-steps 10] [--bench-rounds 3] [--minimal-loop]

With --minimal-loop it also times a hand-written PyTorch loop (same model, data,
optimizer and clipping, none of the trainer's machinery) in alternating rounds on
the same machine, and prints the trainer's overhead over it. Works under torchrun.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.config import load_job_config
from titanlike.train.plan import plan_job  # noqa: E402
from titanlike.observe.metrics import device_peak_flops, peak_memory_gib  # noqa: E402
from titanlike.models.outputs import logits_of  # noqa: E402
from titanlike.objectives.base import BatchContext  # noqa: E402
from titanlike.train.trainer import Trainer  # noqa: E402


def time_steps(step_fn, batches, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step_fn(next(batches))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None):
    """The benchmark's own options and the job's configuration (every other option), checked."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every other option is a train.py job option (--job.config_file FILE, --section.key VALUE): "
               "python3 train.py --help lists them.")
    parser.add_argument("--bench-warmup", type=int, default=3, help="untimed steps first, per loop (default 3)")
    parser.add_argument("--bench-steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--bench-rounds", type=int, default=3,
                        help="timed rounds, alternating the loops; the median is reported (default 3)")
    parser.add_argument("--minimal-loop", action="store_true",
                        help="also time a hand-written PyTorch loop and print the trainer's overhead over it "
                             "(one process, no gradient accumulation)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, run torch.profiler over this many steps and print the operators "
                             "with the most device (or CPU) time, and the step's time outside device kernels")
    bench, rest = parser.parse_known_args(argv)
    return bench, load_job_config(rest)


def main() -> None:
    bench, cfg = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = Trainer(plan_job(cfg, world))
    data = iter(trainer.dataloader)
    accum = trainer.grad_accum_steps
    step_batches = iter(lambda: [next(data) for _ in range(accum)], None)

    def trainer_step(batches):
        trainer.train_step([trainer.prepare(batch) for batch in batches])

    step_fns = {"titanlike": trainer_step}
    if bench.minimal_loop:
        if world != 1 or accum != 1:
            raise SystemExit("--minimal-loop compares one process without gradient accumulation")
        # The plain-PyTorch baseline: same architecture and init, no parallelize, no metrics.
        model = trainer.spec.model_cls(trainer.model_args).to(trainer.device)
        model.init_weights(seed=cfg.debug.seed)
        o = cfg.optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay, foreach=o.implementation == "foreach",
                                fused=o.implementation == "fused")

        # The objective's batch (token windows as they are; BERT's / T5's fields with their padding mask).
        batch_ctx = BatchContext(trainer.device, mask_kernel=trainer.mask_kernel, eos_id=trainer.tokenizer.eos_id)

        def minimal_step(batches):
            mb = trainer.objective.prepare(batches[0], batch_ctx)
            inputs, labels, kwargs = mb.inputs, mb.targets["labels"], mb.forward_kwargs()
            loss = F.cross_entropy(logits_of(model(inputs, **kwargs)).flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_fns["minimal loop"] = minimal_step

    for fn in step_fns.values():
        time_steps(fn, step_batches, bench.bench_warmup)
    times = {name: [] for name in step_fns}
    for _ in range(bench.bench_rounds):  # alternate so machine noise hits both alike
        for name, fn in step_fns.items():
            times[name].append(time_steps(fn, step_batches, bench.bench_steps))

    t = cfg.training
    tokens_per_device = trainer.global_batch_size * t.seq_len * bench.bench_steps / world
    peak = device_peak_flops(trainer.device)
    mem_label, mem = peak_memory_gib(trainer.device)
    if trainer.rank == 0:
        print(f"config: {cfg.model.name} {cfg.model.flavor}, seq {t.seq_len}, global batch "
              f"{trainer.global_batch_size}, {t.mixed_precision_param}, world {world} on {trainer.device.type}, "
              f"compile {cfg.compile.enable}, AC {cfg.activation_checkpoint.mode}")
        for name, samples in times.items():
            med = statistics.median(samples)
            tps = tokens_per_device / med
            mfu = f", MFU {100 * tps * trainer.model_args.flops_per_token(cfg.training.seq_len) / peak:.1f}%" if peak else ", MFU n/a"
            print(f"{name:13s}: {med / bench.bench_steps * 1000:8.1f} ms/step, {tps:10,.0f} tokens/s/device{mfu}"
                  f"  (rounds: {', '.join(f'{s / bench.bench_steps * 1000:.1f}' for s in samples)} ms/step)")
        allocated = (f", allocated {torch.cuda.max_memory_allocated(trainer.device) / 2**30:.2f} GiB"
                     if trainer.device.type == "cuda" else "")
        print(f"peak {mem_label}: {mem:.2f} GiB{allocated}")
        if bench.minimal_loop:
            overhead = statistics.median(times["titanlike"]) / statistics.median(times["minimal loop"]) - 1
            print(f"trainer overhead over the minimal loop: {100 * overhead:+.1f}%")
    if bench.profile_steps:
        profile(trainer_step, step_batches, bench.profile_steps, trainer.device, trainer.rank == 0)
    trainer.close()


def profile(step_fn, batches, n: int, device: torch.device, report: bool) -> None:
    """Where a step's time goes: the operators with the most self time over n steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        time_steps(step_fn, batches, n)
    if not report:
        return
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
