"""gpt-oss family: openai/gpt-oss-20b and gpt-oss-120b, and a CPU-sized debug model.

Hyper-parameters from OpenAI's config.json files: width 2880, 64 query heads of 64 features over 8
key/value heads, 24 (20B) or 36 (120B) layers alternating a 128-token sliding window and full attention,
32 or 128 experts of hidden size 2880 with 4 chosen per token, YaRN RoPE (theta 150k, factor 32 over
4096), vocabulary 201088 (o200k_harmony), context 131072. vocab_size and max_seq_len are placeholders
the trainer overwrites.
"""

from titanlike.models.common.moe import MoEArgs
from titanlike.models.gpt_oss.hf_adapter import GptOssHF
from titanlike.models.gpt_oss.model import GptOss, GptOssModelArgs
from titanlike.models.gpt_oss.sharding import gpt_oss_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec


def _moe(num_experts: int, hidden_dim: int = 2880, top_k: int = 4) -> MoEArgs:
    # HF's GptOssTopKRouter: top-k of the logits, softmax over the k chosen (router_aux_loss_coef 0.9 is
    # only used with output_router_logits, which the published configs leave off).
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden_dim=hidden_dim, score_func="softmax",
                   score_before_topk=False)


def _released(n_layers: int, num_experts: int) -> GptOssModelArgs:
    return GptOssModelArgs(dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, explicit_head_dim=64,
                           vocab_size=201088, max_seq_len=131072, moe=_moe(num_experts))


gpt_oss_flavors: dict[str, GptOssModelArgs] = {
    # CPU-sized: four layers (two sliding, two full), a window of 16 that the layouts' sequences of 32
    # cross, 8 experts choosing 2; every MoE size a multiple of 8 (torch._grouped_mm).
    "debugmodel": GptOssModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, explicit_head_dim=32,
                                  vocab_size=2256, max_seq_len=2048, sliding_window=16, moe=_moe(8, 128, 2)),
    "20B": _released(24, 32),
    "120B": _released(36, 128),
}

register_model_spec(
    ModelSpec(
        name="gpt_oss",
        model_cls=GptOss,
        flavors=gpt_oss_flavors,
        shard=gpt_oss_sharding,
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=GptOssHF(),
    )
)

__all__ = ["GptOss", "GptOssModelArgs", "gpt_oss_flavors"]
