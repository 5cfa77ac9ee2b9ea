"""Hybrid models <-> Hugging Face NemotronHForCausalLM and Mamba2ForCausalLM (state dicts, config.json).

A pattern of Mamba-2 layers only is exported as Mamba2ForCausalLM ("mamba2") when its inner width
is a whole multiple of the model width (Mamba2Config's `expand`); every other pattern as
NemotronHForCausalLM ("nemotron_h", the pattern as `layers_block_type`). Both are read. On disk
both keep the trunk under `backbone.` (NemotronH's in-memory `model.` is read too).

Per layer, HF keeps the mixer under `mixer.`: Mamba-2's in_proj, conv1d (C, 1, K), dt_bias, A_log,
D, norm, out_proj; attention's q/k/v/o_proj; the MLP's up_proj and down_proj. Our Mamba-2 keeps
in_proj's rows and the conv's channels group by group (models/common/mamba2.py), so both are
permuted on the way. Not mapped, and refused in one sentence: Nemotron-H's mixture-of-experts
layers (non-gated squared-ReLU experts with latent projections, not our SwiGLU experts), its
multi-token prediction, biases, SwiGLU MLPs and RoPE (transformers' Nemotron-H attention has no
position encoding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from titanlike.models.common.hf import (
    COMPARED,
    COUNT,
    DECODER_RULES,
    NON_NEGATIVE,
    POSITIVE,
    TEXT,
    HFAdapter,
    list_of,
    optional,
)
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.mamba2 import Mamba2Args, grouped_rows
from titanlike.models.hybrid.model import HybridModelArgs

MAMBA2 = "mamba2"
NEMOTRON_H = "nemotron_h"
# Mamba2Config has no context length; the state-spaces/mamba2 models were trained at 2048.
MAMBA2_CONTEXT = 2048
# transformers' layers_block_type names of the pattern symbols (NemotronHConfig._pattern_to_list),
# and the older names some configs carry.
_SYMBOL_BLOCK_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_HF_BLOCK_TYPES = {**{v: k for k, v in _SYMBOL_BLOCK_TYPE.items()}, "mamba": "M", "attention": "*"}

# our name under layers.N. -> HF's under <prefix>layers.N.
_LAYER_NAMES = {
    "norm.weight": "norm.weight",
    "mamba.in_proj.weight": "mixer.in_proj.weight",
    "mamba.conv_weight": "mixer.conv1d.weight",
    "mamba.conv_bias": "mixer.conv1d.bias",
    "mamba.dt_bias": "mixer.dt_bias",
    "mamba.A_log": "mixer.A_log",
    "mamba.D": "mixer.D",
    "mamba.norm.weight": "mixer.norm.weight",
    "mamba.out_proj.weight": "mixer.out_proj.weight",
    "attention.wq.weight": "mixer.q_proj.weight",
    "attention.wk.weight": "mixer.k_proj.weight",
    "attention.wv.weight": "mixer.v_proj.weight",
    "attention.wo.weight": "mixer.o_proj.weight",
    "feed_forward.w1.weight": "mixer.up_proj.weight",
    "feed_forward.w2.weight": "mixer.down_proj.weight",
}
# Mixer parameters of ours whose first dim is in-proj rows or conv channels (permuted both ways).
_ROWS, _CHANNELS = ("mamba.in_proj.weight",), ("mamba.conv_weight", "mamba.conv_bias")


# Both classes save their trunk under "backbone." (NemotronH renames its in-memory "model." on
# save, as NVIDIA's checkpoints are written); NemotronH's in-memory state dict is read too.
DISK_PREFIX = "backbone."
_PREFIXES = {MAMBA2: (DISK_PREFIX,), NEMOTRON_H: (DISK_PREFIX, "model.")}
KEYS = HFKeyMap(
    top={"tok_embeddings.weight": f"{DISK_PREFIX}embeddings.weight", "norm.weight": f"{DISK_PREFIX}norm_f.weight",
         "output.weight": "lm_head.weight"},
    layer=_LAYER_NAMES,
    hf_layers=f"{DISK_PREFIX}layers.",
)


def _to_hf_layout(name: str | None, value: torch.Tensor, args) -> torch.Tensor:
    rows, channels = grouped_rows(args.mamba)
    if name in _ROWS:
        return value[rows.argsort()]
    if name in _CHANNELS:
        value = value[channels.argsort()]
        return value.unsqueeze(1) if name == "mamba.conv_weight" else value  # HF's Conv1d (C, 1, K)
    return value


def _from_hf_layout(name: str | None, value: torch.Tensor, args) -> torch.Tensor:
    rows, channels = grouped_rows(args.mamba)
    if name in _ROWS:
        return value[rows]
    if name in _CHANNELS:
        value = value.squeeze(1) if name == "mamba.conv_weight" else value
        return value[channels]
    return value


# config.json ---------------------------------------------------------------------------------


def _time_step_limit(value: Any) -> str | None:
    """Mamba2's time_step_limit: [min, max], 0 <= min <= max (max may be infinite, which transformers
    writes as {"__float__": "Infinity"})."""
    if not (isinstance(value, list) and len(value) == 2):
        return "a list [min, max] of numbers with 0 <= min <= max"
    try:
        low, high = (_float(v) for v in value)
    except (TypeError, ValueError):
        return "a list [min, max] of numbers with 0 <= min <= max"
    ok = not any(isinstance(v, bool) for v in value) and math.isfinite(low) and 0 <= low <= high
    return None if ok else "a list [min, max] of numbers with 0 <= min <= max"


def _refuse(cfg: Mapping[str, Any], key: str, ok, why: str) -> None:
    if key in cfg and not ok(cfg[key]):
        raise ValueError(f"config.json {key} = {cfg[key]!r} is not supported: {why}")


def _float(value) -> float:
    """A config.json number; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    return float(value)


class HybridHF(HFAdapter):
    """NemotronHForCausalLM ("nemotron_h") and Mamba2ForCausalLM ("mamba2"), see the module docstring."""

    model_types = (NEMOTRON_H, MAMBA2)
    config_rules = {
        **DECODER_RULES, "use_bias": COMPARED, "use_conv_bias": COMPARED, "mamba_hidden_act": COMPARED,
        "mlp_hidden_act": COMPARED, "sliding_window": COMPARED, "num_nextn_predict_layers": COMPARED,
        "moe_latent_size": COMPARED, "layers_block_type": optional(list_of(TEXT)),
        "hybrid_override_pattern": optional(TEXT), "num_heads": COUNT, "state_size": COUNT, "n_groups": COUNT,
        "conv_kernel": COUNT, "chunk_size": COUNT, "expand": COUNT, "mamba_num_heads": COUNT, "mamba_head_dim": COUNT,
        "ssm_state_size": COUNT, "time_step_min": POSITIVE, "time_step_max": POSITIVE, "time_step_floor": NON_NEGATIVE,
        "time_step_limit": _time_step_limit, "layer_norm_epsilon": POSITIVE,
    }

    def model_type(self, args: HybridModelArgs) -> str:
        """Mamba2ForCausalLM for a pattern of Mamba-2 layers only whose inner width is a whole multiple of
        the model width (Mamba2Config's `expand`), else NemotronHForCausalLM."""
        if set(args.hybrid_layer_pattern) == {"M"} and args.mamba.inner_dim % args.dim == 0:
            return MAMBA2
        return NEMOTRON_H

    def _check_exportable(self, args: HybridModelArgs) -> None:
        """ValueError (one sentence) for what neither transformers class can express."""
        if args.has("E"):
            raise ValueError("the pattern's E (mixture-of-experts) layers use SwiGLU experts, which transformers' "
                             "NemotronH (non-gated squared-ReLU experts) does not have, so they cannot be exported")
        if args.has("-") and args.mlp_activation != "relu2":
            raise ValueError(f"NemotronH's MLP is squared ReLU; mlp_activation {args.mlp_activation} cannot be "
                             "exported")
        if args.has("*") and args.rope_theta is not None:
            raise ValueError("transformers' NemotronH attention has no position encoding; a model with rope_theta "
                             "cannot be exported")
        m = args.mamba
        clamped = m.dt_limit_min > 0 and m.dt_limit_max is None
        if args.has("M") and self.model_type(args) == NEMOTRON_H and not clamped:
            raise ValueError("transformers' NemotronH clamps dt to [time_step_min, inf), so its Mamba-2 layers need "
                             "mamba dt_limit_min > 0 and no dt_limit_max to be exported")

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: HybridModelArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> the HF model's, as saved on disk."""
        self._check_exportable(args)
        return KEYS.export_decoder(sd, tied=args.tie_word_embeddings,
                                   convert=lambda key, value: _to_hf_layout(KEYS.layer_name(key), value, args))

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor],
                           args: HybridModelArgs) -> dict[str, torch.Tensor]:
        """The HF model's state dict -> ours (load_state_dict strict). KeyError for a tensor we have
        no name for or a missing output projection."""
        prefixes = _PREFIXES[self.model_type(args)]
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            # Another accepted trunk prefix (NemotronH's in-memory "model.") reads as the disk one.
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            name = KEYS.from_hf(key if prefix is None else DISK_PREFIX + key[len(prefix):])
            if name is None:
                raise KeyError(f"unexpected Hugging Face parameter {key!r}")
            sd[name] = _from_hf_layout(KEYS.layer_name(name), value, args)
        KEYS.tie_output(sd, args.tie_word_embeddings)
        return sd

    def args_to_config(self, args: HybridModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        self._check_exportable(args)
        m = args.mamba
        common = {
            "hidden_size": args.dim,
            "vocab_size": args.vocab_size,
            "layer_norm_epsilon": args.norm_eps,
            "tie_word_embeddings": args.tie_word_embeddings,
            "n_groups": m.n_groups,
            "conv_kernel": m.conv_kernel,
            "use_conv_bias": m.conv_bias,
            "use_bias": False,
            "chunk_size": m.chunk_size,
            "time_step_max": m.dt_max,
            "time_step_floor": m.dt_init_floor,
        }
        if self.model_type(args) == MAMBA2:
            return {
                "model_type": MAMBA2,
                "architectures": ["Mamba2ForCausalLM"],
                **common,
                "num_hidden_layers": args.n_layers,
                "num_heads": m.num_heads,
                "head_dim": m.head_dim,
                "state_size": m.state_size,
                "expand": m.inner_dim // args.dim,
                "hidden_act": "silu",
                "time_step_min": m.dt_min,
                "time_step_limit": [m.dt_limit_min, math.inf if m.dt_limit_max is None else m.dt_limit_max],
                "residual_in_fp32": True,
                "rescale_prenorm_residual": False,
            }
        return {
            "model_type": NEMOTRON_H,
            "architectures": ["NemotronHForCausalLM"],
            **common,
            "layers_block_type": [_SYMBOL_BLOCK_TYPE[s] for s in args.hybrid_layer_pattern],
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "max_position_embeddings": max_position_embeddings or args.max_seq_len,
            "attention_bias": False,
            "intermediate_size": args.ffn_hidden_dim,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "ssm_state_size": m.state_size,
            "mamba_num_heads": m.num_heads,
            "mamba_head_dim": m.head_dim,
            "mamba_hidden_act": "silu",
            # transformers' NemotronH clamps dt below at time_step_min (and initializes from it).
            "time_step_min": m.dt_limit_min,
            "residual_in_fp32": False,
            "rescale_prenorm_residual": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> HybridModelArgs:
        model_type = cfg.get("model_type")
        _refuse(cfg, "use_bias", lambda v: not v, "the Mamba-2 projections have no bias")
        _refuse(cfg, "use_conv_bias", lambda v: isinstance(v, bool), "expected true or false")
        if model_type == MAMBA2:
            _refuse(cfg, "hidden_act", lambda v: v == "silu", "Mamba-2's conv activation is SiLU")
            limit = [_float(v) for v in cfg.get("time_step_limit", (0.0, math.inf))]
            mamba = Mamba2Args(
                num_heads=cfg["num_heads"], head_dim=cfg["head_dim"], state_size=cfg["state_size"],
                n_groups=cfg["n_groups"], conv_kernel=cfg["conv_kernel"], chunk_size=cfg["chunk_size"],
                conv_bias=cfg.get("use_conv_bias", True), dt_limit_min=limit[0],
                dt_limit_max=None if math.isinf(limit[1]) else limit[1],
                dt_min=cfg["time_step_min"], dt_max=cfg["time_step_max"], dt_init_floor=cfg["time_step_floor"])
            if cfg["hidden_size"] * cfg.get("expand", 2) != mamba.inner_dim:
                raise ValueError(f"config.json hidden_size x expand ({cfg['hidden_size']} x {cfg.get('expand', 2)}) "
                                 f"must equal num_heads x head_dim ({mamba.inner_dim})")
            return HybridModelArgs(
                dim=cfg["hidden_size"], hybrid_layer_pattern="M" * cfg["num_hidden_layers"],
                vocab_size=cfg["vocab_size"], max_seq_len=MAMBA2_CONTEXT, norm_eps=cfg["layer_norm_epsilon"],
                tie_word_embeddings=cfg.get("tie_word_embeddings", False), mamba=mamba)
        if model_type != NEMOTRON_H:
            raise ValueError(f"config.json model_type {model_type!r} is neither {NEMOTRON_H!r} nor {MAMBA2!r}")
        for key, ok, why in (
            ("mamba_hidden_act", lambda v: v == "silu", "Mamba-2's conv activation is SiLU"),
            ("mlp_hidden_act", lambda v: v == "relu2", "the MLP layers are squared ReLU"),
            ("attention_bias", lambda v: not v, "attention without biases only"),
            ("mlp_bias", lambda v: not v, "MLPs without biases only"),
            ("sliding_window", lambda v: v is None, "full attention only"),
            ("num_nextn_predict_layers", lambda v: not v, "multi-token prediction layers are not supported"),
            ("moe_latent_size", lambda v: v is None, "mixture-of-experts layers are not supported"),
        ):
            _refuse(cfg, key, ok, why)
        if cfg.get("layers_block_type"):
            unknown = sorted(set(cfg["layers_block_type"]) - set(_HF_BLOCK_TYPES))
            if unknown:
                raise ValueError(f"config.json layers_block_type has unknown layer types {unknown}")
            pattern = "".join(_HF_BLOCK_TYPES[t] for t in cfg["layers_block_type"])
        elif cfg.get("hybrid_override_pattern"):
            pattern = cfg["hybrid_override_pattern"]
        else:
            raise ValueError("config.json has neither layers_block_type nor hybrid_override_pattern")
        if "E" in pattern:
            raise ValueError("config.json's NemotronH mixture-of-experts layers (non-gated squared-ReLU experts) are "
                             "not supported: our MoE layers have SwiGLU experts")
        time_step_min = cfg.get("time_step_min", 0.001)
        mamba = Mamba2Args(
            num_heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"], state_size=cfg["ssm_state_size"],
            n_groups=cfg["n_groups"], conv_kernel=cfg["conv_kernel"], chunk_size=cfg["chunk_size"],
            conv_bias=cfg.get("use_conv_bias", True), dt_limit_min=time_step_min, dt_limit_max=None,
            dt_min=time_step_min, dt_max=cfg.get("time_step_max", 0.1), dt_init_floor=cfg.get("time_step_floor", 1e-4))
        heads = cfg["num_attention_heads"]
        return HybridModelArgs(
            dim=cfg["hidden_size"], hybrid_layer_pattern=pattern, vocab_size=cfg["vocab_size"],
            max_seq_len=cfg.get("max_position_embeddings", 4096), norm_eps=cfg["layer_norm_epsilon"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, ffn_hidden_dim=cfg["intermediate_size"],
            mlp_activation="relu2", mamba=mamba)


__all__ = ["KEYS", "HybridHF"]
