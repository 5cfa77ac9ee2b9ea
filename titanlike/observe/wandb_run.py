"""Weights & Biases logging ([metrics] enable_wandb, wandb_mode); wandb is an optional extra
(`pip install titanlike[wandb]`), imported only when enabled.

The run goes to `<job.dump_folder>/wandb/` with the job's whole configuration as the run's config.
Mode `auto` logs online only when wandb can log in (WANDB_MODE set, WANDB_API_KEY, or a login
saved by `wandb login` in ~/.netrc); otherwise offline, so a job never stops at a login prompt
and an offline run can be uploaded later with `wandb sync <dump_folder>/wandb/offline-run-*`.
wandb's own variables still apply: WANDB_PROJECT (default here: titanlike), WANDB_ENTITY,
WANDB_NAME, WANDB_RUN_GROUP, WANDB_DIR.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os

logger = logging.getLogger("titanlike")

WANDB_HOST = "api.wandb.ai"


def resolve_mode(requested: str) -> str:
    """online or offline for metrics.wandb_mode (auto, online, offline)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators(WANDB_HOST):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


def validate_wandb() -> None:
    """Before the job starts: metrics.enable_wandb needs the wandb package (ValueError otherwise)."""
    if importlib.util.find_spec("wandb") is None:
        raise ValueError("metrics.enable_wandb needs the wandb package: pip install 'titanlike[wandb]'")


def start_wandb(*, mode: str, folder: str, config: dict):
    """A wandb run in `folder` (its wandb/ subfolder) with `config` logged; mode as resolve_mode's."""
    import wandb

    mode = resolve_mode(mode)
    os.makedirs(folder, exist_ok=True)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "titanlike"), dir=os.environ.get("WANDB_DIR", folder),
                     config=config, mode=mode)
    logger.info(f"wandb: {mode} run {run.id} in {run.dir}"
                + (f" (upload it with: wandb sync {os.path.dirname(run.dir)})" if mode == "offline" else ""))
    return run


__all__ = ["resolve_mode", "start_wandb", "validate_wandb"]
