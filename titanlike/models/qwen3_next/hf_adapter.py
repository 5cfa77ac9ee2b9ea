"""Qwen3-Next and Qwen3.5 <-> Hugging Face Qwen3NextForCausalLM, Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM (state dicts and config.json), by the args' release.

Names are Qwen3-MoE's plus `linear_attn.*` for Gated DeltaNet layers and `mlp.shared_expert*` for the
gated shared expert; experts are one tensor per expert on disk (models/common/hf_moe.py's loop).
Layouts that differ on the way:
  - q/k projections and QK-norm weights: RoPE rotates the first rotary_dim features of each head,
    pair-interleaved here, rotate-half in transformers (the rows of that part are permuted; a query
    projection's gate rows are not);
  - block norms, the final norm and QK-norms hold their scale here and scale - 1 there (Qwen's
    zero-centred RMSNorm); the Gated DeltaNet norm holds its scale on both sides;
  - the conv's channels are grouped by key head here ([q, k, v] of each), [all q, all k, all v] there;
    in_proj_qkvz and in_proj_ba are grouped by key head on both sides;
  - Qwen3.5 keeps those projections apart: in_proj_qkv ([all q, all k, all v], the conv's order),
    in_proj_z, in_proj_b and in_proj_a (value-head order), joined and split here (`_split_projections`).
Qwen3.5's multimodal RoPE turns every one of its three sections by the same position for text, which
is plain RoPE. A folder of the published multimodal models (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration: text_config, model.language_model.*) is read as its text model: the
vision tower's and multi-token prediction's tensors are left unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    ATTENTION_NAMES,
    BLOCK_NORM_NAMES,
    COUNT,
    DECODER_RULES,
    DENSE_MLP_NAMES,
    INDEX,
    MOE_RULES,
    POSITIVE,
    TEXT,
    HFAdapter,
    decoder_config,
    half_to_interleaved,
    interleaved_to_half,
    list_of,
    rope_settings,
    table,
)
from titanlike.models.common.hf_moe import (
    EXPERT_PROJ_NAMES,
    MLP_EXPERTS,
    ROUTER_NAMES,
    HFNames,
    moe_from_hf_state_dict,
    moe_to_hf_state_dict,
)
from titanlike.models.common.moe import MoEArgs
from titanlike.models.qwen3_next.model import Qwen3NextModelArgs

QWEN3_NEXT = "qwen3_next"
QWEN3_5 = "qwen3_5_text"
QWEN3_5_MOE = "qwen3_5_moe_text"
MULTIMODAL = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE}  # read as their text model
ARCHITECTURES = {QWEN3_NEXT: "Qwen3NextForCausalLM", QWEN3_5: "Qwen3_5ForCausalLM",
                 QWEN3_5_MOE: "Qwen3_5MoeForCausalLM"}
def _moe_layer_pattern(moe_layers: list[int], n_layers: int) -> tuple[int, int]:
    """(first_k_dense, layer_freq) whose MoE layers are exactly `moe_layers`; ValueError if none is."""
    first = moe_layers[0] if moe_layers else n_layers
    freq = moe_layers[1] - first if len(moe_layers) > 1 else max(1, n_layers - first)
    probe = MoEArgs(first_k_dense=first, layer_freq=freq)
    if not moe_layers or [i for i in range(n_layers) if probe.is_moe_layer(i)] != moe_layers:
        raise ValueError(f"MoE layers {moe_layers} are not every k-th layer after the first dense ones")
    return first, freq


ZERO_CENTRED = ("attention_norm.weight", "ffn_norm.weight", "attention.q_norm.weight", "attention.k_norm.weight")


def conv_channels(args: Qwen3NextModelArgs) -> torch.Tensor:
    """Our conv channels as indices into transformers' ([all q, all k, all v]): ours = theirs[index]."""
    kh, dk, dv = args.linear_k_heads, args.linear_k_dim, args.linear_v_dim
    r = args.linear_v_heads // kh
    groups = [torch.cat([h * dk + torch.arange(dk), kh * dk + h * dk + torch.arange(dk),
                         2 * kh * dk + h * r * dv + torch.arange(r * dv)]) for h in range(kh)]
    return torch.cat(groups)


def _rotary_rows(w: torch.Tensor, heads: int, head_dim: int, rotary_dim: int, convert, *, gated: bool) -> torch.Tensor:
    """w (heads x [head_dim (x 2 when gated)], ...) with the first rotary_dim rows of each head's
    query (or key) permuted by `convert` (one RoPE order to the other)."""
    shape = w.shape
    w = w.reshape(heads, 2 if gated else 1, head_dim, -1)
    rot = convert(w[:, 0, :rotary_dim].reshape(heads * rotary_dim, -1), heads).view(heads, rotary_dim, -1)
    first = torch.cat([rot, w[:, 0, rotary_dim:]], dim=1)[:, None]
    return torch.cat([first, w[:, 1:]], dim=1).reshape(shape)


def _layout(*, to_hf: bool):
    """(our per-layer name, tensor, args) -> tensor in transformers' layout (to_hf) or back (see the
    module docstring)."""
    convert, offset = (interleaved_to_half, -1.0) if to_hf else (half_to_interleaved, 1.0)

    def change(name: str | None, value: torch.Tensor, args: Qwen3NextModelArgs) -> torch.Tensor:
        hd, rot = args.head_dim, args.rotary_dim
        if name == "attention.wq.weight":
            return _rotary_rows(value, args.n_heads, hd, rot, convert, gated=True)
        if name == "attention.wk.weight":
            return _rotary_rows(value, args.num_kv_heads, hd, rot, convert, gated=False)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):
            value = _rotary_rows(value[:, None], 1, hd, rot, convert, gated=False)[:, 0]
        if name in ZERO_CENTRED:
            return value + offset
        if name == "linear_attention.conv_weight":
            index = conv_channels(args)
            if to_hf:  # ours (C, K) -> theirs (C, 1, K)
                out = torch.empty_like(value)
                out[index] = value
                return out[:, None]
            return value[:, 0][index]
        return value

    return change


NAMES = HFNames(
    layer={**ATTENTION_NAMES, **BLOCK_NORM_NAMES, **DENSE_MLP_NAMES, **ROUTER_NAMES,
           "attention.q_norm.weight": "self_attn.q_norm.weight",
           "attention.k_norm.weight": "self_attn.k_norm.weight",
           **{f"linear_attention.{name}": f"linear_attn.{name}"
              for name in ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log", "norm.weight",
                           "out_proj.weight")},
           "linear_attention.conv_weight": "linear_attn.conv1d.weight",
           "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
           "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
           "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
           "moe.shared_experts.gate.weight": "mlp.shared_expert_gate.weight"},
    experts=MLP_EXPERTS,
    expert_weights=EXPERT_PROJ_NAMES,
    to_hf_layout=_layout(to_hf=True),
    from_hf_layout=_layout(to_hf=False),
)


def _split_projections(hf: dict[str, torch.Tensor], args: Qwen3NextModelArgs) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped by key head) -> Qwen3.5's four projections."""
    kh, dk, dv = args.linear_k_heads, args.linear_k_dim, args.linear_v_dim
    r = args.linear_v_heads // kh
    out = {}
    for key, value in hf.items():
        if key.endswith("linear_attn.in_proj_qkvz.weight"):
            prefix = key[:-len("in_proj_qkvz.weight")]
            q, k, v, z = value.view(kh, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            out[prefix + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, value.shape[-1]) for t in (q, k, v)])
            out[prefix + "in_proj_z.weight"] = z.reshape(-1, value.shape[-1])
        elif key.endswith("linear_attn.in_proj_ba.weight"):
            prefix = key[:-len("in_proj_ba.weight")]
            b, a = value.view(kh, 2 * r, -1).split([r, r], dim=1)
            out[prefix + "in_proj_b.weight"] = b.reshape(-1, value.shape[-1])
            out[prefix + "in_proj_a.weight"] = a.reshape(-1, value.shape[-1])
        else:
            out[key] = value
    return out


def _join_projections(hf: Mapping[str, torch.Tensor], args: Qwen3NextModelArgs) -> dict[str, torch.Tensor]:
    """Qwen3.5's four Gated DeltaNet projections -> Qwen3-Next's in_proj_qkvz / in_proj_ba."""
    kh, dk, dv = args.linear_k_heads, args.linear_k_dim, args.linear_v_dim
    r = args.linear_v_heads // kh
    out = {}
    for key, value in hf.items():
        if key.endswith("linear_attn.in_proj_qkv.weight"):
            prefix, dim = key[:-len("in_proj_qkv.weight")], value.shape[-1]
            q, k, v = value.split([kh * dk, kh * dk, kh * r * dv])
            z = hf[prefix + "in_proj_z.weight"]
            parts = [t.reshape(kh, -1, dim) for t in (q, k, v, z)]
            out[prefix + "in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, dim)
            b, a = (hf[prefix + f"in_proj_{n}.weight"].reshape(kh, r, dim) for n in "ba")
            out[prefix + "in_proj_ba.weight"] = torch.cat([b, a], dim=1).reshape(-1, dim)
        elif not key.endswith(("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                               "linear_attn.in_proj_a.weight")):
            out[key] = value
    return out


TEXT_RULES = {
    **DECODER_RULES, **MOE_RULES, "partial_rotary_factor": POSITIVE, "full_attention_interval": COUNT,
    "layer_types": list_of(TEXT), "linear_num_key_heads": COUNT, "linear_num_value_heads": COUNT,
    "linear_key_head_dim": COUNT, "linear_value_head_dim": COUNT, "linear_conv_kernel_dim": COUNT,
    "num_experts": INDEX, "shared_expert_intermediate_size": INDEX, "chunk_size": COUNT,
}
LANGUAGE_MODEL = "model.language_model."  # the text model's prefix in a multimodal folder


def _text_tensors(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal folder's text model, named as the text class names it (other folders unchanged)."""
    if not any(key.startswith(LANGUAGE_MODEL) for key in hf_sd):
        return dict(hf_sd)
    return {"model." + key[len(LANGUAGE_MODEL):] if key.startswith(LANGUAGE_MODEL) else key: value
            for key, value in hf_sd.items() if key.startswith(LANGUAGE_MODEL) or key == "lm_head.weight"}


class Qwen3NextHF(HFAdapter):
    """Qwen3NextForCausalLM ("qwen3_next"), dense (num_experts 0) or MoE with a gated shared expert;
    Qwen3_5ForCausalLM ("qwen3_5_text", dense) and Qwen3_5MoeForCausalLM ("qwen3_5_moe_text", every
    layer MoE) for args of release qwen3_5."""

    model_types = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, *MULTIMODAL)
    config_rules = {**TEXT_RULES, "text_config": table(TEXT_RULES)}

    def model_type(self, args: Qwen3NextModelArgs) -> str:
        if args.release == "qwen3_next":
            return QWEN3_NEXT
        return QWEN3_5_MOE if args.moe is not None else QWEN3_5

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: Qwen3NextModelArgs) -> dict[str, torch.Tensor]:
        hf = moe_to_hf_state_dict(sd, args, NAMES)
        if "model.norm.weight" in hf:  # a part of the model may be converted (LoRA names one tensor at a time)
            hf["model.norm.weight"] = hf["model.norm.weight"] - 1.0
        return hf if args.release == "qwen3_next" else _split_projections(hf, args)

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor],
                           args: Qwen3NextModelArgs) -> dict[str, torch.Tensor]:
        if args.release == "qwen3_5":
            hf_sd = _join_projections(_text_tensors(hf_sd), args)
        sd = moe_from_hf_state_dict(hf_sd, args, NAMES)
        if "norm.weight" in sd:
            sd["norm.weight"] = sd["norm.weight"] + 1.0
        return sd

    def args_to_config(self, args: Qwen3NextModelArgs, *,
                       max_position_embeddings: int | None = None) -> dict[str, Any]:
        model_type = self.model_type(args)
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[model_type]],
            "model_type": model_type,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(args.rope_theta),
                                "partial_rotary_factor": args.partial_rotary_factor},
            "partial_rotary_factor": args.partial_rotary_factor,
            "hidden_act": "silu",
            "attention_bias": False,
            "full_attention_interval": args.full_attention_interval,
            "layer_types": ["full_attention" if args.is_full_attention(i) else "linear_attention"
                            for i in range(args.n_layers)],
            "linear_num_key_heads": args.linear_k_heads,
            "linear_num_value_heads": args.linear_v_heads,
            "linear_key_head_dim": args.linear_k_dim,
            "linear_value_head_dim": args.linear_v_dim,
            "linear_conv_kernel_dim": args.conv_kernel,
            # Ours, kept beside transformers' keys (it ignores it): the delta rule's chunk, which changes
            # the rounding, not the result.
            "chunk_size": args.chunk_size,
            "initializer_range": 0.02,
        }
        if model_type == QWEN3_NEXT:
            cfg["num_experts"] = 0
        moe = args.moe
        if moe is not None:
            if (moe.score_func != "softmax" or moe.num_shared_experts != 1 or moe.n_groups != 1
                    or moe.route_scale != 1.0 or not moe.score_before_topk):
                raise ValueError("only softmax top-k routing with one shared expert, no expert groups and no "
                                 "route_scale has a Qwen3-Next Hugging Face equivalent")
            cfg.update({
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.hidden_dim,
                "shared_expert_intermediate_size": moe.shared_dim,
                "router_aux_loss_coef": moe.aux_loss_coeff,
            })
            if model_type == QWEN3_NEXT:
                cfg.update({"norm_topk_prob": moe.route_norm, "decoder_sparse_step": 1,
                            "mlp_only_layers": [i for i in range(args.n_layers) if not moe.is_moe_layer(i)]})
            elif moe.first_k_dense or moe.layer_freq != 1 or not moe.route_norm:
                raise ValueError("Qwen3.5's MoE models route every layer through experts with renormalized "
                                 "top-k weights; these moe settings have no Hugging Face equivalent")
        return cfg

    def config_to_args(self, cfg: Mapping[str, Any]) -> Qwen3NextModelArgs:
        if cfg.get("model_type") in MULTIMODAL:
            text = cfg["text_config"]
            return self.config_to_args({**text, "model_type": MULTIMODAL[cfg["model_type"]],
                                        "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                               text.get("tie_word_embeddings", False))})
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False)):
            if cfg.get(key, expected) != expected:
                raise ValueError(f"unsupported Qwen3-Next config: {key}={cfg[key]!r} (expected {expected!r})")
        rope, rope_type = rope_settings(cfg)
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (only unscaled RoPE)")
        n_layers = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval", 4)
        pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if cfg.get("layer_types") not in (None, pattern):
            raise ValueError("layer_types is not every full_attention_interval-th layer full attention")
        moe = None
        release = "qwen3_next" if cfg.get("model_type", QWEN3_NEXT) == QWEN3_NEXT else "qwen3_5"
        if cfg.get("model_type") == QWEN3_5_MOE:
            # Every layer MoE, top-k weights renormalized; intermediate_size (unused) kept when given.
            cfg = {**cfg, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
        if cfg.get("model_type") != QWEN3_5 and cfg.get("num_experts", 0):
            step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
            first_k_dense, layer_freq = _moe_layer_pattern(
                [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0], n_layers)
            if not cfg.get("shared_expert_intermediate_size"):
                raise ValueError("shared_expert_intermediate_size 0 (no shared expert) is not supported")
            moe = MoEArgs(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                          hidden_dim=cfg["moe_intermediate_size"], num_shared_experts=1,
                          shared_hidden_dim=cfg["shared_expert_intermediate_size"], score_func="softmax",
                          route_norm=bool(cfg.get("norm_topk_prob", True)), first_k_dense=first_k_dense,
                          layer_freq=layer_freq, aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return Qwen3NextModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            explicit_head_dim=cfg.get("head_dim") or dim // n_heads, ffn_hidden_dim=cfg.get("intermediate_size", 5120),
            vocab_size=cfg["vocab_size"], max_seq_len=cfg.get("max_position_embeddings", 32768),
            norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
            full_attention_interval=interval, linear_k_heads=cfg.get("linear_num_key_heads", 16),
            linear_v_heads=cfg.get("linear_num_value_heads", 32), linear_k_dim=cfg.get("linear_key_head_dim", 128),
            linear_v_dim=cfg.get("linear_value_head_dim", 128), conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            chunk_size=cfg.get("chunk_size", 64), moe=moe, release=release,
        )


__all__ = ["NAMES", "Qwen3NextHF", "conv_channels"]
