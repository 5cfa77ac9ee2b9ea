"""Train a model from a TOML config with command-line overrides.

    python train.py --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node=8 train.py --job.config_file train_configs/llama3_8b.toml --training.steps 50
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from titanlike.config import ConfigError, HelpRequested, load_job_config
    from titanlike.train.validate import validate_config

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[titanlike] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        cfg = load_job_config(argv)
        dims = validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except HelpRequested as h:
        print(h)
        return 0
    except ConfigError as e:
        # Every rank fails the same way; one message is enough.
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2

    from titanlike.checkpoint import CheckpointError
    from titanlike.train.trainer import Trainer, TrainingError

    trainer = Trainer(cfg, dims)
    try:
        trainer.train()
    except (TrainingError, CheckpointError) as e:
        if rank == 0:
            print(f"training error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
