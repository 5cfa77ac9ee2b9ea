"""Train a model from a TOML config with command-line overrides.

    python train.py --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node=8 train.py --job.config_file train_configs/llama3_8b.toml --training.steps 50

The same program is `python -m titanlike.train` and `titanlike-train`: titanlike/cli/train.py. From a
checkout, the pre-flight checks are this checkout's (its estimator's memory check), whatever an installed
copy registers."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titanlike.cli.train import main as _main  # noqa: E402


def checks() -> list:
    from estimation.fits import check_fits  # once the job is planned: not for --help
    return [check_fits]


def main(argv: list[str] | None = None, prog: str = "train.py", *, process: bool = False) -> int:
    return _main(argv, prog, process=process, checks=checks)


if __name__ == "__main__":
    sys.exit(main(process=True))
