"""Config sections owned by the pieces they configure: a training objective's ([masked_lm]), a model
family's ([hybrid]). JobConfig holds the sections every job has; these are registered here by their
owner when it is imported, and the loader reads, checks, documents (--help) and prints them like the
others (`cfg.masked_lm` is the section).

config/ imports nothing above it, so it cannot import the owners: `add_discovery` lets the package
root hand it a function importing them (titanlike/__init__.py), run once, the first time the loader
needs the whole list. A section class is a dataclass of `opt(...)` fields (config/schema.py); a
`check()` method, if it has one, raises ValueError with one sentence for a value out of range.

Dataset kinds (the values of training.dataset and validation.dataset) are registered the same way,
by the data loader and the objectives that read them (data/loader.py register_dataset_kind), each with
what the config checks of it before any process starts: whether it takes a dataset_path, whether
it is a stream without end.

An owner also names the older spellings of its keys (`training.mask_prob` before [masked_lm] held
it): they keep loading, with the loader's one-line note. One old key may feed several sections
(T5's span corruption reads the same --mask-prob as BERT's masked LM).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

# The titanlike release whose spellings the registered renames keep reading.
RENAMED_SINCE = "0.1.0"

_SECTIONS: dict[str, type] = {}
# Old dotted name -> the dotted names it is read as.
_RENAMED: dict[str, list[str]] = {}
_discoveries: list[Callable[[], None]] = []


def register_section(name: str, section_cls: type, *, renamed: Mapping[str, str] | None = None) -> None:
    """Add `[name]`, read into `section_cls` (a dataclass whose fields all have defaults). renamed:
    older dotted spellings -> the key of this section each is now read as."""
    if not dataclasses.is_dataclass(section_cls):
        raise TypeError(f"config section {name!r} must be a dataclass, got {section_cls!r}")
    if _SECTIONS.get(name, section_cls) is not section_cls:
        raise ValueError(f"config section {name!r} is already registered by {_SECTIONS[name].__qualname__}")
    keys = {f.name for f in dataclasses.fields(section_cls)}
    for old, key in (renamed or {}).items():
        if key not in keys:
            raise ValueError(f"config section {name!r} has no key {key!r} for the old spelling {old!r}")
        targets = _RENAMED.setdefault(old, [])
        if f"{name}.{key}" not in targets:
            targets.append(f"{name}.{key}")
    _SECTIONS[name] = section_cls


@dataclasses.dataclass(frozen=True)
class DatasetKindRule:
    """What the config checks of a dataset kind before any process starts."""

    path: str  # "required", "optional" (read when given) or "none" (takes no dataset_path)
    streaming: bool  # no end to run to: a validation run over it needs validation.steps


_DATASET_KINDS: dict[str, DatasetKindRule] = {}


def register_dataset_kind_rule(name: str, *, path: str, streaming: bool) -> None:
    """Make `name` a value training.dataset and validation.dataset take (data/loader.py calls this
    for every kind it registers)."""
    if path not in ("required", "optional", "none"):
        raise ValueError(f"dataset kind {name!r}: path must be required, optional or none, got {path!r}")
    _DATASET_KINDS[name] = DatasetKindRule(path=path, streaming=streaming)


def dataset_kind_rules() -> dict[str, DatasetKindRule]:
    """Every registered dataset kind: name -> its rule, in registration order."""
    _discover()
    return dict(_DATASET_KINDS)


def dataset_kinds() -> tuple[str, ...]:
    """The registered dataset kinds' names (the choices of training.dataset and validation.dataset)."""
    return tuple(dataset_kind_rules())


def add_discovery(fn: Callable[[], None]) -> None:
    """fn imports the modules that register sections; run once, when the list is first needed."""
    _discoveries.append(fn)


def _discover() -> None:
    while _discoveries:
        _discoveries.pop(0)()


def registered_sections() -> dict[str, type]:
    """Every registered section: name -> its dataclass, in registration order."""
    _discover()
    return dict(_SECTIONS)


def renamed_keys() -> dict[str, list[str]]:
    """Older spellings of registered keys: old dotted name -> the dotted names it is read as."""
    _discover()
    return {old: list(targets) for old, targets in _RENAMED.items()}


def section_default(name: str) -> Any:
    """A fresh `[name]` with every default; KeyError when no owner registered it."""
    return registered_sections()[name]()


__all__ = ["RENAMED_SINCE", "DatasetKindRule", "add_discovery", "dataset_kind_rules", "dataset_kinds",
           "register_dataset_kind_rule", "register_section", "registered_sections", "renamed_keys", "section_default"]
