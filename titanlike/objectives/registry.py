"""Objectives by name: the ones families train with, and those a job may choose over its family's own.

A family trains with its own objective, which its ModelSpec names (`objective`: "causal_lm" for a
decoder, "masked_lm" for BERT) so that titanlike/models/ imports nothing of the objectives; such an
objective registers with `register_family_objective` and a factory `factory(job_config, flavor_args,
**spec.objective_options(job_config, flavor_args))`; `family_objective` builds a spec's.

Some objectives are a different use of the same model: supervised fine-tuning trains any next-token
decoder on conversations. Such an objective registers with `register_objective` under the name
`training.objective` takes, with a factory `factory(job_config, flavor_args, family_objective=...)`
that refuses, in one sentence, a family it cannot train; `job_objective` builds the one a job names.

Python imports a package before any module of it, so whoever imports this module has run
titanlike/objectives/__init__.py, which imports (and so registers) every built-in objective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs
    from titanlike.models.registry import ModelSpec
    from titanlike.objectives.base import Objective

_OBJECTIVES: dict[str, Callable[..., Objective]] = {}
_FAMILY_OBJECTIVES: dict[str, Callable[..., Objective]] = {}
_SECTIONS: dict[str, str] = {}  # objective name -> its config section


def register_objective(name: str, factory: Callable[..., Objective], *, section: str | None = None) -> None:
    """section: the objective's own config section, refused when set for a job of another objective."""
    if name in _OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    _OBJECTIVES[name] = factory
    if section is not None:
        _SECTIONS[name] = section


def register_family_objective(name: str, factory: Callable[..., Objective], *, section: str | None = None) -> None:
    """An objective a family names in its ModelSpec; factory(job_config, flavor_args, **options). section: as
    register_objective's (causal_lm's [fim] is refused in a job of any other objective)."""
    if name in _FAMILY_OBJECTIVES:
        raise ValueError(f"family objective {name!r} is already registered")
    _FAMILY_OBJECTIVES[name] = factory
    if section is not None:
        _SECTIONS[name] = section


def family_objective(cfg: JobConfig, spec: ModelSpec, args: BaseModelArgs) -> Objective:
    """The objective the family of `spec` trains with, for these args (ModelSpec.objective and
    objective_options)."""
    factory = _FAMILY_OBJECTIVES.get(spec.objective)
    if factory is None:
        raise ValueError(f"model spec {spec.name!r} names objective {spec.objective!r}, which is not registered; "
                         f"registered: {', '.join(sorted(_FAMILY_OBJECTIVES))}")
    options = spec.objective_options(cfg, args) if spec.objective_options is not None else {}
    return factory(cfg, args, **options)


def check_unused_sections(cfg: JobConfig, chosen: str) -> None:
    """A registered objective's section set in a job that trains with another objective is refused
    rather than ignored (ValueError, one sentence)."""
    import dataclasses

    for name, section_name in _SECTIONS.items():
        if name == chosen:
            continue
        section = getattr(cfg, section_name)
        default = type(section)()
        for field in dataclasses.fields(section):
            if getattr(section, field.name) != getattr(default, field.name):
                raise ValueError(f"{section_name}.{field.name} is set, but it configures training.objective {name} and "
                                 f"this job's objective is {chosen}; remove it or set training.objective {name}")


def job_chat_template(cfg: JobConfig, tokenizer):
    """(the chat template the job's objective renders conversations with, a data/chat_template.py
    ChatTemplate, and a warning for the log when "auto" fell back to titanlike's llama3 template), or
    (None, None): an objective whose config section has a `chat_template` option (sft, dpo, reward)
    renders with the template it names. The trainer logs it and its checkpoints record it, so that
    their Hugging Face exports chat as training rendered."""
    import dataclasses

    section = _SECTIONS.get(cfg.training.objective)
    options = getattr(cfg, section) if section is not None else None
    if options is None or "chat_template" not in {f.name for f in dataclasses.fields(options)}:
        return None, None
    from titanlike.data.conversations import choose_chat_template

    return choose_chat_template(options.chat_template, tokenizer, option=f"{section}.chat_template")


def objective_names() -> list[str]:
    return sorted(_OBJECTIVES)


def job_objective(cfg: JobConfig, spec: ModelSpec, args: BaseModelArgs, *, model: str) -> Objective:
    """The objective of the job: training.objective's, or (empty, or naming it) the family's own.
    ValueError (one sentence) for an unknown name or one the family cannot train with."""
    family = family_objective(cfg, spec, args)
    name = cfg.training.objective
    check_unused_sections(cfg, name or family.name)
    if not name or name == family.name:
        return family
    if name not in objective_names():
        known = sorted({*objective_names(), family.name})
        raise ValueError(f"training.objective {name!r} is unknown for {model}; known: {', '.join(known)} "
                         "(empty means the family's own)")
    return _OBJECTIVES[name](cfg, args, family_objective=family, model=model)


__all__ = ["check_unused_sections", "family_objective", "job_chat_template", "job_objective", "objective_names",
           "register_family_objective", "register_objective"]
