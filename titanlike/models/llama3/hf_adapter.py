"""Hugging Face interchange for Llama 3: state-dict keys and config.json.

Two differences besides names:
- RoPE layout. We (like Meta's original checkpoints and torchtitan) rotate adjacent
  pairs (x[2i], x[2i+1]) of each head; HF's LlamaForCausalLM rotates the two halves
  (x[i], x[i + head_dim/2]). The attention scores are unchanged if the output rows of
  wq and wk are permuted within each head accordingly, which is what HF's own
  conversion script does; wv/wo are not rotated and keep their layout.
- Tied embeddings. HF stores no lm_head.weight for a tied model; our state dict
  has output.weight as an alias of tok_embeddings.weight.

Works on plain tensors (DTensors must be gathered first).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from titanlike.models.common.hf import (
    ATTENTION_NAMES,
    BLOCK_NORM_NAMES,
    DECODER_LAYERS,
    DECODER_TOP,
    DECODER_RULES,
    DENSE_MLP_NAMES,
    TO_HALF,
    TO_INTERLEAVED,
    HFAdapter,
    decoder_config,
    rope_settings,
)
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.rope import RoPEScaling
from titanlike.models.llama3.model import TransformerModelArgs

# Our names -> HF's: top-level, and per layer (under layers.N. / model.layers.N.).
KEYS = HFKeyMap(top=DECODER_TOP, layer={**ATTENTION_NAMES, **DENSE_MLP_NAMES, **BLOCK_NORM_NAMES},
                hf_layers=DECODER_LAYERS)


class Llama3HF(HFAdapter):
    """LlamaForCausalLM. `flavors`: the family's published flavors, whose MLP rule a config.json's
    intermediate_size is matched against first (so a converted 8B gets the 8B's args)."""

    model_types = ("llama",)
    config_rules = DECODER_RULES
    score_architecture = "LlamaForSequenceClassification"
    score_names = {"lm_head.weight": "score.weight"}

    def __init__(self, flavors: Mapping[str, TransformerModelArgs]):
        self.flavors = flavors

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> LlamaForCausalLM's. Wrapper prefixes in keys are ignored."""
        return KEYS.export_decoder(sd, tied=args.tie_word_embeddings,
                                   convert=lambda key, value: TO_HALF(KEYS.layer_name(key), value, args))

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor],
                           args: TransformerModelArgs) -> dict[str, torch.Tensor]:
        """LlamaForCausalLM's state dict -> ours (loadable with load_state_dict(strict=True))."""
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            if "rotary_emb." in key:  # older transformers saved inv_freq; we recompute RoPE
                continue
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            name = KEYS.from_hf(key)
            if name is None:
                raise KeyError(f"unexpected Hugging Face Llama parameter {key!r}")
            sd[name] = TO_INTERLEAVED(KEYS.layer_name(name), value, args)
        KEYS.tie_output(sd, args.tie_word_embeddings)
        return sd

    def args_to_config(self, args: TransformerModelArgs, *,
                       max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for LlamaForCausalLM.

        Uses the rope_theta / rope_scaling keys, which transformers 4.x and other readers
        (vLLM, llama.cpp) understand and transformers 5.x converts to rope_parameters.

        With Llama 3 RoPE scaling, a context not above the scaling's original one (the debug
        flavors: 2048 <= 8192) is written as the context the scaling extends to, original x factor:
        transformers warns about a scaled model whose context does not exceed its original one,
        and Llama 3 frequencies never depend on max_position_embeddings, so the model computes the
        same. Read back, such a folder gives max_seq_len = that longer context.
        """
        rope_scaling = None
        decoder = decoder_config(args, max_position_embeddings=max_position_embeddings)
        if args.rope_scaling is not None:
            s = args.rope_scaling
            rope_scaling = {
                "rope_type": "llama3",
                "factor": float(s.factor),
                "low_freq_factor": float(s.low_freq_factor),
                "high_freq_factor": float(s.high_freq_factor),
                "original_max_position_embeddings": int(s.original_max_position_embeddings),
            }
            if decoder["max_position_embeddings"] <= s.original_max_position_embeddings:
                decoder["max_position_embeddings"] = int(s.original_max_position_embeddings * s.factor)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": self.model_type(args),
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            **decoder,
            "rope_scaling": rope_scaling,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> TransformerModelArgs:
        """TransformerModelArgs for a LlamaForCausalLM config.json (dict)."""
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported Llama config: {key}={cfg[key]!r} (expected {expected!r})")
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if cfg.get("head_dim") not in (None, dim // n_heads):
            raise ValueError(f"head_dim {cfg['head_dim']} != hidden_size / num_attention_heads ({dim // n_heads})")

        rope, rope_type = rope_settings(cfg)
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope_type == "llama3":
            rope_scaling = RoPEScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            rope_scaling = None
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")

        multiple_of, ffn_dim_multiplier = self._ffn_rule(dim, cfg["intermediate_size"])
        args = TransformerModelArgs(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            vocab_size=cfg["vocab_size"],
            multiple_of=multiple_of,
            ffn_dim_multiplier=ffn_dim_multiplier,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )
        assert args.ffn_hidden_dim == cfg["intermediate_size"], (args.ffn_hidden_dim, cfg["intermediate_size"])
        return args

    def _ffn_rule(self, dim: int, intermediate_size: int) -> tuple[int, float | None]:
        """(multiple_of, ffn_dim_multiplier) reproducing intermediate_size under Meta's rule.

        A published flavor's pair is preferred, so a converted 8B gets the 8B's args; any
        other size is expressed with multiple_of = intermediate_size, which rounds every
        hidden size in (0, intermediate_size] up to exactly intermediate_size.
        """
        for flavor in self.flavors.values():
            if flavor.dim == dim and flavor.ffn_hidden_dim == intermediate_size:
                return flavor.multiple_of, flavor.ffn_dim_multiplier
        base = int(2 * (4 * dim) / 3)
        if base <= intermediate_size:
            return intermediate_size, None
        # Aim just below intermediate_size so float rounding cannot push it over.
        return intermediate_size, (intermediate_size - 0.5) / base


__all__ = ["KEYS", "Llama3HF"]
