"""Expert parallelism and the other placements of mixture-of-experts layers.

For every MoE layer (models/common/moe.py) of a model or pipeline stage:
  - experts: with ep > 1 their stacked weights become DTensors sharded on the expert dimension
    over the ep ranks, and the layer's dispatcher moves each routed token to the rank of its
    expert and back: all-to-all with uneven splits (default), or all-gather + reduce-scatter;
  - expert tensor parallelism (etp > 1, Megatron's --expert-tensor-parallel-size): each expert's
    hidden units are split over the etp ranks too (the dims the experts module names in
    `tensor_parallel_dims`). The etp ranks of a group hold different tokens (the MoE layer is data
    parallel over every rank), so after dispatch they all-gather each other's rows, each computes
    its slice of every row's SwiGLU and a partial sum of its down projection, and a reduce-scatter
    hands each rank its own rows' sums (Megatron's expert TP with sequence parallelism);
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
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titanlike.models import protocol
from titanlike.models.common.moe import Dispatcher, GroupedExperts, moe_layers
from titanlike.parallel.utils import all_gather_autograd, reduce_scatter_autograd

DISPATCHERS = ("alltoall", "allgather")


def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh | None, sequence_mesh: DeviceMesh | None,
                          token_dispatcher: str = "alltoall", etp_mesh: DeviceMesh | None = None,
                          experts_mesh: DeviceMesh | None = None) -> int:
    """Place the MoE layers of `model` (in place); returns how many there were. experts_mesh: the
    (ep, etp) mesh the expert weights are split over (the one of them above 1, or both)."""
    layers = moe_layers(model)
    for _, moe in layers:
        moe.sequence_group = sequence_mesh.get_group() if sequence_mesh is not None else None
        # Read by parallel/fsdp.py: which mesh each part is sharded over.
        protocol.set_fsdp_mesh(moe, "token_fsdp")
        protocol.set_fsdp_mesh(moe.experts, "expert_fsdp")
        # Read by the compile step: routing has data-dependent sizes (token counts as Python ints for
        # the all-to-all splits and the grouped matmul offsets), so the layer runs eagerly.
        protocol.set_skip_compile(moe)
        if ep_mesh is None and etp_mesh is None:
            continue
        _shard_experts(moe.experts, experts_mesh, ep=ep_mesh is not None, etp=etp_mesh is not None)
        num_experts = moe.args.num_experts
        if ep_mesh is not None:
            moe.dispatcher = (AllToAllDispatcher(ep_mesh, num_experts) if token_dispatcher == "alltoall"
                              else AllGatherDispatcher(ep_mesh, num_experts))
        if etp_mesh is not None:
            moe.dispatcher = ExpertTensorParallel(moe.dispatcher, etp_mesh)
    return len(layers)


def _shard_experts(experts: GroupedExperts, mesh: DeviceMesh, *, ep: bool, etp: bool) -> None:
    """Every parameter of the experts: on the expert dimension over ep, on the dimension the experts
    module names in tensor_parallel_dims over etp."""
    for name, param in list(experts.named_parameters(recurse=False)):
        placements = [Shard(0)] if ep else []
        if etp:
            if name not in experts.tensor_parallel_dims:
                raise ValueError(f"{type(experts).__name__}.{name} names no dimension to split under expert tensor "
                                 "parallelism (tensor_parallel_dims); set expert_tensor_parallel_degree 1")
            placements.append(Shard(experts.tensor_parallel_dims[name]))
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements)))


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
        first = self.rank * self.local_experts
        return _gather_run_scatter(rows, counts, experts, self.group, self.ep, first, first + self.local_experts)


class ExpertTensorParallel(Dispatcher):
    """Wraps the dispatcher that brings rows to this rank's experts (local, all-to-all or all-gather):
    the rows that reach the experts are all-gathered over the etp ranks, every rank's slice of the
    experts runs on all of them, and a reduce-scatter sums the slices' partial outputs back to the
    rank each row came from."""

    def __init__(self, inner: Dispatcher, etp_mesh: DeviceMesh):
        self.inner = inner
        self.group = etp_mesh.get_group()
        self.etp = etp_mesh.size()

    def run(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        def sliced(arrived: torch.Tensor, arrived_counts: torch.Tensor) -> torch.Tensor:
            return _gather_run_scatter(arrived, arrived_counts, experts, self.group, self.etp, 0, len(arrived_counts))

        return self.inner.run(rows, counts, sliced)


def _gather_run_scatter(rows: torch.Tensor, counts: torch.Tensor, experts, group: dist.ProcessGroup, size: int,
                        first: int, last: int) -> torch.Tensor:
    """rows grouped by expert (counts[e] for the group's expert e) -> the experts' outputs of this
    rank's rows. Every rank of `group` gathers the rows of all, runs experts first..last-1 (this
    rank's) on the rows routed to them, and a reduce-scatter sums each row's contributions back to
    the rank it came from: one rank's under expert parallelism, every rank's partial sum under
    expert tensor parallelism."""
    all_counts = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(all_counts, counts, group=group)
    all_counts = torch.stack(all_counts)  # (source rank, expert)
    # Ranks route different numbers of rows: pad each to the longest for the gather.
    longest = int(all_counts.sum(1).max())
    padded = rows.new_zeros(longest, rows.shape[1])
    padded = padded.index_copy(0, torch.arange(rows.shape[0], device=rows.device), rows)
    gathered = all_gather_autograd(padded, gather_dim=0, group=group)
    # The rows of experts first..last-1 of every source: contiguous, since each source sorted by expert.
    before = all_counts[:, :first].sum(1)
    mine = all_counts[:, first:last]  # (source, expert of this rank)
    index = torch.cat([torch.arange(int(b), int(b) + int(n), device=rows.device) + src * longest
                       for src, (b, n) in enumerate(zip(before.tolist(), mine.sum(1).tolist()))])
    order = _source_to_expert_order(mine)
    out = experts(gathered.index_select(0, index.index_select(0, order)), mine.sum(0))
    contribution = out.new_zeros(size * longest, out.shape[1]).index_add(0, index.index_select(0, order), out)
    returned = reduce_scatter_autograd(contribution, "sum", scatter_dim=0, group=group)
    return returned[: rows.shape[0]]


__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "ExpertTensorParallel", "apply_expert_parallel"]
