"""Load hooks: what a model converter or an objective adds when a checkpoint is loaded into, or
exported from, a model. checkpoint/ knows no converter and no objective (shared/design.md, section 1):
they bring their own hooks.

A job's hooks come from its converters and its objective; the trainer passes them to
CheckpointManager. A hook a checkpoint needs without any job (LoRA's merge, which load_model and
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

    def hf_export(self, state_dict: dict[str, torch.Tensor], spec, args, folder: str) -> dict[str, torch.Tensor]:
        """Before a model-only Hugging Face export of `state_dict` (full tensors, rank 0) into
        `folder`: the state dict to convert (LoRA writes its PEFT folder beside, and merges)."""
        return state_dict


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
