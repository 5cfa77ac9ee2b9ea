"""The Hugging Face adapter a family gives its ModelSpec (`spec.hf`), and what Llama-style adapters share.

An adapter owns everything about one family's transformers classes: the config.json model_types it
reads (and the one it writes for given args), config.json <-> model args, our state dict <->
theirs (full tensors; DTensors must be gathered first), and the token-id fields of config.json.
The args know nothing about Hugging Face, and the checkpoint code (titanlike/checkpoint/) reads no
family field: it asks the adapter.

Shared by the adapters of transformers' Llama-style decoders (Llama, Qwen3, Mixtral, DeepSeek-V3):
their parameter names (`DECODER_TOP`, `ATTENTION_NAMES`, ...), the config.json fields they have in
common (`decoder_config`), reading an unscaled rope_theta, and the RoPE row order of q/k
projections (ours pair-interleaved, HF's rotate-half).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from titanlike.models.args import BaseModelArgs

StateDict = Mapping[str, torch.Tensor]


class HFAdapter(abc.ABC):
    """One family's Hugging Face interchange. Subclasses set `model_types` and implement the four
    conversions; `model_type` and `token_ids` have defaults."""

    # Every config.json model_type the family reads (one per transformers class it maps).
    model_types: ClassVar[tuple[str, ...]] = ()

    def model_type(self, args: BaseModelArgs) -> str:
        """The model_type args_to_config writes for these args (default: the family's only one)."""
        return self.model_types[0]

    @abc.abstractmethod
    def config_to_args(self, config: Mapping[str, Any]) -> BaseModelArgs:
        """Model args from a config.json (dict); ValueError (or KeyError for a missing key) when the
        configuration has no equivalent here."""

    @abc.abstractmethod
    def args_to_config(self, args: BaseModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for transformers' class of these args (the tokenizer's ids are
        token_ids', set by the checkpoint writer). max_position_embeddings: the model's real context
        when args carry a shorter training seq_len (default: args.max_seq_len). ValueError for args
        with no HF equivalent."""

    @abc.abstractmethod
    def to_hf_state_dict(self, sd: StateDict, args: BaseModelArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors; wrapper prefixes in keys ignored) -> HF's, as saved on disk."""

    @abc.abstractmethod
    def from_hf_state_dict(self, hf_sd: StateDict, args: BaseModelArgs) -> dict[str, torch.Tensor]:
        """HF's state dict -> ours, loadable with load_state_dict(strict=True) (tied aliases
        included); KeyError for a tensor with no name here, ValueError for values that cannot load."""

    def token_ids(self, *, bos: int | None, eos: int | None, pad: int | None) -> dict[str, int]:
        """The token-id fields of config.json (and generation_config.json) for the tokenizer's
        ids, in the order they are written; ids that are None are left out. The default, a decoder's:
        the ids it generates from and stops at."""
        return known_ids(bos_token_id=bos, eos_token_id=eos)


def known_ids(**ids: int | None) -> dict[str, int]:
    """The ids that are set, as ints, in the order given."""
    return {name: int(value) for name, value in ids.items() if value is not None}


# Llama-style decoders (LlamaForCausalLM's names, shared by Qwen3, Mixtral, DeepSeek-V3) ---------

# Our top-level names -> HF's, and the prefix of HF's layer N (ours: "layers.N.").
DECODER_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DECODER_LAYERS = "model.layers."
# Per layer, under each side's layer prefix.
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
BLOCK_NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_MLP_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def decoder_config(args, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """The config.json fields transformers' Llama-style decoders (Llama, Qwen3, Mixtral, DeepSeek-V3)
    share, from a DecoderArgs with rope_theta; a family's adapter adds its model_type, MLP sizes and
    RoPE variant."""
    return {
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def rope_settings(cfg: Mapping[str, Any]) -> tuple[dict, str]:
    """(the RoPE settings, their rope_type) of a config.json: transformers 5.x nests them (with
    rope_theta) in rope_parameters, 4.x has rope_theta beside rope_scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def unscaled_rope_theta(cfg: Mapping[str, Any], default: float) -> float:
    """rope_theta of a config.json whose RoPE is unscaled; ValueError for any other rope_type."""
    rope, rope_type = rope_settings(cfg)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only unscaled RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from pair-interleaved RoPE order (ours, Meta's, torchtitan's: pairs
    (x[2i], x[2i+1]) of each head rotate together) to rotate-half order (HF's: x[i] with
    x[i + head_dim/2]). The attention scores are unchanged when q's and k's rows move alike."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of interleaved_to_half."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _qk_rope_layout(convert):
    """(our per-layer name, tensor, args) -> tensor with `convert` (one RoPE row order to the
    other) applied to the q/k projections and QK-norm weights; other tensors unchanged."""
    def change(name: str | None, value: torch.Tensor, args) -> torch.Tensor:
        if name == "attention.wq.weight":
            return convert(value, args.n_heads)
        if name == "attention.wk.weight":
            return convert(value, args.num_kv_heads)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):  # one head's features
            return convert(value.view(-1, 1), 1).view(-1)
        return value

    return change


# Our q/k rows (and QK-norm weights) in HF's rotate-half order, and back; (our per-layer name or
# None, tensor, args) -> tensor.
TO_HALF = _qk_rope_layout(interleaved_to_half)
TO_INTERLEAVED = _qk_rope_layout(half_to_interleaved)


__all__ = [
    "ATTENTION_NAMES", "BLOCK_NORM_NAMES", "DECODER_LAYERS", "DECODER_TOP", "DENSE_MLP_NAMES", "HFAdapter",
    "TO_HALF", "TO_INTERLEAVED", "decoder_config", "half_to_interleaved", "interleaved_to_half", "known_ids",
    "rope_settings", "unscaled_rope_theta",
]
