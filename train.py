"""Train a model from a TOML config with command-line overrides.

    python train.py --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node=8 train.py --job.config_file train_configs/llama3_8b.toml --training.steps 50

The same program is `python -m titanlike.train` and, after `pip install`, `titanlike-train`:
titanlike/cli/train.py holds it (plan the job, check its memory, train).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titanlike.cli.train import check_memory, main  # noqa: E402

__all__ = ["check_memory", "main"]

if __name__ == "__main__":
    sys.exit(main(process=True))
