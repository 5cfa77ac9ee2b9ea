"""Megatron-LM interchange for Mixtral: megatron-core GPTModel's names with MoE layers (RMSNorm, GQA, RoPE,
untied; every layer's MLP a softmax top-k router over SwiGLU experts, as Megatron-LM's Mixtral recipe).

As for Llama 3 (llama3/megatron_adapter.py), megatron-core rotates the halves of each head and we rotate
adjacent pairs: q's and k's rows are reordered. The experts' gate/up `linear_fc1` splits into w1 and w3.
"""

from titanlike.models.common.hf import TO_INTERLEAVED
from titanlike.models.common.megatron import DECODER_LAYER, DECODER_TOP, MegatronAdapter

MEGATRON = MegatronAdapter(
    top=DECODER_TOP,
    layer={
        **DECODER_LAYER,
        "mlp.router.weight": "moe.router.gate.weight",
    },
    experts=("moe.experts.w1", "moe.experts.w3", "moe.experts.w2"),  # gate, up, down
    rope_rows=TO_INTERLEAVED,
)

__all__ = ["MEGATRON"]
