"""Megatron-LM interchange for Llama 3: megatron-core GPTModel's names (RMSNorm, SwiGLU, GQA, RoPE, untied).

megatron-core rotates the two halves of each head (`rotary_interleaved=False`, its default), as Hugging Face
does; we rotate adjacent pairs, so q's and k's rows are reordered on the way in (TO_INTERLEAVED, as
hf_adapter.py does for Hugging Face).
"""

from collections.abc import Mapping
from typing import Any

from titanlike.models.common.hf import TO_INTERLEAVED
from titanlike.models.common.megatron import DECODER_LAYER, DECODER_TOP, MegatronAdapter


def rope_scaling_settings(settings: Mapping[str, Any], args) -> str | None:
    """Megatron-LM's --use-rope-scaling / --rope-scaling-factor (Llama 3.1's rule, low 1, high 4, original
    8192: megatron-core's RotaryEmbedding) against the flavor's rope_scaling."""
    use, factor = settings.get("use_rope_scaling"), settings.get("rope_scaling_factor")
    if not isinstance(use, bool):
        return None
    if use and args.rope_scaling is None:
        return "Megatron-LM trained it with --use-rope-scaling, the flavor has none (name a flavor that scales RoPE)"
    if not use and args.rope_scaling is not None:
        return ("Megatron-LM trained it without --use-rope-scaling, the flavor scales RoPE "
                "(--model.args rope_scaling=none)")
    if use and isinstance(factor, (int, float)) and float(factor) != args.rope_scaling.factor:
        return (f"Megatron-LM trained it with --rope-scaling-factor {factor}, the flavor has "
                f"{args.rope_scaling.factor} (--model.args rope_scaling.factor={factor})")
    return None


MEGATRON = MegatronAdapter(
    top=DECODER_TOP,
    layer={
        **DECODER_LAYER,
        "mlp.linear_fc2.weight": "feed_forward.w2.weight",
    },
    fc1=("feed_forward.w1", "feed_forward.w3"),  # gate, up
    rope_rows=TO_INTERLEAVED,
    check_settings=rope_scaling_settings,
)

__all__ = ["MEGATRON", "rope_scaling_settings"]
