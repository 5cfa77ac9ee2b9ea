"""What a checkpoint holds: one Stateful per component (model, optimizer, LR schedule, data loader
position, RNG, step, loss scaler), each keyed so that any layout loads what any other saved.

  model.<fqn>            parameters, by full name (DTensor shards: any layout loads any other)
  optimizer.state.<fqn>.*   optimizer state tensors, by parameter (flattened: layout-free too)
  optimizer.param_groups.<fqn>   that parameter's hyper-parameters, JSON
  lr_scheduler.state     the schedule's state_dict, JSON
  dataloader.dp_rank_R   each data-parallel rank's loader position, JSON
  rng.rank_R             each rank's RNG states (torch, CUDA, Python, NumPy), JSON
  train_state.step       the step the checkpoint was taken after (int64), and format_version
  loss_scaler.state      float16 loss scaling's scale and counters, JSON (jobs that scale the loss)
  rollouts.dp_rank_R     each data-parallel rank's generated batches not yet trained, JSON (jobs that
                         generate: train/companions.py InFlight)

saving.py writes them, loading.py reads them back; `unlike` checks a loaded JSON state against the
job's own before a component sees it.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titanlike.checkpoint import format as fmt
from titanlike.checkpoint.format import Json, tied_aliases

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, LOSS_SCALER, ROLLOUTS = (
    "model", "optimizer", "lr_scheduler", "dataloader", "rng", "train_state", "loss_scaler", "rollouts")
# LOSS_SCALER is saved and loaded only by jobs that scale the loss (float16), ROLLOUTS by jobs that generate (RL).
COMPONENTS = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG, TRAIN_STATE, LOSS_SCALER, ROLLOUTS)
# What checkpoint.exclude_from_loading may name.
CHECKPOINT_COMPONENTS = COMPONENTS


@dataclass
class JobModel:
    """The job's model as its checkpoints record it (the sidecar's "model") and as a load checks it."""

    spec: Any
    args: Any
    description: dict[str, Any]
    context_len: int | None
    # [model.args] changed a model loaded from a Hugging Face folder (a fresh multi-token-prediction
    # layer, more layers): tensors the folder lacks keep their initialization.
    grown: bool = False


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


def load_template(state: Stateful) -> dict[str, Any]:
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


class ScheduleState(JsonState):
    """The LR schedule, whose per-group lists (base_lrs, _last_lr, lr_lambdas) are fitted to this job's optimizer:
    every group of a job follows one schedule, so a checkpoint of another optimizer (AdamW's one group,
    Muon's two) resumes the schedule when its optimizer state is not loaded."""

    _PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, groups = dict(state_dict["state"]), len(self.obj.optimizer.param_groups)
        for key in self._PER_GROUP:
            values = state.get(key)
            if isinstance(values, list) and values and len(values) != groups:
                if any(v != values[0] for v in values):
                    raise ValueError(f"its learning-rate schedule holds {len(values)} groups with different rates, "
                                     f"where this job's optimizer has {groups} groups")
                state[key] = values[:1] * groups
        self.obj.load_state_dict(state)


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


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # As plain lists (JSON).
        "python": [*internal, version, gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
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
# another machine, a ramp-up, the schedule's per-group rates (ScheduleState); a dataset's own position state may have other keys.
SAME_SHAPE = (LR_SCHEDULER, LOSS_SCALER, DATALOADER, RNG)
_FREE_LENGTH = {"cuda", "rampup", *ScheduleState._PER_GROUP}
_FREE_KEYS = {"samples"}


def unlike(mine: Any, theirs: Any, where: str) -> str | None:
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
            if key in theirs and (problem := unlike(mine[key], theirs[key], f"{where}.{key}")) is not None:
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
                # lr_lambdas: None for a plain function (LambdaLR saves only callable objects' state).
                if not (value is None or isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() < 2**20)):
                    return f"{where}[{i}] is {type(value).__name__}"
                continue
            if (problem := unlike(like, value, f"{where}[{i}]")) is not None:
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
