"""Megatron-LM interchange for DeepSeek-V3: megatron-core GPTModel's names with multi-head latent attention
(MLASelfAttention, `--multi-latent-attention`), dense first layers (`--moe-layer-freq`), sigmoid routing with the
aux-loss-free expert bias (`mlp.router.expert_bias`) and shared experts (`mlp.shared_experts`).

megatron-core's MLA lays out q and the latent as we do: each head's q is [no-RoPE | RoPE] features (as is
linear_q_proj's / linear_q_up_proj's), linear_kv_up_proj gives each head's [k no-RoPE | v], and
linear_kv_down_proj's rows are the latent's, then the shared RoPE key's (split into our wkv_a and wk_pe). Its
RoPE (models/common/embeddings/rope_utils.py, multi_latent_attention) takes the even features then the odd
ones of each RoPE part and rotates halves of that, which is our rotation of adjacent pairs up to one
permutation of q's and k's RoPE features alike: the rows are kept as they are.

megatron-core normalises the latents with the model's norm epsilon, titanlike with 1e-6 as DeepSeek does
(deepseek_v3/attention.py LATENT_NORM_EPS); a model trained with another epsilon converts with that small
difference in its two latent norms.
"""

from collections.abc import Mapping
from typing import Any

from titanlike.models.common.megatron import DECODER_LAYER, DECODER_TOP, MegatronAdapter

# megatron-core MLATransformerConfig's YaRN fields (Megatron-LM's args of the same names) -> ours.
_YARN = {"rotary_scaling_factor": "factor", "original_max_position_embeddings": "original_max_position_embeddings",
         "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def mla_settings(settings: Mapping[str, Any], args) -> str | None:
    """Megatron-LM's RoPE type and YaRN settings and its router's (score function, scaling, groups) against the
    flavor's."""
    rope_type = settings.get("rope_type")
    if rope_type == "rope" and args.rope_scaling is not None:
        return "Megatron-LM trained it with --rope-type rope, the flavor scales RoPE (--model.args rope_scaling=none)"
    if rope_type == "yarn":
        if args.rope_scaling is None:
            return "Megatron-LM trained it with --rope-type yarn, the flavor has no rope_scaling (name a YaRN flavor)"
        for theirs, ours in _YARN.items():
            value, mine = settings.get(theirs), getattr(args.rope_scaling, ours)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) != float(mine or 0):
                return (f"Megatron-LM trained it with {theirs} {value}, the flavor has rope_scaling.{ours} {mine} "
                        f"(--model.args rope_scaling.{ours}={value})")
    moe = args.moe
    if moe is None:
        return None
    score = settings.get("moe_router_score_function")
    if isinstance(score, str) and score != moe.score_func:
        return (f"Megatron-LM trained it with --moe-router-score-function {score}, the flavor has moe.score_func "
                f"{moe.score_func} (--model.args moe.score_func={score})")
    scale = settings.get("moe_router_topk_scaling_factor", False)
    scale = 1.0 if scale is None else scale  # recorded unset: the gate values are not scaled
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and float(scale) != moe.route_scale:
        return (f"Megatron-LM trained it with --moe-router-topk-scaling-factor {scale}, the flavor has "
                f"moe.route_scale {moe.route_scale} (--model.args moe.route_scale={scale})")
    if score == "sigmoid" and moe.top_k > 1 and not moe.route_norm:
        return ("megatron-core renormalises the top-k sigmoid scores, the flavor does not "
                "(--model.args moe.route_norm=true)")
    groups, group_topk = settings.get("moe_router_num_groups") or 1, settings.get("moe_router_group_topk") or 1
    if isinstance(groups, int) and (groups, group_topk) != (moe.n_groups, moe.topk_groups):
        return (f"Megatron-LM trained it with --moe-router-num-groups {groups} and --moe-router-group-topk "
                f"{group_topk}, the flavor has moe.n_groups {moe.n_groups} and moe.topk_groups {moe.topk_groups} "
                f"(--model.args moe.n_groups={groups},moe.topk_groups={group_topk})")
    if moe.n_groups > 1 and moe.top_k // moe.topk_groups != min(2, moe.num_experts // moe.n_groups):
        return (f"megatron-core ranks expert groups by their best top_k / group_topk = "
                f"{moe.top_k // moe.topk_groups} scores, titanlike by their best 2: the routing would differ")
    return None


MEGATRON = MegatronAdapter(
    top=DECODER_TOP,
    layer={
        **DECODER_LAYER,
        "self_attention.linear_q_proj.weight": "attention.wq.weight",
        "self_attention.linear_q_down_proj.weight": "attention.wq_a.weight",
        "self_attention.q_layernorm.weight": "attention.q_norm.weight",
        "self_attention.linear_q_up_proj.weight": "attention.wq_b.weight",
        "self_attention.kv_layernorm.weight": "attention.kv_norm.weight",
        "self_attention.linear_kv_up_proj.weight": "attention.wkv_b.weight",
        "mlp.linear_fc2.weight": "feed_forward.w2.weight",
        "mlp.router.weight": "moe.router.gate.weight",
        "mlp.router.expert_bias": "moe.expert_bias",
        "mlp.shared_experts.linear_fc2.weight": "moe.shared_experts.w2.weight",
    },
    split_rows={"self_attention.linear_kv_down_proj.weight": (("attention.wkv_a.weight", "kv_lora_rank"),
                                                               ("attention.wk_pe.weight", "qk_rope_head_dim"))},
    fc1=("feed_forward.w1", "feed_forward.w3"),  # gate, up
    experts=("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"),  # gate, up, down
    shared_fc1=("moe.shared_experts.w1", "moe.shared_experts.w3"),
    check_settings=mla_settings,
)

__all__ = ["MEGATRON", "mla_settings"]
