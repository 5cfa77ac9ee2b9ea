"""Gemma 3 family (text): google/gemma-3-1b-pt and the language models of gemma-3-{4b,12b,27b}-pt, and a
CPU-sized debug model.

Hyper-parameters from Google's config.json files: head_dim 256 (27B: 128 with query_pre_attn_scalar
168), five sliding-window layers (window 512 for 1B, 1024 from 4B up) for each global one, RoPE bases
10k (local) and 1M (global, linearly scaled by 8 from 4B up), vocabulary 262144 (1B) or 262208, context
32768 (1B) or 131072. The vision tower of 4B-27B (SigLIP + projector) is not built: a text-only flavor
reads the language model's weights. vocab_size and max_seq_len are placeholders the trainer overwrites.
"""

from titanlike.models.common.sharding import decoder_sharding, sequence_replicated
from titanlike.models.gemma3.hf_adapter import Gemma3HF
from titanlike.models.gemma3.model import Gemma3, Gemma3ModelArgs
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec


def _released(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden_dim: int, *, head_dim: int = 256,
              query_pre_attn_scalar: int = 256) -> Gemma3ModelArgs:
    # 4B, 12B, 27B: window 1024, global RoPE scaled 8x for their 128k context.
    return Gemma3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           explicit_head_dim=head_dim, ffn_hidden_dim=ffn_hidden_dim, vocab_size=262208,
                           max_seq_len=131072, sliding_window=1024, rope_scaling_factor=8.0,
                           query_pre_attn_scalar=query_pre_attn_scalar)


gemma3_flavors: dict[str, Gemma3ModelArgs] = {
    # CPU-sized: one global layer after five local ones, a window of 16 (the layouts' sequences of 32
    # cross it, and CP chunk boundaries with it), the scaled global RoPE and a q scale that is not
    # head_dim^-0.5, so every difference from Llama is exercised.
    "debugmodel": Gemma3ModelArgs(
        dim=128, n_layers=6, n_heads=4, n_kv_heads=2, explicit_head_dim=32, ffn_hidden_dim=384,
        vocab_size=2256, max_seq_len=2048, sliding_window=16, rope_scaling_factor=8.0, query_pre_attn_scalar=24,
    ),
    "1B": Gemma3ModelArgs(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, explicit_head_dim=256, ffn_hidden_dim=6912,
                          vocab_size=262144, max_seq_len=32768, sliding_window=512),
    "4B": _released(2560, 34, 8, 4, 10240),
    "12B": _released(3840, 48, 16, 8, 15360),
    "27B": _released(5376, 62, 32, 16, 21504, head_dim=128, query_pre_attn_scalar=168),
}

register_model_spec(
    ModelSpec(
        name="gemma3",
        model_cls=Gemma3,
        flavors=gemma3_flavors,
        # The post-norms run on this rank's slice of the sequence and hand a plain tensor to the residual add.
        shard=decoder_sharding(mlp_inputs=("w1", "w3"), qk_norm=True).with_changes(
            block={"post_attention_norm": sequence_replicated, "post_ffn_norm": sequence_replicated}),
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=Gemma3HF(),
    )
)

__all__ = ["Gemma3", "Gemma3ModelArgs", "gemma3_flavors"]
