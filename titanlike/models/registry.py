"""Model families register a ModelSpec; the trainer looks one up by `model.name`.

Everything that differs between model families hangs off the spec, so the
trainer, the parallelize functions and the checkpoint code stay generic and
adding a family never copies parallelize code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn


@dataclass
class ModelSpec:
    name: str
    # The nn.Module class; constructed as model_cls(args) on the meta device.
    model_cls: type[nn.Module]
    # flavor name -> model args dataclass instance (e.g. "debugmodel", "8B").
    flavors: dict[str, Any]
    # Tensor-parallel plan for one model instance:
    # fn(model, tp_mesh, *, loss_parallel: bool, sequence_parallel: bool) -> None.
    # None means the family does not support TP yet.
    tensor_parallel_plan: Callable[..., None] | None = None
    # Hugging Face interchange: state-dict and config.json conversion (models/<family>/hf_adapter.py).
    hf_adapter: Any = None
    # Pipeline split rule: fn(model, layer_keys, *, first: bool, last: bool) -> nn.Module, a copy of
    # the meta model that keeps only those entries of model.layers, plus the input end if first and
    # the output end if last, with parameter names unchanged. None means no pipeline parallelism.
    pipeline_stage: Callable[..., nn.Module] | None = None
    # Free-form extras a family may need later.
    extras: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    _import_builtin_families()
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def model_names() -> list[str]:
    _import_builtin_families()
    return sorted(_REGISTRY)


def _import_builtin_families() -> None:
    # Importing a family's package registers its spec.
    import titanlike.models.llama3  # noqa: F401
