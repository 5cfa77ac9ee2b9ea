"""Loading: what a job starts from. The resume verdict (is anything left to train), resuming from
the latest or a chosen checkpoint (verified against its checksums first, an older one on corruption
when asked), a fresh run's initial model from a DCP checkpoint or a Hugging Face folder, and another
model's load into a job's layout (load_frozen_model: a teacher).

What a converter or an objective adds on load comes in as LoadHooks (hooks.py): LoRA's merge, the
entries a fresh run keeps at their initialization (adapters, a reward model's new score head).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from titanlike.checkpoint import format as fmt
from titanlike.checkpoint import hf
from titanlike.checkpoint.format import CheckpointError, Json, published_steps, summarize
from titanlike.models.load_hooks import LoadHook, merges
from titanlike.checkpoint.resume import resume_verdict
from titanlike.checkpoint.states import (
    COMPONENTS,
    DATALOADER,
    MODEL,
    OPTIMIZER,
    RNG,
    ROLLOUTS,
    SAME_SHAPE,
    TRAIN_STATE,
    JobModel,
    ModelState,
    PerRankState,
    load_template,
    unlike,
)

logger = logging.getLogger("titanlike")


# config.json keys that decide neither whether a Hugging Face checkpoint's weights fit this job's
# model nor what they compute: the context length (it only sizes position tables), token ids,
# dtype and bookkeeping. Every other key of the family's adapter's args_to_config must agree.
HF_KEYS_NOT_COMPARED = frozenset({
    "max_position_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "architectures", "initializer_range", "transformers_version", "_name_or_path",
    "name_or_path", "_from_model_config", "tokenizer_class", "output_attentions", "output_hidden_states",
    "return_dict",
})


def _verify_split(path: str, crcs: dict[str, str], group) -> str | None:
    """The files of checkpoint path against their CRC-32s, split among the ranks of `group` (None: this
    process alone) and the verdicts gathered: every rank returns the first problem, or None."""
    names = sorted(crcs)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    try:
        problem = fmt.verify_files(path, crcs, names[rank::world])
    except OSError as e:
        problem = f"checkpoint {path} cannot be read: {e}"
    if group is not None:
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, problem, group=group)
        problem = next((v for v in verdicts if v), None)
    return problem


def load_frozen_model(parts: list[nn.Module], folder: str, spec, args) -> None:
    """Load the model of checkpoint `folder` (checkpoint/hf.py checkpoint_model: its spec and args)
    into `parts`, this rank's shards of it built with the job's layout, as a job's own initial load
    reads: from a DCP checkpoint each rank reads only its shards; from a Hugging Face folder (whose
    conversion needs whole tensors) rank 0 reads and converts, and every rank keeps its shards of the
    broadcast, as a checkpoint a load hook merges is (LoRA's adapters fold into whole weights).
    Names and shapes are checked against the model first (check_fits); CheckpointError otherwise, on
    every rank alike."""
    distributed = dist.is_available() and dist.is_initialized()
    if fmt.is_dcp_folder(folder):
        metadata = fmt.read_dcp_metadata(folder)
        fmt.check_dcp_files(folder, metadata)
        names, _ = fmt.dcp_model_keys(metadata)
        if not merges(names):
            # The files against their checksums, each read by one rank (streamed, none held).
            crcs = fmt.checksummed_files(folder)
            problem = fmt.missing_checksums(folder, metadata) if crcs is None else next(
                (f"checkpoint {folder}: {fmt.SIDECAR} has no checksum for {m}, which {fmt.DCP_METADATA} names"
                 for m in fmt.uncovered_files(metadata, crcs)), None)
            if problem is None and crcs is not None:
                problem = _verify_split(folder, crcs, dist.group.WORLD if distributed else None)
            if problem:
                raise CheckpointError(problem)
            # The index stands for the tensors: names and shapes checked on meta, nothing read.
            index = {fqn: torch.empty(metadata.state_dict_metadata[key].size, device="meta",
                                      dtype=metadata.state_dict_metadata[key].properties.dtype)
                     for fqn, key in names.items()}
            fmt.check_fits(index, spec, args, folder)
            state = ModelState(parts)
            local = state.load_template()
            template = {names[k]: v for k, v in local.items()}
            try:
                fmt.dcp_load(template, folder, no_dist=not distributed)
            except BaseException as e:  # CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(f"reading checkpoint {folder} failed: {summarize(e)}") from None
            loaded = {k: template[names[k]] for k in local}
            # A teacher's or a reference's weights are input from anywhere, as a Hugging Face folder's are.
            fmt.refuse_non_finite(loaded, f"checkpoint {folder}", distributed=distributed)
            state.load_state_dict(loaded)
            return
    full: dict[str, torch.Tensor] = {}
    error = None
    if not distributed or dist.get_rank() == 0:
        try:
            full = hf.checkpoint_state_dict(folder, spec, args)
        except CheckpointError as e:
            error = str(e)
    fmt.raise_rank0_verdict(error, distributed=distributed)
    opts = StateDictOptions(full_state_dict=distributed, broadcast_from_rank0=distributed, strict=False)
    for part in parts:
        set_model_state_dict(part, dict(full), options=opts)


class Loader:
    """CheckpointManager's loading half (manager.py): reads `states` back from `folder`'s checkpoints,
    or a fresh run's model from checkpoint.initial_load_path."""

    def __init__(self, c, folder: str, states: dict[str, Stateful], *, initial_load_path: str | None,
                 job: JobModel | None, hooks: Sequence[LoadHook], rank: int, distributed: bool, pg, pp: bool):
        self.cfg, self.folder, self.states = c, folder, states
        self.initial_load_path, self.job, self.hooks = initial_load_path, job, tuple(hooks)
        self.rank, self.distributed, self._pg = rank, distributed, pg
        self._pp = pp  # model parts hold one pipeline stage's keys
        self._whole_keys: set[str] | None = None

    def path(self, step: int) -> str:
        return fmt.step_folder(self.folder, step)

    def resume_verdict(self, total_steps: int) -> str | None:
        """The sentence to print instead of training when the checkpoint to resume from is already at
        or past training.steps (a finished run relaunched); raises CheckpointError when the latest
        checkpoint is a model-only final export that cannot be extended, naming the flags to pass.
        Rank 0 reads the folder; every rank gets its verdict."""
        c = self.cfg
        if c.create_seed_checkpoint:
            return None
        verdict = None
        if self.rank == 0:
            try:
                verdict = resume_verdict(self.folder, c.load_step, total_steps, other_model=self._other_model)
            except Exception:  # a damaged or crafted checkpoint: load() reports it, on every rank
                verdict = None
        if self.distributed:
            box = [verdict]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            verdict = box[0]
        if verdict is None:
            return None
        kind, message = verdict
        if kind == "error":
            raise CheckpointError(message)
        return message

    @torch.no_grad()
    def load(self) -> int:
        """Loads `checkpoint.load_step` (or the latest checkpoint) if the folder has any, otherwise
        the model from `checkpoint.initial_load_path` if set; returns the step to continue after.
        The checkpoint's files are verified against their checksums first; a corrupt latest
        checkpoint is an error naming the file (or, with `checkpoint.fallback_on_corruption`, the
        newest one that verifies is loaded)."""
        steps = published_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step {self.cfg.load_step}: {self.path(self.cfg.load_step)} does not "
                    f"exist (published steps in {self.folder}: {steps or 'none'})"
                )
            step = self.cfg.load_step
        elif steps:
            step = steps[-1]
        else:
            if not self.initial_load_path:
                if self.rank == 0:
                    logger.info(f"checkpoint: none in {self.folder}; starting from step 0")
                return 0
            if self.cfg.initial_load_model_only:
                self.load_initial(self.initial_load_path)
                return 0
            return self._resume_from_initial(self.initial_load_path)

        path = self.path(step)
        begin = time.monotonic()
        if fmt.is_hf_folder(path) and not fmt.is_dcp_folder(path):
            raise CheckpointError(
                f"the latest checkpoint {path} is a Hugging Face export (checkpoint.last_save_in_hf), "
                "which holds the model only: training cannot resume from it; start a new run with "
                f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_in_hf"
            )
        metadata, problem = self._open_verified(path)
        if problem is not None:
            step, path, metadata = self._after_corruption(step, problem, steps)
        _, full = fmt.dcp_model_keys(metadata)
        if not full:
            if step != 0:
                raise CheckpointError(
                    f"checkpoint {path} holds the model only (checkpoint.last_save_model_only), so training "
                    f"cannot resume from it; use it as --checkpoint.initial_load_path in a new run, or set "
                    f"--checkpoint.load_step to a full checkpoint (published steps: {steps})"
                )
            # A seed checkpoint: the model, then a fresh start.
            self._load_model_dcp(path, metadata, prefixed=False)
            if self.rank == 0:
                logger.info(f"checkpoint: loaded the seed model from {path}")
            return 0
        return self._load_full(path, metadata, begin)

    def _resume_from_initial(self, path: str) -> int:
        """checkpoint.no_initial_load_model_only: continue another run's full checkpoint (model,
        optimizer, schedule, data position, step) in this run's folder."""
        begin = time.monotonic()
        metadata, problem = self._open_verified(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint.initial_load_path: {problem}")
        if not fmt.dcp_model_keys(metadata)[1]:
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} holds the model only, so it cannot be resumed from with "
                "checkpoint.initial_load_model_only off; leave it on to start from its model")
        return self._load_full(path, metadata, begin)

    def _load_full(self, path: str, metadata: Metadata, begin: float) -> int:
        names = [k for k in self.states if k not in self.cfg.exclude_from_loading]
        if MODEL in names:
            self._check_same_model(path, metadata)
        for per_rank in (DATALOADER, RNG, ROLLOUTS):
            state: PerRankState = self.states.get(per_rank)
            if per_rank in names:
                state.source = self._pick_source(state, metadata, path)
        template = {name: load_template(self.states[name]) for name in names}
        loaded = self._load_entries(template, metadata, path, what=f"loading checkpoint {path}")
        for name in names:
            if name in SAME_SHAPE:  # small JSON states: the checkpoint's must look like this job's
                problem = unlike(template[name], loaded[name], name)
                if problem is not None:
                    raise CheckpointError(f"checkpoint {path}: {problem}, unlike what this job saves; was it "
                                          f"edited? --checkpoint.exclude_from_loading {name} skips it")
            try:
                self.states[name].load_state_dict(loaded[name])
            except ValueError as e:  # the loader's sentence (another batch or sequence length, ...)
                raise CheckpointError(f"checkpoint {path}: {e}") from None
            except Exception as e:  # whatever a crafted value makes the component raise
                raise CheckpointError(f"checkpoint {path}: its {name} state cannot be restored ({type(e).__name__}: "
                                      f"{e}); --checkpoint.exclude_from_loading {name} skips it") from None
        step = self.states[TRAIN_STATE].step if TRAIN_STATE in names else 0
        published = fmt.STEP_RE.fullmatch(os.path.basename(path))
        if TRAIN_STATE in names and not (0 <= step < 2**62 and (published is None or int(published.group(1)) == step)):
            raise CheckpointError(f"checkpoint {path} records step {step}, not the step of its folder")
        if self.rank == 0:
            skipped = f" (not loaded: {', '.join(self.cfg.exclude_from_loading)})" if self.cfg.exclude_from_loading else ""
            logger.info(f"checkpoint: resumed from {path} in {time.monotonic() - begin:.2f} s{skipped}")
        return step

    def _load_entries(self, template: dict, metadata: Metadata, path: str, *, what: str) -> dict:
        """Load template (nested, with Json placeholders) from checkpoint path; returns it with
        tensors filled in place and JSON entries decoded. Nothing pickled is read."""
        flat, mappings = flatten_state_dict(template)
        pickled = fmt.pickled_entries(flat, metadata)
        if pickled:
            components = ",".join(c for c in COMPONENTS if any(k.split(".")[0] == c for k in pickled))
            raise CheckpointError(
                f"checkpoint {path} holds pickled state ({components}), as an older titanlike wrote it, and "
                f"titanlike never unpickles checkpoint entries; resume with --checkpoint.exclude_from_loading "
                f"{components} or re-save it")
        json_keys = [k for k, v in flat.items() if isinstance(v, Json)]
        for key in json_keys:
            if key in metadata.state_dict_metadata:  # a missing key is named by the check below
                flat[key] = fmt.json_template(key, metadata, path)
        self._check_against_index(flat, metadata, path)
        try:
            fmt.dcp_load(flat, path, process_group=self._pg, no_dist=not self.distributed)
        except BaseException as e:  # CheckpointException derives from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise CheckpointError(f"{what} failed: {summarize(e)}") from None
        for key in json_keys:
            flat[key] = fmt.decode_json(flat[key], key, path)
        return unflatten_state_dict(flat, mappings)

    # Verifying ----------------------------------------------------------------------------

    def _open_verified(self, path: str) -> tuple[Metadata | None, str | None]:
        """(index, None) if checkpoint path is whole, else (index or None, the first problem):
        a damaged or crafted index, a missing or truncated file, a file whose checksum differs."""
        try:
            metadata = fmt.read_dcp_metadata(path)
            fmt.check_dcp_files(path, metadata)
        except CheckpointError as e:
            return None, str(e)
        return metadata, self._verify(path, metadata)

    def _verify(self, path: str, metadata: Metadata) -> str | None:
        """The checkpoint's files against the CRC-32s in its sidecar: None if all match (or it
        records none), else the first problem. The files are split among the ranks of the
        checkpoint's group and the verdicts gathered, so every rank returns the same answer."""
        try:
            crcs = fmt.checksummed_files(path)
        except CheckpointError as e:
            return str(e)
        if crcs is None:
            if problem := fmt.missing_checksums(path, metadata):
                return problem
            if self.rank == 0:
                logger.info(f"checkpoint: {path} records no checksums (an older titanlike wrote it); "
                            "its files are not verified")
            return None
        if missing := fmt.uncovered_files(metadata, crcs):
            return f"checkpoint {path}: {fmt.SIDECAR} has no checksum for {missing[0]}, which {fmt.DCP_METADATA} names"
        return _verify_split(path, crcs, self._pg if self.distributed else None)

    def _after_corruption(self, step: int, problem: str, steps: list[int]) -> tuple[int, str, Metadata]:
        """A corrupt checkpoint was chosen: an error naming it and the newest older checkpoint that
        verifies, or (checkpoint.fallback_on_corruption, no explicit load_step) that checkpoint."""
        if self.cfg.load_step >= 0:
            raise CheckpointError(problem)
        for older in reversed([s for s in steps if s < step]):
            path = self.path(older)
            if not fmt.is_dcp_folder(path):
                continue
            metadata, trouble = self._open_verified(path)
            if trouble is not None or not (fmt.dcp_model_keys(metadata)[1] or older == 0):
                continue
            if self.cfg.fallback_on_corruption:
                if self.rank == 0:
                    logger.warning(f"checkpoint: {problem}; resuming from {path} instead, the newest checkpoint "
                                   "that verifies (checkpoint.fallback_on_corruption)")
                return older, path, metadata
            raise CheckpointError(
                f"{problem}; the newest checkpoint that verifies is {path}: resume from it with "
                f"--checkpoint.load_step {older} or --checkpoint.fallback_on_corruption")
        raise CheckpointError(f"{problem}; no older checkpoint in {self.folder} verifies")

    def _pick_source(self, state: PerRankState, metadata: Metadata, path: str) -> int:
        head = f"{state.name}.{state.prefix}"
        have = sorted(int(k[len(head):]) for k in metadata.state_dict_metadata
                      if k.startswith(head) and k[len(head):].isdigit())
        if not have:
            raise CheckpointError(f"checkpoint {path} has no {state.name} entries")
        if state.rank in have:
            return state.rank
        if self.rank == 0:
            logger.info(f"checkpoint: {state.name} was saved by {len(have)} rank(s) and is loaded by more; "
                        f"ranks without their own entry take {state.name}.{state.prefix}{have[0]}")
        return have[0]

    def _check_same_model(self, path: str, metadata: Metadata) -> None:
        """The checkpoint holds this job's model: the family and flavor its sidecar records are the
        job's, and it has no model tensor the job's model lacks (they would be dropped silently);
        a missing or misshapen one is _check_against_index's. checkpoint.allow_partial_load skips
        both checks (the extra tensors are named in a log line). Every rank reads the same files and
        decides alike."""
        if self.job is None:
            return
        partial = self.cfg.allow_partial_load
        other = self._other_model(path)
        if other is not None:
            raise CheckpointError(other)
        extra = sorted(set(fmt.dcp_model_keys(metadata)[0]) - self._model_keys())
        if extra and not partial:
            raise CheckpointError(
                f"checkpoint {path} holds {len(extra)} model tensor(s) this job's model does not have (e.g. "
                f"{', '.join(extra[:3])}); was it written for another model? pass --checkpoint.allow_partial_load "
                "to load only the tensors the two models share")
        if extra and self.rank == 0:
            logger.warning(f"checkpoint: {len(extra)} model tensor(s) of {path} that this job's model does not have "
                           f"are not loaded (checkpoint.allow_partial_load), e.g. {', '.join(extra[:3])}")

    def _other_model(self, path: str) -> str | None:
        """The refusal, one sentence, when the sidecar of checkpoint `path` records another family or
        flavor than the job's (None: the same, unrecorded, or checkpoint.allow_partial_load)."""
        recorded = (fmt.read_sidecar(path) or {}).get("model")
        if self.job is None or self.cfg.allow_partial_load or not isinstance(recorded, dict):
            return None
        theirs = (recorded.get("name"), recorded.get("flavor"))
        mine = (self.job.spec.name, self.job.description.get("flavor"))
        if theirs[0] == mine[0] and (theirs[1] is None or theirs[1] == mine[1]):
            return None
        held = " ".join(str(x) for x in theirs if x is not None)
        return (f"checkpoint {path} holds a {held} model but this job's is "
                f"{' '.join(x for x in mine if x is not None)} (model.name, model.flavor): loading it would drop or "
                "misread weights; resume it with its own model, or pass --checkpoint.allow_partial_load to load only "
                "the tensors the two models share")

    def _model_keys(self) -> set[str]:
        """The whole model's state-dict keys (tied aliases left out, as saved): this rank's parts', or
        under pipeline parallelism every stage's (gathered once over the checkpoint's group)."""
        if self._whole_keys is None:
            keys = set(self.states[MODEL].state_dict())
            if self._pp and self.distributed:
                found: list = [None] * dist.get_world_size(self._pg)
                dist.all_gather_object(found, sorted(keys), group=self._pg)
                keys = set().union(*found)
            self._whole_keys = keys
        return self._whole_keys

    def _check_against_index(self, template: dict, metadata: Metadata, path: str) -> None:
        """Every key we load exists in the checkpoint with the same shape.

        Ranks ask for different keys (each pipeline stage its own), so one rank's verdict is shared
        with every rank before any of them enters DCP's collective load, where the others would wait
        for it forever.
        """
        problem = self._index_problem(template, metadata, path)
        if self.distributed:
            verdicts: list = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(verdicts, problem, group=self._pg)
            problem = next((v for v in verdicts if v), None)
        if problem is not None:
            raise CheckpointError(problem)

    @staticmethod
    def _index_problem(template: dict, metadata: Metadata, path: str) -> str | None:
        flat, _ = flatten_state_dict(template)
        saved = metadata.state_dict_metadata
        if (problem := _other_optimizer(flat, saved, path)) is not None:
            return problem
        for key, value in flat.items():
            md = saved.get(key)
            if md is None:
                similar = [k for k in saved if k.split(".")[0] == key.split(".")[0]][:3]
                return (f"checkpoint {path} has no entry {key!r} that this job needs"
                        + (f" (it has e.g. {similar})" if similar else "")
                        + "; was it written for another model or optimizer? "
                        "checkpoint.exclude_from_loading skips whole components")
            if isinstance(value, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    return f"checkpoint {path}: entry {key!r} is not a tensor"
                if tuple(md.size) != tuple(value.shape):
                    return (f"checkpoint {path}: {key!r} has shape {tuple(md.size)} but this job's is "
                            f"{tuple(value.shape)} (another model flavor or vocabulary?)")
        return None

    def _load_model_dcp(self, path: str, metadata: Metadata, *, prefixed: bool, initial: bool = False) -> None:
        """initial: a fresh run's start (checkpoint.initial_load_path), which may be a checkpoint of
        another model that the hooks start from (a pre-training run's for a LoRA job, a language model
        for a reward model): the entries they name that it lacks or holds in another shape keep their
        initialization."""
        self._check_same_model(path, metadata)
        model = self.states[MODEL]
        local = model.load_template()
        prefix = fmt.MODEL_PREFIX if prefixed else ""
        if initial and self.hooks:
            index, saved = metadata.state_dict_metadata, _saved_args(path)
            fresh = sorted(k for k, v in local.items() if any(h.fresh(k, saved) for h in self.hooks) and (
                prefix + k not in index or tuple(getattr(index[prefix + k], "size", ())) != tuple(v.shape)))
            local = {k: v for k, v in local.items() if k not in set(fresh)}
            if fresh and self.rank == 0:
                logger.info(f"checkpoint: {len(fresh)} tensor(s) of the model are not in {path} as the model holds "
                            f"them and keep their initialization, e.g. {', '.join(fresh[:3])}")
        template = {prefix + k: v for k, v in local.items()}
        loaded = self._load_entries(template, metadata, path, what=f"loading the model from {path}")
        loaded = {k[len(prefix):]: v for k, v in loaded.items()}
        if initial:  # a checkpoint this run did not write: its values are checked as a Hugging Face folder's
            fmt.refuse_non_finite(loaded, f"checkpoint.initial_load_path {path}", distributed=self.distributed,
                                  group=self._pg)
        model.load_state_dict(loaded)

    @torch.no_grad()
    def load_initial_model(self, parts: list[nn.Module]) -> bool:
        """Load the model this job started from (checkpoint.initial_load_path) into `parts`, a copy of
        the model built and initialized like it (an objective's frozen reference, rebuilt when a run
        resumes); False when the job has none (its initialization is where it started)."""
        if not self.initial_load_path:
            return False
        kept = self.states[MODEL]
        self.states[MODEL] = ModelState(parts)
        try:
            self.load_initial(self.initial_load_path)
        finally:
            self.states[MODEL] = kept
        return True

    def load_initial(self, path: str) -> None:
        begin = time.monotonic()
        if self.cfg.initial_load_in_hf:
            self._load_model_hf(path)
        else:
            metadata, problem = self._open_verified(path)
            if problem is not None:
                raise CheckpointError(problem)
            _, full = fmt.dcp_model_keys(metadata)
            self._load_model_dcp(path, metadata, prefixed=full, initial=True)
        if self.rank == 0:
            logger.info(f"checkpoint: model initialized from {path} in {time.monotonic() - begin:.2f} s")

    def _load_model_hf(self, path: str) -> None:
        """Rank 0 reads the safetensors; the full tensors are broadcast into every rank's shards.

        The q/k row permutation (RoPE layout) needs whole heads, so the conversion runs on
        full tensors, on one rank: the others need no host memory for the full model.
        """
        spec, job_args = self.job.spec, self.job.args
        state_dict: dict[str, torch.Tensor] = {}
        error = None
        if self.rank == 0:
            try:
                _, saved = hf.hf_folder_args(path, spec)  # every value config.json gives checked first
                # The hooks may read the folder's model as another (a reward model's language model, with
                # a score head): the tensors they name then start from their initialization.
                args = saved
                for hook in self.hooks:
                    args = hook.saved_args(job_args, args)
                if not self.job.grown:
                    check_hf_args(spec, job_args, args, path)
                hf_sd, _ = hf.read_hf(path)
                if args.has_score_head:  # a reward model's folder (...ForSequenceClassification)
                    hf_sd = spec.hf.unscore_model(hf_sd)
                try:
                    state_dict = spec.hf.from_hf_state_dict(hf_sd, args)
                except Exception as e:
                    raise CheckpointError(f"Hugging Face checkpoint {path} does not match its {fmt.HF_CONFIG} "
                                          f"({type(e).__name__}: {e})") from None
                if self.hooks:  # what the hooks start fresh and the folder holds in another shape is not loaded
                    with torch.device("meta"):
                        shapes = {k: tuple(v.shape) for k, v in spec.model_cls(job_args).state_dict().items()}
                    fresh = sorted(k for k, v in state_dict.items()
                                   if any(h.fresh(k, saved) for h in self.hooks) and tuple(v.shape) != shapes.get(k))
                else:
                    fresh = []
                for key in fresh:
                    del state_dict[key]
                if fresh:
                    logger.info(f"checkpoint: {', '.join(fresh)} of {path} start from their initialization")
                # Names, shapes, floating point, finite: against the job's model. A model [model.args]
                # changed loads the tensors it shares with the folder; the others keep their init.
                missing, dropped = fmt.check_fits(state_dict, spec, job_args, f"Hugging Face checkpoint {path}",
                                                  partial=self.job.grown or args is not saved)
                for key in dropped:
                    del state_dict[key]
                if missing and self.job.grown:
                    logger.info(f"checkpoint: {len(missing)} tensor(s) of the model are not in {path} and start from "
                                f"their initialization (model.args), e.g. {', '.join(missing[:3])}")
                if dropped:
                    logger.info(f"checkpoint: {len(dropped)} tensor(s) of {path} are not in the model (model.args) and "
                                f"are not loaded, e.g. {', '.join(dropped[:3])}")
            except Exception as e:  # any verdict of rank 0 must reach the other ranks, never strand them
                error = str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
        fmt.raise_rank0_verdict(error, distributed=self.distributed, group=self._pg)
        # Every rank of the job joins the broadcast of every tensor; each keeps its own shard.
        opts = StateDictOptions(full_state_dict=self.distributed, broadcast_from_rank0=self.distributed, strict=False)
        for part in self.states[MODEL].parts:
            set_model_state_dict(part, dict(state_dict), options=opts)


def _other_optimizer(flat: dict, saved: dict, path: str) -> str | None:
    """A checkpoint of another optimizer (AdamW's moments where this job keeps Muon's momentum, or
    the reverse: optimizer.name or the parameters Muon steps changed), in one sentence."""
    prefix = f"{OPTIMIZER}.state."
    for key in flat:
        if not key.startswith(prefix) or key in saved:
            continue
        fqn = key[len(prefix):].rsplit(".", 1)[0]  # state names hold no dots
        theirs = sorted(k.rsplit(".", 1)[1] for k in saved if k.startswith(f"{prefix}{fqn}."))
        if theirs:
            ours = sorted(k.rsplit(".", 1)[1] for k in flat if k.startswith(f"{prefix}{fqn}."))
            return (f"checkpoint {path} holds another optimizer's state for {fqn} ({', '.join(theirs)}, where this "
                    f"job's optimizer keeps {', '.join(ours)}); resume with --checkpoint.exclude_from_loading "
                    "optimizer to start the optimizer's state afresh")
    return None


def check_hf_args(spec, job_args, args, path: str) -> None:
    """The Hugging Face checkpoint's model (`args`) is this job's (`job_args`): same config.json, key
    by key. Both sides go through the family's adapter (args_to_config), so the comparison is between
    normalized configs and needs no family's field names; HF_KEYS_NOT_COMPARED lists what may differ."""
    # The job's args carry training.seq_len as their context; the folder's is its own.
    mine = spec.hf.args_to_config(job_args.with_context_len(args.context_len))
    theirs = spec.hf.args_to_config(args)
    for key in [*mine, *(k for k in theirs if k not in mine)]:
        if key in HF_KEYS_NOT_COMPARED or mine.get(key) == theirs.get(key):
            continue
        raise CheckpointError(
            f"Hugging Face checkpoint {path} has {key}={_show(theirs.get(key))} but this job's model has "
            f"{_show(mine.get(key))} (model.flavor / tokenizer)"
        )


def _saved_args(path: str):
    """The args of the model DCP checkpoint `path` holds, by its sidecar; None when it records none
    readable (the index checks that follow name the problem)."""
    recorded = (fmt.read_sidecar(path) or {}).get("model")
    try:
        return fmt.build_args(recorded, where=os.path.join(path, fmt.SIDECAR))[1]
    except Exception:
        return None


def _show(value: Any) -> str:
    """A config.json value as it reads in the file (JSON), for one-line messages."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)
