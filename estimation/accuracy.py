"""Compare the estimates with peaks measured on CPU, for a small model under several layouts.

    python estimation/accuracy.py [--model debug|100m] [--only NAME ...] [--save DIR]

--model debug (default): the debug model, seq 256, local batch 8 (5 min on 2 cores).
--model 100m: the ~100M flavor (train_configs/llama3_100m.toml), seq 256, local batch 4
(13 min on 2 cores).

For each layout: the real step measured by estimation/measure_cpu.py (torchrun, gloo,
allocator events from torch.profiler), the traced estimate and the analytic one, both
counting exact bytes (--estimate.alloc_granularity 1, as the CPU allocator does not
round like CUDA's). Prints the peak of the largest rank of each, and "off-thread": how
much of the measured peak may be tensors already freed by gloo's threads, which the
profiler does not see (the largest rank's true peak is at least measured - off-thread).
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

# name -> (config file, seq_len, local_batch_size)
MODELS = {
    "debug": ("debug_model.toml", 256, 8),
    "100m": ("llama3_100m.toml", 256, 4),
}
BF16 = ["--training.mixed_precision_param", "bfloat16"]
FP32 = ["--training.mixed_precision_param", "float32"]


def base_args(model: str) -> list[str]:
    config, seq, batch = MODELS[model]
    return ["--job.config_file", str(REPO / "train_configs" / config), "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch), "--metrics.no_enable_tensorboard",
            "--lr_scheduler.warmup_steps", "2", *FP32]


def layouts(model: str) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, train.py overrides). fp32 unless the name says bf16."""
    batch = MODELS[model][2]
    return {
        "1 rank, fp32": (1, []),
        "FSDP 2, fp32": (2, []),
        "FSDP 2, bf16": (2, BF16),
        "FSDP 2, bf16, AC full": (2, [*BF16, "--activation_checkpoint.mode", "full"]),
        "FSDP 2, bf16, AC op": (2, [*BF16, "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "op"]),
        # global batch = 2 ranks x local batch x 2 microbatches
        "FSDP 2, 2 microbatches": (2, ["--training.global_batch_size", str(4 * batch)]),
        "TP 2, bf16 autocast": (2, [*BF16, "--parallelism.tensor_parallel_degree", "2"]),
        "FSDP 2 x TP 2, bf16": (4, [*BF16, "--parallelism.tensor_parallel_degree", "2"]),
        "HSDP 2x2, bf16": (4, [*BF16, "--parallelism.data_parallel_replicate_degree", "2"]),
        "CP 2 (allgather), fp32": (2, ["--parallelism.context_parallel_degree", "2"]),
        f"PP 2, 1F1B, {batch // 2} microbatches": (2, ["--parallelism.pipeline_parallel_degree", "2",
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


def measure(base: list[str], nproc: int, overrides: list[str], out: Path) -> list[dict]:
    script = str(REPO / "estimation" / "measure_cpu.py")
    args = [*base, *overrides, "--job.dump_folder", str(out / "dump"), "--measure.out", str(out)]
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"measurement failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def estimate(base: list[str], nproc: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(REPO / "estimation" / "estimate.py"), *base, *overrides,
           "--estimate.world_size", str(nproc), "--estimate.alloc_granularity", "1", "--estimate.json"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"estimate failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="debug",
                        help="debug: the debug model (5 min on 2 cores); 100m: the ~100M flavor (13 min)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only the layouts whose name contains one of these (case-insensitive)")
    parser.add_argument("--save", type=Path, default=None,
                        help="also write each layout's per-rank measurements and full estimate as JSON here")
    a = parser.parse_args()
    base = base_args(a.model)
    print("| layout | ranks | measured peak (MiB) | off-thread (MiB) | traced (MiB) | traced error | analytic (MiB) "
          "| analytic error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (nproc, overrides) in layouts(a.model).items():
        if a.only and not any(o.lower() in name.lower() for o in a.only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            measured = measure(base, nproc, overrides, Path(tmp))
        est = estimate(base, nproc, overrides)
        m = max(r["peak_bytes"] for r in measured)
        # Bytes the profiler saw allocated in the step and never freed were freed on a thread it does not
        # follow (see measure_cpu.py): each rank's true peak lies in [peak - those, peak].
        low = max(r["peak_bytes"] - max(0, r["end_minus_start_bytes"]) for r in measured)
        t, an = est["traced"]["peak_bytes"], est["analytic"]["peak_bytes"]
        mib = 2**20
        if a.save:
            a.save.mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "_" for c in name)
            (a.save / f"{slug}.json").write_text(json.dumps({"layout": name, "ranks": nproc, "overrides": overrides,
                                                             "measured": measured, "estimate": est}, indent=1))
        print(f"| {name} | {nproc} | {m / mib:.1f} | {(m - low) / mib:.1f} | {t / mib:.1f} | {(t - m) / m:+.1%} | "
              f"{an / mib:.1f} | {(an - m) / m:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
