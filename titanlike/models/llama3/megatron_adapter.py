"""Megatron-LM interchange for Llama 3: megatron-core GPTModel's names (RMSNorm, SwiGLU, GQA, RoPE, untied).

megatron-core rotates the two halves of each head (`rotary_interleaved=False`, its default), as Hugging Face
does; we rotate adjacent pairs, so q's and k's rows are reordered on the way in (TO_INTERLEAVED, as
hf_adapter.py does for Hugging Face).
"""

from titanlike.models.common.hf import TO_INTERLEAVED
from titanlike.models.common.megatron import MegatronAdapter

MEGATRON = MegatronAdapter(
    top={
        "embedding.word_embeddings.weight": "tok_embeddings.weight",
        "decoder.final_layernorm.weight": "norm.weight",
        "output_layer.weight": "output.weight",
    },
    layer={
        "input_layernorm.weight": "attention_norm.weight",
        "self_attention.linear_proj.weight": "attention.wo.weight",
        "pre_mlp_layernorm.weight": "ffn_norm.weight",
        "mlp.linear_fc2.weight": "feed_forward.w2.weight",
    },
    fc1=("feed_forward.w1", "feed_forward.w3"),  # gate, up
    rope_rows=TO_INTERLEAVED,
)

__all__ = ["MEGATRON"]
