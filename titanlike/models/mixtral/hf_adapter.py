"""Mixtral <-> Hugging Face MixtralForCausalLM (state dicts and config.json).

On disk (save_pretrained, and the published checkpoints) Mixtral keeps one tensor per expert,
`block_sparse_moe.experts.E.{w1,w2,w3}.weight` (w1 gate, w3 up, w2 down, as ours), and the router
`block_sparse_moe.gate.weight`. The mapping is the shared MoE decoders' (models/common/hf_moe.py)
with these names and without QK-norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    ATTENTION_NAMES,
    BLOCK_NORM_NAMES,
    COMPARED,
    DECODER_RULES,
    MOE_RULES,
    HFAdapter,
    decoder_config,
    unscaled_rope_theta,
)
from titanlike.models.common.hf_moe import (
    HFNames,
    check_softmax_routing,
    moe_from_hf_state_dict,
    moe_to_hf_state_dict,
    renormalizes_top_k,
)
from titanlike.models.common.moe import MoEArgs
from titanlike.models.mixtral.model import MixtralModelArgs

NAMES = HFNames(
    layer={**ATTENTION_NAMES, **BLOCK_NORM_NAMES, "moe.router.gate.weight": "block_sparse_moe.gate.weight"},
    experts="block_sparse_moe.experts",
    expert_weights={"moe.experts.w1": "w1.weight", "moe.experts.w2": "w2.weight", "moe.experts.w3": "w3.weight"},
)


class MixtralHF(HFAdapter):
    """MixtralForCausalLM."""

    model_types = ("mixtral",)
    config_rules = {**DECODER_RULES, **MOE_RULES, "sliding_window": COMPARED, "router_jitter_noise": COMPARED}

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: MixtralModelArgs) -> dict[str, torch.Tensor]:
        return moe_to_hf_state_dict(sd, args, NAMES)

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: MixtralModelArgs) -> dict[str, torch.Tensor]:
        return moe_from_hf_state_dict(hf_sd, args, NAMES)

    def args_to_config(self, args: MixtralModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        moe = args.moe
        check_softmax_routing(moe)
        if not renormalizes_top_k(moe):
            raise ValueError("Mixtral renormalizes the top-k gate values: set moe route_norm")
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": self.model_type(args),
            "hidden_size": args.dim,
            "intermediate_size": moe.hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "sliding_window": None,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> MixtralModelArgs:
        """MixtralModelArgs for a MixtralForCausalLM config.json (dict)."""
        for key, expected in (("hidden_act", "silu"), ("sliding_window", None), ("router_jitter_noise", 0.0)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported Mixtral config: {key}={cfg[key]!r} (expected {expected!r})")
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        moe = MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      hidden_dim=cfg["intermediate_size"], score_func="softmax", route_norm=True,
                      aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))
        head_dim = cfg.get("head_dim") or dim // n_heads
        return MixtralModelArgs(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            explicit_head_dim=None if head_dim == dim // n_heads and dim % n_heads == 0 else head_dim,
            vocab_size=cfg["vocab_size"],
            max_seq_len=cfg.get("max_position_embeddings", 32768),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=unscaled_rope_theta(cfg, 1_000_000.0),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            moe=moe,
        )


__all__ = ["MixtralHF", "NAMES"]
