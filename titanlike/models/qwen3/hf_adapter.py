"""Qwen3 <-> Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM (state dicts and config.json).

Weights as save_pretrained writes them and from_pretrained reads them: Llama's names plus
`self_attn.{q,k}_norm.weight`, and for MoE layers the router `mlp.gate.weight` (E, D) and one
tensor per expert and projection, `mlp.experts.E.{gate,up,down}_proj.weight` (transformers
stacks them in memory only). Our experts are stacked (w1 = gate, w3 = up: (E, F, D); w2 = down:
(E, D, F)). Our RoPE is pair-interleaved, HF's rotate-half, so the rows of q/k projections and
the entries of the q/k norm weights are permuted on the way.

The mapping is shared with Mixtral (models/mixtral/hf_adapter.py), which differs only in names,
and DeepSeek-V3 (models/deepseek_v3/hf_adapter.py), which also has its own RoPE row layout;
`HFNames` holds the names and the layout changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.init import canonical_fqn
from titanlike.models.llama3.hf_adapter import KEYS as LLAMA_KEYS
from titanlike.models.llama3.hf_adapter import half_to_interleaved, interleaved_to_half


def _rope_layout(convert):
    """(our per-layer name, tensor, args) -> tensor with `convert` (one RoPE row order to the
    other) applied to the q/k projections and norms; other tensors unchanged."""
    def change(name: str, value: torch.Tensor, args) -> torch.Tensor:
        if name == "attention.wq.weight":
            return convert(value, args.n_heads)
        if name == "attention.wk.weight":
            return convert(value, args.num_kv_heads)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):  # one head's features
            return convert(value.view(-1, 1), 1).view(-1)
        return value

    return change


_to_half = _rope_layout(interleaved_to_half)
_to_interleaved = _rope_layout(half_to_interleaved)


@dataclass(frozen=True)
class HFNames:
    """A HF MoE decoder's parameter names that differ from ours, and the layout changes on the way."""

    layer: dict[str, str]  # our per-layer name -> HF's (both under the layer prefix)
    experts: str  # HF prefix of the per-expert tensors under the layer, e.g. "mlp.experts"
    expert_weights: dict[str, str]  # our stacked expert parameter -> HF per-expert name
    # (our per-layer name, tensor, args) -> tensor in HF's layout, and back: the rows of the
    # projections RoPE rotates are permuted (pair-interleaved ours, rotate-half HF's).
    to_hf_layout: Callable[[str, torch.Tensor, Any], torch.Tensor] = _to_half
    from_hf_layout: Callable[[str, torch.Tensor, Any], torch.Tensor] = _to_interleaved
    # The plain renames: Llama's top-level names and `layer` under model.layers.N.
    keys: HFKeyMap = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", HFKeyMap(top=LLAMA_KEYS.top, layer=self.layer,
                                                  hf_layers=LLAMA_KEYS.hf_layers))


_BLOCK_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_COMMON_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **_BLOCK_NORMS,
}
_DENSE_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
QWEN3_NAMES = HFNames(
    layer={**_COMMON_LAYER, **_DENSE_MLP,
           "attention.q_norm.weight": "self_attn.q_norm.weight",
           "attention.k_norm.weight": "self_attn.k_norm.weight",
           "moe.router.gate.weight": "mlp.gate.weight"},
    experts="mlp.experts",
    expert_weights={"moe.experts.w1": "gate_proj.weight", "moe.experts.w2": "down_proj.weight",
                    "moe.experts.w3": "up_proj.weight"},
)


def moe_to_hf_state_dict(sd: Mapping[str, torch.Tensor], args, names: HFNames) -> dict[str, torch.Tensor]:
    """Our state dict (full tensors) -> the HF model's as saved on disk. Wrapper prefixes ignored."""
    keys = names.keys
    hf: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        key = canonical_fqn(key)
        if key == "rope_cache" or (key == "output.weight" and args.tie_word_embeddings):
            continue
        hf_key = keys.to_hf(key)
        layer, name = keys.split(key) or (None, None)
        if hf_key is not None:
            hf[hf_key] = value if name is None else names.to_hf_layout(name, value, args)
        elif name in names.expert_weights:
            for e in range(value.shape[0]):  # stacked (E, ...) -> one tensor per expert
                hf[f"{keys.hf_layers}{layer}.{names.experts}.{e}.{names.expert_weights[name]}"] = value[e]
        elif name == "moe.expert_bias":
            raise KeyError("the aux-loss-free balancing bias (moe.bias_update_rate > 0) has no Hugging Face "
                           "equivalent; its routing cannot be exported")
        else:
            raise KeyError(f"no Hugging Face name for parameter {key!r}")
    return hf


def moe_from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], args, names: HFNames) -> dict[str, torch.Tensor]:
    """The HF model's state dict (per-expert tensors, as on disk) -> ours (load_state_dict strict).

    KeyError for a tensor we have no name for; ValueError for a layer whose experts are not
    exactly 0..num_experts-1."""
    keys = names.keys
    sd: dict[str, torch.Tensor] = {}
    expert_re = re.compile(rf"{re.escape(names.experts)}\.(\d+)\.(.+)")
    hf_expert_weights = {v: k for k, v in names.expert_weights.items()}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, our name) -> {expert: tensor}
    for key, value in hf_sd.items():
        if "rotary_emb." in key:  # older transformers saved inv_freq; we recompute RoPE
            continue
        if key == "lm_head.weight" and args.tie_word_embeddings:
            continue
        ours = keys.from_hf(key)
        if ours is not None:
            name = keys.layer_name(ours)
            sd[ours] = value if name is None else names.from_hf_layout(name, value, args)
            continue
        layer, hf_name = keys.split_hf(key) or (None, "")
        e = expert_re.fullmatch(hf_name)
        if e is None or e.group(2) not in hf_expert_weights:
            raise KeyError(f"unexpected Hugging Face parameter {key!r}")
        experts.setdefault((layer, hf_expert_weights[e.group(2)]), {})[int(e.group(1))] = value
    num_experts = args.moe.num_experts if args.moe is not None else 0
    for (layer, name), by_index in sorted(experts.items()):
        if sorted(by_index) != list(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(by_index))
            extra = sorted(set(by_index) - set(range(num_experts)))
            raise ValueError(f"layer {layer} {names.experts}.*.{names.expert_weights[name]}: the checkpoint's "
                             f"experts are incomplete for {num_experts} experts (missing {missing[:8]}, "
                             f"unexpected {extra[:8]})")
        # Sorted by integer index (string order would put expert 10 before 2).
        sd[f"layers.{layer}.{name}"] = torch.stack([by_index[i] for i in range(num_experts)])
    keys.tie_output(sd, args.tie_word_embeddings)
    return sd


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    return moe_to_hf_state_dict(sd, args, QWEN3_NAMES)


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    return moe_from_hf_state_dict(hf_sd, args, QWEN3_NAMES)


# config.json ---------------------------------------------------------------------------------


def check_hf_routing(moe) -> None:
    """ValueError unless the routing is HF's: softmax over all experts, top-k, optionally
    renormalized (score_before_topk False, softmax over the k chosen, is the renormalized form)."""
    if (moe.score_func != "softmax" or moe.num_shared_experts or moe.n_groups != 1 or moe.route_scale != 1.0
            or (not moe.score_before_topk and not moe.route_norm)):
        raise ValueError("only softmax top-k routing without shared experts, expert groups or route_scale has "
                         "a Hugging Face equivalent")


def hf_rope_theta(cfg: Mapping[str, Any], default: float) -> float:
    """rope_theta from a 5.x rope_parameters or a 4.x rope_theta / rope_scaling; unscaled RoPE only."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only unscaled RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def args_to_hf_config(args, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """config.json for Qwen3ForCausalLM (dense args) or Qwen3MoeForCausalLM (args with moe)."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        **args.hf_decoder_config(max_position_embeddings=max_position_embeddings),
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
        check_hf_routing(moe)
        cfg.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "norm_topk_prob": moe.route_norm or not moe.score_before_topk,
            # Every layer not MoE listed: exact for any first_k_dense / layer_freq.
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(args.n_layers) if not moe.is_moe_layer(i)],
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False,
        })
    return cfg


def moe_layer_pattern(moe_layers: list[int], n_layers: int) -> tuple[int, int]:
    """(first_k_dense, layer_freq) whose MoE layers are exactly `moe_layers`; ValueError if none."""
    from titanlike.models.common.moe import MoEArgs

    if not moe_layers:
        raise ValueError("the config has no MoE layer")
    first = moe_layers[0]
    freq = moe_layers[1] - first if len(moe_layers) > 1 else max(1, n_layers - first)
    probe = MoEArgs(first_k_dense=first, layer_freq=freq)
    if [i for i in range(n_layers) if probe.is_moe_layer(i)] != moe_layers:
        raise ValueError(f"MoE layers {moe_layers} are not every k-th layer after the first dense ones "
                         "(first_k_dense / layer_freq cannot express them)")
    return first, freq


def args_from_hf_config(cfg: Mapping[str, Any]):
    """Qwen3ModelArgs for a Qwen3ForCausalLM or Qwen3MoeForCausalLM config.json (dict)."""
    from titanlike.models.common.moe import MoEArgs
    from titanlike.models.qwen3.model import Qwen3ModelArgs

    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        if cfg.get(key, expected) != expected:
            raise ValueError(f"unsupported Qwen3 config: {key}={cfg[key]!r} (expected {expected!r})")
    n_layers, dim, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    moe = None
    if cfg.get("model_type") == "qwen3_moe":
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
        rope_theta=hf_rope_theta(cfg, 1_000_000.0),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        moe=moe,
    )
