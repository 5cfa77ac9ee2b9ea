"""CheckpointManager: save and resume a training job with torch.distributed.checkpoint (DCP).

One checkpoint is one DCP folder ``<dump_folder>/<checkpoint.folder>/step-N`` holding

  model.<fqn>            parameters, by full name (DTensor shards: any layout loads any other)
  optimizer.state.<fqn>.*   optimizer state tensors, by parameter (flattened: layout-free too)
  optimizer.param_groups.<fqn>   that parameter's hyper-parameters, JSON
  lr_scheduler.state     the schedule's state_dict, JSON
  dataloader.dp_rank_R   each data-parallel rank's loader position, JSON
  rng.rank_R             each rank's RNG states (torch, CUDA, Python, NumPy), JSON
  train_state.step       the step the checkpoint was taken after (int64), and format_version
  loss_scaler.state      float16 loss scaling's scale and counters, JSON (jobs that scale the loss)

plus ``titanlike.json`` (model family and args, for load_model and the converters, and the
CRC-32 of every file, verified before a load). Every entry is a tensor: JSON entries are
UTF-8 bytes in a uint8 tensor (format.Json), so loading a checkpoint unpickles nothing but
DCP's index, and that with an allow-list (format.SafeFileSystemReader).

Publishing is atomic: everything is written to ``step-N.tmp`` and renamed to ``step-N`` by
rank 0 only once DCP reports the save complete on every rank (DCP's final all-reduce, i.e. a
barrier, or the async future). Readers only ever consider ``step-N`` folders, so a crash
mid-save leaves the previous checkpoint as the latest. ``keep_latest_k`` counts published
checkpoints only, so the one being written never counts against it. A save that fails (a full
disk, ...) removes its ``step-N.tmp``; a step whose parameters are not all finite is not saved.
Leftover ``.tmp``/``.purge`` folders of a killed job are removed when the manager is built,
before anything else of the job writes.

A layout change between save and load works at any step boundary: DCP reshards model and
optimizer, and a new data-parallel rank takes the loader position of the old rank with its
index if there was one (else rank 0's): every rank is at the same global step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlike.checkpoint import format as fmt
from titanlike.checkpoint.format import (
    PURGE_SUFFIX,
    STEP_RE,
    TMP_SUFFIX,
    CheckpointError,
    Json,
    published_steps,
    summarize,
    tied_aliases,
)
from titanlike.data.hf_tokenizer import tokenizer_record

logger = logging.getLogger("titanlike")

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, LOSS_SCALER = (
    "model", "optimizer", "lr_scheduler", "dataloader", "rng", "train_state", "loss_scaler")
# LOSS_SCALER is saved and loaded only by jobs that scale the loss (float16).
COMPONENTS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, LOSS_SCALER)
# What checkpoint.exclude_from_loading may name.
CHECKPOINT_COMPONENTS = COMPONENTS
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# config.json keys that decide neither whether a Hugging Face checkpoint's weights fit this job's
# model nor what they compute: the context length (it only sizes position tables), token ids,
# dtype and bookkeeping. Every other key of the family's adapter's args_to_config must agree.
HF_KEYS_NOT_COMPARED = frozenset({
    "max_position_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "architectures", "initializer_range", "transformers_version", "_name_or_path",
    "name_or_path", "_from_model_config", "tokenizer_class", "output_attentions", "output_hidden_states",
    "return_dict",
})


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
        check(os.path.isdir(path), f"checkpoint.initial_load_path {path} does not exist or is not a folder")
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
        config = fmt.read_hf_config(path)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    if config.get("model_type") in spec.hf.model_types:
        try:
            spec.hf.read_config(config)
        except ValueError as e:
            raise ValueError(f"{os.path.join(path, fmt.HF_CONFIG)}: {e}") from None


# Stateful pieces --------------------------------------------------------------------------


class ModelState(Stateful):
    """All model parts (pipeline stages on this rank) as one flat FQN -> tensor dict.

    A tied parameter is stored once, under its owner's name: DCP deduplicates by key, not by
    storage, and the output projection of a tied 1B model would add 1 GB of fp32 otherwise.
    Loading fills the alias through the shared Parameter, or, on a pipeline stage that holds the
    alias alone (its own synchronised copy), from the owner's entry (fmt.stage_aliases).
    """

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        self.aliases = set().union(*(tied_aliases(part) for part in parts))
        held = [set(get_model_state_dict(part)) for part in parts]
        self.stage_aliases = fmt.stage_aliases(parts, held)
        self.held = set().union(*held)

    def state_dict(self) -> dict[str, Any]:
        """What a save writes: every weight once, under its owner's name."""
        dropped = self.aliases.union(*self.stage_aliases)
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items() if k not in dropped}

    def load_template(self) -> dict[str, Any]:
        """What a load reads: state_dict(), plus a lone alias's tensor under its owner's key (filled
        in place) where no part of this rank holds the owner."""
        template = self.state_dict()
        for part, aliases in zip(self.parts, self.stage_aliases):
            local = get_model_state_dict(part) if aliases else {}
            template.update({owner: local[alias] for alias, owner in aliases.items() if owner not in self.held})
        return template

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, aliases in zip(self.parts, self.stage_aliases):
            own = {**state_dict, **{alias: state_dict[owner] for alias, owner in aliases.items()}}
            # strict=False: the dict holds the other parts' keys too; this part's own missing
            # keys were already ruled out against the checkpoint index before loading.
            set_model_state_dict(part, own, options=StateDictOptions(strict=False))


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


def load_frozen_model(parts: list[nn.Module], folder: str, spec, args, read_whole) -> None:
    """Load the model of checkpoint `folder` (checkpoint/hf.py checkpoint_model: its spec and args)
    into `parts`, this rank's shards of it built with the job's layout, as a job's own initial load
    reads: from a DCP checkpoint each rank reads only its shards; from a Hugging Face folder (whose
    conversion needs whole tensors) rank 0 reads and converts, and every rank keeps its shards of the
    broadcast. A LoRA checkpoint is read whole on every rank (its adapters fold into whole weights).
    Names and shapes are checked against the model first (check_fits); CheckpointError otherwise, on
    every rank alike. read_whole(folder, spec, args): the full tensors in our names, for the Hugging
    Face and LoRA cases (checkpoint/hf.py checkpoint_state_dict; passed in, as this module imports
    format.py only)."""
    from titanlike.models.lora import has_adapters

    distributed = dist.is_available() and dist.is_initialized()
    if fmt.is_dcp_folder(folder):
        metadata = fmt.read_dcp_metadata(folder)
        fmt.check_dcp_files(folder, metadata)
        names, _ = fmt.dcp_model_keys(metadata)
        if not has_adapters(names):
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
            state.load_state_dict({k: template[names[k]] for k in local})
            return
    full: dict[str, torch.Tensor] = {}
    error = None
    if not distributed or dist.get_rank() == 0:
        try:
            full = read_whole(folder, spec, args)
        except CheckpointError as e:
            error = str(e)
    if distributed:  # rank 0's verdict first, so no rank waits in a broadcast that never comes
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)
        error = verdict[0]
    if error:
        raise CheckpointError(error)
    opts = StateDictOptions(full_state_dict=distributed, broadcast_from_rank0=distributed, strict=False)
    for part in parts:
        set_model_state_dict(part, dict(full), options=opts)


class OptimizerState(Stateful):
    """The optimizer's state keyed by parameter FQN (flattened), so any layout loads it.

    One optimizer spanning several model parts is handled by viewing the parts as one
    ModuleList and removing its "<i>." prefix from the keys, so keys do not depend on which
    stage holds a parameter.
    """

    _OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
    _KEY = re.compile(r"(state|param_groups)\.(\d+)\.(.*)")

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self.multi = len(parts) > 1
        self._owner: dict[str, int] = {}
        held = [set(get_model_state_dict(part)) for part in parts]
        for i, keys in enumerate(held):
            self._owner.update(dict.fromkeys(keys, i))
        # A lone alias's state (a pipeline stage's copy of a tied weight) is stored under its
        # owner's name, as ModelState stores the weight: {alias: owner}.
        self.lone: dict[str, str] = {}
        for aliases in fmt.stage_aliases(parts, held):
            self.lone.update(aliases)

    @staticmethod
    def _fqn(key: str) -> str:
        """The parameter of a flat key "state.<fqn>.<name>" or "param_groups.<fqn>.<name>"."""
        return key.partition(".")[2].rsplit(".", 1)[0]

    def state_dict(self) -> dict[str, Any]:
        """What a save writes: a lone alias's state is left to its owner's stage."""
        return self._grouped({k: v for k, v in self._entries().items() if self._fqn(k) not in self.lone})

    def load_template(self) -> dict[str, Any]:
        """What a load reads: a lone alias's state under its owner's keys (filled in place), unless
        this rank holds the owner too (then load_state_dict copies the owner's)."""
        out = {}
        for k, v in self._entries().items():
            fqn = self._fqn(k)
            owner = self.lone.get(fqn)
            if owner is None:
                out[k] = v
            elif owner not in self._owner:
                kind, _, rest = k.partition(".")
                out[f"{kind}.{owner}{rest[len(fqn):]}"] = v
        return self._grouped(out)

    def _entries(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.module, self.optimizer, options=self._OPTS)
        if self.multi:
            out = {}
            for k, v in sd.items():
                m = self._KEY.fullmatch(k)
                out[f"{m.group(1)}.{m.group(3)}" if m else k] = v
            sd = out
        return sd

    @staticmethod
    def _grouped(sd: dict[str, Any]) -> dict[str, Any]:
        # Non-tensor values (a parameter's lr, betas, ...) become one JSON entry per parameter:
        # "param_groups.<fqn>.lr" -> {"lr": ...} under "param_groups.<fqn>" (names hold no dots).
        grouped: dict[str, Any] = {}
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                grouped[k] = v
            else:
                owner, name = k.rsplit(".", 1)
                grouped.setdefault(owner, Json({})).value[name] = v
        return grouped

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expanded = {}
        for k, v in state_dict.items():
            if isinstance(v, dict):  # a decoded JSON entry: the parameter's values by name
                expanded.update({f"{k}.{name}": value for name, value in v.items()})
            else:
                expanded[k] = v
        state_dict = expanded
        for k, v in list(state_dict.items()):
            fqn = self._fqn(k)
            for alias in (a for a, owner in self.lone.items() if owner == fqn):
                kind, _, rest = k.partition(".")
                # Its own copy: two parameters must never step one state tensor.
                state_dict[f"{kind}.{alias}{rest[len(fqn):]}"] = v.clone() if isinstance(v, torch.Tensor) else v
                if fqn not in self._owner:
                    del state_dict[k]
        if self.multi:
            renamed = {}
            for k, v in state_dict.items():
                kind, _, rest = k.partition(".")
                fqn = rest.rsplit(".", 1)[0]  # state / hyper-parameter names hold no dots
                renamed[f"{kind}.{self._owner[fqn]}.{rest}" if fqn in self._owner else k] = v
            state_dict = renamed
        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=self._OPTS)


def _load_template(state: Stateful) -> dict[str, Any]:
    """The entries a load of this component reads (a tied weight's lone alias reads its owner's)."""
    return state.load_template() if isinstance(state, (ModelState, OptimizerState)) else state.state_dict()


class JsonState(Stateful):
    """A small non-tensor state (the LR schedule) saved as one JSON entry."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def state_dict(self) -> dict[str, Any]:
        return {"state": Json(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict["state"])


class PerRankState(Stateful):
    """A state that differs per rank (loader position, RNG): one JSON entry per rank.

    Saving writes only this rank's entry. Loading reads the entry `source` (picked by the
    manager from the checkpoint's index before the load: this rank's own if it exists).
    """

    def __init__(self, name: str, prefix: str, rank: int, get, put):
        self.name, self.prefix, self.rank = name, prefix, rank
        self.get, self.put = get, put
        self.source = rank

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def state_dict(self) -> dict[str, Any]:
        # On load this is the template, so it names the entry to read.
        return {self.key(self.source): Json(self.get())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.put(state_dict[self.key(self.source)])
        self.source = self.rank


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64),
                "format_version": torch.tensor(fmt.FORMAT_VERSION, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # As plain lists (JSON).
        "python": [*internal, version, gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


# The JSON states whose loaded value must have the structure of this job's own (same keys, list
# lengths, value types; tensors of the same dtype and shape), so that a crafted entry cannot hand a
# component an absurd value. Lists that may legitimately differ in length: the CUDA generators of
# another machine, a ramp-up; a dataset's own position state may have other keys.
_SAME_SHAPE = (LR_SCHEDULER, LOSS_SCALER, DATALOADER, RNG)
_FREE_LENGTH = {"cuda", "rampup"}
_FREE_KEYS = {"samples"}


def _unlike(mine: Any, theirs: Any, where: str) -> str | None:
    """Where and how `theirs` (a decoded checkpoint entry) differs in structure from `mine` (this
    job's own state, JSON entries as Json), or None."""
    if isinstance(mine, Json):
        mine = mine.value
    shown = repr(theirs)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if isinstance(mine, dict):
        if not isinstance(theirs, dict):
            return f"{where} is {shown}, not an object"
        last = where.rpartition(".")[2]
        if last not in _FREE_KEYS and set(mine) != set(theirs):
            odd = sorted(map(str, set(mine) ^ set(theirs)))
            return f"{where} has other keys ({', '.join(odd[:3])})"
        for key in mine:
            if key in theirs and (problem := _unlike(mine[key], theirs[key], f"{where}.{key}")) is not None:
                return problem
        return None
    if isinstance(mine, (list, tuple)):
        if not isinstance(theirs, (list, tuple)):
            return f"{where} is {shown}, not a list"
        free = where.rpartition(".")[2] in _FREE_LENGTH
        if (free and len(theirs) > 1024) or (not free and len(theirs) != len(mine)):
            return f"{where} holds {len(theirs)} values, not {len(mine)}"
        for i, value in enumerate(theirs):
            like = mine[min(i, len(mine) - 1)] if mine else None
            if like is None and free:
                if not (isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() < 2**20)):
                    return f"{where}[{i}] is {type(value).__name__}"
                continue
            if (problem := _unlike(like, value, f"{where}[{i}]")) is not None:
                return problem
        return None
    if isinstance(mine, torch.Tensor):
        if not (isinstance(theirs, torch.Tensor) and theirs.dtype == mine.dtype and theirs.shape == mine.shape):
            return f"{where} is {shown}, not a {mine.dtype} tensor of shape {tuple(mine.shape)}"
        return None
    if isinstance(mine, np.ndarray):
        if not (isinstance(theirs, np.ndarray) and theirs.dtype == mine.dtype and theirs.shape == mine.shape):
            return f"{where} is {shown}, not a {mine.dtype} array of shape {mine.shape}"
        return None
    if isinstance(mine, bool):
        return None if isinstance(theirs, bool) else f"{where} is {shown}, not true or false"
    if mine is None:  # unset here (Python's cached gaussian, ...): a plain value at most
        ok = theirs is None or (isinstance(theirs, (int, float, str)) and len(repr(theirs)) <= 100)
        return None if ok else f"{where} is {shown}, not a plain value"
    if isinstance(mine, int):
        ok = isinstance(theirs, int) and not isinstance(theirs, bool) and abs(theirs) < 2**64
        return None if ok else f"{where} is {shown}, not an integer"
    if isinstance(mine, float):
        ok = isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and (
            math.isfinite(theirs) or not math.isfinite(mine))
        return None if ok else f"{where} is {shown}, not a finite number"
    if isinstance(mine, str):
        return None if isinstance(theirs, str) and len(theirs) <= 10_000 else f"{where} is {shown}, not a string"
    return None


# The manager ------------------------------------------------------------------------------


@dataclass
class _Pending:
    """An async save in flight, published once its future completes."""
    step: int
    future: Future
    started: float
    finished: float | None = None  # set by the future's callback: publishing waits for the next poll


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
                 dataloader, model_args=None, tokenizer=None, loss_scaler=None, converters=None,
                 context_len: int | None = None, flavor: str | None | _Unset = _UNSET):
        """context_len: the model's own context (the plan's), recorded instead of the job's seq_len;
        flavor: the flavor the model is (None: sized by a Hugging Face folder or [model.args]).
        Both default to model.flavor's."""
        c = cfg.checkpoint
        self.cfg = c
        # The model converters (models/converters.py): a Hugging Face export asks them for the state
        # dict to write (LoRA merges its adapters and writes its PEFT folder beside).
        self.converters = converters
        self.enabled = c.enable
        self.folder = os.path.join(cfg.job.dump_folder, c.folder)
        self.initial_load_path = initial_load_path(c, cfg.model.hf_assets_path)
        self.total_steps = cfg.training.steps
        self.model_parts = model_parts
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.step = 0
        self.blocked_s = 0.0  # time the training loop spent inside save() and staging waits
        self.save_seconds: list[tuple[int, float]] = []  # (step, start of save -> published), rank 0
        self._pending: _Pending | None = None
        self._staging: Future | None = None
        self._stager = None
        self._pg = None
        self._purger: _Purger | None = None
        self._leftovers_removed = False
        if not self.enabled:
            return

        self.train_state = TrainState()
        dp_rank = dims.dp_rank() if dims is not None else 0
        self.states: dict[str, Stateful] = {
            MODEL: ModelState(model_parts),
            OPTIMIZER: OptimizerState(model_parts, optimizer),
            LR_SCHEDULER: JsonState(lr_scheduler, LR_SCHEDULER),
            DATALOADER: PerRankState(DATALOADER, "dp_rank_", dp_rank,
                                     dataloader.state_dict, dataloader.load_state_dict),
            RNG: PerRankState(RNG, "rank_", self.rank, _rng_state, _set_rng_state),
            TRAIN_STATE: self.train_state,
        }
        if loss_scaler is not None:
            self.states[LOSS_SCALER] = JsonState(loss_scaler, LOSS_SCALER)
        self._description = None
        self._grown = False
        self._context_len = None
        self._pp = dims is not None and dims.pp_enabled  # model parts hold one pipeline stage's keys
        self._whole_keys: set[str] | None = None
        if model_args is not None:
            from titanlike.models.registry import get_model_spec

            spec = get_model_spec(cfg.model.name)
            self.spec, self.model_args = spec, model_args
            # The job's args carry training.seq_len as their context; a checkpoint records the
            # model's real one (it sizes position tables only, never the weights).
            if isinstance(flavor, _Unset):
                flavor = cfg.model.flavor
            if context_len is None:
                own = spec.flavors.get(flavor) if flavor is not None else None
                context_len = own.context_len if own is not None else model_args.context_len
            self._context_len = context_len
            self._description = fmt.model_description(spec.name, model_args, context_len=context_len, flavor=flavor)
            # [model.args] changed a model loaded from a Hugging Face folder (a fresh multi-token-
            # prediction layer, more layers): tensors the folder lacks keep their initialization.
            self._grown = bool(cfg.model.args)
        self._tokenizer = tokenizer_record(tokenizer) if tokenizer is not None else {}
        if self.distributed:
            # DCP's own collectives (plans, the final all-reduce) run on a separate gloo group:
            # in a background thread they must not interleave with training collectives, and on
            # GPUs they then cost no GPU memory.
            self._pg = dist.new_group(backend="gloo")
        if c.keep_latest_k > 0 and self.rank == 0:
            self._purger = _Purger()

        self.async_mode = c.async_mode
        if self.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            if not cuda and self.rank == 0:
                logger.info("checkpoint: pinned memory needs CUDA, which is not available; "
                            "async_with_pinned_mem stages into shared (pageable) CPU memory instead")
            if not self.distributed:
                logger.info("checkpoint: a single-process job has no process group for a checkpoint "
                            "process; async_with_pinned_mem writes from a background thread instead")
            # Staging runs in a thread, overlapping the next forward/backward; the checkpoint
            # is written by a separate process (reading the staged copy from shared memory), so
            # file writing never holds this GIL.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=self.distributed, use_async_staging=True,
                use_non_blocking_copy=cuda))
            # Staging reads the parameters and optimizer state the next optimizer step
            # overwrites in place: that step waits for it.
            optimizer.register_step_pre_hook(lambda *_: self.wait_for_staging())
        # Before the trainer builds its metrics writers (a full disk would stop them first).
        self.remove_leftovers()

    @property
    def saves(self) -> bool:
        """Whether this job writes checkpoints (enabled, and not checkpoint.load_only)."""
        return self.enabled and not self.cfg.load_only

    # Paths -------------------------------------------------------------------------------

    def path(self, step: int) -> str:
        return fmt.step_folder(self.folder, step)

    @property
    def process_group(self):
        """The gloo group DCP's own collectives run on (None when not distributed). Its timeout
        must outlast a slow rank's checkpoint write, so the short training timeout skips it."""
        return self._pg

    # Loading ------------------------------------------------------------------------------

    @torch.no_grad()
    def load(self) -> int | None:
        """Restore the job; returns the step to continue after (0 for a fresh start).

        Loads `checkpoint.load_step` (or the latest checkpoint) if the folder has any,
        otherwise the model from `checkpoint.initial_load_path` if set. With
        `checkpoint.create_seed_checkpoint` writes the initialized model as step 0 instead
        and returns None: there is nothing to train. The checkpoint's files are verified
        against their checksums first; a corrupt latest checkpoint is an error naming the file
        (or, with `checkpoint.fallback_on_corruption`, the newest one that verifies is loaded).
        """
        if not self.enabled:
            return 0
        self.remove_leftovers()
        if self.cfg.create_seed_checkpoint:
            if published_steps(self.folder):
                raise CheckpointError(
                    f"{self.folder} already holds checkpoints (steps {published_steps(self.folder)}); "
                    "a seed checkpoint goes into an empty checkpoint folder"
                )
            self._check_finite(0)
            self._save_model_only(0, torch.float32, in_hf=False)
            return None

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
                self._load_initial(self.initial_load_path)
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
        for per_rank in (DATALOADER, RNG):
            state: PerRankState = self.states[per_rank]
            if per_rank in names:
                state.source = self._pick_source(state, metadata, path)
        template = {name: _load_template(self.states[name]) for name in names}
        loaded = self._load_entries(template, metadata, path, what=f"loading checkpoint {path}")
        for name in names:
            if name in _SAME_SHAPE:  # small JSON states: the checkpoint's must look like this job's
                problem = _unlike(template[name], loaded[name], name)
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
        self.step = self.train_state.step if TRAIN_STATE in names else 0
        published = fmt.STEP_RE.fullmatch(os.path.basename(path))
        if TRAIN_STATE in names and not (0 <= self.step < 2**62 and (published is None
                                                                     or int(published.group(1)) == self.step)):
            raise CheckpointError(f"checkpoint {path} records step {self.step}, not the step of its folder")
        if self.rank == 0:
            skipped = f" (not loaded: {', '.join(self.cfg.exclude_from_loading)})" if self.cfg.exclude_from_loading else ""
            logger.info(f"checkpoint: resumed from {path} in {time.monotonic() - begin:.2f} s{skipped}")
        return self.step

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
        if self._description is None:
            return
        partial = self.cfg.allow_partial_load
        recorded = (fmt.read_sidecar(path) or {}).get("model")
        if isinstance(recorded, dict) and not partial:
            theirs = (recorded.get("name"), recorded.get("flavor"))
            mine = (self.spec.name, self._description.get("flavor"))
            if theirs[0] != mine[0] or (theirs[1] is not None and theirs[1] != mine[1]):
                held = " ".join(str(x) for x in theirs if x is not None)
                raise CheckpointError(
                    f"checkpoint {path} holds a {held} model but this job's is "
                    f"{' '.join(x for x in mine if x is not None)} (model.name, model.flavor): loading it would drop or misread weights; resume it with its own model, or "
                    "pass --checkpoint.allow_partial_load to load only the tensors the two models share")
        extra = sorted(set(fmt.dcp_model_keys(metadata)[0]) - self._model_keys())
        if extra and not partial:
            raise CheckpointError(
                f"checkpoint {path} holds {len(extra)} model tensor(s) this job's model does not have (e.g. "
                f"{', '.join(extra[:3])}); was it written for another model? pass --checkpoint.allow_partial_load "
                "to load only the tensors the two models share")
        if extra and self.rank == 0:
            logger.warning(f"checkpoint: {len(extra)} model tensor(s) of {path} that this job's model does not have "
                           f"are not loaded (checkpoint.allow_partial_load), e.g. {', '.join(extra[:3])}")

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
        """initial: a fresh run's start (checkpoint.initial_load_path), which may be a checkpoint of the
        model before the converters' swap (a pre-training run's for a LoRA job): what they added and it
        lacks keeps its initialization."""
        self._check_same_model(path, metadata)
        model = self.states[MODEL]
        local = model.load_template()
        prefix = fmt.MODEL_PREFIX if prefixed else ""
        if self._new_score_head(path):
            # A reward model started from a language model (an SFT run's step folder): every tensor
            # but the output projection, the one whose shape differs, which starts from its init.
            index = metadata.state_dict_metadata
            # (A language model of tied embeddings holds no output projection of its own.)
            head = [k for k, v in local.items() if prefix + k not in index
                    or tuple(getattr(index[prefix + k], "size", ())) != tuple(v.shape)]
            local = {k: v for k, v in local.items() if k not in head}
            if self.rank == 0:
                logger.info(f"checkpoint: {path} is a language model: the score head ({', '.join(head)}) "
                            "starts from its initialization")
        if initial and self.converters is not None:
            fresh = sorted(k for k in local if self.converters.added(k) and prefix + k not in metadata.state_dict_metadata)
            local = {k: v for k, v in local.items() if k not in set(fresh)}
            if fresh and self.rank == 0:
                logger.info(f"checkpoint: {len(fresh)} tensor(s) the model converters added are not in {path} and "
                            f"keep their initialization, e.g. {', '.join(fresh[:3])}")
        template = {prefix + k: v for k, v in local.items()}
        loaded = self._load_entries(template, metadata, path, what=f"loading the model from {path}")
        model.load_state_dict({k[len(prefix):]: v for k, v in loaded.items()})

    def _new_score_head(self, path: str) -> bool:
        """Whether this job's model has a score head (a reward model) and DCP checkpoint `path`, by
        its sidecar, holds a model without one (a language model)."""
        if self._description is None or not self.model_args.has_score_head:
            return False
        recorded = (fmt.read_sidecar(path) or {}).get("model")
        try:
            _, args = fmt.build_args(recorded, where=os.path.join(path, fmt.SIDECAR))
        except Exception:  # no sidecar or an unreadable one: the index checks that follow name the problem
            return False
        return not args.has_score_head

    @torch.no_grad()
    def load_initial_model(self, parts: list[nn.Module]) -> bool:
        """Load the model this job started from (checkpoint.initial_load_path) into `parts`, a copy of
        the model built and initialized like it (an objective's frozen reference, rebuilt when a run
        resumes); False when the job has none (its initialization is where it started)."""
        if not (self.enabled and self.initial_load_path):
            return False
        kept = self.model_parts, self.states[MODEL]
        self.model_parts, self.states[MODEL] = parts, ModelState(parts)
        try:
            self._load_initial(self.initial_load_path)
        finally:
            self.model_parts, self.states[MODEL] = kept
        return True

    def _load_initial(self, path: str) -> None:
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
        spec = self.spec
        state_dict: dict[str, torch.Tensor] = {}
        error = None
        if self.rank == 0:
            try:
                _, args = fmt.hf_folder_args(path, spec)  # every value config.json gives checked first
                # A reward model started from a language model (an SFT export): all but the output
                # projection, whose one-score head starts from its initialization.
                new_head = self.model_args.has_score_head and not args.has_score_head
                if new_head:
                    args = args.with_score_head()
                if not self._grown:
                    self._check_hf_args(args, path)
                hf_sd, _ = fmt.read_hf(path)
                try:
                    state_dict = spec.hf.from_hf_state_dict(hf_sd, args)
                except Exception as e:
                    raise CheckpointError(f"Hugging Face checkpoint {path} does not match its {fmt.HF_CONFIG} "
                                          f"({type(e).__name__}: {e})") from None
                if new_head:
                    state_dict.pop("output.weight", None)
                    logger.info(f"checkpoint: {path} is a language model: the score head starts from its "
                                "initialization")
                # Names, shapes, floating point, finite: against the job's model. A model [model.args]
                # changed loads the tensors it shares with the folder; the others keep their init.
                missing, dropped = fmt.check_fits(state_dict, spec, self.model_args, f"Hugging Face checkpoint {path}",
                                                  partial=self._grown or new_head)
                for key in dropped:
                    del state_dict[key]
                if missing:
                    logger.info(f"checkpoint: {len(missing)} tensor(s) of the model are not in {path} and start from "
                                f"their initialization (model.args), e.g. {', '.join(missing[:3])}")
                if dropped:
                    logger.info(f"checkpoint: {len(dropped)} tensor(s) of {path} are not in the model (model.args) and "
                                f"are not loaded, e.g. {', '.join(dropped[:3])}")
            except Exception as e:  # any verdict of rank 0 must reach the other ranks, never strand them
                error = str(e) if isinstance(e, CheckpointError) else f"{path}: {type(e).__name__}: {e}"
        if self.distributed:
            # Share rank 0's verdict first, so no rank waits in a broadcast that never comes.
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0, group=self._pg)
            error = verdict[0]
        if error:
            raise CheckpointError(error)
        # Every rank of the job joins the broadcast of every tensor; each keeps its own shard.
        opts = StateDictOptions(full_state_dict=self.distributed, broadcast_from_rank0=self.distributed, strict=False)
        for part in self.model_parts:
            set_model_state_dict(part, dict(state_dict), options=opts)

    def _check_hf_args(self, args, path: str) -> None:
        """The Hugging Face checkpoint's model is this job's: same config.json, key by key.

        Both sides go through the family's adapter (args_to_config), so the comparison is between
        normalized configs and needs no family's field names; HF_KEYS_NOT_COMPARED lists what may differ.
        """
        # The job's args carry training.seq_len as their context; the folder's is its own.
        mine = self.spec.hf.args_to_config(self.model_args.with_context_len(args.context_len))
        theirs = self.spec.hf.args_to_config(args)
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            if key in HF_KEYS_NOT_COMPARED or mine.get(key) == theirs.get(key):
                continue
            raise CheckpointError(
                f"Hugging Face checkpoint {path} has {key}={_show(theirs.get(key))} but this job's model has "
                f"{_show(mine.get(key))} (model.flavor / tokenizer)"
            )

    # Saving -------------------------------------------------------------------------------

    @torch.no_grad()
    def saves_at(self, step: int) -> bool:
        """Whether save(step) writes a checkpoint (the interval, the last step, the first step with
        checkpoint.enable_first_step_checkpoint); the loop reads the step's results before those."""
        return self.saves and (step >= self.total_steps or step % self.cfg.interval == 0
                               or (step == 1 and self.cfg.enable_first_step_checkpoint))

    def resume_verdict(self) -> str | None:
        """The sentence to print instead of training when the checkpoint to resume from is already at
        or past training.steps (a finished run relaunched); raises CheckpointError when the latest
        checkpoint is a model-only final export that cannot be extended, naming the flags to pass.
        Rank 0 reads the folder; every rank gets its verdict."""
        from titanlike.checkpoint.resume import resume_verdict

        c = self.cfg
        if not self.enabled or c.create_seed_checkpoint:
            return None
        verdict = None
        if self.rank == 0:
            try:
                verdict = resume_verdict(self.folder, c.load_step, self.total_steps)
            except Exception:  # a damaged or crafted checkpoint: load() reports it, on every rank
                verdict = None
        if self.distributed:
            box = [verdict]
            dist.broadcast_object_list(box, src=0, group=self.process_group)
            verdict = box[0]
        if verdict is None:
            return None
        kind, message = verdict
        if kind == "error":
            raise CheckpointError(message)
        return message

    def save(self, step: int, *, force: bool = False) -> None:
        """Call after every training step; saves at the interval, at the last step and, with
        checkpoint.enable_first_step_checkpoint, after step 1. force saves a full, synchronous
        (resumable) checkpoint now, e.g. before a job is preempted. Nothing with checkpoint.load_only."""
        if not self.saves:
            return
        begin = time.monotonic()
        self._poll_pending()
        last = step >= self.total_steps
        if force and not last:
            self._wait_pending()
            self._check_finite(step)
            self.train_state.step = step
            self._save_full_sync(step)
        elif self.saves_at(step):
            self._wait_pending()  # one save in flight at a time
            self._check_finite(step)
            self.train_state.step = step
            if last and self.cfg.last_save_model_only:
                self._save_model_only(step, _DTYPES[self.cfg.export_dtype], in_hf=self.cfg.last_save_in_hf)
            elif last or self.async_mode == "disabled":
                self._save_full_sync(step)
            else:
                self._save_full_async(step)
        self.blocked_s += time.monotonic() - begin

    def _check_finite(self, step: int) -> None:
        """Refuse to save a model with a NaN or infinite parameter: all ranks agree (one all-reduce
        over the checkpoint's group), so all raise the same error and the previous checkpoint
        stays the latest. One isfinite().all() per local shard and one device sync."""
        names, flags = [], []
        for name, t in self.states[MODEL].state_dict().items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.is_floating_point() and local.numel():
                names.append(name)
                flags.append(torch.isfinite(local).all())
        bad = (~torch.stack(flags)).nonzero().flatten().tolist() if flags else []
        first = names[bad[0]] if bad else None
        if self.distributed:
            flag = torch.tensor([0 if first is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
            if flag.item():
                found: list = [None] * dist.get_world_size(self._pg)
                dist.all_gather_object(found, first, group=self._pg)
                first = next(n for n in found if n is not None)
        if first is not None:
            raise CheckpointError(f"step {step} has non-finite parameters (first: {first}); not saving it")

    def _tmp(self, step: int) -> str:
        return self.path(step) + TMP_SUFFIX

    def _dcp_state(self, states: dict[str, Stateful]) -> dict[str, torch.Tensor]:
        """The states as DCP saves them: one flat dict of tensors, JSON entries encoded."""
        flat, _ = flatten_state_dict({name: state.state_dict() for name, state in states.items()})
        out = {}
        for key, value in flat.items():
            if isinstance(value, Json):
                value = fmt.encode_json(value.value, key)
            elif not isinstance(value, torch.Tensor):
                raise CheckpointError(f"checkpoint entry {key!r} holds a {type(value).__name__}, not a tensor; "
                                      "titanlike stores non-tensor state as JSON only (format.Json)")
            out[key] = value
        return out

    def _save_full_sync(self, step: int) -> None:
        begin = time.monotonic()
        self._dcp_save(self._dcp_state(self.states), step)
        self._publish_agreed(step, "full", begin)

    def _save_full_async(self, step: int) -> None:
        kwargs = {}
        if self.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            # DCP's checkpoint process joins a process group of its own, set up through the job's;
            # a single-process job has none, so there the writing stays in a thread.
            kind = AsyncCheckpointerType.PROCESS if self.distributed else AsyncCheckpointerType.THREAD
            kwargs = dict(async_checkpointer_type=kind, async_stager=self._stager)
        state = self._dcp_state(self.states)
        if not self.distributed:
            fmt.ignore_single_process_warning()
        try:
            response = dcp.async_save(state, storage_writer=fmt.ChecksumWriter(self._tmp(step)),
                                      process_group=self._pg, no_dist=not self.distributed, **kwargs)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(step, e, f"starting the save of {self._tmp(step)} failed: {summarize(e)}") from None
        if hasattr(response, "upload_completion"):  # staging in the background
            self._staging, future = response.staging_completion, response.upload_completion
        else:
            future = response
        pending = self._pending = _Pending(step, future, time.monotonic())
        future.add_done_callback(lambda _: setattr(pending, "finished", time.monotonic()))

    def _save_model_only(self, step: int, dtype: torch.dtype, *, in_hf: bool) -> None:
        begin = time.monotonic()
        state = self.states[MODEL].state_dict()
        if dtype != torch.float32 and not in_hf:
            state = {k: v.to(dtype) for k, v in state.items()}
        tmp = self._tmp(step)
        if not in_hf:
            self._dcp_save(state, step)
            self._publish_agreed(step, "model_only", begin)
            return
        # Every rank writes its shards as DCP (any layout, pipeline stages included); rank 0 then
        # converts the whole model, which needs full tensors for the q/k permutation.
        staging = os.path.join(tmp, "dcp")
        self._dcp_save(state, step, path=staging)

        def convert() -> None:
            state_dict = fmt.read_dcp_model(staging, verify=False)  # written just now, by this job
            if self.converters is not None:
                state_dict = self.converters.hf_export(state_dict, self.spec, self.model_args, tmp)
            tok = self._tokenizer
            export = fmt.write_hf(state_dict, self.spec, self.model_args, tmp, dtype=dtype,
                                  context_len=self._context_len, bos_id=tok.get("bos_id"), eos_id=tok.get("eos_id"),
                                  pad_id=tok.get("pad_id"), tokenizer_path=tok.get("path"),
                                  tokenizer_fingerprint=tok.get("fingerprint"))
            (logger.info if export.converted else logger.warning)(f"checkpoint: {export.message}")
            shutil.rmtree(staging)

        # The other ranks wait for rank 0's conversion in _publish_agreed, on the checkpoint's group
        # with its long timeout, rather than in their next collective on a group with the (short)
        # comm.train_timeout_seconds.
        self._publish_agreed(step, "hf", begin, prepare=convert)

    def _dcp_save(self, state: dict, step: int, *, path: str | None = None) -> None:
        path = path or self._tmp(step)
        try:
            fmt.dcp_save(state, path, process_group=self._pg, no_dist=not self.distributed)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(step, e, f"saving checkpoint {path} failed: {summarize(e)}") from None

    def _save_failed(self, step: int, e: BaseException, message: str) -> CheckpointError:
        """The error of a save that failed: rank 0 removes the partial step-N.tmp (a full disk
        stays full otherwise), and the message says what stays the latest checkpoint."""
        if self.rank == 0:
            shutil.rmtree(self._tmp(step), ignore_errors=True)
        steps = published_steps(self.folder)
        kept = f"{self.path(steps[-1])} stays the latest checkpoint" if steps else "there is no earlier checkpoint"
        if fmt.is_no_space(e):
            message = f"no space left on device while saving step {step} to {self.path(step)}"
        return CheckpointError(f"{message}; removed the partial save, {kept}")

    def _publish_agreed(self, step: int, contents: str, begin: float, prepare=None) -> None:
        """Publish a synchronous save (after prepare(), on rank 0) and share rank 0's verdict, so
        that if rank 0 cannot publish (no space for the sidecar, ...) every rank stops with it."""
        error = None
        if self.rank == 0:
            try:
                if prepare is not None:
                    prepare()
                self._publish(step, contents, time.monotonic() - begin)
            except Exception as e:  # whatever rank 0 meets, the other ranks must hear it, not wait
                detail = str(e) if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: {e}"
                error = str(self._save_failed(step, e, f"publishing checkpoint {self._tmp(step)} failed: {detail}"))
        if self.distributed:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0, group=self._pg)
            error = verdict[0]
        if error:
            raise CheckpointError(error)

    def _publish(self, step: int, contents: str, seconds: float) -> None:
        """Rank 0 renames step-N.tmp to step-N; every rank's data is on disk by now.

        DCP's save ends with an all-reduce in which the coordinator (rank 0) writes the index
        after gathering every rank's write results, so its completion is the barrier. The
        sidecar, written last, records the checksum of every file (format.collect_checksums).
        """
        if self.rank != 0:
            return
        tmp, final = self._tmp(step), self.path(step)
        # The tokenizer's files go into the checkpoint (write_sidecar), except into a Hugging Face
        # export, which already holds them as transformers reads them.
        tokenizer = self._tokenizer if contents != "hf" else {k: v for k, v in self._tokenizer.items() if k != "path"}
        info = {"contents": contents, "step": step, "tokenizer": tokenizer}
        if self._description is not None:
            info["model"] = self._description
        fmt.write_sidecar(tmp, info)
        if os.path.exists(final):
            # Re-saving a step (after load_step went back): drop the old one first.
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        self.save_seconds.append((step, seconds))
        logger.info(f"checkpoint: saved {contents.replace('_', ' ')} {final} in {seconds:.2f} s")
        self._purge()

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if self._purger is None or k <= 0:
            return
        for old in published_steps(self.folder)[:-k]:
            doomed = self.path(old) + PURGE_SUFFIX
            # Renamed first, so a half-deleted folder is never mistaken for a checkpoint.
            os.rename(self.path(old), doomed)
            self._purger.submit(doomed)

    def remove_leftovers(self) -> None:
        """Delete step-N.tmp (a save that never finished) and step-N.purge folders. Runs when
        the manager is built, before the job's metrics or TensorBoard files are written: a save
        that filled the disk must not stop the relaunch before it is removed. Once per manager."""
        if self._leftovers_removed:
            return
        self._leftovers_removed = True
        if self.rank == 0 and os.path.isdir(self.folder):
            for name in os.listdir(self.folder):
                if name.endswith((TMP_SUFFIX, PURGE_SUFFIX)) and STEP_RE.match(name):
                    logger.warning(f"checkpoint: removing {os.path.join(self.folder, name)} "
                                   "(left by a save or purge that did not finish)")
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if self.distributed:
            # No rank may start writing a step-N.tmp that rank 0 is still deleting.
            dist.barrier(group=self._pg)

    # Async bookkeeping ----------------------------------------------------------------------

    def wait_for_staging(self) -> None:
        if self._staging is not None:
            begin = time.monotonic()
            staging, self._staging = self._staging, None
            try:
                staging.result()
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(f"staging the checkpoint failed: {summarize(e)}") from None
            self.blocked_s += time.monotonic() - begin

    def _poll_pending(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self.wait_for_staging()
        try:
            pending.future.result()
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._save_failed(
                pending.step, e, f"saving checkpoint {self._tmp(pending.step)} failed: {summarize(e)}") from None
        # Rank 0 alone publishes an async save, when its future is done (the ranks poll at
        # different times, so no collective here).
        try:
            self._publish(pending.step, "full", (pending.finished or time.monotonic()) - pending.started)
        except (CheckpointError, OSError) as e:
            raise self._save_failed(
                pending.step, e, f"publishing checkpoint {self._tmp(pending.step)} failed: {e}") from None

    def close(self) -> None:
        """Finish the save in flight, then stop the purge thread and the checkpoint process."""
        if not self.enabled:
            return
        try:
            self._wait_pending()
        except CheckpointError as e:
            # Only reachable after the loop failed (the last step's save is synchronous), so
            # that error is the one being reported; this one is logged next to it.
            logger.error(f"checkpoint: {e}")
        finally:
            if self._purger is not None:
                self._purger.close()
                self._purger = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
                # The checkpoint process is torch's module-level singleton; dropping the last
                # reference asks it to exit (private API: keep in step with torch).
                from torch.distributed.checkpoint import _async_process_executor as ape

                if getattr(ape, "_CHECKPOINT_PROCESS", None) is not None:
                    ape._CHECKPOINT_PROCESS = None


class _Purger:
    """Deletes old checkpoints in a background thread (rmtree of GBs takes seconds)."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="checkpoint-purge", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (path := self.queue.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)

    def submit(self, path: str) -> None:
        self.queue.put(path)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _show(value: Any) -> str:
    """A config.json value as it reads in the file (JSON), for one-line messages."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)
