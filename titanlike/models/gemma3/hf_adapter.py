"""Gemma 3 <-> Hugging Face Gemma3ForCausalLM ("gemma3_text"): state dicts and config.json.

Llama's names plus QK-norm and Gemma's four block norms; q/k rows (and QK-norm weights) permuted
between our pair-interleaved RoPE and HF's rotate-half (models/common/hf.py); every RMSNorm weight
is HF's plus 1 (Gemma multiplies by 1 + weight, ours by the weight). config.json is written with the
keys the published checkpoints carry (rope_theta, rope_local_base_freq, rope_scaling,
sliding_window_pattern), which transformers 5 converts to rope_parameters; both forms are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    ATTENTION_NAMES,
    COMPARED,
    COUNT,
    DECODER_LAYERS,
    DECODER_RULES,
    DECODER_TOP,
    DENSE_MLP_NAMES,
    POSITIVE,
    ROPE,
    TEXT,
    TO_HALF,
    TO_INTERLEAVED,
    HFAdapter,
    decoder_config,
    list_of,
    optional,
    table,
)
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.gemma3.model import Gemma3ModelArgs

NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
KEYS = HFKeyMap(top=DECODER_TOP, layer={**ATTENTION_NAMES, **DENSE_MLP_NAMES, **NORMS}, hf_layers=DECODER_LAYERS)
SLIDING, FULL = "sliding_attention", "full_attention"


def _whole(value: float) -> int:
    if float(value) != int(value):
        raise ValueError(f"query_pre_attn_scalar {value} is not a whole number (transformers' Gemma 3 takes an int)")
    return int(value)


def _is_norm(key: str) -> bool:
    return key == "norm.weight" or KEYS.layer_name(key) in NORMS


class Gemma3HF(HFAdapter):
    model_types = ("gemma3_text",)
    config_rules = {
        **DECODER_RULES, "hidden_activation": COMPARED, "query_pre_attn_scalar": POSITIVE,
        "sliding_window": COUNT, "sliding_window_pattern": COUNT, "layer_types": optional(list_of(TEXT)),
        "rope_local_base_freq": POSITIVE, "rope_parameters": table({FULL: ROPE, SLIDING: ROPE}),
        "final_logit_softcapping": COMPARED, "attn_logit_softcapping": COMPARED,
        "use_bidirectional_attention": COMPARED,
    }
    # Gemma's tokenizer starts every text with <bos>, as Llama's.

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: Gemma3ModelArgs) -> dict[str, torch.Tensor]:
        def convert(key: str, value: torch.Tensor) -> torch.Tensor:
            value = value - 1 if _is_norm(key) else value
            return TO_HALF(KEYS.layer_name(key), value, args)

        return KEYS.export_decoder(sd, tied=args.tie_word_embeddings, convert=convert)

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: Gemma3ModelArgs) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            name = KEYS.from_hf(key)
            if name is None:
                raise KeyError(f"unexpected Hugging Face Gemma 3 parameter {key!r}")
            value = TO_INTERLEAVED(KEYS.layer_name(name), value, args)
            sd[name] = value + 1 if _is_norm(name) else value
        KEYS.tie_output(sd, args.tie_word_embeddings)
        return sd

    def args_to_config(self, args: Gemma3ModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        scaling = None if args.rope_scaling_factor == 1 else {"rope_type": "linear",
                                                                "factor": float(args.rope_scaling_factor)}
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": self.model_types[0],
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            "rope_local_base_freq": float(args.rope_local_theta),
            "rope_scaling": scaling,
            "sliding_window": args.sliding_window,
            "sliding_window_pattern": args.sliding_window_pattern,
            "layer_types": [FULL if args.attention_window(i) is None else SLIDING for i in range(args.n_layers)],
            "query_pre_attn_scalar": args.query_pre_attn_scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> Gemma3ModelArgs:
        """Gemma3ModelArgs for a Gemma3ForCausalLM config.json (dict)."""
        for key, expected in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False),
                              ("use_bidirectional_attention", False),
                              # Gemma 2's tanh caps; Gemma 3 scales q by query_pre_attn_scalar instead.
                              ("final_logit_softcapping", None), ("attn_logit_softcapping", None)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported Gemma 3 config: {key}={cfg[key]!r} (expected {expected!r})")
        n_layers, dim, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        pattern = cfg.get("sliding_window_pattern", 6)
        args = Gemma3ModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            explicit_head_dim=cfg.get("head_dim") or dim // n_heads, ffn_hidden_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"], max_seq_len=cfg.get("max_position_embeddings", 131072),
            norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            sliding_window=cfg.get("sliding_window") or 4096, sliding_window_pattern=pattern,
            query_pre_attn_scalar=_whole(cfg.get("query_pre_attn_scalar", 256)), **self._rope(cfg))
        layer_types = cfg.get("layer_types")
        ours = [FULL if args.attention_window(i) is None else SLIDING for i in range(n_layers)]
        if layer_types is not None and list(layer_types) != ours:
            pattern_found = [i for i, kind in enumerate(layer_types) if kind != SLIDING]
            raise ValueError(f"layer_types with full attention at layers {pattern_found[:8]} are not every "
                             f"sliding_window_pattern-th ({pattern}) layer")
        return args

    def _rope(self, cfg: Mapping[str, Any]) -> dict[str, float]:
        """The two RoPE bases and the global layers' linear factor, from rope_parameters (transformers 5)
        or rope_theta / rope_local_base_freq / rope_scaling (the published checkpoints)."""
        nested = cfg.get("rope_parameters") or {}
        full = nested.get(FULL) or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        local = nested.get(SLIDING) or {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        for kind, rope in ((FULL, full), (SLIDING, local)):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "linear") or (kind == SLIDING and rope_type != "default"):
                raise ValueError(f"unsupported rope_type {rope_type!r} for the {kind} layers")
        factor = float(full.get("factor", 1.0)) if full.get("rope_type", full.get("type")) == "linear" else 1.0
        return dict(rope_theta=float(full.get("rope_theta", 1e6)), rope_scaling_factor=factor,
                    rope_local_theta=float(local.get("rope_theta", 1e4)))


__all__ = ["Gemma3HF", "KEYS"]
