"""Train a model from a TOML config with command-line overrides: train.py, `python -m titanlike.train`
and the `titanlike-train` console script all run main().

    titanlike-train --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node=8 -m titanlike.train --job.config_file train_configs/llama3_8b.toml
    titanlike-train --job.config_file ... --job.validate_only   # check, plan, memory; exit 0 without training

The job is planned once (titanlike.train.plan.plan_job), its memory checked against this machine
(estimation/fits.py: a step this entry point takes, skipped with a note where the estimator is not
importable; the library never imports it), then trained. With job.validate_only it stops after the
checks: launchers (scripts/run_train.sh) run it once with the world size torchrun will start, so a bad
config never starts ranks.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    from titanlike.config import ConfigError, HelpRequested, load_job_config
    from titanlike.train.plan import plan_job

    rank = int(os.environ.get("RANK", 0))
    from titanlike.train.faults import set_parent_death_signal, under_torchrun

    if under_torchrun():
        # A rank whose launcher dies (even SIGKILLed) gets SIGTERM: it saves and exits instead of
        # training on as an orphan. Not for a plain `python train.py`, which may outlive its shell.
        set_parent_death_signal()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[titanlike] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        notes: list[str] = []  # torchtitan's older spellings, and its keys that do nothing here
        cfg = load_job_config(argv, notes=notes)
        if rank == 0:
            for note in notes:
                logging.getLogger("titanlike").warning(f"config: {note}")
        plan = plan_job(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
        check_memory(plan, rank)
    except HelpRequested as h:
        print(str(h).replace("usage: train.py", f"usage: {prog}", 1))
        return 0
    except ConfigError as e:
        # Every rank fails the same way; one message is enough.
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.job.validate_only:
        if rank == 0:
            logging.getLogger("titanlike").info(
                f"job.validate_only: {plan.model_name} on world size {plan.dims.world_size} is valid "
                f"({plan.dims}); not training")
        return 0

    from titanlike.checkpoint import CheckpointError
    from titanlike.data import DataError
    from titanlike.train.trainer import Trainer, TrainingError

    try:
        trainer = Trainer(plan)
    except DataError as e:
        # The data the job names cannot be read or used (found while building the loaders); every
        # rank builds the same data, so every rank fails alike.
        if rank == 0:
            print(f"data error: {e}", file=sys.stderr)
        _shutdown_process_group()
        return 2
    except TrainingError as e:
        # Raised by every rank together (job.dump_folder is in use by another job).
        if rank == 0:
            print(f"training error: {e}", file=sys.stderr)
        _shutdown_process_group()
        return 1
    from titanlike.parallel.timeouts import CollectiveFailure

    try:
        trainer.train()
    except (TrainingError, CheckpointError) as e:
        if rank == 0:
            print(f"training error: {e}", file=sys.stderr)
        return 1
    except CollectiveFailure as e:
        # Each rank saw the hang its own way (a timeout, a peer gone): every rank says which step.
        print(f"training error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    # A stop on SIGTERM / SIGUSR1 also ends here, after its checkpoint was saved: exit 0.
    return 0


def check_memory(plan, rank: int) -> None:
    """Refuse, before any process group exists, a job whose estimated peak memory per rank exceeds
    this machine's (estimation/fits.py; ConfigError, one sentence). The estimator is a package installed
    beside the library, which never imports it: this entry point does, as a step of its own. Where it is
    not importable, or cannot model the job, the check is skipped and says so."""
    try:
        from estimation.fits import check_fits
    except ImportError as e:
        skipped = f"the estimator is not importable here ({e}); install titanlike with its estimation package"
    else:
        skipped = check_fits(plan)
    if skipped is not None and rank == 0:
        logging.getLogger("titanlike").info(f"memory check skipped: {skipped}")


def _shutdown_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def console_main() -> None:
    """The `titanlike-train` console script."""
    sys.exit(main(prog="titanlike-train"))
