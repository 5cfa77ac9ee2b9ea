"""DeepSeek-V3's tensor + sequence parallelism: the decoder's plan with multi-head latent attention
split by heads and the multi-token-prediction modules on the sequence slice.

The gathered input feeds the query (wq, or wq_a -> q_norm -> wq_b) and the latent (wkv_a -> kv_norm
-> wkv_b); the down projections and latent norms run whole on every rank (replicated), the up
projections are colwise, wo rowwise. The RoPE key (wk_pe) is read by each rank's heads directly,
not through a colwise linear, so its gradient is summed over the ranks (replicated_to_heads).
MLP and MoE as every decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from titanlike.models.common.sharding import (
    colwise,
    decoder_sharding,
    gather_input,
    replicated,
    sequence_norm,
    sequence_replicated,
    vocab_embedding,
)
from titanlike.models.spec_types import ShardOptions

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel.style import ParallelStyle


def replicated_to_heads(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    """A replicated module whose output each rank's local heads read directly (MLA's RoPE key, shared
    by all heads): its output's gradient is summed over the ranks in backward (ReplicatedModule's
    read_by_heads, models/common/parallel_styles.py)."""
    from titanlike.models.common.parallel_styles import ReplicatedModule

    return ReplicatedModule(read_by_heads=True)


deepseek_v3_sharding = decoder_sharding(mlp_inputs=("w1", "w3")).with_changes(
    top={"mtp_embeddings": vocab_embedding},
    block={
        # The replicated down projections read the gathered input in high precision: no float8 gather.
        "attention": gather_input(),
        "attention.wq_a": replicated, "attention.q_norm": replicated, "attention.wq_b": colwise,
        "attention.wkv_a": replicated, "attention.kv_norm": replicated, "attention.wkv_b": colwise,
        "attention.wk_pe": replicated_to_heads,
        # Multi-token prediction modules (entries after the trunk): their input norms and projection
        # work per token on the sequence slice and feed the block's residual stream as plain tensors;
        # head_norm feeds the shared output head as the final norm does.
        "enorm": sequence_replicated, "hnorm": sequence_replicated, "eh_proj": sequence_replicated,
        "head_norm": sequence_norm,
    },
    drop=("attention.wk", "attention.wv"),
)

__all__ = ["deepseek_v3_sharding", "replicated_to_heads"]
