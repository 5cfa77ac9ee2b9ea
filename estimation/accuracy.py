"""Compare the estimates with peaks measured on CPU, for the debug model under several layouts.

    python estimation/accuracy.py [--only NAME ...] [--markdown]

For each layout: the real step measured by estimation/measure_cpu.py (torchrun, gloo,
allocator events from torch.profiler), the traced estimate and the analytic one, both
counting exact bytes (--estimate.alloc_granularity 1, as the CPU allocator does not
round like CUDA's). Prints the peak of the largest rank of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.seq_len", "256",
        "--training.local_batch_size", "8", "--metrics.no_enable_tensorboard", "--lr_scheduler.warmup_steps", "2"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]

# name -> (ranks, train.py overrides)
LAYOUTS = {
    "1 rank, fp32": (1, []),
    "FSDP 2, fp32": (2, []),
    "FSDP 2, bf16": (2, BF16),
    "FSDP 2, bf16, AC full": (2, [*BF16, "--activation_checkpoint.mode", "full"]),
    "FSDP 2, bf16, AC op": (2, [*BF16, "--activation_checkpoint.mode", "selective",
                                "--activation_checkpoint.selective_ac_option", "op"]),
    "FSDP 2, 2 microbatches": (2, ["--training.global_batch_size", "32"]),
    "TP 2, bf16 autocast": (2, [*BF16, "--parallelism.tensor_parallel_degree", "2"]),
    "FSDP 2 x TP 2, bf16": (4, [*BF16, "--parallelism.tensor_parallel_degree", "2"]),
    "HSDP 2x2, bf16": (4, [*BF16, "--parallelism.data_parallel_replicate_degree", "2"]),
    "CP 2 (allgather), fp32": (2, ["--parallelism.context_parallel_degree", "2"]),
    "PP 2, 1F1B, 4 microbatches": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "PP 2 x FSDP 2, Interleaved1F1B, bf16": (4, [*BF16, "--parallelism.pipeline_parallel_degree", "2",
                                                  "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                                  "--parallelism.pipeline_parallel_microbatch_size", "2"]),
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def measure(nproc: int, overrides: list[str], out: Path) -> list[dict]:
    script = str(REPO / "estimation" / "measure_cpu.py")
    args = [*BASE, *overrides, "--job.dump_folder", str(out / "dump"), "--measure.out", str(out)]
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"measurement failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def estimate(nproc: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(REPO / "estimation" / "estimate.py"), *BASE, *overrides,
           "--estimate.world_size", str(nproc), "--estimate.alloc_granularity", "1", "--estimate.json"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"estimate failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--markdown", action="store_true")
    a = parser.parse_args()
    rows = []
    print("| layout | ranks | measured peak (MiB) | traced (MiB) | traced error | analytic (MiB) | analytic error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (nproc, overrides) in LAYOUTS.items():
        if a.only and not any(o.lower() in name.lower() for o in a.only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure(nproc, overrides, Path(tmp))
        est = estimate(nproc, overrides)
        m = max(r["peak_bytes"] for r in measured)
        t, an = est["traced"]["peak_bytes"], est["analytic"]["peak_bytes"]
        mib = 2**20
        rows.append((name, nproc, m, t, an))
        print(f"| {name} | {nproc} | {m / mib:.1f} | {t / mib:.1f} | {(t - m) / m:+.1%} | {an / mib:.1f} | "
              f"{(an - m) / m:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
