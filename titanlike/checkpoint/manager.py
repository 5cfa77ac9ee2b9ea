"""CheckpointManager: save and resume a training job with torch.distributed.checkpoint (DCP).

One checkpoint is one DCP folder ``<dump_folder>/<checkpoint.folder>/step-N`` holding the job's
states (states.py: model, optimizer, LR schedule, data loader position, RNG, step, loss scaler),
plus ``titanlike.json`` (model family and args, for load_model and the converters, and the
CRC-32 of every file, verified before a load). Every entry is a tensor: JSON entries are
UTF-8 bytes in a uint8 tensor (format.Json), so loading a checkpoint unpickles nothing but
DCP's index, and that with an allow-list (format.SafeFileSystemReader).

The manager is a thin facade over two halves with one job each: saving.py (async saves, atomic
publishing, keep-k purging) and loading.py (resume verdicts, resuming, initial loads from DCP and
Hugging Face folders). What a converter or an objective adds on load or export comes in as
LoadHooks (hooks.py); this package imports none of them.

A layout change between save and load works at any step boundary: DCP reshards model and
optimizer, and a new data-parallel rank takes the loader position of the old rank with its
index if there was one (else rank 0's): every rank is at the same global step.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from titanlike.checkpoint import format as fmt
from titanlike.checkpoint.format import CheckpointError
from titanlike.checkpoint.hf import read_hf_config
from titanlike.models.load_hooks import LoadHook
from titanlike.checkpoint.loading import HF_KEYS_NOT_COMPARED, Loader
from titanlike.checkpoint.saving import Saver
from titanlike.config.compat import hub_id_hint
from titanlike.checkpoint.states import (
    CHECKPOINT_COMPONENTS,
    COMPONENTS,
    DATALOADER,
    LOSS_SCALER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    RNG,
    ROLLOUTS,
    TRAIN_STATE,
    JobModel,
    JsonState,
    ScheduleState,
    ModelState,
    OptimizerState,
    PerRankState,
    TrainState,
    rng_state,
    set_rng_state,
)
from titanlike.data.hf_tokenizer import tokenizer_record

def initial_load_path(c, hf_assets_path: str | None) -> str | None:
    """The checkpoint a run without its own starts from: checkpoint.initial_load_path, or for a
    Hugging Face load without one, the model's Hugging Face assets folder (as torchtitan does)."""
    if c.initial_load_path:
        return c.initial_load_path
    return hf_assets_path if c.initial_load_in_hf and hf_assets_path else None


def validate_checkpoint_config(c, spec, *, hf_assets_path: str | None = None) -> None:
    """The [checkpoint] section's rules, before any process group exists: ValueError, one sentence.

    c: the checkpoint section of the job config; spec: the job's ModelSpec; hf_assets_path:
    model.hf_assets_path (where initial_load_in_hf loads from without an initial_load_path).
    """

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    for name, on in (("initial_load_path", bool(c.initial_load_path)),
                     ("create_seed_checkpoint", c.create_seed_checkpoint),
                     ("last_save_in_hf", c.last_save_in_hf),
                     ("load_only", c.load_only),
                     ("enable_first_step_checkpoint", c.enable_first_step_checkpoint)):
        check(c.enable or not on, f"checkpoint.{name} needs checkpoint.enable")
    check(not (c.load_only and (c.create_seed_checkpoint or c.enable_first_step_checkpoint)),
          "checkpoint.load_only saves nothing, so it excludes create_seed_checkpoint and enable_first_step_checkpoint")
    check(bool(c.folder), "checkpoint.folder must not be empty")
    check(c.interval >= 1, f"checkpoint.interval must be at least 1, got {c.interval}")
    check(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {c.keep_latest_k}")
    check(c.load_step >= -1, f"checkpoint.load_step must be -1 (the latest) or a step >= 0, got {c.load_step}")
    unknown = [n for n in c.exclude_from_loading if n not in CHECKPOINT_COMPONENTS]
    check(not unknown, f"checkpoint.exclude_from_loading may only name {', '.join(CHECKPOINT_COMPONENTS)}; "
                       f"got {', '.join(unknown)}")
    path = initial_load_path(c, hf_assets_path)
    check(not c.initial_load_in_hf or bool(path),
          "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the Hugging Face folder) or "
          "model.hf_assets_path")
    check(c.enable or not path, "checkpoint.initial_load_in_hf needs checkpoint.enable")
    check(c.initial_load_model_only or not c.initial_load_in_hf,
          "checkpoint.initial_load_in_hf loads a model only, so it needs checkpoint.initial_load_model_only")
    if path:
        check(os.path.isdir(path), f"checkpoint.initial_load_path {path} does not exist or is not a folder"
                                   + hub_id_hint(path, "checkpoint.initial_load_path"))
        if c.initial_load_in_hf:
            check(os.path.isfile(os.path.join(path, fmt.HF_CONFIG)),
                  f"checkpoint.initial_load_path {path} has no {fmt.HF_CONFIG}, so it is not a Hugging Face "
                  "model folder")
            _check_hf_config_values(path, spec)
        else:
            check(os.path.isfile(os.path.join(path, fmt.DCP_METADATA)),
                  f"checkpoint.initial_load_path {path} has no {fmt.DCP_METADATA}, so it is not a DCP checkpoint "
                  "(add --checkpoint.initial_load_in_hf for a Hugging Face folder)")
    if c.initial_load_in_hf or c.last_save_in_hf:
        check(spec.hf is not None, f"model {spec.name} has no Hugging Face adapter, so "
                                   "checkpoint.initial_load_in_hf and last_save_in_hf are unavailable")
    check(not c.last_save_in_hf or c.last_save_model_only,
          "checkpoint.last_save_in_hf writes the model only, so it needs checkpoint.last_save_model_only")


def _check_hf_config_values(path: str, spec) -> None:
    """Before any process group: the values of the Hugging Face folder's config.json that the
    family's adapter reads are in range (HFAdapter.read_config); ValueError, one sentence naming
    the file, key and value. Whether its model is the job's is the load's to say (_check_hf_args)."""
    if spec.hf is None:
        return
    try:
        config = read_hf_config(path)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    if config.get("model_type") in spec.hf.model_types:
        try:
            spec.hf.read_config(config)
        except ValueError as e:
            raise ValueError(f"{os.path.join(path, fmt.HF_CONFIG)}: {e}") from None


# Stateful pieces --------------------------------------------------------------------------


class _Unset:
    pass


_UNSET = _Unset()


class CheckpointManager:
    """Saves every `checkpoint.interval` steps and at the end; loads on start.

    Use: construct after the optimizer and dataloader, `step = load()` before iterating the
    loader, `save(step)` after every step, `close()` at the end. Does nothing when
    `checkpoint.enable` is false.
    """

    def __init__(self, cfg, *, dims, model_parts: list[nn.Module], optimizer, lr_scheduler,
                 dataloader, model_args=None, tokenizer=None, loss_scaler=None, hooks: Sequence[LoadHook] = (),
                 context_len: int | None = None, flavor: str | None | _Unset = _UNSET, chat_template=None,
                 rollouts: Stateful | None = None):
        """hooks: what the job's converters and objective add when a checkpoint loads or is exported
        (hooks.py); context_len: the model's own context (the plan's), recorded instead of the job's
        seq_len; flavor: the flavor the model is (None: sized by a Hugging Face folder or
        [model.args]). Both default to model.flavor's. chat_template: the data/chat_template.py ChatTemplate
        the objective rendered conversations with, recorded with the tokenizer for the exports. rollouts: a
        job that generates (RL): its generated batches not yet trained, saved per data-parallel rank."""
        c = self.cfg = cfg.checkpoint
        self.enabled = c.enable
        self.folder = os.path.join(cfg.job.dump_folder, c.folder)
        self.total_steps = cfg.training.steps
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.step = 0
        self._pg = None
        self._saver: Saver | None = None
        if not self.enabled:
            return

        self.train_state = TrainState()
        dp_rank = dims.dp_rank() if dims is not None else 0
        self.states: dict[str, Stateful] = {
            MODEL: ModelState(model_parts),
            OPTIMIZER: OptimizerState(model_parts, optimizer),
            LR_SCHEDULER: ScheduleState(lr_scheduler, LR_SCHEDULER),
            DATALOADER: PerRankState(DATALOADER, "dp_rank_", dp_rank,
                                     dataloader.state_dict, dataloader.load_state_dict),
            RNG: PerRankState(RNG, "rank_", self.rank, rng_state, set_rng_state),
            TRAIN_STATE: self.train_state,
        }
        if loss_scaler is not None:
            self.states[LOSS_SCALER] = JsonState(loss_scaler, LOSS_SCALER)
        if rollouts is not None:
            self.states[ROLLOUTS] = PerRankState(ROLLOUTS, "dp_rank_", dp_rank, rollouts.state_dict,
                                                 rollouts.load_state_dict)
        job = None
        if model_args is not None:
            from titanlike.models.registry import get_model_spec

            spec = get_model_spec(cfg.model.name)
            # The job's args carry training.seq_len as their context; a checkpoint records the
            # model's real one (it sizes position tables only, never the weights).
            if isinstance(flavor, _Unset):
                flavor = cfg.model.flavor
            if context_len is None:
                own = spec.flavors.get(flavor) if flavor is not None else None
                context_len = own.context_len if own is not None else model_args.context_len
            job = JobModel(spec, model_args, fmt.model_description(spec.name, model_args, context_len=context_len,
                                                                   flavor=flavor),
                           context_len, grown=bool(cfg.model.args))
        if self.distributed:
            # DCP's own collectives (plans, the final all-reduce) run on a separate gloo group:
            # in a background thread they must not interleave with training collectives, and on
            # GPUs they then cost no GPU memory.
            self._pg = dist.new_group(backend="gloo")
        where = dict(rank=self.rank, distributed=self.distributed, pg=self._pg)
        start = initial_load_path(c, cfg.model.hf_assets_path)
        self._saver = Saver(c, self.folder, self.states, total_steps=self.total_steps, job=job,
                            tokenizer=tokenizer_record(tokenizer, chat_template) if tokenizer is not None else {},
                            hooks=hooks, optimizer=optimizer, base_model=start if c.initial_load_in_hf else None,
                            **where)
        self._loader = Loader(c, self.folder, self.states, initial_load_path=start,
                              job=job, hooks=hooks, pp=dims is not None and dims.pp_enabled, **where)
        # Before the trainer builds its metrics writers (a full disk would stop them first).
        self._saver.remove_leftovers()

    @property
    def saves(self) -> bool:
        """Whether this job writes checkpoints (enabled, and not checkpoint.load_only)."""
        return self.enabled and not self.cfg.load_only

    def path(self, step: int) -> str:
        return fmt.step_folder(self.folder, step)

    @property
    def process_group(self):
        """The gloo group DCP's own collectives run on (None when not distributed). Its timeout
        must outlast a slow rank's checkpoint write, so the short training timeout skips it."""
        return self._pg

    @property
    def blocked_s(self) -> float:
        """Time the training loop spent inside save() and staging waits."""
        return self._saver.blocked_s if self._saver is not None else 0.0

    @property
    def save_seconds(self) -> list[tuple[int, float]]:
        """(step, start of save -> published) of every save, on rank 0."""
        return self._saver.save_seconds if self._saver is not None else []

    # Loading ------------------------------------------------------------------------------

    def resume_verdict(self) -> str | None:
        """The sentence to print instead of training when the checkpoint to resume from is already at
        or past training.steps (a finished run relaunched); raises CheckpointError when the latest
        checkpoint is a model-only final export that cannot be extended (loading.py)."""
        return self._loader.resume_verdict(self.total_steps) if self.enabled else None

    @torch.no_grad()
    def load(self) -> int | None:
        """Restore the job; returns the step to continue after (0 for a fresh start).

        Loads `checkpoint.load_step` (or the latest checkpoint) if the folder has any,
        otherwise the model from `checkpoint.initial_load_path` if set (loading.py). With
        `checkpoint.create_seed_checkpoint` writes the initialized model as step 0 instead
        and returns None: there is nothing to train.
        """
        if not self.enabled:
            return 0
        self._saver.remove_leftovers()
        if self.cfg.create_seed_checkpoint:
            self._saver.save_seed()
            return None
        self.step = self._loader.load()
        return self.step

    def load_initial_model(self, parts: list[nn.Module]) -> bool:
        """Load the model this job started from (checkpoint.initial_load_path) into `parts`, a copy of
        the model built and initialized like it (an objective's frozen reference, rebuilt when a run
        resumes); False when the job has none (its initialization is where it started)."""
        return self.enabled and self._loader.load_initial_model(parts)

    # Saving -------------------------------------------------------------------------------

    def saves_at(self, step: int) -> bool:
        """Whether save(step) writes a checkpoint (the interval, the last step, the first step with
        checkpoint.enable_first_step_checkpoint); the loop reads the step's results before those."""
        return self.enabled and self._saver.saves_at(step)

    def save(self, step: int, *, force: bool = False) -> None:
        """Call after every training step; saves at the interval, at the last step and, with
        checkpoint.enable_first_step_checkpoint, after step 1. force saves a full, synchronous
        (resumable) checkpoint now, e.g. before a job is preempted. Nothing with checkpoint.load_only."""
        if self.enabled:
            self._saver.save(step, force=force)

    def wait_for_staging(self) -> None:
        if self.enabled:
            self._saver.wait_for_staging()

    def remove_leftovers(self) -> None:
        """Delete step-N.tmp and step-N.purge folders a killed job left (saving.py); once per manager."""
        if self.enabled:
            self._saver.remove_leftovers()

    def close(self) -> None:
        """Finish the save in flight, then stop the purge thread and the checkpoint process."""
        if self.enabled:
            self._saver.close()


__all__ = ["CHECKPOINT_COMPONENTS", "COMPONENTS", "HF_KEYS_NOT_COMPARED", "CheckpointError", "CheckpointManager",
           "initial_load_path", "validate_checkpoint_config"]
