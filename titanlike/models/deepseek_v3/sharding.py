"""DeepSeek-V3's tensor + sequence parallelism: the decoder's plan with multi-head latent attention
split by heads and the multi-token-prediction modules on the sequence slice.

The gathered input feeds the query (wq, or wq_a -> q_norm -> wq_b) and the latent (wkv_a -> kv_norm
-> wkv_b); the down projections and latent norms run whole on every rank (replicated), the up
projections are colwise, wo rowwise. The RoPE key (wk_pe) is read by each rank's heads directly,
not through a colwise linear, so its gradient is summed over the ranks (replicated_to_heads).
MLP and MoE as every decoder.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel.style import ParallelStyle

from titanlike.models.common.sharding import (
    ReplicatedModule,
    colwise,
    decoder_sharding,
    gather_input,
    replicated,
    sequence_norm,
    sequence_replicated,
    vocab_embedding,
)
from titanlike.models.spec_types import ShardOptions


class ReplicatedToHeads(ReplicatedModule):
    """A replicated module whose output each rank's local heads read directly (MLA's RoPE key, shared
    by all heads). In backward each rank then holds only its heads' share of the output's gradient,
    so the output is an identity whose backward all-reduces that gradient first (Megatron's copy to
    the tensor-parallel region). Summing a gradient a colwise reader already summed would multiply
    it by the TP degree: that is why ReplicatedModule itself does not."""

    def local_output(self, out, mesh: DeviceMesh):
        # Identity forward; backward reads the local gradient as a partial sum (Partial) and
        # from_local's backward redistributes it to Replicate: an all-reduce.
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def replicated_to_heads(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    return ReplicatedToHeads()


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

__all__ = ["ReplicatedToHeads", "deepseek_v3_sharding", "replicated_to_heads"]
