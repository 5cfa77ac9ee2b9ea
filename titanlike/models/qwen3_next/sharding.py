"""Qwen3-Next's tensor + sequence parallelism: full attention and MLP / MoE as every decoder (the gate
rows of wq travel with their head's query rows); a Gated DeltaNet mixer split by key heads, each with its
value heads (model.py's layout): in_proj_qkvz and in_proj_ba colwise, out_proj rowwise, its conv
filters, dt_bias and A_log split with the heads (the Mamba-2 mixer's style, which splits what a module
names in head_split_parameters and gathers its input), its per-head norm as QK-norm (weight whole,
gradient summed over the ranks)."""

from titanlike.models.common.mamba2 import mamba2_head_split
from titanlike.models.common.sharding import colwise, decoder_sharding, head_norm, rowwise

qwen3_next_sharding = decoder_sharding(mlp_inputs=("w1", "w3"), qk_norm=True).with_changes(block={
    "linear_attention": mamba2_head_split,
    "linear_attention.in_proj_qkvz": colwise,
    "linear_attention.in_proj_ba": colwise,
    "linear_attention.out_proj": rowwise,
    "linear_attention.norm": head_norm,
})

__all__ = ["qwen3_next_sharding"]
