"""The tiny T5 that tests/unit/test_t5_model.py and tests/distributed/test_t5_model_ranks.py build, written
once (imported like tests/family_checks.py)."""

from __future__ import annotations

import dataclasses

from family_checks import materialize
from titanlike.models.t5 import T5, T5Args, t5_flavors


def tiny_args(**overrides) -> T5Args:
    return dataclasses.replace(t5_flavors["debugmodel"], **{"dim": 64, "n_heads": 4, "head_dim": 16,
                                                            "ffn_hidden_dim": 96, "vocab_size": 320, **overrides})


def build(args, seed=0) -> T5:
    """The trainer's sequence: meta construction, to_empty, init_weights."""
    return materialize(T5, args, seed=seed).eval()
