"""Load hooks: what a model converter or the model's own args add when a checkpoint is loaded into,
or exported from, a model. titanlike/checkpoint/ knows no converter and no objective: they bring
their own hooks, declared here, beside the models (which import nothing above them).

A job's hooks come from its converters (ModelConverters.load_hooks) and its model args (model_hooks:
a reward model's score head, which an objective asked for through its model_args); the trainer
passes them to CheckpointManager. A hook a checkpoint needs without any job (LoRA's merge, which load_model and
convert_dcp_to_hf apply to a LoRA job's checkpoint) is also registered by its owner when that is
imported (register_load_hook), as config sections are: the package root's discovery imports every
owner (titanlike/__init__.py, config/sections.py registered_sections).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch


class LoadHook:
    """One owner's part in loading and exporting checkpoints; every default changes nothing."""

    def merges(self, keys: Iterable[str]) -> bool:
        """Whether `merged` changes a state dict of these keys, so that a sharded load must read the
        whole tensors first (LoRA: a checkpoint holding adapters)."""
        return False

    def merged(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's full tensors as the plain model holds them (LoRA folds its adapters in)."""
        return state_dict

    def fresh(self, key: str, saved_args: Any) -> bool:
        """On a fresh run's initial load: whether the job's model entry `key` keeps its initialization
        when the checkpoint (of a model with `saved_args`, None if unknown) lacks it or holds it in
        another shape (the adapters a converter added; a reward model's new score head)."""
        return False

    def saved_args(self, job_args: Any, saved_args: Any) -> Any:
        """The args to read a Hugging Face folder's model with (its own: `saved_args`), for a job whose
        model has `job_args` (a reward model read from a language model: with a score head)."""
        return saved_args

    def hf_export(self, state_dict: dict[str, torch.Tensor], spec, args, folder: str, *,
                  base_model: str | None = None) -> dict[str, torch.Tensor]:
        """Before a model-only Hugging Face export of `state_dict` (full tensors, rank 0) into
        `folder`: the state dict to convert (LoRA writes its PEFT folder beside, and merges).
        base_model: the Hugging Face folder the job started from, if it did (None otherwise)."""
        return state_dict


class NewScoreHead(LoadHook):
    """A model with a scalar score head (BaseModelArgs.with_score_head: a reward model) started from a
    language model (an SFT run's checkpoint or export): every tensor but the output projection, whose
    one-score head (another shape) starts from its initialization."""

    def fresh(self, key: str, saved_args: Any) -> bool:
        return saved_args is not None and not saved_args.has_score_head

    def saved_args(self, job_args: Any, saved_args: Any) -> Any:
        return saved_args if saved_args.has_score_head else saved_args.with_score_head()


def model_hooks(args: Any) -> tuple[LoadHook, ...]:
    """What a model of these args adds on load: a score head's fresh start."""
    return (NewScoreHead(),) if args.has_score_head else ()


_REGISTERED: list[LoadHook] = []


def register_load_hook(hook: LoadHook) -> None:
    """Apply `hook`'s merge to every checkpoint read without a job (load_model, convert_dcp_to_hf, a
    teacher's or another model's load). Called by the hook's owner when it is imported."""
    if all(type(h) is not type(hook) for h in _REGISTERED):
        _REGISTERED.append(hook)


def registered_hooks() -> tuple[LoadHook, ...]:
    """The hooks every owner registered, its module imported first (the package root's discovery)."""
    from titanlike.config.sections import registered_sections

    registered_sections()  # runs the discovery once: it imports every owner of a config section
    return tuple(_REGISTERED)


def merged(state_dict: dict[str, torch.Tensor], hooks: Sequence[LoadHook] | None = None) -> dict[str, torch.Tensor]:
    """`state_dict` through every hook's merge (default: the registered hooks)."""
    for hook in registered_hooks() if hooks is None else hooks:
        if hook.merges(state_dict):
            state_dict = hook.merged(state_dict)
    return state_dict


def merges(keys: Mapping[str, Any] | Iterable[str], hooks: Sequence[LoadHook] | None = None) -> bool:
    """Whether any hook (default: the registered ones) merges a state dict of these keys."""
    keys = list(keys)
    return any(hook.merges(keys) for hook in (registered_hooks() if hooks is None else hooks))
