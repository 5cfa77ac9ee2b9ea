"""Model families register a ModelSpec; generic code looks one up by `model.name`.

A family is one folder under titanlike/models/ that builds a ModelSpec and registers it. It
touches no generic file: the trainer, the parallelisms, the checkpoint and Hugging Face code
and the estimator ask the spec and the args contract (titanlike/models/args.py), never a
family's field names.

What a model class (spec.model_cls) must provide, and every attribute of it or of its modules
that generic code reads, is declared in titanlike/models/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch.nn as nn

from titanlike.config.sections import register_section
from titanlike.models.args import BaseModelArgs
from titanlike.models.common.hf import HFAdapter
from titanlike.models.common.megatron import MegatronAdapter
from titanlike.models.spec_types import PipelineEnds, ShardFn, ShardOptions

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig


@dataclass(frozen=True)
class ModelOptions:
    """A family's own config section (Megatron's --hybrid-layer-pattern for the hybrid family): the
    loader reads `[section]` into `options_cls` (a dataclass of opt(...) fields, registered with the
    config loader when the spec is), and `apply(flavor_args, section)` gives the flavor's args under
    the job's values (ValueError, one sentence, for values the family refuses)."""

    section: str
    options_cls: type
    apply: Callable[[BaseModelArgs, Any], BaseModelArgs]
    # Older spellings of its keys: old dotted name -> key of this section (config/sections.py).
    renamed: dict[str, str] | None = None


@dataclass(frozen=True)
class ImageInputs:
    """How a vision-language family takes images with a prompt (ModelSpec.images): an image stands in
    the tokens as `tokens_per_image` copies of `image_token_id`, and its pixels go to the prefill as
    the tower's preprocessing prepares them: `processor` "clip" or "siglip" at `image_size`
    (data/images.py ImageProcessor.of_tower; inference/processor.py applies it)."""

    image_token_id: int
    tokens_per_image: int
    processor: str
    image_size: int


@dataclass
class ModelSpec:
    name: str
    # The nn.Module class; constructed as model_cls(args) on the meta device.
    model_cls: type[nn.Module]
    # flavor name -> model args (a BaseModelArgs dataclass), e.g. "debugmodel", "8B".
    flavors: dict[str, BaseModelArgs]
    # The family's tensor/sequence-parallel function (ShardFn, models/spec_types.py), usually a ShardingPlan of
    # models/common/sharding.py. None: no tensor parallelism.
    shard: ShardFn | None = None
    # Input and output ends for the pipeline split. None: no pipeline parallelism.
    pipeline_ends: PipelineEnds | None = None
    # The family's training objective, by the name it is registered under (titanlike/objectives/
    # registry.py builds it): the family names it and imports nothing of the objectives.
    objective: str = "causal_lm"
    # What the objective takes from this family's args, as keyword arguments of its factory:
    # objective_options(job_config, flavor_args) -> dict (BERT's sentence pairs, LLaVA's image
    # tokens). None: nothing.
    objective_options: Callable[[JobConfig, BaseModelArgs], dict[str, Any]] | None = None
    # Hugging Face interchange (models/common/hf.py): the config.json model_types the family reads,
    # config.json <-> args, state dicts, token ids. None: no HF.
    hf: HFAdapter | None = None
    # Megatron-LM import (models/common/megatron.py): megatron-core's parameter names -> the family's.
    # None: `titanlike-convert from-megatron` refuses the family.
    megatron: MegatronAdapter | None = None
    # The family's own config section, or None.
    options: ModelOptions | None = None
    # A vision-language family's images in a prompt, from the model args: where they go in the tokens
    # and how their pixels are prepared (inference/processor.py reads it). None: a text model.
    images: Callable[[BaseModelArgs], ImageInputs] | None = None

    def __post_init__(self) -> None:
        kinds = {type(args) for args in self.flavors.values()}
        if len(kinds) != 1:
            raise ValueError(f"model spec {self.name!r}: every flavor must use one args class, got {kinds}")
        if not issubclass(next(iter(kinds)), BaseModelArgs):
            raise TypeError(f"model spec {self.name!r}: args must derive from BaseModelArgs")
        if self.hf is not None and not (isinstance(self.hf, HFAdapter) and self.hf.model_types):
            raise TypeError(f"model spec {self.name!r}: hf must be an HFAdapter naming its model_types")
        if not isinstance(self.objective, str):
            raise TypeError(f"model spec {self.name!r}: objective is the name of a registered objective "
                            f"(titanlike/objectives/registry.py), got {self.objective!r}")

    @property
    def args_cls(self) -> type[BaseModelArgs]:
        return type(next(iter(self.flavors.values())))


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    if spec.options is not None:
        register_section(spec.options.section, spec.options.options_cls, renamed=spec.options.renamed)
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    _import_builtin_families()
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def model_names() -> list[str]:
    _import_builtin_families()
    return sorted(_REGISTRY)


def resolve_model(name: str, flavor: str | None) -> ModelSpec:
    """The spec of model.name, checking model.flavor (None: the job's sizes come from elsewhere, a
    Hugging Face folder): ValueError, one sentence naming what is known."""
    if name not in model_names():
        raise ValueError(f"model.name {name!r} is unknown; known models: {', '.join(model_names())}")
    spec = _REGISTRY[name]
    if flavor is not None and flavor not in spec.flavors:
        raise ValueError(f"model.flavor {flavor!r} is unknown for {name}; known flavors: {', '.join(spec.flavors)}")
    return spec


def check_other_families_sections(job_config, spec: ModelSpec) -> None:
    """A family's own section (ModelSpec.options) is read only when that family is trained: one set
    for another family is refused rather than ignored (ValueError, one sentence)."""
    import dataclasses

    for name in model_names():
        options = _REGISTRY[name].options
        if options is None or name == spec.name or (spec.options and spec.options.section == options.section):
            continue
        section = getattr(job_config, options.section)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if value != getattr(options.options_cls(), field.name):
                raise ValueError(f"{options.section}.{field.name} {value!r} is set, but it configures the {name} "
                                 f"family and model.name is {job_config.model.name}; remove it or set model.name {name}")


def spec_for_hf_model_type(model_type: str | None) -> ModelSpec:
    """The family that reads Hugging Face folders of this config.json model_type (KeyError if none)."""
    _import_builtin_families()
    readers = [spec for spec in _REGISTRY.values() if spec.hf is not None]
    for spec in readers:
        if model_type in spec.hf.model_types:
            return spec
    known = sorted(t for spec in readers for t in spec.hf.model_types)
    raise KeyError(f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(known)}")


def _import_builtin_families() -> None:
    """Import every family package under titanlike/models/ (importing one registers its spec), so a
    new family is a new folder and no list here needs editing."""
    import importlib
    import pkgutil

    import titanlike.models as models

    for info in pkgutil.iter_modules(models.__path__):
        if info.ispkg and info.name not in _NOT_FAMILIES:
            importlib.import_module(f"titanlike.models.{info.name}")


_NOT_FAMILIES = {"common"}


# PipelineEnds and ShardOptions are defined in models/spec_types.py; a family imports them from here
# with the rest of its spec.
__all__ = ["ImageInputs", "ModelOptions", "ModelSpec", "PipelineEnds", "ShardFn", "ShardOptions", "check_other_families_sections",
           "get_model_spec", "model_names", "register_model_spec", "resolve_model", "spec_for_hf_model_type"]
