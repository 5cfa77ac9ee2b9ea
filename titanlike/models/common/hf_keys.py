"""State-dict key renaming between our model families and their Hugging Face classes.

Most of an adapter's keys are plain renames: a few top-level names (embeddings, final norm,
output head) and, under each layer's prefix ("layers.N." ours, e.g. "model.layers.N." HF's), a
table of per-layer names. `HFKeyMap` holds those tables and renames one key either way;
anything it does not know comes back as None, so the adapter handles its special cases (fused
or stacked tensors, skipped buffers, aliases) around it and raises its own KeyError. Tensors
are not touched here: layout changes (transposes, RoPE row order) stay with the adapter.
`export_decoder` and `tie_output` are the decoders' shared export loop and last import step (the
output head of a tied model is its embedding table).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from titanlike.models.common.init import canonical_fqn


def _invert(table: Mapping[str, str], what: str) -> dict[str, str]:
    inverse = {v: k for k, v in table.items()}
    if len(inverse) != len(table):
        doubled = sorted(v for v, n in Counter(table.values()).items() if n > 1)
        raise ValueError(f"{what} maps several of our names onto {doubled}; the renaming must be one-to-one")
    return inverse


def _layer_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}(\d+)\.(.+)")


@dataclass(frozen=True)
class HFKeyMap:
    """One-to-one renames between our state-dict keys and a Hugging Face model's."""

    top: Mapping[str, str]  # our full key -> HF's, outside the layers
    layer: Mapping[str, str]  # our per-layer name -> HF's (each under its side's layer prefix)
    hf_layers: str  # HF's prefix of layer N without the N, e.g. "model.layers."
    our_layers: str = "layers."
    _hf_top: dict[str, str] = field(init=False, repr=False, compare=False)
    _hf_layer: dict[str, str] = field(init=False, repr=False, compare=False)
    _our_re: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _hf_re: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen: the derived lookups are set once, here.
        object.__setattr__(self, "_hf_top", _invert(self.top, "the top-level table"))
        object.__setattr__(self, "_hf_layer", _invert(self.layer, "the per-layer table"))
        object.__setattr__(self, "_our_re", _layer_re(self.our_layers))
        object.__setattr__(self, "_hf_re", _layer_re(self.hf_layers))

    def split(self, key: str) -> tuple[str, str] | None:
        """(layer index, per-layer name) of one of our keys under the layer prefix, else None."""
        m = self._our_re.fullmatch(key)
        return None if m is None else (m.group(1), m.group(2))

    def split_hf(self, key: str) -> tuple[str, str] | None:
        """(layer index, per-layer name) of a HF key under its layer prefix, else None."""
        m = self._hf_re.fullmatch(key)
        return None if m is None else (m.group(1), m.group(2))

    def to_hf(self, key: str) -> str | None:
        """HF's name for our (canonical) key; None when it is not a plain rename."""
        if key in self.top:
            return self.top[key]
        split = self.split(key)
        if split is None or split[1] not in self.layer:
            return None
        return f"{self.hf_layers}{split[0]}.{self.layer[split[1]]}"

    def from_hf(self, key: str) -> str | None:
        """Our name for a HF key; None when it is not a plain rename."""
        if key in self._hf_top:
            return self._hf_top[key]
        split = self.split_hf(key)
        if split is None or split[1] not in self._hf_layer:
            return None
        return f"{self.our_layers}{split[0]}.{self._hf_layer[split[1]]}"

    def layer_name(self, key: str) -> str | None:
        """The per-layer part of one of our keys (what layout changes key on); None for a top-level key."""
        split = self.split(key)
        return None if split is None else split[1]

    def export_decoder(self, sd: Mapping, *, tied: bool, convert: Callable[[str, Any], Any]) -> dict:
        """A decoder's state dict renamed to HF's, every key a plain rename: wrapper prefixes dropped,
        the RoPE cache (a buffer) and a tied output head (HF ties lm_head itself) skipped, each value
        passed through convert(our key, value) for its layout. KeyError for a key with no HF name."""
        hf = {}
        for key, value in sd.items():
            key = canonical_fqn(key)
            if key == "rope_cache" or (key == "output.weight" and tied):
                continue
            hf_key = self.to_hf(key)
            if hf_key is None:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
            hf[hf_key] = convert(key, value)
        return hf

    def tie_output(self, sd: dict, tied: bool) -> None:
        """After reading a decoder's HF weights: a tied output head is the embedding table (HF
        stores no lm_head for it); an untied one must have been read. KeyError naming HF's key."""
        if tied:
            if "tok_embeddings.weight" not in sd:
                raise KeyError(f"tied model without {self.top['tok_embeddings.weight']}")
            sd["output.weight"] = sd["tok_embeddings.weight"]
        elif "output.weight" not in sd:
            raise KeyError(f"untied model without {self.top['output.weight']} (is tie_word_embeddings set correctly?)")


__all__ = ["HFKeyMap"]
