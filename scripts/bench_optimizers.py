"""AdamW against Muon on the loss curve: the same model, the same tokens, learning rates tuned on a grid.

Every (optimizer, learning rate, seed) is one train.py run of --flavor on the embedded corpus with
--steps steps; debug.seed fixes both the initial weights and the data order, so the two optimizers
see the same tokens seed by seed. For each optimizer the learning rate with the lowest final loss
(mean over seeds) is kept; the report gives, per seed and paired, the final loss and the steps to
reach --target (default: the higher of the two optimizers' mean final losses, so both reach it),
and --plot draws the kept runs' curves (thin: each seed; thick: the mean).

    python scripts/bench_optimizers.py --steps 200 --seeds 0,1,2 --plot optimizers.png
    python scripts/bench_optimizers.py --flavor debugmodel_tiny --steps 30 --adamw-lrs 8e-4 --muon-lrs 8e-4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(name: str, lr: float, seed: int, args, folder: Path) -> list[float]:
    """The loss at every step of one train.py run."""
    dump = folder / f"{name}-{lr:g}-{seed}"
    cmd = [sys.executable, str(REPO / "train.py"), "--model.flavor", args.flavor, "--training.steps", str(args.steps),
           "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
           "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", str(args.warmup),
           "--optimizer.name", name, "--optimizer.lr", str(lr), "--debug.seed", str(seed),
           "--metrics.log_freq", "1", "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard",
           "--checkpoint.no_enable", "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed for {name} lr {lr:g} seed {seed}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def steps_to(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, loss in enumerate(curve) if loss <= target), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="debugmodel", help="llama3 flavor (default debugmodel)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=20, help="learning-rate warm-up steps")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--seeds", default="0,1,2", help="debug.seed of each paired run")
    ap.add_argument("--adamw-lrs", default="4e-4,8e-4,1.6e-3", help="AdamW's learning-rate grid")
    ap.add_argument("--muon-lrs", default="4e-4,8e-4,1.6e-3,3.2e-3",
                    help="Muon's grid (adjust_lr_fn match_rms_adamw: AdamW's scale)")
    ap.add_argument("--target", type=float, default=None, help="loss whose first step is reported")
    ap.add_argument("--tail", type=int, default=10, help="final loss: the mean of the last TAIL steps")
    ap.add_argument("--plot", default=None, help="PNG of the kept runs' loss curves")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    grids = {"AdamW": [float(x) for x in args.adamw_lrs.split(",")],
             "Muon": [float(x) for x in args.muon_lrs.split(",")]}
    final = lambda curve: statistics.fmean(curve[-args.tail:])  # noqa: E731
    kept: dict[str, tuple[float, dict[int, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, grid in grids.items():
            for lr in grid:
                curves = {seed: run(name, lr, seed, args, Path(tmp)) for seed in seeds}
                mean = statistics.fmean(final(c) for c in curves.values())
                print(f"{name:5s} lr {lr:<8g} final loss {mean:.4f} (mean over seeds {args.seeds})", flush=True)
                if name not in kept or mean < statistics.fmean(final(c) for c in kept[name][1].values()):
                    kept[name] = (lr, curves)
    target = args.target if args.target is not None else max(
        statistics.fmean(final(c) for c in curves.values()) for _, curves in kept.values())
    print(f"\nkept: AdamW lr {kept['AdamW'][0]:g}, Muon lr {kept['Muon'][0]:g}; {args.flavor}, {args.steps} steps of "
          f"{args.batch} x {args.seq_len} tokens; target loss {target:.4f}")
    print(f"{'seed':>4}  {'AdamW final':>11}  {'Muon final':>10}  {'Muon - AdamW':>12}  {'AdamW to target':>15}  "
          f"{'Muon to target':>14}")
    for seed in seeds:
        a, m = kept["AdamW"][1][seed], kept["Muon"][1][seed]
        print(f"{seed:>4}  {final(a):>11.4f}  {final(m):>10.4f}  {final(m) - final(a):>+12.4f}  "
              f"{str(steps_to(a, target)):>15}  {str(steps_to(m, target)):>14}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, (lr, curves)), color in zip(kept.items(), ("tab:blue", "tab:red")):
            for curve in curves.values():
                ax.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.25, linewidth=0.8)
            mean = [statistics.fmean(v) for v in zip(*curves.values())]
            ax.plot(range(1, len(mean) + 1), mean, color=color, linewidth=2, label=f"{name} (lr {lr:g})")
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set(xlabel="step", ylabel="training loss", title=f"llama3 {args.flavor}, seeds {args.seeds}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
