"""Qwen3 <-> Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM (state dicts and config.json).

Weights as save_pretrained writes them and from_pretrained reads them: Llama's names plus
`self_attn.{q,k}_norm.weight`, and for MoE layers the router `mlp.gate.weight` (E, D) and one
tensor per expert and projection, `mlp.experts.E.{gate,up,down}_proj.weight`; the loop that
stacks and unstacks them is shared with the other MoE decoders (models/common/hf_moe.py). Our
RoPE is pair-interleaved, HF's rotate-half, so the rows of q/k projections and the entries of
the q/k norm weights are permuted on the way.
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
    DENSE_MLP_NAMES,
    MOE_RULES,
    HFAdapter,
    decoder_config,
    unscaled_rope_theta,
)
from titanlike.models.common.hf_moe import (
    EXPERT_PROJ_NAMES,
    MLP_EXPERTS,
    ROUTER_NAMES,
    HFNames,
    check_softmax_routing,
    moe_from_hf_state_dict,
    moe_to_hf_state_dict,
    renormalizes_top_k,
)
from titanlike.models.common.moe import MoEArgs
from titanlike.models.qwen3.model import Qwen3ModelArgs

QWEN3 = "qwen3"
QWEN3_MOE = "qwen3_moe"

NAMES = HFNames(
    layer={**ATTENTION_NAMES, **BLOCK_NORM_NAMES, **DENSE_MLP_NAMES,
           "attention.q_norm.weight": "self_attn.q_norm.weight",
           "attention.k_norm.weight": "self_attn.k_norm.weight",
           **ROUTER_NAMES},
    experts=MLP_EXPERTS,
    expert_weights=EXPERT_PROJ_NAMES,
)


def moe_layer_pattern(moe_layers: list[int], n_layers: int) -> tuple[int, int]:
    """(first_k_dense, layer_freq) whose MoE layers are exactly `moe_layers`; ValueError if none."""
    if not moe_layers:
        raise ValueError("the config has no MoE layer")
    first = moe_layers[0]
    freq = moe_layers[1] - first if len(moe_layers) > 1 else max(1, n_layers - first)
    probe = MoEArgs(first_k_dense=first, layer_freq=freq)
    if [i for i in range(n_layers) if probe.is_moe_layer(i)] != moe_layers:
        raise ValueError(f"MoE layers {moe_layers} are not every k-th layer after the first dense ones "
                         "(first_k_dense / layer_freq cannot express them)")
    return first, freq


class Qwen3HF(HFAdapter):
    """Qwen3ForCausalLM ("qwen3") for dense args, Qwen3MoeForCausalLM ("qwen3_moe") for args with moe."""

    model_types = (QWEN3, QWEN3_MOE)
    config_rules = {**DECODER_RULES, **MOE_RULES, "use_sliding_window": COMPARED}
    score_architecture = "Qwen3ForSequenceClassification"
    score_names = {"lm_head.weight": "score.weight"}

    def model_type(self, args: Qwen3ModelArgs) -> str:
        return QWEN3_MOE if args.moe is not None else QWEN3

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
        return moe_to_hf_state_dict(sd, args, NAMES)

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
        return moe_from_hf_state_dict(hf_sd, args, NAMES)

    def args_to_config(self, args: Qwen3ModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": self.model_type(args),
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if not args.qk_norm:
            raise ValueError("Qwen3 without QK-norm has no Hugging Face equivalent")
        if args.moe is not None:
            moe = args.moe
            check_softmax_routing(moe)
            cfg.update({
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.hidden_dim,
                "norm_topk_prob": renormalizes_top_k(moe),
                # Every layer not MoE listed: exact for any first_k_dense / layer_freq.
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(args.n_layers) if not moe.is_moe_layer(i)],
                "router_aux_loss_coef": moe.aux_loss_coeff,
                "output_router_logits": False,
            })
        return cfg

    def config_to_args(self, cfg: Mapping[str, Any]) -> Qwen3ModelArgs:
        """Qwen3ModelArgs for a Qwen3ForCausalLM or Qwen3MoeForCausalLM config.json (dict)."""
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported Qwen3 config: {key}={cfg[key]!r} (expected {expected!r})")
        n_layers, dim, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        moe = None
        if cfg.get("model_type") == QWEN3_MOE:
            num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if num_experts is None:
                raise KeyError("num_experts")
            step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
            moe_layers = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
            first_k_dense, layer_freq = moe_layer_pattern(moe_layers, n_layers)
            moe = MoEArgs(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                          hidden_dim=cfg["moe_intermediate_size"], score_func="softmax",
                          route_norm=bool(cfg.get("norm_topk_prob", False)), first_k_dense=first_k_dense,
                          layer_freq=layer_freq, aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))
        return Qwen3ModelArgs(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            explicit_head_dim=cfg.get("head_dim") or dim // n_heads,
            ffn_hidden_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_seq_len=cfg.get("max_position_embeddings", 40960),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=unscaled_rope_theta(cfg, 1_000_000.0),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            moe=moe,
        )


__all__ = ["NAMES", "Qwen3HF", "moe_layer_pattern"]
