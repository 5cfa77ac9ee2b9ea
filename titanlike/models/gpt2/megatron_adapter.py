"""Megatron-LM interchange for GPT-2: megatron-core GPTModel's names (LayerNorm, learned positions, GELU,
biases, tied embeddings).

The MLP's GELU is the args' gelu_approximate: "tanh" is Megatron-LM's `--openai-gelu`, "none" its default exact
erf GELU; the checkpoint's args say which it trained with, and a flavor computing the other is refused with the
--model.args that fixes it.
"""

from collections.abc import Mapping
from typing import Any

from titanlike.models.common.megatron import MegatronAdapter


def gelu_settings(settings: Mapping[str, Any], args) -> str | None:
    """Megatron-LM's --openai-gelu (tanh) against the flavor's gelu_approximate."""
    openai_gelu = settings.get("openai_gelu")
    if not isinstance(openai_gelu, bool):
        return None  # not recorded (a torch_dist checkpoint without common.pt args)
    theirs = "tanh" if openai_gelu else "none"
    if theirs == args.gelu_approximate:
        return None
    trained = "the tanh GELU (--openai-gelu)" if openai_gelu else "the exact GELU (no --openai-gelu)"
    return (f"Megatron-LM trained it with {trained}, the flavor computes gelu_approximate {args.gelu_approximate} "
            f"(--model.args gelu_approximate={theirs})")


MEGATRON = MegatronAdapter(
    top={
        "embedding.word_embeddings.weight": "tok_embeddings.weight",
        "embedding.position_embeddings.weight": "pos_embeddings.weight",
        "decoder.final_layernorm.weight": "norm.weight",
        "decoder.final_layernorm.bias": "norm.bias",
        "output_layer.weight": "output.weight",
    },
    layer={
        "input_layernorm.weight": "attention_norm.weight",
        "input_layernorm.bias": "attention_norm.bias",
        "self_attention.linear_proj.weight": "attention.wo.weight",
        "self_attention.linear_proj.bias": "attention.wo.bias",
        "pre_mlp_layernorm.weight": "ffn_norm.weight",
        "pre_mlp_layernorm.bias": "ffn_norm.bias",
        "mlp.linear_fc2.weight": "feed_forward.w2.weight",
        "mlp.linear_fc2.bias": "feed_forward.w2.bias",
    },
    fc1=("feed_forward.w1",),
    check_settings=gelu_settings,
)

__all__ = ["MEGATRON"]
