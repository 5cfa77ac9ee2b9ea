"""Dataset kinds: the values of training.dataset and validation.dataset, each an object with its own
rules (whether it holds out a split, which samples besides token windows it gives, what its
dataset_path must be). Apart from the loader (data/loader.py, which registers the built-in kinds and
builds their sources) so that the modules building an objective's samples from a kind
(data/sentence_samples.py, data/conversations.py) look kinds up without importing the loader.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from titanlike.data.errors import DataError


@dataclass(frozen=True)
class DatasetKind:
    """A dataset kind and its own rules: other code asks the kind (`dataset_kind(name)`) rather than
    comparing kind names, so a new kind is one registration (data/loader.py registers the built-in ones)."""

    name: str
    factory: Callable[..., Any]  # (*, dataset_path, tokenizer, seq_len, seed, num_samples, split, split_name)
    shuffle: bool  # reshuffle a map-style source's samples every epoch from `seed`
    needs_path: bool
    workers_ok: bool  # False where the source cannot be read whole inside each loader worker
    optional_path: bool = False  # reads dataset_path when given, works without it too
    # Its data keep a held-out split (split_name "valid") that validation reads when it has no dataset
    # of its own (and, reading no path, when it is validation.dataset: validates_on_held_out).
    held_out: bool = False
    # The samples it gives besides token windows, by sort -> the kind's reader of them:
    #   "sentences": reader(dataset_path=, tokenizer=, split=, what=) -> (sentence-split documents, the
    #       split string over them), for masked-LM and span-corruption samples (data/sentence_samples.py);
    #   "rows": reader(kind, dataset_path, option=, contents=) checks that the path holds JSONL or Parquet rows
    #       (conversations, preference pairs: data/conversations.py);
    #   "image_captions": image-caption samples (objectives/image_caption.py defines the reader).
    readers: Mapping[str, Any] = field(default_factory=dict)

    @property
    def takes_path(self) -> bool:
        return self.needs_path or self.optional_path

    def gives(self, sort: str) -> bool:
        return sort in self.readers

    @property
    def validates_on_held_out(self) -> bool:
        """As validation.dataset it gives its held-out part: reading no path, it trains on the same data."""
        return self.held_out and not self.takes_path


_KINDS: dict[str, DatasetKind] = {}


def register_dataset_kind(
    name: str, factory: Callable[..., Any], *, shuffle: bool, needs_path: bool = True, workers_ok: bool = True,
    optional_path: bool = False, streaming: bool = False, held_out: bool = False,
    readers: Mapping[str, Any] | None = None,
) -> None:
    """Add `name` as a dataset kind, and as a value of training.dataset and validation.dataset
    (config/sections.py: the config checks its path rule and, for a `streaming` source without end,
    validation.steps, before any process starts). held_out, readers: DatasetKind's."""
    from titanlike.config.sections import register_dataset_kind_rule

    _KINDS[name] = DatasetKind(name=name, factory=factory, shuffle=shuffle, needs_path=needs_path and not optional_path,
                               workers_ok=workers_ok, optional_path=optional_path, held_out=held_out,
                               readers=dict(readers or {}))
    register_dataset_kind_rule(name, path="optional" if optional_path else "required" if needs_path else "none",
                               streaming=streaming)


def dataset_kinds() -> list[str]:
    return sorted(_KINDS)


def dataset_kind(name: str) -> DatasetKind:
    """The registered kind `name` (DataError, one sentence, for an unknown name)."""
    kind = _KINDS.get(name)
    if kind is None:
        close = difflib.get_close_matches(str(name), _KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DataError(f"unknown dataset {name!r}{hint}; known: {', '.join(dataset_kinds())}")
    return kind


def find_dataset_kind(name: str | None) -> DatasetKind | None:
    """The registered kind `name`, or None (an unknown name is refused where the data is built)."""
    return _KINDS.get(name) if name is not None else None


def add_dataset_reader(name: str, sort: str, reader: Any) -> None:
    """Give the registered kind `name` a reader of `sort` (DatasetKind.readers): for an objective that
    defines how a built-in kind gives its samples (objectives/image_caption.py)."""
    kind = dataset_kind(name)
    if sort in kind.readers:
        raise ValueError(f"dataset kind {name!r} already has a {sort} reader")
    _KINDS[name] = replace(kind, readers={**kind.readers, sort: reader})


__all__ = ["DatasetKind", "add_dataset_reader", "dataset_kind", "dataset_kinds", "find_dataset_kind",
           "register_dataset_kind"]
