"""Llama 3 family: Llama 3.1 (8B, 70B, 405B), Llama 3.2 (1B, 3B) and small debug models.

Hyper-parameters follow Meta's published params.json / Hugging Face config.json.
vocab_size and max_seq_len of every flavor are placeholders the trainer overwrites (from the
tokenizer and training.seq_len) through update_from_config; max_seq_len is the real context length.
"""

from titanlike.models.common.rope import RoPEScaling
from titanlike.models.llama3.hf_adapter import Llama3HF
from titanlike.models.llama3.megatron_adapter import MEGATRON
from titanlike.models.llama3.model import Transformer, TransformerModelArgs
from titanlike.models.common.sharding import decoder_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec

LLAMA31_ROPE_SCALING = RoPEScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192)
LLAMA32_ROPE_SCALING = RoPEScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192)

llama3_flavors: dict[str, TransformerModelArgs] = {
    # CPU-sized; n_kv_heads < n_heads so GQA is exercised, and the 3.1 RoPE scaling so the
    # scaled-frequency path is too.
    "debugmodel": TransformerModelArgs(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=2256, multiple_of=256,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=2048,
    ),
    "debugmodel_tiny": TransformerModelArgs(
        dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=2256, multiple_of=32,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=2048,
    ),
    # ~100M parameters with the 2048-token debug tokenizer (98.6M; 96.5M without embeddings):
    # big enough for memory and throughput measurements on CPU to mean something.
    "100M": TransformerModelArgs(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=256,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, max_seq_len=2048,
    ),
    "1B": TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
        ffn_dim_multiplier=1.5, rope_theta=500000.0, rope_scaling=LLAMA32_ROPE_SCALING,
        max_seq_len=131072, tie_word_embeddings=True,
    ),
    "3B": TransformerModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=256,
        ffn_dim_multiplier=1.0, rope_theta=500000.0, rope_scaling=LLAMA32_ROPE_SCALING,
        max_seq_len=131072, tie_word_embeddings=True,
    ),
    "8B": TransformerModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
    "70B": TransformerModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
    "405B": TransformerModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
        ffn_dim_multiplier=1.2, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=131072,
    ),
}

register_model_spec(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=llama3_flavors,
        shard=decoder_sharding(mlp_inputs=("w1", "w3")),
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=Llama3HF(llama3_flavors),
        megatron=MEGATRON,
    )
)

__all__ = ["LLAMA31_ROPE_SCALING", "LLAMA32_ROPE_SCALING", "Transformer", "TransformerModelArgs", "llama3_flavors"]
