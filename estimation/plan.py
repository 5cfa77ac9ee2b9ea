"""Rank training layouts for a model, a GPU count, GPU memory and a sequence length.

    python estimation/plan.py --job.config_file train_configs/llama3_70b.toml --estimate.world_size 64 \\
        --estimate.device_memory_gib 80 [--training.seq_len 8192] [--estimate.plan_verify 2] [--estimate.json]

The same as `estimation/estimate.py --estimate.plan`; see estimation/planner.py for the
enumeration and the throughput model with its stated assumptions.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimation.estimate import main as _estimate_main  # noqa: E402


def main(argv: list[str] | None = None, prog: str = "estimation/plan.py") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return _estimate_main([*argv, "--estimate.plan"], prog=prog)


def console_main() -> None:
    """The `titanlike-plan` console script."""
    sys.exit(main(prog="titanlike-plan"))


if __name__ == "__main__":
    sys.exit(main())
