"""Megatron-LM interchange for GPT-2: megatron-core GPTModel's names (LayerNorm, learned positions, GELU,
biases, tied embeddings).

Our MLP computes the tanh-approximated GELU, which is Megatron-LM's `--openai-gelu`; its default is the exact
erf GELU, so a model trained with it computes slightly differently here.
"""

from titanlike.models.common.megatron import MegatronAdapter

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
)

__all__ = ["MEGATRON"]
