"""gpt-oss <-> Hugging Face GptOssForCausalLM ("gpt_oss"): state dicts and config.json.

Llama's names plus the attention's biases and sinks (`self_attn.sinks`) and the MoE's router
(`mlp.router.{weight,bias}`). transformers keeps the experts fused as gpt-oss ships them:
`mlp.experts.gate_up_proj` (E, D, 2F) with gate and up interleaved along the last dim (gate at even
indices), `gate_up_proj_bias` (E, 2F), `down_proj` (E, F, D) and `down_proj_bias` (E, D); ours are the
shared MoE's stacked (E, out, in) weights and separate biases. q/k rows and biases are permuted between
our pair-interleaved RoPE and HF's rotate-half (models/common/hf.py).

The published checkpoints store the expert weights as MXFP4 (`*_blocks`: two 4-bit e2m1 values per byte,
low nibble first, in blocks of 32 values; `*_scales`: one power-of-two exponent per block, biased by
127); they are dequantized on import (`dequantize_mxfp4`, transformers' convert_moe_packed_tensors).
Export writes plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    ATTENTION_NAMES,
    BLOCK_NORM_NAMES,
    COMPARED,
    COUNT,
    DECODER_LAYERS,
    DECODER_RULES,
    DECODER_TOP,
    FLAG,
    MOE_RULES,
    POSITIVE,
    TEXT,
    HFAdapter,
    decoder_config,
    half_to_interleaved,
    interleaved_to_half,
    list_of,
    optional,
    rope_settings,
)
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.init import canonical_fqn
from titanlike.models.common.moe import MoEArgs
from titanlike.models.common.rope import YaRNScaling
from titanlike.models.gpt_oss.model import GptOssModelArgs

BIASES = {k.replace(".weight", ".bias"): v.replace(".weight", ".bias") for k, v in ATTENTION_NAMES.items()}
LAYER = {**ATTENTION_NAMES, **BIASES, **BLOCK_NORM_NAMES, "attention.sinks": "self_attn.sinks",
         "moe.router.gate.weight": "mlp.router.weight", "moe.router.gate.bias": "mlp.router.bias"}
KEYS = HFKeyMap(top=DECODER_TOP, layer=LAYER, hf_layers=DECODER_LAYERS)
EXPERTS = "mlp.experts."
SLIDING, FULL = "sliding_attention", "full_attention"
# The 16 values of a 4-bit e2m1 code (sign, 2 exponent bits, 1 mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(..., rows, G, 16) uint8 blocks and (..., rows, G) uint8 exponents -> (..., rows, 32 G) values."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    # One lookup per byte: the table of its two values (low nibble first).
    values = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.arange(256, device=blocks.device)
    pairs = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)  # (256, 2)
    out = pairs[blocks.to(torch.int32)].flatten(-3)  # (..., rows, 32 G)
    # Powers of two are exact in bf16 (8 exponent bits, as fp32's), so the product is ldexp's.
    scale = torch.exp2(scales.to(torch.float32) - 127).to(dtype).repeat_interleave(32, dim=-1)
    return out * scale


def _rope_rows(convert, name: str, value: torch.Tensor, args: GptOssModelArgs) -> torch.Tensor:
    """q/k weights and biases with `convert` (one RoPE row order to the other); other tensors unchanged."""
    heads = {"attention.wq": args.n_heads, "attention.wk": args.num_kv_heads}.get(name.rsplit(".", 1)[0])
    if heads is None:
        return value
    return convert(value, heads) if value.dim() == 2 else convert(value.view(-1, 1), heads).view(-1)


class GptOssHF(HFAdapter):
    model_types = ("gpt_oss",)
    config_rules = {
        **DECODER_RULES, **MOE_RULES, "attention_bias": COMPARED, "sliding_window": COUNT,
        "layer_types": optional(list_of(TEXT)), "swiglu_limit": POSITIVE, "swiglu_alpha": POSITIVE,
        "hidden_act": COMPARED, "quantization_config": COMPARED, "output_router_logits": FLAG,
    }
    # o200k_harmony has no BOS: a text starts with its own tokens.
    tokenizer_template = ("$A", "$A $B")

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: GptOssModelArgs) -> dict[str, torch.Tensor]:
        hf: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, torch.Tensor]] = {}  # layer -> our expert name -> tensor
        for key, value in sd.items():
            key = canonical_fqn(key)
            if key == "rope_cache" or (key == "output.weight" and args.tie_word_embeddings):
                continue
            hf_key = KEYS.to_hf(key)
            layer, name = KEYS.split(key) or (None, None)
            if hf_key is not None:
                hf[hf_key] = value if name is None else _rope_rows(interleaved_to_half, name, value, args)
            elif name is not None and name.startswith("moe.experts."):
                experts.setdefault(layer, {})[name.removeprefix("moe.experts.")] = value
            elif name == "moe.expert_bias":
                raise KeyError("the aux-loss-free balancing bias (moe.bias_update_rate > 0) has no Hugging Face "
                               "equivalent; its routing cannot be exported")
            else:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
        for layer, e in experts.items():
            prefix = f"{DECODER_LAYERS}{layer}.{EXPERTS}"
            # (E, F, D) gate and up -> (E, D, 2F) with gate at the even columns.
            hf[prefix + "gate_up_proj"] = torch.stack([e["w1"], e["w3"]], dim=2).flatten(1, 2).transpose(1, 2)
            hf[prefix + "gate_up_proj_bias"] = torch.stack([e["b1"], e["b3"]], dim=2).flatten(1, 2)
            hf[prefix + "down_proj"] = e["w2"].transpose(1, 2)
            hf[prefix + "down_proj_bias"] = e["b2"]
        return {k: v.contiguous() for k, v in hf.items()}

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: GptOssModelArgs) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in hf_sd.items():
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            name = KEYS.from_hf(key)
            if name is not None:
                layer_name = KEYS.layer_name(name)
                sd[name] = value if layer_name is None else _rope_rows(half_to_interleaved, layer_name, value, args)
                continue
            layer, hf_name = KEYS.split_hf(key) or (None, "")
            if not hf_name.startswith(EXPERTS):
                raise KeyError(f"unexpected Hugging Face gpt-oss parameter {key!r}")
            experts.setdefault(layer, {})[hf_name.removeprefix(EXPERTS)] = value
        for layer, e in experts.items():
            for proj in ("gate_up_proj", "down_proj"):
                if proj + "_blocks" in e:  # MXFP4: (E, out, in) once dequantized, transposed as transformers'
                    e[proj] = dequantize_mxfp4(e.pop(proj + "_blocks"), e.pop(proj + "_scales")).transpose(1, 2)
            missing = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"} - set(e)
            if missing or len(e) != 4:
                raise KeyError(f"layer {layer} mlp.experts: expected gate_up_proj, down_proj and their biases, "
                               f"got {sorted(e)}")
            prefix = f"layers.{layer}.moe.experts."
            gate_up, bias = e["gate_up_proj"].transpose(1, 2), e["gate_up_proj_bias"]  # (E, 2F, D), (E, 2F)
            sd[prefix + "w1"], sd[prefix + "w3"] = gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous()
            sd[prefix + "b1"], sd[prefix + "b3"] = bias[:, 0::2].contiguous(), bias[:, 1::2].contiguous()
            sd[prefix + "w2"] = e["down_proj"].transpose(1, 2).contiguous()
            sd[prefix + "b2"] = e["down_proj_bias"]
        KEYS.tie_output(sd, args.tie_word_embeddings)
        return sd

    def args_to_config(self, args: GptOssModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        moe = args.moe
        if moe.score_before_topk or moe.num_shared_experts or moe.n_groups != 1 or moe.route_scale != 1.0:
            raise ValueError("gpt-oss routes by a softmax over the top-k logits: set moe score_before_topk false, "
                             "without shared experts, expert groups or route_scale")
        rope = {"rope_type": "default"} if args.rope_scaling is None else args.rope_scaling.to_hf()
        rope.pop("type", None)
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": self.model_types[0],
            "hidden_size": args.dim,
            "intermediate_size": moe.hidden_dim,
            **decoder_config(args, max_position_embeddings=max_position_embeddings),
            "rope_scaling": rope,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": moe.aux_loss_coeff > 0,
            "sliding_window": args.sliding_window,
            "layer_types": [FULL if args.attention_window(i) is None else SLIDING for i in range(args.n_layers)],
            "swiglu_limit": args.swiglu_limit,
            "swiglu_alpha": args.swiglu_alpha,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> GptOssModelArgs:
        """GptOssModelArgs for a GptOssForCausalLM config.json (dict)."""
        if cfg.get("attention_bias", True) is not True:
            raise ValueError("unsupported gpt-oss config: attention_bias=False (gpt-oss has q/k/v/o biases)")
        quantization = cfg.get("quantization_config")
        if quantization is not None and quantization.get("quant_method") != "mxfp4":
            raise ValueError(f"unsupported gpt-oss quantization {quantization.get('quant_method')!r} (only mxfp4)")
        n_layers, dim, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        rope, rope_type = rope_settings(cfg)
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (gpt-oss uses yarn)")
        max_len = cfg.get("max_position_embeddings", 131072)
        scaling = YaRNScaling.from_hf(rope, max_position_embeddings=max_len) if rope_type == "yarn" else None
        # transformers adds router_aux_loss_coef's loss only with output_router_logits (the published
        # configs: 0.9, off).
        aux = float(cfg.get("router_aux_loss_coef", 0.0)) if cfg.get("output_router_logits") else 0.0
        moe = MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      hidden_dim=cfg["intermediate_size"], score_func="softmax", score_before_topk=False,
                      aux_loss_coeff=aux)
        args = GptOssModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            explicit_head_dim=cfg.get("head_dim") or dim // n_heads, vocab_size=cfg["vocab_size"],
            max_seq_len=max_len, norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 150000.0))), rope_scaling=scaling,
            sliding_window=cfg.get("sliding_window") or 128, swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), moe=moe)
        layer_types = cfg.get("layer_types")
        ours = [FULL if args.attention_window(i) is None else SLIDING for i in range(n_layers)]
        if layer_types is not None and list(layer_types) != ours:
            raise ValueError("layer_types other than sliding and full attention alternating from a sliding "
                             "layer 0 are not gpt-oss's")
        return args


__all__ = ["GptOssHF", "KEYS", "dequantize_mxfp4"]
