"""Plot a run's metrics.jsonl as one PNG: loss and validation loss, learning rate, gradient norm
and throughput against the step, then every other series the run logged (the objective's own: DPO's
rewards and accuracy, a reward model's accuracy, distillation's KL; MoE balance, loss scale), one
panel each (keys sharing a "name/" prefix share one).

    python scripts/plot_metrics.py outputs/metrics.jsonl                 # writes outputs/metrics.png
    python scripts/plot_metrics.py outputs/metrics.jsonl -o run.png --smooth 0.9
    python scripts/plot_metrics.py a/metrics.jsonl b/metrics.jsonl --labels fsdp tp   # runs side by side

train.py writes metrics.jsonl into job.dump_folder (metrics.enable_jsonl, on by default): one line
per logged step, one per validation. A resumed run appends to the same file; the step's last
record wins. Needs matplotlib (`pip install 'titanlike[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (record key, panel title); the loss panel also draws validation_loss.
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tps", "tokens/s per device"))
# What the machine did rather than what the model learned (observe/metrics.py peak_memory_gib's labels, MFU
# follows tokens/s): no panel of their own.
MACHINE = ("memory", "max_rss", "mfu")


def other_panels(records: list[dict]) -> dict[str, list[str]]:
    """Panel title -> the numeric keys it draws, for every key of the records beyond PANELS and MACHINE:
    a key "group/name" joins the panel of its group."""
    panels: dict[str, list[str]] = {}
    known = {"step", *MACHINE, *(key for key, _ in PANELS)}
    for record in records:
        for key, value in record.items():
            if key in known or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            keys = panels.setdefault(key.split("/")[0] if "/" in key else key, [])
            if key not in keys:
                keys.append(key)
    return panels


def read_metrics(path: str) -> tuple[dict[int, dict], dict[int, float]]:
    """(step -> training record, step -> validation loss) from a metrics.jsonl; a line that is not
    JSON (a run killed mid-write) is skipped with a note on stderr."""
    train, validation = {}, {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                print(f"{path}:{number}: not a metrics record, skipped", file=sys.stderr)
                continue
            if "validation_loss" in record:
                validation[step] = record["validation_loss"]
            elif "loss" in record:
                train[step] = record
    return train, validation


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start; 0 is none."""
    if weight <= 0:
        return values
    out, average, norm = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        average = weight * average + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def plot(runs: list[tuple[str, str]], output: str, smoothing: float = 0.0) -> None:
    """Draw every (label, metrics.jsonl) into one PNG at `output`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    read = [read_metrics(path) for _, path in runs]
    extra: dict[str, list[str]] = {}
    for train, _ in read:
        for title, keys in other_panels([train[s] for s in sorted(train)]).items():
            extra.setdefault(title, []).extend(k for k in keys if k not in extra.get(title, []))
    rows = 2 + (len(extra) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), constrained_layout=True, squeeze=False)
    for index, ((label, path), (train, validation)) in enumerate(zip(runs, read)):
        color = f"C{index}"  # one color per run, its validation loss included
        steps = sorted(train)
        for ax, (title, keys) in zip(axes.flat[len(PANELS):], extra.items()):
            for n, key in enumerate(keys):
                xs = [s for s in steps if key in train[s]]
                if xs:
                    name = label if len(keys) == 1 else f"{label} {key}"
                    ax.plot(xs, [train[s][key] for s in xs], color=color, linestyle=("-", "--", ":", "-.")[n % 4],
                            label=name)
            ax.set_title(title)
            ax.set_xlabel("step")
        for ax, (key, title) in zip(axes.flat, PANELS):
            xs = [s for s in steps if key in train[s]]
            if xs:
                ys = [train[s][key] for s in xs]
                if key == "loss":
                    ax.plot(xs, smooth(ys, smoothing), color=color, label=f"{label} train")
                else:
                    ax.plot(xs, ys, color=color, label=label)
            ax.set_title(title)
            ax.set_xlabel("step")
        if validation:
            xs = sorted(validation)
            axes.flat[0].plot(xs, [validation[s] for s in xs], "o--", color=color, label=f"{label} validation")
    axes.flat[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes.flat[len(PANELS) + len(extra):]:
        ax.set_visible(False)  # the odd panel out
    for ax in axes.flat[:len(PANELS) + len(extra)]:
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl file(s) written by train.py")
    parser.add_argument("-o", "--output", help="PNG to write; default: metrics.png beside the first metrics file")
    parser.add_argument("--labels", nargs="+", help="one legend label per metrics file; default: its folder name")
    parser.add_argument("--smooth", type=float, default=0.0,
                        help="exponential smoothing of the training loss in [0, 1), as TensorBoard's slider; 0 is none")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        parser.error(f"--labels needs one label per metrics file ({len(args.metrics)}), got {len(args.labels)}")
    if not 0 <= args.smooth < 1:
        parser.error(f"--smooth must lie in [0, 1), got {args.smooth}")
    for path in args.metrics:
        if not os.path.isfile(path):
            parser.error(f"no such metrics file: {path}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics.py needs matplotlib: pip install 'titanlike[plot]'", file=sys.stderr)
        return 2
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.metrics]
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "metrics.png")
    plot(list(zip(labels, args.metrics)), output, smoothing=args.smooth)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
