"""DeepSeek-V3 family: DeepSeek-V3 (671B-A37B), a 16B-A3B of its architecture at Moonlight's sizes,
and CPU-sized debug models.

Hyper-parameters follow the published config.json files (deepseek-ai/DeepSeek-V3,
moonshotai/Moonlight-16B-A3B). Balancing follows DeepSeek-V3's report: aux-loss-free bias updates
at rate 1e-3 and a small sequence-wise balance loss (V3: 1e-4; Moonlight's config: 1e-3). vocab_size
and max_seq_len are placeholders the trainer overwrites (update_from_config); max_seq_len is the
real context.
"""

from titanlike.models.common.moe import MoEArgs
from titanlike.models.common.rope import YaRNScaling
from titanlike.models.deepseek_v3.hf_adapter import DeepSeekV3HF
from titanlike.models.deepseek_v3.megatron_adapter import MEGATRON
from titanlike.models.deepseek_v3.model import DeepSeekV3, DeepSeekV3ModelArgs
from titanlike.models.deepseek_v3.sharding import deepseek_v3_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec


def _debug_moe() -> MoEArgs:
    # DeepSeek-V3's routing at CPU size: 8 experts in 4 groups of which 2 are searched, every MoE
    # size a multiple of 8 (torch._grouped_mm).
    return MoEArgs(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=1, score_func="sigmoid",
                   route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2, first_k_dense=1,
                   seq_aux_loss_coeff=1e-4, bias_update_rate=1e-3)


def _debugmodel(q_lora_rank: int) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(dim=256, n_layers=4, n_heads=8, vocab_size=2256, max_seq_len=2048,
                               ffn_hidden_dim=768, q_lora_rank=q_lora_rank, kv_lora_rank=64, qk_nope_head_dim=32,
                               qk_rope_head_dim=16, v_head_dim=32, moe=_debug_moe(), mtp_num_layers=1)


deepseek_v3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    # CPU-sized, the width of qwen3's debugmodel_moe: layer 0 dense, the low-rank query path on, one
    # multi-token-prediction module (as the 671B).
    "debugmodel": _debugmodel(q_lora_rank=128),
    # The same with one query projection (as the 16B).
    "debugmodel_nolora": _debugmodel(q_lora_rank=0),
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V2-Lite's shapes, DeepSeek-V3's architecture): no query
    # compression, 64 experts top 6 in one group, 2 shared experts, RoPE theta 5e4, 8192 context.
    "16B": DeepSeekV3ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=163840, max_seq_len=8192, norm_eps=1e-5,
        ffn_hidden_dim=11264, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=50000.0,
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, num_shared_experts=2, score_func="sigmoid",
                    route_norm=True, route_scale=2.446, first_k_dense=1, seq_aux_loss_coeff=1e-3,
                    bias_update_rate=1e-3),
    ),
    # deepseek-ai/DeepSeek-V3: YaRN from 4096 to 163840 positions, node-limited routing (8 groups,
    # best 4), one multi-token-prediction module.
    "671B": DeepSeekV3ModelArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, max_seq_len=163840, norm_eps=1e-6,
        ffn_hidden_dim=18432, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=10000.0,
        rope_scaling=YaRNScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=8, topk_groups=4, first_k_dense=3,
                    seq_aux_loss_coeff=1e-4, bias_update_rate=1e-3),
        mtp_num_layers=1,
    ),
}


register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        model_cls=DeepSeekV3,
        flavors=deepseek_v3_flavors,
        shard=deepseek_v3_sharding,
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output", "mtp_embeddings")),
        hf=DeepSeekV3HF(),
        megatron=MEGATRON,
    )
)

__all__ = ["DeepSeekV3", "DeepSeekV3ModelArgs", "deepseek_v3_flavors", "deepseek_v3_sharding"]
