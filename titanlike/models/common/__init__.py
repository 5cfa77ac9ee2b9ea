"""Layers and helpers shared by model families."""

from titanlike.models.common.attention import core_attention, sdpa_takes_gqa
from titanlike.models.common.init import canonical_fqn, constant_, normal_, ones_, seed_for, trunc_normal_, zeros_
from titanlike.models.common.rope import (
    RoPEScaling,
    YaRNScaling,
    apply_rotary_emb,
    precompute_rope_cache,
    rope_inv_freq,
    yarn_mscale,
)

__all__ = [
    "RoPEScaling",
    "YaRNScaling",
    "apply_rotary_emb",
    "canonical_fqn",
    "core_attention",
    "sdpa_takes_gqa",
    "constant_",
    "normal_",
    "ones_",
    "precompute_rope_cache",
    "rope_inv_freq",
    "seed_for",
    "trunc_normal_",
    "yarn_mscale",
    "zeros_",
]
