"""Mixtral family: Mixtral 8x7B, 8x22B (Mistral AI) and a CPU-sized debug model.

Hyper-parameters follow the published config.json files (mistralai/Mixtral-8x7B-v0.1,
Mixtral-8x22B-v0.1): 8 experts, top 2, RoPE theta 1e6, RMSNorm eps 1e-5, router aux loss
coefficient 0.02. vocab_size and max_seq_len are placeholders the trainer overwrites
(update_from_config); max_seq_len is the real context.
"""

from titanlike.models.common.moe import MoEArgs
from titanlike.models.mixtral.hf_adapter import MixtralHF
from titanlike.models.mixtral.megatron_adapter import MEGATRON
from titanlike.models.mixtral.model import Mixtral, MixtralModelArgs
from titanlike.models.common.sharding import decoder_sharding
from titanlike.models.registry import ModelSpec, PipelineEnds, register_model_spec


def _moe(hidden_dim: int) -> MoEArgs:
    # HF's MixtralSparseMoeBlock: softmax over the 8 experts, top 2, renormalized.
    return MoEArgs(num_experts=8, top_k=2, hidden_dim=hidden_dim, score_func="softmax", route_norm=True,
                   aux_loss_coeff=0.02)


mixtral_flavors: dict[str, MixtralModelArgs] = {
    # CPU-sized, llama3 debugmodel's width; every MoE size a multiple of 8 (torch._grouped_mm).
    "debugmodel": MixtralModelArgs(dim=256, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=2256,
                                   max_seq_len=2048, moe=_moe(256)),
    "8x7B": MixtralModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                             max_seq_len=32768, moe=_moe(14336)),
    "8x22B": MixtralModelArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768,
                              max_seq_len=65536, moe=_moe(16384)),
}

register_model_spec(
    ModelSpec(
        name="mixtral",
        model_cls=Mixtral,
        flavors=mixtral_flavors,
        shard=decoder_sharding(mlp_inputs=("w1", "w3")),
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=MixtralHF(),
        megatron=MEGATRON,
    )
)

__all__ = ["Mixtral", "MixtralModelArgs", "mixtral_flavors"]
