"""Megatron-LM interchange for Qwen3, dense and MoE: megatron-core GPTModel's names with QK-norm
(`--qk-layernorm`: one RMSNorm over each head's features of q and of k) and, for the MoE flavors, softmax
top-k routers over SwiGLU experts (dense layers first where `--moe-layer-freq` says so).

As for Llama 3 (llama3/megatron_adapter.py), q's and k's rows are reordered for our pair-interleaved RoPE,
and so are the QK-norm weights (one head's features).
"""

from titanlike.models.common.hf import TO_INTERLEAVED
from titanlike.models.common.megatron import DECODER_LAYER, DECODER_TOP, MegatronAdapter

MEGATRON = MegatronAdapter(
    top=DECODER_TOP,
    layer={
        **DECODER_LAYER,
        "self_attention.q_layernorm.weight": "attention.q_norm.weight",
        "self_attention.k_layernorm.weight": "attention.k_norm.weight",
        "mlp.linear_fc2.weight": "feed_forward.w2.weight",
        "mlp.router.weight": "moe.router.gate.weight",
    },
    fc1=("feed_forward.w1", "feed_forward.w3"),  # gate, up
    experts=("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"),  # gate, up, down
    rope_rows=TO_INTERLEAVED,
)

__all__ = ["MEGATRON"]
