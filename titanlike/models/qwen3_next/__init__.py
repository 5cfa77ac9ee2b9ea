"""Qwen3-Next / Qwen3.5 family: Gated DeltaNet layers mixed 3:1 with gated full attention (model.py),
dense or mixture of experts with a gated shared expert, and CPU-sized debug models.

Hyper-parameters: Qwen3-Next-80B-A3B from Qwen's config.json (Qwen/Qwen3-Next-80B-A3B-Instruct: 48
layers, every 4th full attention with 16 heads of 256 (2 key/value heads, RoPE on 64 features, theta
1e7); Gated DeltaNet with 16 key heads and 32 value heads of 128; 512 experts of 512, top 10, one shared
expert of 512). Qwen3.5 (9B, 27B dense; 35B-A3B: 256 experts, top 8, every layer) are the text models
of Qwen's releases (the same pattern, vocabulary 248320); their vision tower is not built here. vocab_size and
max_seq_len are placeholders the trainer overwrites (update_from_config); max_seq_len is the context.
"""

from titanlike.models.common.moe import MoEArgs
from titanlike.models.qwen3_next.hf_adapter import Qwen3NextHF
from titanlike.models.qwen3_next.model import Qwen3Next, Qwen3NextModelArgs
from titanlike.models.qwen3_next.sharding import qwen3_next_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec

DEBUG_VOCAB = 2256  # the debug tokenizer's


def _debug_moe(hidden_dim: int, **changes) -> MoEArgs:
    return MoEArgs(num_experts=8, top_k=2, hidden_dim=hidden_dim, num_shared_experts=1, shared_hidden_dim=hidden_dim,
                   score_func="softmax", route_norm=True, aux_loss_coeff=0.01, **changes)


qwen3_next_flavors: dict[str, Qwen3NextModelArgs] = {
    # The debug models alternate the two mixers (full_attention_interval 2, the released models 4), so
    # that any two consecutive layers hold both.
    # CPU-sized dense model, llama3's debugmodel width: 8 layers, 4 of them full attention.
    "debugmodel": Qwen3NextModelArgs(
        dim=256, n_layers=8, n_heads=8, n_kv_heads=2, explicit_head_dim=32, ffn_hidden_dim=768,
        vocab_size=DEBUG_VOCAB, max_seq_len=2048, rope_theta=10_000.0, full_attention_interval=2,
        linear_k_heads=4, linear_v_heads=8, linear_k_dim=32, linear_v_dim=32,
    ),
    # The same with mixture-of-experts MLPs after a dense first layer (sizes multiples of 8 for
    # torch._grouped_mm).
    "debugmodel_moe": Qwen3NextModelArgs(
        dim=256, n_layers=8, n_heads=8, n_kv_heads=2, explicit_head_dim=32, ffn_hidden_dim=768,
        vocab_size=DEBUG_VOCAB, max_seq_len=2048, rope_theta=10_000.0, full_attention_interval=2,
        linear_k_heads=4, linear_v_heads=8, linear_k_dim=32, linear_v_dim=32, moe=_debug_moe(128, first_k_dense=1),
    ),
    # Tiny, debugmodel_moe's structure, for parity tests: a dense first layer, then MoE; two key heads
    # (TP 2), chunks of 16 (several per sequence).
    "debugmodel_tiny": Qwen3NextModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=16, ffn_hidden_dim=128,
        vocab_size=DEBUG_VOCAB, max_seq_len=2048, rope_theta=10_000.0, full_attention_interval=2, chunk_size=16,
        linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16,
        moe=_debug_moe(32, first_k_dense=1),
    ),
    "80B-A3B": Qwen3NextModelArgs(
        dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, explicit_head_dim=256, ffn_hidden_dim=5120,
        vocab_size=151936, max_seq_len=262144,
        moe=MoEArgs(num_experts=512, top_k=10, hidden_dim=512, num_shared_experts=1, shared_hidden_dim=512,
                    score_func="softmax",
                    route_norm=True, aux_loss_coeff=0.001),
    ),
    # transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults, which its docstrings name as the
    # 9B and 35B-A3B configurations.
    "3.5-9B": Qwen3NextModelArgs(
        dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, explicit_head_dim=256, ffn_hidden_dim=12288,
        vocab_size=248320, max_seq_len=262144, release="qwen3_5",
    ),
    "3.5-35B-A3B": Qwen3NextModelArgs(
        dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, explicit_head_dim=256, vocab_size=248320,
        max_seq_len=262144, release="qwen3_5",
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=512, num_shared_experts=1, shared_hidden_dim=512,
                    score_func="softmax", route_norm=True, aux_loss_coeff=0.001),
    ),
    "3.5-27B": Qwen3NextModelArgs(
        dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, explicit_head_dim=256, ffn_hidden_dim=17408,
        vocab_size=248320, max_seq_len=262144, linear_v_heads=48, release="qwen3_5",
    ),
}

register_model_spec(
    ModelSpec(
        name="qwen3_next",
        model_cls=Qwen3Next,
        flavors=qwen3_next_flavors,
        shard=qwen3_next_sharding,
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=Qwen3NextHF(),
    )
)

__all__ = ["Qwen3Next", "Qwen3NextModelArgs", "qwen3_next_flavors"]
