"""Hugging Face weights of Llama-style mixture-of-experts decoders (Qwen3-MoE, Mixtral, DeepSeek-V3).

On disk (save_pretrained, and the published checkpoints) these keep one tensor per expert and
projection, e.g. `mlp.experts.E.{gate,up,down}_proj.weight` (transformers stacks them in memory
only); ours are stacked (moe.experts.w1 = gate, w3 = up: (E, F, D); w2 = down: (E, D, F)). The
families differ in names and in the layout changes on the way, which `HFNames` holds; the loop
that renames, unstacks and stacks is `moe_to_hf_state_dict` / `moe_from_hf_state_dict`. Dense
layers of such a model go through the same loop (plain renames).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titanlike.models.common.hf import DECODER_LAYERS, DECODER_TOP, TO_HALF, TO_INTERLEAVED
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.init import canonical_fqn


@dataclass(frozen=True)
class HFNames:
    """A HF MoE decoder's parameter names that differ from ours, and the layout changes on the way."""

    layer: dict[str, str]  # our per-layer name -> HF's (both under the layer prefix)
    experts: str  # HF prefix of the per-expert tensors under the layer, e.g. "mlp.experts"
    expert_weights: dict[str, str]  # our stacked expert parameter -> HF per-expert name
    # (our per-layer name, tensor, args) -> tensor in HF's layout, and back: the rows of the
    # projections RoPE rotates are permuted (pair-interleaved ours, rotate-half HF's).
    to_hf_layout: Callable[[str, torch.Tensor, Any], torch.Tensor] = TO_HALF
    from_hf_layout: Callable[[str, torch.Tensor, Any], torch.Tensor] = TO_INTERLEAVED
    # The plain renames: the Llama-style top-level names and `layer` under model.layers.N.
    keys: HFKeyMap = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", HFKeyMap(top=DECODER_TOP, layer=self.layer, hf_layers=DECODER_LAYERS))


# transformers' Qwen-style names (Qwen3-MoE, DeepSeek-V3): the router, and the routed experts under
# mlp.experts.E. with the dense MLP's projection names.
ROUTER_NAMES = {"moe.router.gate.weight": "mlp.gate.weight"}
MLP_EXPERTS = "mlp.experts"
EXPERT_PROJ_NAMES = {"moe.experts.w1": "gate_proj.weight", "moe.experts.w2": "down_proj.weight",
                     "moe.experts.w3": "up_proj.weight"}


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


def check_softmax_routing(moe) -> None:
    """ValueError unless the routing is transformers' Qwen3-MoE / Mixtral routing: softmax over all
    experts, top-k, optionally renormalized (score_before_topk False, softmax over the k chosen, is
    the renormalized form)."""
    if (moe.score_func != "softmax" or moe.num_shared_experts or moe.n_groups != 1 or moe.route_scale != 1.0
            or (not moe.score_before_topk and not moe.route_norm)):
        raise ValueError("only softmax top-k routing without shared experts, expert groups or route_scale has "
                         "a Hugging Face equivalent")


def renormalizes_top_k(moe) -> bool:
    """Whether the k chosen gate values sum to one (HF's norm_topk_prob)."""
    return moe.route_norm or not moe.score_before_topk


__all__ = ["EXPERT_PROJ_NAMES", "HFNames", "MLP_EXPERTS", "ROUTER_NAMES", "check_softmax_routing",
           "moe_from_hf_state_dict", "moe_to_hf_state_dict", "renormalizes_top_k"]
