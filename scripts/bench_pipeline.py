"""Step time of every pipeline schedule on the same job, side by side (the bubble in practice).

    python scripts/bench_pipeline.py [--pp 2] [--repeats 3] [--schedules GPipe,1F1B,...] [train.py overrides]

Runs scripts/bench.py once in one process (the no-pipeline baseline) and once per schedule
under torchrun with pp ranks, all with the same config and global batch, and prints each
schedule's ms/step next to the ideal (baseline / pp: no bubble, free communication).
Each rank gets OMP_NUM_THREADS=1 (and so does the baseline), so pp ranks use pp cores
against the baseline's one. The whole sweep runs --repeats times and each figure is the
fastest repeat: on a shared machine other jobs only ever slow a run down.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlike.parallel.pipeline import SCHEDULES  # noqa: E402

DEFAULTS = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--training.seq_len", "256", "--training.local_batch_size", "8",
            "--training.mixed_precision_param", "float32", "--metrics.no_enable_tensorboard",
            "--metrics.log_freq", "1000000"]
_MS = re.compile(r"titanlike\s*:\s*([\d.]+) ms/step")


def run_bench(nproc: int, args: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    bench = [str(REPO / "scripts" / "bench.py"), "--bench-warmup", "2", "--bench-steps", "5", "--bench-rounds", "3"]
    cmd = [sys.executable, *bench] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *bench]
    proc = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True)
    match = _MS.search(proc.stdout)
    if proc.returncode or not match:
        raise SystemExit(f"bench failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every other option is a train.py job option (python3 train.py --help lists them), passed to "
               "scripts/bench.py for every run; the defaults are train_configs/debug_model.toml at seq 256, "
               "local batch 8, float32.")
    parser.add_argument("--pp", type=int, default=2,
                        help="pipeline ranks (torchrun processes) per schedule (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps; each figure is the fastest (default 3)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated schedules (default: all of {', '.join(SCHEDULES)})")
    opts, rest = parser.parse_known_args()
    args = [*DEFAULTS, *rest]
    names = opts.schedules.split(",")
    runs: dict[str, list[float]] = {name: [] for name in ["baseline", *names]}
    for _ in range(opts.repeats):
        runs["baseline"].append(run_bench(1, args))
        for name in names:
            runs[name].append(run_bench(opts.pp, [*args, "--parallelism.pipeline_parallel_degree", str(opts.pp),
                                                  "--parallelism.pipeline_parallel_schedule", name]))
    ideal = min(runs["baseline"]) / opts.pp
    print(f"{'schedule':24s} {'ms/step':>9s} {'vs ideal':>9s}   all repeats (ms/step)")
    for name, samples in runs.items():
        label = "(one process, no PP)" if name == "baseline" else name
        print(f"{label:24s} {min(samples):9.1f} {min(samples) / ideal:8.2f}x   "
              f"{', '.join(f'{x:.0f}' for x in samples)}")
    print(f"ideal at pp {opts.pp} (baseline / {opts.pp}): {ideal:.1f} ms/step")


if __name__ == "__main__":
    main()
