"""Mixture-of-experts feed-forward layer, shared by every MoE family (Qwen3-MoE, Mixtral, ...).

    x -> router (fp32 linear gate, softmax or sigmoid scores, top-k, optional group limit)
      -> [capacity: drop routes over an expert's per-sequence capacity]
      -> dispatch the routed copies of each token to its experts (a Dispatcher: local, or over
         the expert-parallel ranks by all-to-all or all-gather)
      -> experts (SwiGLU, stacked weights (E, F, D), computed with torch._grouped_mm or a loop)
      -> combine: sum of the k expert outputs weighted by their gate values
      (+ shared experts: a dense MLP every token goes through)

Balancing. The auxiliary losses (Switch/GShard per micro-batch, DeepSeek's sequence-wise, the
router z-loss) are computed here in the training loss's units, sums over the micro-batch's tokens
(the trainer divides gradients by the step's global target-token count). They join the loss
through the layer's output: an identity whose backward also feeds the loss's gradient of one to
them (as Megatron's MoEAuxLossAutoScaler). That is what makes them exact under pipeline
parallelism, where the layer and the loss live on different ranks. Their values are kept on the
module for logging. Aux-loss-free balancing keeps a per-expert bias that only affects which
experts are chosen; train/expert_balance.py updates it from the step's token counts.

Layout independence. A sequence may be cut over the ranks of `sequence_group` (context
parallelism, and tensor parallelism's sequence split). Every statistic that needs a whole
sequence or micro-batch (token counts for the losses, capacity ranks) is reduced over that group,
so a run's routing, drops and losses do not depend on the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models.common.dtensor import local_part
from titanlike.models.common.feed_forward import FeedForward
from titanlike.models.common.init import LinearInit, zeros_
from titanlike.models.outputs import attach_loss

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
EXPERT_IMPLS = ("grouped_mm", "loop")


@dataclass
class MoEArgs:
    """The MoE part of a family's model args (flavor defaults; [moe] config keys override some)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 1024  # each routed expert's SwiGLU hidden size
    num_shared_experts: int = 0  # always-on experts; their MLP is num_shared_experts x shared_hidden_dim wide
    shared_hidden_dim: int | None = None  # None: hidden_dim
    # Routing.
    score_func: str = "softmax"  # softmax | sigmoid
    score_before_topk: bool = True  # False (softmax only): top-k of the logits, then softmax over the k chosen
    route_norm: bool = False  # renormalize the k gate values to sum 1
    route_scale: float = 1.0  # multiply the gate values (DeepSeek's routed_scaling_factor)
    n_groups: int = 1  # group-limited routing: experts in n_groups groups ...
    topk_groups: int = 1  # ... of which each token may use the best topk_groups
    # Which layers are MoE: from first_k_dense on, every layer_freq-th (Megatron's moe_layer_freq).
    first_k_dense: int = 0
    layer_freq: int = 1
    # Balancing.
    aux_loss_coeff: float = 0.0  # Switch/GShard load-balancing loss per micro-batch
    seq_aux_loss_coeff: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    bias_update_rate: float = 0.0  # aux-loss-free balancing (0: off)
    # Token dropping: None is dropless.
    capacity_factor: float | None = None
    drop_policy: str = "probs"  # probs: keep an expert's highest-probability routes | position: its earliest
    pad_to_capacity: bool = False  # pad every expert's input to its capacity (static shapes)
    experts_impl: str = "grouped_mm"  # grouped_mm | loop (the reference)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def shared_dim(self) -> int:
        return self.num_shared_experts * (self.shared_hidden_dim or self.hidden_dim)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense and (layer_id - self.first_k_dense) % self.layer_freq == 0

    def num_moe_layers(self, n_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(n_layers))

    def params(self, dim: int, *, active: bool = False) -> int:
        """Parameters of one MoE layer (router, routed experts, shared experts); active: those one
        token uses (top_k routed experts)."""
        experts = self.top_k if active else self.num_experts
        return dim * self.num_experts + experts * 3 * dim * self.hidden_dim + 3 * dim * self.shared_dim

    def with_run_settings(self, section) -> MoEArgs:
        """A copy with a job's [moe] settings (config.schema.MoE); its empty values keep these."""
        changes = dict(experts_impl=section.experts_impl, drop_policy=section.drop_policy,
                       pad_to_capacity=section.pad_to_capacity)
        for name in ("capacity_factor", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(section, name) is not None:
                changes[name] = getattr(section, name)
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """ValueError, one sentence, for values no layout can run."""
        e, k = self.num_experts, self.top_k
        if e < 1 or k < 1:
            raise ValueError(f"MoE needs at least one expert and top_k >= 1, got {e} experts and top_k {k}")
        if k > e:
            raise ValueError(f"moe top_k {k} is larger than the {e} experts")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"moe score_func {self.score_func!r} is not one of {SCORE_FUNCS}")
        if not self.score_before_topk and self.score_func != "softmax":
            raise ValueError("moe score_before_topk False (softmax over the chosen k) needs score_func softmax")
        if self.n_groups < 1 or e % self.n_groups:
            raise ValueError(f"moe n_groups {self.n_groups} must divide the {e} experts")
        if not 1 <= self.topk_groups <= self.n_groups or self.topk_groups * (e // self.n_groups) < k:
            raise ValueError(f"moe topk_groups {self.topk_groups} of {self.n_groups} groups leaves fewer than "
                             f"top_k {k} experts to choose from")
        if self.first_k_dense < 0 or self.layer_freq < 1:
            raise ValueError("moe first_k_dense must be >= 0 and layer_freq >= 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor must be > 0 (or unset for dropless), got {self.capacity_factor}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"moe.drop_policy {self.drop_policy!r} is not one of {DROP_POLICIES}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("moe.pad_to_capacity needs moe.capacity_factor (dropless experts have no capacity)")
        if self.experts_impl not in EXPERT_IMPLS:
            raise ValueError(f"moe.experts_impl {self.experts_impl!r} is not one of {EXPERT_IMPLS}")
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} must be >= 0, got {getattr(self, name)}")

    def validate_layout(self, *, dim: int, ep: int, cp: int, etp: int) -> None:
        """The rules that depend on the layout (called from a family's args.validate)."""
        if self.num_experts % ep:
            raise ValueError(f"parallelism.expert_parallel_degree {ep} must divide the model's "
                             f"{self.num_experts} experts")
        if self.hidden_dim % etp:
            raise ValueError(f"parallelism.expert_tensor_parallel_degree {etp} must divide the experts' hidden size "
                             f"{self.hidden_dim}")
        if self.drop_policy == "position" and self.capacity_factor is not None and cp > 1:
            raise ValueError("moe.drop_policy position needs each sequence's token order, which context "
                             "parallelism's load-balanced split does not keep; use drop_policy probs")
        if self.experts_impl == "grouped_mm" and (dim % 8 or self.hidden_dim // etp % 8):
            per_rank = f", {self.hidden_dim // etp} per expert-tensor-parallel rank" if etp > 1 else ""
            raise ValueError(f"torch._grouped_mm needs the model dim ({dim}) and the expert hidden size "
                             f"({self.hidden_dim}{per_rank}) to be multiples of 8; set moe.experts_impl loop")


# Routing ---------------------------------------------------------------------------------------


@dataclass
class Routing:
    """What the router decided for T tokens (flattened batch x sequence)."""

    experts: torch.Tensor  # (T, k) int64 expert ids
    weights: torch.Tensor  # (T, k) fp32 gate values
    probs: torch.Tensor  # (T, E) fp32 scores the balancing losses use
    logits: torch.Tensor  # (T, E) fp32


class Router(nn.Module):
    """The fp32 linear gate and the top-k choice."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        # Read by the float8 converter: the choice is computed in fp32 (see forward).
        self.gate.keep_high_precision = True

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None) -> Routing:
        a = self.args
        # fp32: the top-k choice is discontinuous; bf16 logits would make it flicker.
        logits = F.linear(x.float(), self.gate.weight.float())
        if not a.score_before_topk:
            # Mixtral's form: choose on the logits, softmax over the k chosen.
            choice = logits if expert_bias is None else logits + expert_bias
            experts = choice.topk(a.top_k, dim=-1).indices
            weights = logits.gather(-1, experts).softmax(dim=-1)
            probs = logits.softmax(dim=-1)
        else:
            scores = logits.softmax(dim=-1) if a.score_func == "softmax" else logits.sigmoid()
            # The bias moves the choice only; the gate values come from the unbiased scores.
            choice = scores if expert_bias is None else scores + expert_bias
            if a.n_groups > 1:
                choice = self._limit_groups(choice)
            experts = choice.topk(a.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
            probs = scores if a.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
            if a.route_norm and a.top_k > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * a.route_scale, probs, logits)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek's node-limited): rank the groups by the sum of their best
        two scores, keep the best topk_groups, mask the experts of the other groups."""
        a = self.args
        grouped = choice.unflatten(-1, (a.n_groups, -1))
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = best.topk(a.topk_groups, dim=-1).indices
        mask = torch.ones_like(best, dtype=torch.bool).scatter_(-1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(-2)


# Experts ---------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs with stacked weights: w1, w3 (E, F, D) and w2 (E, D, F).

    Under expert parallelism the weights are DTensors sharded on dim 0 over the ep ranks; forward
    uses this rank's experts (the dispatcher brought their tokens here). Under expert tensor
    parallelism each is also split over the etp ranks on the dimension tensor_parallel_dims names:
    the hidden units (the SwiGLU is elementwise in them), so forward computes this rank's slice of
    the hidden units and a partial sum of the down projection, which the dispatcher sums over the
    etp ranks (parallel/expert_parallel.py).
    """

    tensor_parallel_dims: dict[str, int] = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, impl: str = "grouped_mm"):
        super().__init__()
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # The experts' grouped GEMM (impl grouped_mm): torch's, or one a converter puts in its place
        # with use_grouped_mm (MXFP8's, titanlike/models/mx.py).
        self.grouped_mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = grouped_mm

    def use_grouped_mm(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Compute the experts' matmuls with fn(x, w, offsets), as grouped_mm below does."""
        self.grouped_mm = fn

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(local_part(w) for w in (self.w1, self.w2, self.w3))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (N, D) rows grouped by local expert, counts[e] rows for local expert e (sum = N)."""
        w1, w2, w3 = (w.to(x.dtype) for w in self.local_weights())
        if self.impl == "loop":
            return _experts_loop(x, counts, w1, w2, w3)
        if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            # A weight copy per row suits a decode step's few rows; a training batch's thousands of
            # rows would copy the experts thousands of times, so it takes the loop (graph breaks).
            gathered = x.shape[0] <= GATHERED_ROWS_LIMIT
            return (_experts_gathered if gathered else _experts_loop)(x, counts, w1, w2, w3)
        offsets = counts.cumsum(0).to(torch.int32)
        h = F.silu(self.grouped_mm(x, w1, offsets))
        h = h * self.grouped_mm(x, w3, offsets)
        return self.grouped_mm(h, w2, offsets)

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.w1, seed=seed, fqn=f"{prefix}w1")
        init.fill(self.w2, seed=seed, fqn=f"{prefix}w2", output=True)
        init.fill(self.w3, seed=seed, fqn=f"{prefix}w3", output=True)


GATHERED_ROWS_LIMIT = 256


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (group e ends at offsets[e]) times their expert's w (E, out, in), transposed."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def _experts_gathered(x, counts, w1, w2, w3) -> torch.Tensor:
    """The experts as one batched matmul over each row's own expert weights: what a compiled forward
    runs outside bf16 (torch's meta kernel of _grouped_mm, which compile traces with, accepts bf16
    only, though the CPU kernel takes fp32). Static shapes and no host sync (the loop's split sizes
    are), at the memory of a weight per row: meant for decode steps of a few rows."""
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0])
    rows = x[:, None, :]
    h = F.silu(rows @ w1[expert].transpose(-2, -1)) * (rows @ w3[expert].transpose(-2, -1))
    return (h @ w2[expert].transpose(-2, -1))[:, 0]


def _experts_loop(x, counts, w1, w2, w3) -> torch.Tensor:
    """The reference: one matmul chain per expert."""
    outputs = []
    # unbind once: indexing w[e] per expert would make every expert's backward write a gradient the
    # size of the whole stacked weight (quadratic in the expert count).
    experts = zip(w1.unbind(0), w2.unbind(0), w3.unbind(0))
    for rows, (a, b, c) in zip(torch.split(x, counts.tolist()), experts):
        outputs.append((F.silu(rows @ a.T) * (rows @ c.T)) @ b.T)
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


# Dispatch --------------------------------------------------------------------------------------


def group_by_expert(experts: torch.Tensor, keep: torch.Tensor | None, num_experts: int):
    """Order the kept routes by expert.

    experts: (T, k) expert ids; keep: (T, k) bool or None (all kept). Returns (route_ids, counts):
    route_ids (R,) flat indices into the T*k routes, grouped by expert (stable: token order within
    an expert); counts (E,) int64 kept routes per expert.
    """
    flat = experts.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped routes sort last, then go
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    route_ids = order[: int(counts.sum())] if keep is not None else order
    return route_ids, counts


def pad_groups(rows: torch.Tensor, counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert -> every group padded with zero rows to `size` rows; also returns the
    index of each real row in the padded tensor."""
    starts = counts.cumsum(0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts)
    within = torch.arange(rows.shape[0], device=rows.device) - starts[expert_of_row]
    where = expert_of_row * size + within
    padded = rows.new_zeros(len(counts) * size, rows.shape[1]).index_copy(0, where, rows)
    return padded, where


class Dispatcher:
    """How routed rows reach their experts and come back. Subclasses implement `run`; padding to
    capacity is done here, for all of them."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts, pad_to: int | None):
        """rows: (R, D) routed token copies grouped by expert (counts[e] each) -> expert outputs, same order."""
        if pad_to is None:
            return self.run(rows, counts, experts)
        padded, where = pad_groups(rows, counts, pad_to)
        return self.run(padded, torch.full_like(counts, pad_to), experts).index_select(0, where)

    def run(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        raise NotImplementedError


class LocalDispatcher(Dispatcher):
    """No expert parallelism: every expert is on this rank."""

    def run(self, rows, counts, experts):
        return experts(rows, counts)


# The layer ------------------------------------------------------------------------------------


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing a block's MLP. Input and output (B, S, D).

    Set by parallelization (parallel/expert_parallel.py), not by the family:
      dispatcher      how routed tokens reach their experts (LocalDispatcher without EP)
      sequence_group  process group over which this rank's sequences are cut (cp x tp), or None
    """

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args.experts_impl)
        self.shared_experts = FeedForward(dim, args.shared_dim) if args.num_shared_experts else None
        # The aux-loss-free balancing bias: persistent (checkpointed), not a parameter (no gradient).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=args.bias_update_rate > 0)
        # Per-step statistics (train/expert_balance.py reads and resets them): routes per expert,
        # routes dropped, and each balancing loss's value in summed units.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("step_stats", torch.zeros(len(STAT_NAMES)), persistent=False)
        self.dispatcher = LocalDispatcher()
        self.sequence_group: dist.ProcessGroup | None = None
        self.record_statistics = True  # off while a pipeline infers shapes on placeholder inputs
        # The objective's weight for the balancing losses' backward: the step's weight tensor, set
        # once at build time (models/outputs.py attach_loss); None: 1.
        self.loss_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if a.bias_update_rate > 0 else None
        routing = self.router(tokens, bias)
        keep, capacity = None, None
        if a.capacity_factor is not None:
            keep, capacity = self._within_capacity(routing, batch, seq)
        route_ids, counts = group_by_expert(routing.experts, keep, a.num_experts)
        token_of_route = torch.div(route_ids, a.top_k, rounding_mode="floor")
        rows = tokens.index_select(0, token_of_route)
        # Padding: the most routes this rank's slice of its sequences can send one expert.
        pad_to = batch * min(capacity, seq * a.top_k) if a.pad_to_capacity else None
        expert_out = self.dispatcher(rows, counts, self.experts, pad_to)
        # Combine: each route's output times its gate value, summed per token (in the activations'
        # dtype: an fp32 copy of every routed row would cost more memory than the rows themselves).
        gate = routing.weights.reshape(-1).index_select(0, route_ids).unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(tokens, dtype=expert_out.dtype).index_add_(
            0, token_of_route, expert_out * gate).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(batch, seq, dim)
        # Training forwards only: not evaluation, not the pipeline's shape-inference forward on
        # placeholder tensors (record_statistics off), and a checkpointed forward's recomputation
        # adds its losses' gradients again but not its counts (see _counting).
        if self.training and torch.is_grad_enabled() and self.record_statistics:
            counting = _counting()
            aux = self._balancing_losses(routing, batch, seq, record=counting)
            if aux is not None:
                out = attach_loss(out, aux, self.loss_weight)
            if counting:
                self._record(routing, keep)
        return out

    # Layout-independent statistics ---------------------------------------------------------------

    def _sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding other slices of the same sequences (no gradient)."""
        if self.sequence_group is None:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, group=self.sequence_group)
        return t

    @property
    def _sequence_ranks(self) -> int:
        return 1 if self.sequence_group is None else dist.get_world_size(self.sequence_group)

    def _balancing_losses(self, routing: Routing, batch: int, seq: int, *, record: bool) -> torch.Tensor | None:
        """The sum of the enabled balancing losses, in summed units (mean-form loss x tokens), as
        this rank's share: the shares of the ranks of sequence_group add up to the whole."""
        a = self.args
        e, k = a.num_experts, a.top_k
        full_seq = seq * self._sequence_ranks
        total = None
        with torch.no_grad():
            chosen = torch.zeros(batch, seq, e, device=routing.probs.device).scatter_(
                -1, routing.experts.view(batch, seq, k), 1.0)
        if a.aux_loss_coeff > 0:
            # Switch: coeff * E/(k T^2) * sum_i count_i * probsum_i over the micro-batch's T tokens.
            counts = self._sequence_sum(chosen.sum((0, 1)))
            tokens = batch * full_seq
            loss = a.aux_loss_coeff * e / (k * tokens) * (counts * routing.probs.sum(0)).sum()
            if record:
                self.step_stats[STAT_NAMES.index("aux_loss")] += loss.detach()
            total = loss
        if a.seq_aux_loss_coeff > 0:
            # DeepSeek-V3: the same per sequence (S tokens), averaged over sequences -> x tokens.
            counts = self._sequence_sum(chosen.sum(1))  # (B, E)
            probsum = routing.probs.view(batch, seq, e).sum(1)
            loss = a.seq_aux_loss_coeff * e / (k * full_seq) * (counts * probsum).sum()
            if record:
                self.step_stats[STAT_NAMES.index("seq_aux_loss")] += loss.detach()
            total = loss if total is None else total + loss
        if a.z_loss_coeff > 0:
            loss = a.z_loss_coeff * (torch.logsumexp(routing.logits, dim=-1) ** 2).sum()
            if record:
                self.step_stats[STAT_NAMES.index("z_loss")] += loss.detach()
            total = loss if total is None else total + loss
        return total

    def _within_capacity(self, routing: Routing, batch: int, seq: int) -> tuple[torch.Tensor, int]:
        """(T, k) mask of the routes each expert accepts, and the capacity: per sequence, an expert
        takes at most ceil(capacity_factor x seq_len x top_k / experts) routes, its highest-probability
        ones (probs) or its earliest (position). Decided on the whole sequence, so any layout drops
        the same routes."""
        a = self.args
        e, k = a.num_experts, a.top_k
        full_seq = seq * self._sequence_ranks
        capacity = min(math.ceil(a.capacity_factor * full_seq * k / e), full_seq * k)
        experts = routing.experts.view(batch, seq * k)
        score = routing.weights.view(batch, seq * k).detach()
        if self.sequence_group is not None:
            experts, score = (_gather_sequence(t, self.sequence_group) for t in (experts, score))
        with torch.no_grad():
            chosen = F.one_hot(experts, e).bool()  # (B, S*k, E)
            if a.drop_policy == "position":
                rank_in_expert = chosen.cumsum(1).gather(-1, experts.unsqueeze(-1)).squeeze(-1)
                keep = rank_in_expert <= capacity
            else:
                by_expert = torch.where(chosen, score.unsqueeze(-1), float("-inf"))
                top = by_expert.topk(min(capacity, by_expert.shape[1]), dim=1).indices  # (B, C, E)
                accepted = torch.zeros_like(chosen).scatter_(1, top, True) & chosen
                keep = accepted.any(-1)
        if self.sequence_group is not None:
            rank = dist.get_rank(self.sequence_group)
            keep = keep[:, rank * seq * k:(rank + 1) * seq * k]
        return keep.reshape(batch * seq, k), capacity

    def _record(self, routing: Routing, keep: torch.Tensor | None) -> None:
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(routing.experts.reshape(-1),
                                                     minlength=self.args.num_experts).float()
            self.step_stats[STAT_NAMES.index("routes")] += routing.experts.numel()
            if keep is not None:
                self.step_stats[STAT_NAMES.index("dropped")] += (~keep).sum()

    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        init.fill(self.router.gate.weight, seed=seed, fqn=f"{prefix}router.gate.weight")
        self.experts.init_weights(init, seed=seed, prefix=f"{prefix}experts.")
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init, seed=seed, prefix=f"{prefix}shared_experts.")
        zeros_(self.expert_bias)
        self.tokens_per_expert.zero_()
        self.step_stats.zero_()


# step_stats entries, per layer per step (this rank's share).
STAT_NAMES = ("routes", "dropped", "aux_loss", "seq_aux_loss", "z_loss")


def _counting() -> bool:
    """False while autograd recomputes a checkpointed forward in backward (the tokens were already
    counted in the first forward)."""
    return torch._C._current_graph_task_id() == -1


def _gather_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, n) -> (B, n x ranks): the slices of every rank of `group`, in rank order (no gradient)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def validate_moe_job(section, *, has_experts: bool, ep: int, model: str, etp: int = 1) -> None:
    """Expert parallelism and the [moe] settings need a mixture-of-experts model: ValueError, one
    sentence. section: the job's [moe] section; model: "name flavor" for the message."""
    if has_experts:
        return
    if ep > 1:
        raise ValueError(f"parallelism.expert_parallel_degree {ep} needs a mixture-of-experts model, and {model} is "
                         "dense; set it to 1")
    if etp > 1:
        raise ValueError(f"parallelism.expert_tensor_parallel_degree {etp} needs a mixture-of-experts model, and "
                         f"{model} is dense; set it to 1")
    for name in ("capacity_factor", "aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        if getattr(section, name) is not None:
            raise ValueError(f"moe.{name} is set but {model} has no mixture-of-experts layers; remove it or pick "
                             "an MoE model")
    if section.pad_to_capacity:
        raise ValueError(f"moe.pad_to_capacity is set but {model} has no mixture-of-experts layers")


def moe_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer in a model or pipeline stage."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


__all__ = ["MoE", "MoEArgs", "Dispatcher", "GroupedExperts", "LocalDispatcher", "Router", "Routing", "STAT_NAMES",
           "group_by_expert", "grouped_mm", "moe_layers", "pad_groups"]
