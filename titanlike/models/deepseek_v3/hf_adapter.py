"""DeepSeek-V3 <-> Hugging Face DeepseekV3ForCausalLM (state dicts and config.json).

Weights as save_pretrained writes them: Llama's block norms and dense MLP names, MLA's
`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
`kv_b_proj`, `o_proj`, and in MoE layers the router `mlp.gate.weight`, the selection bias
`mlp.gate.e_score_correction_bias` (our moe.expert_bias), one tensor per routed expert
`mlp.experts.E.{gate,up,down}_proj.weight` and the shared experts as one MLP
`mlp.shared_experts.{gate,up,down}_proj.weight`. The mapping loop is the shared MoE decoders'
(models/common/hf_moe.py).

Multi-token-prediction modules are layers n_layers.. (as DeepSeek's checkpoints number them, e.g.
model.layers.61 of DeepSeek-V3), with `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` besides a
block's names, and copies of the embedding table and output head (`embed_tokens`,
`shared_head.head`), written on export (into multi_token_prediction.safetensors, which the index
does not list, so transformers loads the folder without naming them unexpected) and checked
against the model's own on import. transformers' DeepseekV3ForCausalLM ignores these layers (its
num_hidden_layers counts the trunk); a folder without them (save_pretrained drops them) reads as
the model without them (args_for_weights).

Two layout differences:
- kv_a_proj_with_mqa holds the latent's rows and the RoPE key's (kv_lora_rank + qk_rope_head_dim);
  we keep them as wkv_a and wk_pe (see attention.py), joined and split here.
- RoPE rows: with rope_interleave (HF's default and DeepSeek's checkpoints) HF rotates pairs as we
  do; without it, rotate-half, so the RoPE rows of each head of q_proj / q_b_proj and of
  kv_a_proj_with_mqa are permuted (args.hf_rope_interleave records which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    BLOCK_NORM_NAMES,
    COMPARED,
    COUNT,
    DECODER_RULES,
    DENSE_MLP_NAMES,
    FLAG,
    INDEX,
    MOE_RULES,
    HFAdapter,
    decoder_config,
    half_to_interleaved,
    interleaved_to_half,
    optional,
    rope_settings,
)
from titanlike.models.common.hf_moe import (
    EXPERT_PROJ_NAMES,
    MLP_EXPERTS,
    ROUTER_NAMES,
    HFNames,
    moe_from_hf_state_dict,
    moe_to_hf_state_dict,
)
from titanlike.models.common.init import canonical_fqn
from titanlike.models.common.moe import MoEArgs
from titanlike.models.common.rope import YaRNScaling
from titanlike.models.deepseek_v3.model import DeepSeekV3ModelArgs

# wkv_a and wk_pe joined, as HF's one kv_a_proj_with_mqa (a name that exists only in transit).
_KV_A = "attention.wkv_a_with_pe.weight"
_EXPERT_BIAS = "moe.expert_bias"


def _rope_rows(w: torch.Tensor, heads: int, head_dim: int, rope_dim: int, convert) -> torch.Tensor:
    """`convert` (interleaved <-> rotate-half) applied to the last rope_dim rows of each head."""
    out_dim, in_dim = w.shape
    nope, rope = w.view(heads, head_dim, in_dim).split([head_dim - rope_dim, rope_dim], dim=1)
    rope = convert(rope.reshape(heads * rope_dim, in_dim), heads).view(heads, rope_dim, in_dim)
    return torch.cat([nope, rope], dim=1).reshape(out_dim, in_dim)


def _rope_layout(convert):
    def change(name: str, value: torch.Tensor, args) -> torch.Tensor:
        if args.hf_rope_interleave:
            return value
        if name in ("attention.wq.weight", "attention.wq_b.weight"):
            return _rope_rows(value, args.n_heads, args.qk_head_dim, args.qk_rope_head_dim, convert)
        if name == _KV_A:
            return _rope_rows(value, 1, args.kv_lora_rank + args.qk_rope_head_dim, args.qk_rope_head_dim, convert)
        return value

    return change


NAMES = HFNames(
    layer={
        **BLOCK_NORM_NAMES, **DENSE_MLP_NAMES,
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        _KV_A: "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        **ROUTER_NAMES,
        _EXPERT_BIAS: "mlp.gate.e_score_correction_bias",
        # The shared experts are one SwiGLU MLP, named as the dense one under mlp.shared_experts.
        **{f"moe.shared_experts.{ours.removeprefix('feed_forward.')}": f"mlp.shared_experts.{hf.removeprefix('mlp.')}"
           for ours, hf in DENSE_MLP_NAMES.items()},
        # Multi-token prediction layers only.
        "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "head_norm.weight": "shared_head.norm.weight",
    },
    experts=MLP_EXPERTS,
    expert_weights=EXPERT_PROJ_NAMES,
    to_hf_layout=_rope_layout(interleaved_to_half),
    from_hf_layout=_rope_layout(half_to_interleaved),
)


# config.json ---------------------------------------------------------------------------------

# DeepSeek-V3's aux-loss-free balancing speed (its report, section 4.2): config.json has no field
# for it, and a model read from one should keep selecting with its bias.
HF_BIAS_UPDATE_RATE = 1e-3


def check_hf_routing(moe) -> None:
    """ValueError unless the routing is DeepseekV3ForCausalLM's: sigmoid scores, selection with the
    bias over group-limited experts, every layer after the first dense ones MoE."""
    if moe.score_func != "sigmoid" or not moe.score_before_topk:
        raise ValueError("DeepseekV3ForCausalLM routes with sigmoid scores (moe score_func sigmoid)")
    if moe.layer_freq != 1:
        raise ValueError("DeepseekV3ForCausalLM has a mixture of experts in every layer after first_k_dense: "
                         "set moe layer_freq 1")
    if moe.shared_hidden_dim not in (None, moe.hidden_dim):
        raise ValueError("DeepseekV3ForCausalLM's shared experts are as wide as the routed ones: unset "
                         "moe shared_hidden_dim")
    if moe.route_norm and moe.top_k == 1:
        # HF renormalizes a single gate value to 1; ours keeps it (as Megatron does for top 1).
        raise ValueError("with top_k 1, route_norm differs from DeepseekV3ForCausalLM's norm_topk_prob")
    if moe.num_experts // moe.n_groups < 2:
        raise ValueError("DeepseekV3ForCausalLM scores each expert group by its best two experts: "
                         "groups need at least 2 experts")


class DeepSeekV3HF(HFAdapter):
    """DeepseekV3ForCausalLM."""

    model_types = ("deepseek_v3",)
    config_rules = {
        **DECODER_RULES, **MOE_RULES, "scoring_func": COMPARED, "topk_method": COMPARED, "moe_layer_freq": COMPARED,
        "q_lora_rank": optional(INDEX), "kv_lora_rank": COUNT, "qk_nope_head_dim": COUNT, "qk_rope_head_dim": COUNT,
        "v_head_dim": COUNT, "rope_interleave": FLAG, "num_nextn_predict_layers": INDEX, "num_mtp_layers": INDEX,
    }

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> DeepseekV3ForCausalLM's as saved on disk."""
        ours = {canonical_fqn(k): v for k, v in sd.items()}
        ours.pop("mtp_embeddings.weight", None)  # tok_embeddings under its tied name
        for key in [k for k in ours if k.endswith(".attention.wkv_a.weight")]:
            prefix = key.removesuffix("wkv_a.weight")
            ours[f"{prefix}wkv_a_with_pe.weight"] = torch.cat([ours.pop(key), ours.pop(f"{prefix}wk_pe.weight")])
        hf = moe_to_hf_state_dict(ours, args, NAMES)
        # Without aux-loss-free balancing our layers keep no bias (they select on the plain scores);
        # HF always reads one: zeros select the same experts.
        for key in [k for k in hf if k.endswith(".mlp.gate.weight")]:
            hf.setdefault(key.removesuffix("weight") + "e_score_correction_bias",
                          torch.zeros(args.moe.num_experts, dtype=torch.float32))
        for layer in range(args.n_layers, args.total_layers):
            # Copies, not the same tensor: safetensors refuses tensors that share memory.
            hf[f"model.layers.{layer}.embed_tokens.weight"] = ours["tok_embeddings.weight"].clone()
            hf[f"model.layers.{layer}.shared_head.head.weight"] = ours["output.weight"].clone()
        return hf

    def unlisted_tensors(self, names: Collection[str], args: DeepSeekV3ModelArgs) -> tuple[str, set[str]]:
        """The multi-token-prediction layers: DeepseekV3ForCausalLM has no module for them and ignores
        only DeepSeek-V3's own layer 61 by name, so any other model's would be listed as unexpected."""
        prefixes = tuple(f"model.layers.{layer}." for layer in range(args.n_layers, args.total_layers))
        return "multi_token_prediction.safetensors", {name for name in names if name.startswith(prefixes)}

    def args_for_weights(self, args: DeepSeekV3ModelArgs, names: Collection[str]) -> DeepSeekV3ModelArgs:
        """transformers' save_pretrained keeps num_nextn_predict_layers in config.json but drops those
        layers (DeepseekV3ForCausalLM has no module for them): such a folder is the model without
        them, as transformers reads it; the prediction layers it does hold are kept."""
        held = 0
        for layer in range(args.n_layers, args.total_layers):
            if not any(name.startswith(f"model.layers.{layer}.") for name in names):
                break
            held += 1
        return args if held == args.mtp_num_layers else dataclasses.replace(args, mtp_num_layers=held)

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor],
                           args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
        """DeepseekV3ForCausalLM's state dict (per-expert tensors, as on disk) -> ours (load_state_dict
        strict)."""
        hf_sd = dict(hf_sd)
        for layer in range(args.n_layers, args.total_layers):
            if not any(k.startswith(f"model.layers.{layer}.") for k in hf_sd):
                raise ValueError(f"config.json lists num_nextn_predict_layers {args.mtp_num_layers} but the weights "
                                 f"have no model.layers.{layer} (transformers' save_pretrained drops the "
                                 "multi-token-prediction layers); read the folder with "
                                 "titanlike.checkpoint.hf_folder_args, which loads it without them")
            # DeepSeek's checkpoints repeat the table and head in every prediction layer: copies of ours.
            for copy, own in (("embed_tokens.weight", "model.embed_tokens.weight"),
                              ("shared_head.head.weight", "lm_head.weight")):
                value = hf_sd.pop(f"model.layers.{layer}.{copy}", None)
                if value is not None and own in hf_sd and not torch.equal(value, hf_sd[own]):
                    raise ValueError(f"model.layers.{layer}.{copy} differs from {own}; this model shares one table")
        sd = moe_from_hf_state_dict(hf_sd, args, NAMES)
        for key in [k for k in sd if k.endswith(_KV_A)]:
            prefix = key.removesuffix(_KV_A)
            sd[f"{prefix}attention.wkv_a.weight"], sd[f"{prefix}attention.wk_pe.weight"] = sd.pop(key).split(
                [args.kv_lora_rank, args.qk_rope_head_dim])
        if args.moe is not None and args.moe.bias_update_rate == 0:
            # Our layers select experts with the bias only under aux-loss-free balancing.
            for key in [k for k in sd if k.endswith(_EXPERT_BIAS)]:
                if sd.pop(key).any():
                    hf_key = f"model.{key.removesuffix(_EXPERT_BIAS)}mlp.gate.e_score_correction_bias"
                    raise ValueError(f"{hf_key} is not zero, and the model uses it only with moe.bias_update_rate > 0; "
                                     "set it (DeepSeek-V3: 0.001)")
        return sd

    def args_to_config(self, args: DeepSeekV3ModelArgs, *,
                       max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json for DeepseekV3ForCausalLM (a dense model: every layer within first_k_dense_replace)."""
        cfg: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": self.model_type(args),
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            # transformers sets head_dim to the RoPE width (it sizes the rotary table from it).
            "head_dim": args.qk_rope_head_dim,
            "rope_scaling": args.rope_scaling.to_hf() if args.rope_scaling is not None else None,
            "rope_interleave": args.hf_rope_interleave,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "num_nextn_predict_layers": args.mtp_num_layers,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        moe = args.moe
        if moe is None:
            return {**cfg, "first_k_dense_replace": args.n_layers}
        check_hf_routing(moe)
        cfg.update({
            "first_k_dense_replace": moe.first_k_dense,
            "moe_layer_freq": 1,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.num_shared_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "n_group": moe.n_groups,
            "topk_group": moe.topk_groups,
            "norm_topk_prob": moe.route_norm,
            "routed_scaling_factor": moe.route_scale,
            # Read by DeepSeek's own modeling code and by other readers (vLLM), not by transformers.
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "seq_aux": True,
            "aux_loss_alpha": moe.seq_aux_loss_coeff,
        })
        return cfg

    def config_to_args(self, cfg: Mapping[str, Any]) -> DeepSeekV3ModelArgs:
        """DeepSeekV3ModelArgs for a DeepseekV3ForCausalLM config.json (dict); absent keys take
        transformers' DeepseekV3Config defaults, except multi-token prediction (none unless listed)."""
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("scoring_func", "sigmoid"),
                              ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported DeepSeek-V3 config: {key}={cfg[key]!r} (expected {expected!r})")
        n_layers, dim, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        if cfg.get("num_key_value_heads") not in (None, n_heads):
            raise ValueError(f"unsupported DeepSeek-V3 config: num_key_value_heads {cfg['num_key_value_heads']} != "
                             f"num_attention_heads {n_heads} (multi-head latent attention has one key per head)")
        max_positions = cfg.get("max_position_embeddings", 4096)
        rope, rope_type = rope_settings(cfg)
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (default or yarn)")
        scaling = YaRNScaling.from_hf(rope, max_position_embeddings=max_positions) if rope_type == "yarn" else None
        first_k_dense = cfg.get("first_k_dense_replace", 3)
        moe = None
        if first_k_dense < n_layers:
            moe = MoEArgs(
                num_experts=cfg.get("n_routed_experts", cfg.get("num_local_experts", 256)),
                top_k=cfg.get("num_experts_per_tok", 8), hidden_dim=cfg.get("moe_intermediate_size", 2048),
                num_shared_experts=cfg.get("n_shared_experts", 1), score_func="sigmoid",
                route_norm=bool(cfg.get("norm_topk_prob", True)),
                route_scale=float(cfg.get("routed_scaling_factor", 2.5)),
                n_groups=cfg.get("n_group", 8), topk_groups=cfg.get("topk_group", 4), first_k_dense=first_k_dense,
                seq_aux_loss_coeff=float(cfg.get("aux_loss_alpha", 0.0)) if cfg.get("seq_aux", True) else 0.0,
                bias_update_rate=HF_BIAS_UPDATE_RATE)
        return DeepSeekV3ModelArgs(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            vocab_size=cfg["vocab_size"],
            max_seq_len=max_positions,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            moe=moe,
            ffn_hidden_dim=cfg["intermediate_size"],
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            kv_lora_rank=cfg.get("kv_lora_rank", 512),
            qk_nope_head_dim=cfg.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=cfg.get("qk_rope_head_dim", 64),
            v_head_dim=cfg.get("v_head_dim", 128),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            hf_rope_interleave=bool(cfg.get("rope_interleave", True)),
            mtp_num_layers=cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)),
        )


__all__ = ["DeepSeekV3HF", "NAMES"]
