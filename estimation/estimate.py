"""Estimate the peak GPU memory of a training job, for any world size, without GPUs.

    python estimation/estimate.py --job.config_file train_configs/llama3_405b.toml --estimate.world_size 512
    python estimation/estimate.py --job.config_file train_configs/llama3_8b.toml --estimate.world_size 8 \\
        --activation_checkpoint.mode full --estimate.device_memory_gib 80 [--estimate.json]
    python estimation/estimate.py --job.config_file ... --estimate.plan --estimate.world_size 64 \\
        --estimate.device_memory_gib 80

Takes every train.py option (the same TOML and overrides) plus the `--estimate.*` options listed by
--help. Plans the job as train.py does, runs its training step on fake tensors (one block of each
kind, estimation/probe.py) and lays that out along the model, the layout and the pipeline schedule
(estimation/layout.py); `--estimate.plan` ranks layouts instead (estimation/planner.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None, prog: str = "estimation/estimate.py") -> int:
    from estimation.options import estimate_help, parse_estimate_args
    from titanlike.config import ConfigError, help_text, load_job_config

    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text().replace("usage: train.py", f"usage: {prog} [--estimate.key VALUE ...]", 1)
              + "\n" + estimate_help())
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 (stdout keeps the JSON)
    try:
        opts, rest = parse_estimate_args(argv)
        cfg = load_job_config(rest)
        if opts.plan:
            from estimation.planner import format_plan, run_plan

            plan = run_plan(cfg, opts, log=log)
            print(json.dumps(plan, indent=1) if opts.json else format_plan(plan))
            return 0
        from estimation.report import format_report, run_estimate

        result = run_estimate(cfg, opts, log=log)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if opts.json else format_report(result))
    return 0


def console_main() -> None:
    """The `titanlike-estimate` console script."""
    sys.exit(main(prog="titanlike-estimate"))


if __name__ == "__main__":
    sys.exit(main())
