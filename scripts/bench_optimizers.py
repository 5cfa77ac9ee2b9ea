"""AdamW against Muon on the loss curve: the same model, the same tokens, learning rates tuned on a grid.

Every (optimizer, learning rate, seed) is one train.py run of llama3 --flavor on the embedded corpus
with --steps steps, on --threads CPU threads; debug.seed fixes both the initial weights and the data
order, so the two optimizers see the same tokens seed by seed. For each optimizer the learning rate
with the lowest final loss (mean over seeds) is kept, and the report says when it lies at an edge of
its grid (the grid should then be widened). The report gives, per seed and paired, the final loss
and the steps to reach --target (default: the higher of the two optimizers' mean final losses, so
both reach it), the CPU seconds of a run of each optimizer, and --plot draws the kept runs' curves (thin: each
seed; thick: the mean). --quick is a smoke run (two short runs) for the tests.

    python scripts/bench_optimizers.py --runs runs/ --plot docs/optimizers.png   # docs/optimizers.md's figures
    python scripts/bench_optimizers.py --quick
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _losses(dump: Path) -> list[float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def run(name: str, lr: float, seed: int, args, folder: Path) -> tuple[list[float], float | None]:
    """The loss at every step of one train.py run, and the CPU seconds the run took (user + system;
    None for a run of --runs made by an earlier call that did not record them). A run --runs already
    holds whole (the same flavor and sizes: the caller keeps one folder per setting) is read back."""
    dump = folder / f"{name}-{lr:g}-{seed}"
    if (dump / "metrics.jsonl").is_file() and len(_losses(dump)) == args.steps:
        cpu = dump / "cpu_seconds.txt"
        return _losses(dump), float(cpu.read_text()) if cpu.is_file() else None
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "train.py"), "--model.flavor", args.flavor, "--training.steps", str(args.steps),
           "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
           "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", str(args.warmup),
           "--optimizer.name", name, "--optimizer.lr", str(lr), "--debug.seed", str(seed),
           "--metrics.log_freq", "1", "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard",
           "--checkpoint.no_enable", "--job.dump_folder", str(dump)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with open(dump / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"train.py failed for {name} lr {lr:g} seed {seed}:\n"
                         f"{(dump / 'stderr.txt').read_text()[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    (dump / "cpu_seconds.txt").write_text(f"{cpu:.2f}\n")
    return _losses(dump), cpu


def steps_to(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, loss in enumerate(curve) if loss <= target), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="debugmodel_tiny", help="llama3 flavor (default debugmodel_tiny)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up steps")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--seeds", default="0,1,2", help="debug.seed of each paired run")
    ap.add_argument("--adamw-lrs", default="1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2,6.4e-2",
                    help="AdamW's learning-rate grid")
    ap.add_argument("--muon-lrs", default="2e-3,4e-3,8e-3,1.6e-2,3.2e-2,6.4e-2",
                    help="Muon's grid (adjust_lr_fn match_rms_adamw: AdamW's scale)")
    ap.add_argument("--target", type=float, default=None, help="loss whose first step is reported")
    ap.add_argument("--tail", type=int, default=10, help="final loss: the mean of the last TAIL steps")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each run (OMP_NUM_THREADS)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--plot", default=None, help="PNG of the kept runs' loss curves")
    ap.add_argument("--runs", default=None, help="folder keeping each run (default: a temporary one); runs it "
                    "already holds whole are read back, so a grid can be widened without running it again")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, seed 0, one rate each")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.seq_len, args.tail, args.seeds = 4, 1, 32, 2, "0"
        args.adamw_lrs, args.muon_lrs = args.adamw_lrs.split(",")[0], args.muon_lrs.split(",")[0]
    seeds = [int(s) for s in args.seeds.split(",")]
    grids = {"AdamW": [float(x) for x in args.adamw_lrs.split(",")],
             "Muon": [float(x) for x in args.muon_lrs.split(",")]}
    final = lambda curve: statistics.fmean(curve[-args.tail:])  # noqa: E731
    mean_final = lambda curves: statistics.fmean(final(c) for c, _ in curves.values())  # noqa: E731
    results: dict[tuple[str, float], dict[int, tuple[list[float], float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = Path(args.runs) if args.runs else Path(tmp)
        # Seed by seed, the optimizers alternating: a slower machine for a while hits both alike.
        todo = [(name, lr, seed) for seed in seeds for i in range(max(map(len, grids.values())))
                for name, grid in grids.items() if i < len(grid) for lr in [grid[i]]]
        futures = {key: pool.submit(run, *key, args, runs) for key in todo}
        for name, grid in grids.items():
            for lr in grid:
                results[name, lr] = {seed: futures[name, lr, seed].result() for seed in seeds}
                print(f"{name:5s} lr {lr:<8g} final loss {mean_final(results[name, lr]):.4f} "
                      f"(mean over seeds {args.seeds})", flush=True)
    kept: dict[str, tuple[float, dict[int, tuple[list[float], float]]]] = {}
    for name, grid in grids.items():
        lr = min(grid, key=lambda x: mean_final(results[name, x]))
        kept[name] = (lr, results[name, lr])
        if len(grid) > 1 and lr in (min(grid), max(grid)):
            print(f"note: {name}'s best rate {lr:g} is at an edge of its grid: widen it", flush=True)
    target = args.target if args.target is not None else max(mean_final(curves) for _, curves in kept.values())
    print(f"\nkept: AdamW lr {kept['AdamW'][0]:g}, Muon lr {kept['Muon'][0]:g}; llama3 {args.flavor}, {args.steps} "
          f"steps of {args.batch} x {args.seq_len} tokens; target loss {target:.4f}")
    print("| seed | AdamW final | Muon final | Muon - AdamW | AdamW steps to target | Muon steps to target |")
    print("|---|---|---|---|---|---|")
    for seed in seeds:
        (a, _), (m, _) = kept["AdamW"][1][seed], kept["Muon"][1][seed]
        print(f"| {seed} | {final(a):.4f} | {final(m):.4f} | {final(m) - final(a):+.4f} | {steps_to(a, target)} | "
              f"{steps_to(m, target)} |")
    for name in grids:  # the optimizer's cost: CPU seconds of whole runs (start-up included) over their steps
        cpus = [c for (n, _), curves in results.items() if n == name for _, c in curves.values() if c is not None]
        if cpus:
            print(f"{name}: {statistics.fmean(cpus):.1f} CPU s per run of {args.steps} steps "
                  f"(mean of {len(cpus)} runs, {args.threads} thread(s) each)")
    cpu = [c for curves in results.values() for _, c in curves.values() if c is not None]
    print(f"CPU time of the {len(cpu)} runs made or recorded: {sum(cpu):.0f} s")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # Left: the kept runs' curves; right: the final loss of every rate of each grid (the best inside it).
        fig, (ax, grid_ax) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
        for (name, (lr, curves)), color in zip(kept.items(), ("tab:blue", "tab:red")):
            for curve, _ in curves.values():
                ax.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.25, linewidth=0.8)
            mean = [statistics.fmean(v) for v in zip(*(c for c, _ in curves.values()))]
            ax.plot(range(1, len(mean) + 1), mean, color=color, linewidth=2, label=f"{name} (lr {lr:g})")
            grid = grids[name]
            grid_ax.plot(grid, [mean_final(results[name, x]) for x in grid], "o-", color=color, label=name)
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set(xlabel="step", ylabel="training loss", title=f"llama3 {args.flavor}, seeds {args.seeds}")
        ax.legend()
        grid_ax.set(xscale="log", xlabel="learning rate", ylabel=f"final loss (last {args.tail} steps, mean of seeds)",
                    title="learning-rate grids")
        grid_ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
