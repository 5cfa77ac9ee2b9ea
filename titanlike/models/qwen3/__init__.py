"""Qwen3 family: the dense Qwen3 models (0.6B to 32B), the MoE ones (30B-A3B, 235B-A22B) and
CPU-sized debug models.

Hyper-parameters follow Qwen's published config.json files (Qwen/Qwen3-*): head_dim 128, RoPE
theta 1e6, RMSNorm eps 1e-6, vocabulary 151936, context 40960; the small dense models tie the
output projection to the embeddings. vocab_size and max_seq_len are placeholders the trainer
overwrites (update_from_config); max_seq_len is the real context.
"""

from titanlike.models.common.moe import MoEArgs
from titanlike.models.qwen3.hf_adapter import Qwen3HF
from titanlike.models.qwen3.megatron_adapter import MEGATRON
from titanlike.models.qwen3.model import Qwen3, Qwen3ModelArgs
from titanlike.models.common.sharding import decoder_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec

QWEN3_VOCAB = 151936
QWEN3_CONTEXT = 40960


def _dense(dim: int, n_layers: int, n_heads: int, ffn_hidden_dim: int, *, tie: bool) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, explicit_head_dim=128,
                          ffn_hidden_dim=ffn_hidden_dim, vocab_size=QWEN3_VOCAB, max_seq_len=QWEN3_CONTEXT,
                          tie_word_embeddings=tie)


def _moe(dim: int, n_layers: int, n_heads: int, ffn_hidden_dim: int, expert_hidden_dim: int) -> Qwen3ModelArgs:
    # norm_topk_prob true: the top-k softmax scores are renormalized (route_norm).
    moe = MoEArgs(num_experts=128, top_k=8, hidden_dim=expert_hidden_dim, score_func="softmax",
                  route_norm=True, aux_loss_coeff=0.001)
    return Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, explicit_head_dim=128,
                          ffn_hidden_dim=ffn_hidden_dim, vocab_size=QWEN3_VOCAB, max_seq_len=QWEN3_CONTEXT,
                          moe=moe)


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # CPU-sized dense model, the size of llama3's debugmodel (GQA, QK-norm, tied embeddings off).
    "debugmodel": Qwen3ModelArgs(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, explicit_head_dim=16, ffn_hidden_dim=768,
        vocab_size=2256, max_seq_len=2048,
    ),
    # CPU-sized MoE: layer 0 dense so both block kinds appear; every MoE size a multiple of 8
    # (torch._grouped_mm).
    "debugmodel_moe": Qwen3ModelArgs(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, explicit_head_dim=16, ffn_hidden_dim=768,
        vocab_size=2256, max_seq_len=2048,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, score_func="softmax", route_norm=True,
                    first_k_dense=1, aux_loss_coeff=0.01),
    ),
    "0.6B": _dense(1024, 28, 16, 3072, tie=True),
    "1.7B": _dense(2048, 28, 16, 6144, tie=True),
    "4B": _dense(2560, 36, 32, 9728, tie=True),
    "8B": _dense(4096, 36, 32, 12288, tie=False),
    "14B": _dense(5120, 40, 40, 17408, tie=False),
    "32B": _dense(5120, 64, 64, 25600, tie=False),
    # intermediate_size (ffn_hidden_dim) is in their config.json but unused: every layer is MoE.
    "30B-A3B": _moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _moe(4096, 94, 64, 12288, 1536),
}

register_model_spec(
    ModelSpec(
        name="qwen3",
        model_cls=Qwen3,
        flavors=qwen3_flavors,
        shard=decoder_sharding(mlp_inputs=("w1", "w3"), qk_norm=True),
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=Qwen3HF(),
        megatron=MEGATRON,
    )
)

__all__ = ["QWEN3_CONTEXT", "QWEN3_VOCAB", "Qwen3", "Qwen3ModelArgs", "qwen3_flavors"]
