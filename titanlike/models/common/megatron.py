"""Megatron-LM checkpoint import: megatron-core's parameter names and layouts, and the table a family fills.

What every megatron-core GPTModel shares lives here:
- where tensor parallelism cuts a weight (`TP_DIM`): ColumnParallelLinear (fused QKV, `linear_fc1`, the
  vocabulary-parallel embedding and output layer) on the output features, dim 0; RowParallelLinear
  (`linear_proj`, `linear_fc2`) on the input features, dim 1, its bias whole on every rank;
- the two spellings of a layer's norms: Transformer Engine's fused `linear_qkv.layer_norm_weight` (also what
  the torch_dist format writes for either implementation, megatron-core's local layer spec maps its names to
  it) and the local spec's `input_layernorm.weight` (`canonical_name` reads both as the latter);
- the fused QKV, one group after the other (each query group's heads, then its key head, then its value head;
  `split_qkv`), and SwiGLU's `linear_fc1`, gate rows above up rows on each tensor-parallel rank;
- MoE experts, saved per expert by the legacy format (`mlp.experts.local_experts.E.linear_fc1.weight` of
  SequentialMLP, `mlp.experts.linear_fc1.weightE` of Transformer Engine's grouped MLP) and stacked by torch_dist
  (`mlp.experts.experts.linear_fc1.weight`, experts first): `stack_experts` makes every spelling the stacked
  `mlp.experts.linear_fc1.weight` (experts x out x in). The legacy GroupedMLP (`--moe-grouped-gemm` without
  Transformer Engine) keeps all of a rank's experts in two matrices, `mlp.experts.weight1` and `weight2`, which
  `ungroup_experts` cuts into the grouped MLP's per-expert names first;
- multi-head latent attention (MLASelfAttention): its up projections and `linear_q_proj` are column-parallel;
  its down projections are column-parallel in the local layer spec but whole on every rank in Transformer
  Engine's (`merge_tp` tells them apart: identical shards are one weight); Transformer Engine fuses the latent
  norms into the up projections (`linear_q_up_proj.layer_norm_weight`), read as `q_layernorm.weight`.

A family gives its ModelSpec a `MegatronAdapter`: its names for megatron-core's (`top`, `layer`), where the
fused QKV and `linear_fc1` go, whether `linear_fc1` is gated, and how its q/k rows are ordered for RoPE. The
converter (titanlike/checkpoint/megatron.py) reads files and merges ranks; it reads no family's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

LAYERS = "decoder.layers."
_LAYER = re.compile(rf"{re.escape(LAYERS)}(\d+)\.(.+)")

# megatron-core's tensor-parallel split of each kind of parameter, by the end of its name; None: whole on
# every rank (norms, row-parallel biases, position embeddings).
TP_DIM: dict[str, int] = {
    "linear_qkv.weight": 0, "linear_qkv.bias": 0,
    "linear_fc1.weight": 0, "linear_fc1.bias": 0,
    "linear_proj.weight": 1, "linear_fc2.weight": 1,
    "word_embeddings.weight": 0, "output_layer.weight": 0,
    "linear_q_proj.weight": 0, "linear_q_up_proj.weight": 0, "linear_kv_up_proj.weight": 0,
    "linear_q_down_proj.weight": 0, "linear_kv_down_proj.weight": 0,
}

# MLA's down projections: column-parallel in megatron-core's local layer spec, duplicated (the whole weight on
# every rank) in Transformer Engine's.
_DUPLICATED_UNDER_TE = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")

# Transformer Engine's (and torch_dist's) names of a layer's norms -> the local layer spec's.
_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


_EXPERT_INDEX = re.compile(r"(weight|bias)\d+$")  # TEGroupedMLP's weightE
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)")


def tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits megatron-core parameter `name` on, or None."""
    name = _EXPERT_INDEX.sub(r"\1", name)
    for end, dim in TP_DIM.items():
        if name.endswith(end):
            return dim
    return None


def split_layer(name: str) -> tuple[int, str] | None:
    """(layer index, name inside the layer) of a per-layer megatron-core name, else None."""
    m = _LAYER.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def canonical_name(name: str) -> str:
    """A megatron-core parameter name with a layer's norms spelled as the local layer spec does, and
    torch_dist's stacked experts (`mlp.experts.experts.`) as `mlp.experts.`."""
    parts = split_layer(name)
    if parts is None:
        return name
    inner = _NORM_ALIASES.get(parts[1], parts[1])
    if inner.startswith("mlp.experts.experts."):
        inner = "mlp.experts." + inner[len("mlp.experts.experts."):]
    return f"{LAYERS}{parts[0]}.{inner}"


def stack_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` with each layer's per-expert tensors (legacy format) stacked into `mlp.experts.linear_fc1.weight`
    and its kin, experts first; ValueError naming a layer whose expert indices are not 0..E-1."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in sd.items():
        parts = split_layer(name)
        m = parts and (_LOCAL_EXPERT.fullmatch(parts[1]) or _GROUPED_EXPERT.fullmatch(parts[1]))
        if not m:
            out[name] = value
            continue
        index, kind = (m.group(1), m.group(2)) if m.re is _LOCAL_EXPERT else (m.group(2), m.group(1))
        experts.setdefault(f"{LAYERS}{parts[0]}.mlp.experts.{kind}", {})[int(index)] = value
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{name} has experts {sorted(by_index)[:8]}, not 0 to {len(by_index) - 1}")
        shapes = {tuple(t.shape) for t in by_index.values()}
        if len(shapes) > 1:
            raise ValueError(f"{name}'s experts have different shapes ({', '.join(map(str, sorted(shapes)[:3]))})")
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def ungroup_experts(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's state dict with the legacy GroupedMLP's `mlp.experts.weight1` / `weight2` as the grouped MLP's
    per-expert `mlp.experts.linear_fc1.weightE` (rank's gate and up rows x hidden) / `linear_fc2.weightE`.

    GroupedMLP (megatron/core/transformer/moe/experts.py) holds weight1 as (hidden, experts x fc1 columns) whose
    memory is (experts, hidden, fc1 columns), the rank's gate columns before its up columns, and weight2 as
    (experts x fc2 rows, hidden), memory (experts, fc2 rows, hidden): its forward views them so, and its
    sharded_state_dict transposes them into linear_fc1/linear_fc2 alike. The experts are counted by the same
    layer's router; ValueError when it has none."""
    out: dict[str, torch.Tensor] = {}
    for name, value in sd.items():
        parts = split_layer(name)
        if not parts or parts[1] not in ("mlp.experts.weight1", "mlp.experts.weight2"):
            out[name] = value
            continue
        router = sd.get(f"{LAYERS}{parts[0]}.mlp.router.weight")
        if router is None or value.dim() != 2:
            raise ValueError(f"{name} is GroupedMLP's, but layer {parts[0]} has no mlp.router.weight to count its "
                             "experts by")
        experts, hidden = router.shape[0], router.shape[1]
        first = parts[1].endswith("weight1")
        shape = (experts, hidden, -1) if first else (experts, -1, hidden)
        grouped = value.contiguous().view(shape)
        kind = "linear_fc1" if first else "linear_fc2"
        for e, w in enumerate(grouped.transpose(1, 2).unbind(0)):
            out[f"{LAYERS}{parts[0]}.mlp.experts.{kind}.weight{e}"] = w.contiguous()
    return out


def is_extra_state(name: str) -> bool:
    """Transformer Engine's per-module `_extra_state` (FP8 scaling metadata), not a weight."""
    return name.endswith("._extra_state") or "._extra_state/" in name


def split_qkv(w: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v rows of megatron-core's fused linear_qkv weight or bias, whose rows are grouped per query
    group: the group's n_heads / n_kv_heads query heads, then its key head, then its value head."""
    per_group = n_heads // n_kv_heads
    head_dim = w.shape[0] // (n_heads + 2 * n_kv_heads)
    grouped = w.reshape(n_kv_heads, (per_group + 2) * head_dim, *w.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(n_heads * head_dim, *w.shape[1:]).contiguous(),
            k.reshape(n_kv_heads * head_dim, *w.shape[1:]).contiguous(),
            v.reshape(n_kv_heads * head_dim, *w.shape[1:]).contiguous())


def merge_tp(name: str, shards: list[torch.Tensor], *, gated: bool) -> torch.Tensor:
    """One parameter from its tensor-parallel shards (rank order), as megatron-core partitions it. A gated
    linear_fc1 holds [gate; up] on each rank: the gates are joined, then the ups."""
    dim = tp_dim(name)
    if len(shards) == 1 or dim is None:
        return shards[0]
    if name.endswith(_DUPLICATED_UNDER_TE) and all(torch.equal(shards[0], s) for s in shards[1:]):
        return shards[0]
    if gated and _EXPERT_INDEX.sub(r"\1", name).endswith(("linear_fc1.weight", "linear_fc1.bias")):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=dim)


# megatron-core's names for the parts every RMSNorm decoder of models/common (Decoder, TransformerBlock) has under
# the same names: the embedding table, the final norm, the untied output, and a block's two norms and attention
# output projection. A family's table adds its own (`{**DECODER_LAYER, ...}`).
DECODER_TOP = {
    "embedding.word_embeddings.weight": "tok_embeddings.weight",
    "decoder.final_layernorm.weight": "norm.weight",
    "output_layer.weight": "output.weight",
}
DECODER_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attention.linear_proj.weight": "attention.wo.weight",
    "pre_mlp_layernorm.weight": "ffn_norm.weight",
}


@dataclass(frozen=True)
class MegatronAdapter:
    """A family's names for megatron-core GPTModel's parameters (full tensors, layers numbered from 0).

    top: megatron-core name -> ours outside the layers (`embedding.word_embeddings.weight` ...).
    layer: name inside a layer (local spec spelling, `canonical_name`) -> ours inside `layers.N.`.
    qkv: our names of q, k and v, for `self_attention.linear_qkv.{weight,bias}`'s suffix ("weight"/"bias").
    fc1: our names of `mlp.linear_fc1`'s parts: (gate, up) when gated, else (one,).
    rope_rows: (our per-layer name, tensor, args) -> tensor in our q/k row order, from megatron-core's
    rotate-half order (None: no RoPE).
    experts: our names of the stacked experts' gate, up and down projections (experts x out x in), for
    `mlp.experts.linear_fc1` (gate and up) and `mlp.experts.linear_fc2`; () for a family without MoE.
    shared_fc1: our names of the shared experts' `mlp.shared_experts.linear_fc1` gate and up rows (its
    linear_fc2 is in `layer`); () for a family without shared experts.
    split_rows: a name inside a layer -> its row blocks in order, each (our name, the args field counting its
    rows), for a megatron-core weight that is several of ours (MLA's latent and RoPE key in linear_kv_down_proj).
    check_settings: (Megatron-LM's args as a dict, our args) -> what they say differently about a setting of
    the family's own that no shape shows (with the --model.args that fixes it), or None.
    """

    top: Mapping[str, str]
    layer: Mapping[str, str]
    qkv: tuple[str, str, str] = ("attention.wq", "attention.wk", "attention.wv")
    fc1: tuple[str, ...] = ("feed_forward.w1",)
    rope_rows: Callable[[str, torch.Tensor, object], torch.Tensor] | None = None
    experts: tuple[str, ...] = ()
    shared_fc1: tuple[str, ...] = ()
    split_rows: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    check_settings: Callable[[Mapping[str, Any], Any], str | None] | None = None

    @property
    def gated(self) -> bool:
        """Whether linear_fc1 holds a gate and an up projection (SwiGLU), on every tensor-parallel rank; the
        experts' (routed and shared) always do."""
        return len(self.fc1) == 2 or bool(self.experts) or bool(self.shared_fc1)

    def to_ours(self, sd: Mapping[str, torch.Tensor], args, *,
                rotary_interleaved: bool = False) -> dict[str, torch.Tensor]:
        """megatron-core's full state dict (canonical names) -> ours; KeyError naming a parameter the
        family has no name for, ValueError naming a tensor whose shape does not fit args. rotary_interleaved: the
        model was trained with --rotary-interleaved, which rotates adjacent pairs as we do (no reordering)."""
        out: dict[str, torch.Tensor] = {}
        for name, value in sd.items():
            if name == "output_layer.weight" and args.tie_word_embeddings:
                continue  # a tied model's last pipeline stage keeps a copy of the embeddings
            if name in self.top:
                out[self.top[name]] = value
                continue
            parts = split_layer(name)
            if parts is None:
                raise KeyError(f"no parameter of this family is called {name!r}")
            layer, inner = parts
            prefix = f"layers.{layer}."
            if inner in self.layer:
                out[prefix + self.layer[inner]] = value
            elif inner in self.split_rows:
                blocks = self.split_rows[inner]
                rows = [getattr(args, field_name) for _, field_name in blocks]
                if value.shape[0] != sum(rows):
                    raise ValueError(f"{name} has {value.shape[0]} rows, but "
                                     f"{' + '.join(f'{n} {r}' for (_, n), r in zip(blocks, rows))} need {sum(rows)}")
                for (ours, _), part in zip(blocks, value.split(rows)):
                    out[prefix + ours] = part.contiguous()
            elif self.shared_fc1 and inner == "mlp.shared_experts.linear_fc1.weight":
                if value.shape[0] % 2:
                    raise ValueError(f"{name} has an odd number of output features, not a gate and an up half")
                for ours, part in zip(self.shared_fc1, value.chunk(2, dim=0)):
                    out[f"{prefix}{ours}.weight"] = part.contiguous()
            elif inner.startswith("self_attention.linear_qkv."):
                kind = inner.rsplit(".", 1)[1]
                want = (args.n_heads + 2 * args.num_kv_heads) * args.head_dim
                if value.shape[0] != want:
                    raise ValueError(f"{name} has {value.shape[0]} output features, but {args.n_heads} query and "
                                     f"{args.num_kv_heads} key/value heads of {args.head_dim} need {want}")
                for ours, part in zip(self.qkv, split_qkv(value, args.n_heads, args.num_kv_heads)):
                    out[f"{prefix}{ours}.{kind}"] = part
            elif self.experts and inner == "mlp.experts.linear_fc1.weight":
                if value.dim() != 3 or value.shape[1] % 2:
                    raise ValueError(f"{name} has shape {tuple(value.shape)}, not experts x (gate and up) x hidden")
                gate, up = value.chunk(2, dim=1)
                out[prefix + self.experts[0]], out[prefix + self.experts[1]] = gate.contiguous(), up.contiguous()
            elif self.experts and inner == "mlp.experts.linear_fc2.weight":
                out[prefix + self.experts[2]] = value
            elif inner.startswith("mlp.linear_fc1."):
                kind = inner.rsplit(".", 1)[1]
                if len(self.fc1) == 2 and value.shape[0] % 2:
                    raise ValueError(f"{name} has an odd number of output features, not a gate and an up half")
                for ours, part in zip(self.fc1, value.chunk(len(self.fc1), dim=0)):
                    out[f"{prefix}{ours}.{kind}"] = part.contiguous()
            else:
                raise KeyError(f"no parameter of this family is called {name!r}")
        if self.rope_rows is not None and not rotary_interleaved:
            for key, value in out.items():
                parts = key.split(".", 2)
                if parts[0] == "layers" and len(parts) == 3:
                    out[key] = self.rope_rows(parts[2], value, args)
        if args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out


__all__ = ["DECODER_LAYER", "DECODER_TOP", "LAYERS", "MegatronAdapter", "TP_DIM", "canonical_name", "is_extra_state", "merge_tp", "split_layer",
           "split_qkv", "stack_experts", "tp_dim", "ungroup_experts"]
