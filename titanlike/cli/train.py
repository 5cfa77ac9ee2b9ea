"""Train a model from a TOML config with command-line overrides: train.py, `python -m titanlike.train`
and the `titanlike-train` console script all run main().

    titanlike-train --job.config_file train_configs/debug_model.toml
    torchrun --nproc_per_node=8 -m titanlike.train --job.config_file train_configs/llama3_8b.toml
    titanlike-train --job.config_file ... --job.validate_only   # check, plan, memory; exit 0 without training

The job is planned once (titanlike.train.plan.plan_job), checked by the pre-flight checks installed
packages register (the entry-point group `titanlike.preflight`: the estimation package's memory check,
estimation/fits.py, which the library never imports), then trained. With job.validate_only it stops
after the checks: launchers (scripts/run_train.sh) run it once with the world size torchrun will
start, so a bad config never starts ranks.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None, prog: str = "train.py", *, process: bool = False,
         checks=None) -> int:
    """The trainer's work; the exit code. process: this call is the process's whole life (train.py,
    python -m titanlike.train, titanlike-train), so the stop-signal handlers installed first thing stay
    until it exits: SIGTERM or SIGUSR1 at any moment, in setup or after the final summary, never kills
    it (an in-process caller, a test, gets its own handlers back when main returns). checks: the
    pre-flight checks to run on the plan, or a function returning them (called once the job is planned,
    so that --help imports none of them); None means those installed packages register (preflight_checks)."""
    # First, before torch is imported: a stop signal in the first seconds of setup is recorded, and
    # acted on as the loop would (there is nothing to save yet: exit 0, saying so).
    from titanlike.train.faults import StopRequest, set_parent_death_signal, under_torchrun

    stop = StopRequest(watch_parent=under_torchrun())
    stop.install()
    rank = int(os.environ.get("RANK", 0))
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
        return _run(argv, prog, stop, rank, checks)
    finally:
        if process:
            stop.run_ended()
        else:
            stop.restore()


def _run(argv: list[str] | None, prog: str, stop, rank: int, checks) -> int:
    from titanlike.config import ConfigError, HelpRequested, load_job_config

    # The launcher (scripts/run_train.sh) validated this job for the same world size before starting the
    # ranks, showing its config notes and running the pre-flight checks: the ranks repeat neither.
    validated = os.environ.get(LAUNCHER_VALIDATED) == "1"
    try:
        notes: list[str] = []  # torchtitan's older spellings, and its keys that do nothing here
        cfg = load_job_config(argv, notes=notes)
        from titanlike.train.plan import plan_job  # after --help, which needs none of the planning

        if rank == 0 and not validated:
            for note in notes:
                logging.getLogger("titanlike").warning(f"config: {note}")
        plan = plan_job(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if validated:
            if rank == 0:
                logging.getLogger("titanlike").info("pre-flight checks: run by the launcher before the ranks started")
        else:
            run_checks(plan, rank, preflight_checks() if checks is None else checks() if callable(checks) else checks)
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
    if stop.code and plan.dims.world_size == 1:
        # A signal during planning (a multi-rank job agrees on it before its first step instead).
        logging.getLogger("titanlike").info(f"received {stop.describe(stop.code)} during setup, before "
                                            "training started: nothing to save; exiting")
        return 0

    from titanlike.checkpoint import CheckpointError
    from titanlike.data import DataError
    from titanlike.train.trainer import Trainer, TrainingError

    try:
        trainer = Trainer(plan, stop=stop)
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


PREFLIGHT_GROUP = "titanlike.preflight"
# Set to 1 by scripts/run_train.sh for the ranks it starts after validating the job (--job.validate_only).
LAUNCHER_VALIDATED = "TITANLIKE_LAUNCHER_VALIDATED"


def preflight_checks() -> list:
    """The checks installed packages register under the entry-point group `titanlike.preflight`
    (pyproject.toml: the estimation package registers its memory check). A check takes the JobPlan and
    raises ConfigError (one sentence) to refuse the job, or returns None, or a note saying why it was
    skipped. Registered, not imported: the library depends on no package above it."""
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group=PREFLIGHT_GROUP)]


def run_checks(plan, rank: int, checks: list) -> None:
    """Run each pre-flight check on the plan before any process group exists; a skipped check says so."""
    log = logging.getLogger("titanlike")
    if not checks and rank == 0:
        log.info(f"pre-flight checks skipped: no installed package registers one ({PREFLIGHT_GROUP}; "
                 "`pip install -e .` registers the estimator's memory check)")
    for check in checks:
        skipped = check(plan)
        if skipped is not None and rank == 0:
            log.info(f"pre-flight check {check.__module__}.{check.__name__} skipped: {skipped}")


def _shutdown_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def console_main() -> None:
    """The `titanlike-train` console script."""
    sys.exit(main(prog="titanlike-train", process=True))
