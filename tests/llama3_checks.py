"""The tiny Llama 3 that tests/unit/test_llama3_model.py and tests/distributed/test_llama3_model_ranks.py
build, written once (imported like tests/family_checks.py)."""

from __future__ import annotations

import dataclasses

from family_checks import materialize
from titanlike.models.llama3 import Transformer, llama3_flavors

TINY = llama3_flavors["debugmodel_tiny"]


def tiny_args(**overrides):
    return dataclasses.replace(TINY, **{"vocab_size": 320, "max_seq_len": 64, **overrides})


def build(args, seed=0, device="cpu"):
    """The trainer's sequence: meta construction, to_empty, init_weights."""
    return materialize(Transformer, args, seed=seed, device=device)
