"""Expert parallelism and the other placements of mixture-of-experts layers.

For every MoE layer (models/common/moe.py) of a model or pipeline stage:
  - experts: with ep > 1 their stacked weights become DTensors sharded on the expert dimension
    over the ep ranks, and the layer's dispatcher moves each routed token to the rank of its
    expert and back: all-to-all with uneven splits (default), or all-gather + reduce-scatter;
  - sequence_group: the cp x tp ranks holding other slices of the same sequences, over which the
    layer reduces the statistics its balancing losses and capacity need;
  - FSDP meshes (applied later by parallel/fsdp.py): experts over expert_fsdp, the router and
    shared experts over token_fsdp, which spans the TP ranks too: under sequence parallelism each
    TP rank routes different tokens, so their gradients must be summed over TP as well.

Gradients need no extra scaling: the trainer divides them by the global token count and every FSDP
reduction is a plain sum, so an expert's gradient is the sum over every token routed to it,
whichever rank the token came from (EP 2 equals EP 1; the test is tests/distributed/test_moe_parity.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import (
    all_gather_tensor_autograd,
    all_to_all_single_autograd,
    reduce_scatter_tensor_autograd,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlike.models import protocol
from titanlike.models.common.moe import Dispatcher, GroupedExperts, moe_layers

DISPATCHERS = ("alltoall", "allgather")


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh | None, sequence_mesh: DeviceMesh | None,
                          token_dispatcher: str = "alltoall") -> int:
    """Place the MoE layers of `model` (in place); returns how many there were."""
    layers = moe_layers(model)
    for _, moe in layers:
        moe.sequence_group = sequence_mesh.get_group() if sequence_mesh is not None else None
        # Read by parallel/fsdp.py: which mesh each part is sharded over.
        protocol.set_fsdp_mesh(moe, "token_fsdp")
        protocol.set_fsdp_mesh(moe.experts, "expert_fsdp")
        # Read by the compile step: routing has data-dependent sizes (token counts as Python ints for
        # the all-to-all splits and the grouped matmul offsets), so the layer runs eagerly.
        protocol.set_skip_compile(moe)
        if ep_mesh is None:
            continue
        _shard_experts(moe.experts, ep_mesh)
        num_experts = moe.args.num_experts
        moe.dispatcher = (AllToAllDispatcher(ep_mesh, num_experts) if token_dispatcher == "alltoall"
                          else AllGatherDispatcher(ep_mesh, num_experts))
    return len(layers)


def _shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))


def _source_to_expert_order(counts: torch.Tensor) -> torch.Tensor:
    """counts (sources, experts): rows arrive grouped by source, then expert; the index that
    regroups them by expert, then source (what the grouped matmul needs)."""
    lengths = counts.reshape(-1)
    starts = (lengths.cumsum(0) - lengths).view_as(counts)
    seg_starts, seg_lengths = starts.T.reshape(-1), counts.T.reshape(-1)
    total = int(seg_lengths.sum())
    seg_offsets = seg_lengths.cumsum(0) - seg_lengths
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(seg_offsets, seg_lengths)
    return torch.repeat_interleave(seg_starts, seg_lengths) + within


class _ExpertGroupDispatcher(Dispatcher):
    """A dispatcher over the ranks of one expert group (the ep mesh): rank r holds experts
    r x local_experts .. (r + 1) x local_experts - 1."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int):
        self.group = ep_mesh.get_group()
        self.rank = ep_mesh.get_local_rank()
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep


class AllToAllDispatcher(_ExpertGroupDispatcher):
    """Token dispatch by all-to-all with uneven splits: each rank sends every routed row to the
    rank holding its expert, the experts run on what arrived, and the outputs go back the same way."""

    def run(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, self.local_experts)  # (source rank, local expert)
        # Split sizes must be Python ints (a device-to-host sync on GPU).
        send_splits = counts.view(self.ep, self.local_experts).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        order = _source_to_expert_order(received)
        out = experts(arrived.index_select(0, order), received.sum(0))
        back = torch.zeros_like(out).index_copy(0, order, out)  # back to (source rank, expert) order
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


class AllGatherDispatcher(_ExpertGroupDispatcher):
    """Token dispatch by all-gather: every rank of the expert group gathers all routed rows of the
    group, runs its experts on the rows routed to them, and a reduce-scatter returns each rank the
    outputs of its own rows (Megatron's allgather dispatcher; simpler collectives, more traffic)."""

    def run(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        all_counts = [torch.empty_like(counts) for _ in range(self.ep)]
        dist.all_gather(all_counts, counts, group=self.group)
        all_counts = torch.stack(all_counts)  # (source rank, expert)
        # Ranks route different numbers of rows: pad each to the longest for the gather.
        longest = int(all_counts.sum(1).max())
        padded = rows.new_zeros(longest, rows.shape[1])
        padded = padded.index_copy(0, torch.arange(rows.shape[0], device=rows.device), rows)
        gathered = all_gather_tensor_autograd(padded, gather_dim=0, group=self.group)
        # This rank's experts' rows of every source: contiguous, since each source sorted by expert.
        first, last = self.rank * self.local_experts, (self.rank + 1) * self.local_experts
        before = all_counts[:, :first].sum(1)
        mine = all_counts[:, first:last]  # (source, local expert)
        index = torch.cat([torch.arange(int(b), int(b) + int(n), device=rows.device) + src * longest
                           for src, (b, n) in enumerate(zip(before.tolist(), mine.sum(1).tolist()))])
        order = _source_to_expert_order(mine)
        out = experts(gathered.index_select(0, index.index_select(0, order)), mine.sum(0))
        contribution = out.new_zeros(self.ep * longest, out.shape[1]).index_add(0, index.index_select(0, order), out)
        returned = reduce_scatter_tensor_autograd(contribution, "sum", scatter_dim=0, group=self.group)
        return returned[: rows.shape[0]]


__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "apply_expert_parallel"]
