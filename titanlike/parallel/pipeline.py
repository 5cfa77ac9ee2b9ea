"""Pipeline parallelism: split a meta model into stages and drive them with a torch schedule.

Three pieces, all generic over model families:

Layout (`plan_layout`). How many stages, how many transformer layers each, and
which stages a pipeline rank holds. Single-stage schedules (GPipe, 1F1B) give
each rank one stage; multi-stage schedules give it several, looped (rank r holds
r, r+pp, r+2pp, ...) for the interleaved and BFS schedules, or V-shaped (rank r
holds r and 2*pp-1-r) for ZBVZeroBubble and DualPipeV, whose torch
implementations hard-code that placement. With `layers_per_stage` the stage
count follows from the layers; without it, it is pp for single-stage schedules
and 2*pp otherwise, and the layers are spread evenly. Layers that do not divide
evenly are taken off the first and last stages, which also carry the embedding
and the output projection.

Split (`build_stage_modules`). Each stage is a deep copy of the meta model
keeping only its layers, the input ends on the first stage and the output ends
on the last (the family's ModelSpec names them in `pipeline_ends`): parameter
names are unchanged, so checkpoints and initialization do not depend on the
layout. Tied weights (a model's `tied_weights`, e.g. the output projection
sharing the embedding table) become one copy on the first stage and one on the
last, initialized alike; `TiedWeightSync` adds their gradients after every
backward, as Megatron's embedding group does, so the copies stay equal.

Schedule (`build_schedule`). One torch PipelineStage per model part and the
schedule class named by `pipeline_parallel_schedule`. Gradients are not scaled
by the schedule (scale_grads=False): the loss function the trainer hands in is
already the summed cross-entropy divided by the global token count, exactly as
without pipelining.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _torch_schedules

from titanlike.models import protocol
from titanlike.models.registry import ModelSpec
from titanlike.models.spec_types import PipelineEnds

# Our names for torch's schedule classes (torchtitan's names). DualPipeV only exists in newer
# torch releases, so the list a user may choose from is what the installed torch has.
_CLASS_NAMES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
SCHEDULES: dict[str, type] = {
    name: getattr(_torch_schedules, cls) for name, cls in _CLASS_NAMES.items() if hasattr(_torch_schedules, cls)
}
# torch maps their stages to ranks in a V; giving them looped stages would deadlock.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split each backward into input-grad and weight-grad halves run at different
# times. With FSDP resharding parameters after forward they give wrong or missing gradients
# (measured: loss off by up to 1e-2 in 3 steps at pp 2 x FSDP 2), and torch does not support
# the split with compiled modules. Its own check looks for torch.compile's wrapper modules, which
# blocks compiled in place are not, so the refusal is ours (torch 2.13, ZBVZeroBubble at pp 2: the
# input half's retained graph fails the compiled backward's donated buffers; with those off, the
# weight gradients come out wrong, loss 1.2e-4 off one process at step 2).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def splits_backward(p) -> bool:
    """Whether the [parallelism] section p pipelines with a schedule of SPLIT_BACKWARD_SCHEDULES."""
    return p.pipeline_parallel_degree > 1 and schedule_name(p.pipeline_parallel_schedule) in SPLIT_BACKWARD_SCHEDULES


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name (matched case-insensitively, as torch does).

    Raises ValueError naming the nearest known schedule.
    """
    for known in SCHEDULES:
        if known.lower() == name.lower():
            return known
    lower = {known.lower(): known for known in SCHEDULES}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.3)
    hint = f"; did you mean {lower[close[0]]!r}?" if close else ""
    raise ValueError(f"parallelism.pipeline_parallel_schedule {name!r} is unknown; this torch has "
                     f"{', '.join(SCHEDULES)}{hint}")


def is_single_stage(name: str) -> bool:
    return issubclass(SCHEDULES[schedule_name(name)], _torch_schedules.PipelineScheduleSingle)


@dataclass(frozen=True)
class PipelineLayout:
    """Stages and their layers; stage i holds layers[i] consecutive transformer layers."""

    pp: int
    layers: tuple[int, ...]
    v_shaped: bool

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stage indices held by pipeline rank `rank`, in the order the schedule wants them."""
        if self.v_shaped:
            return [rank, 2 * self.pp - 1 - rank]
        return list(range(rank, self.num_stages, self.pp))

    def layer_indices(self, stage: int) -> range:
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])

    def stage_layers(self, stage: int, total_layers: int) -> list[int]:
        """The model's layers stage `stage` holds: its share of the trunk the layout cuts and, on the
        last stage, every layer after the trunk (multi-token-prediction modules, the args' total_layers)."""
        trailing = range(sum(self.layers), total_layers) if stage == self.num_stages - 1 else range(0)
        return [*self.layer_indices(stage), *trailing]

    def describe(self) -> str:
        placement = "V-shaped" if self.v_shaped else "looped" if self.stages_per_rank > 1 else "one per rank"
        return (f"{self.num_stages} stages over {self.pp} ranks ({placement}), "
                f"layers per stage {list(self.layers)}")


def plan_layout(n_layers: int, pp: int, schedule: str, layers_per_stage: int | None,
                first_stage_less_layers: int | None = None, last_stage_less_layers: int | None = None,
                layer_costs: Sequence[float] | None = None) -> PipelineLayout:
    """The stage layout for a model of n_layers transformer layers.

    With first/last_stage_less_layers (either; the other then counts as torchtitan's default, 1),
    torchtitan's rule: the embedding counts as that many layers on the first stage and the output
    projection as that many on the last, and these "effective" layers are spread evenly, earlier
    stages taking the remainder.

    layer_costs: each layer's relative compute (the args' `layer_costs`, for models whose layers
    differ: a hybrid's Mamba, attention and MLP layers); without layers_per_stage (or the rule
    above), the stages then get contiguous runs of layers whose summed costs are as even as possible
    (the most expensive stage as cheap as it can be) instead of equal layer counts.

    Raises ValueError (one sentence naming the option to change) when the layers cannot
    fill the stages or the stage count does not suit the schedule.
    """
    name = schedule_name(schedule)
    single = is_single_stage(name)
    if first_stage_less_layers is not None or last_stage_less_layers is not None:
        layers = _weighted_layers(n_layers, pp, single, layers_per_stage,
                                  1 if first_stage_less_layers is None else first_stage_less_layers,
                                  1 if last_stage_less_layers is None else last_stage_less_layers)
        num_stages = len(layers)
    elif layers_per_stage is None:
        num_stages = pp * (1 if single else 2)
        if n_layers < num_stages:
            raise ValueError(
                f"{name} at pipeline_parallel_degree {pp} needs {num_stages} stages of at least one layer each, "
                f"but the model has {n_layers} layers")
        if layer_costs is not None:
            if len(layer_costs) != n_layers:
                raise ValueError(f"the model gives {len(layer_costs)} layer costs for its {n_layers} layers")
            layers = balance_by_cost(layer_costs, num_stages)
        else:
            base, extra = divmod(n_layers, num_stages)
            # The middle stages take the spare layers; the end stages already hold the embedding
            # and the output projection. Ties go to the earlier stage: the output projection is
            # the heavier end.
            by_preference = sorted(range(num_stages), key=lambda s: (-min(s, num_stages - 1 - s), s))
            layers = [base + (s in by_preference[:extra]) for s in range(num_stages)]
    else:
        num_stages = _stages_at(n_layers, layers_per_stage, pp, f"{n_layers} layers")
        # Stages hold layers_per_stage layers except for the shortfall (< layers_per_stage),
        # taken alternately off the last and the first stage so that neither becomes empty.
        layers = [layers_per_stage] * num_stages
        for i in range(num_stages * layers_per_stage - n_layers):
            layers[-1 if i % 2 == 0 else 0] -= 1
    per_rank = num_stages // pp
    if single and per_rank != 1:
        raise ValueError(
            f"{name} runs one stage per rank, but pipeline_parallel_layers_per_stage {layers_per_stage} gives "
            f"{num_stages} stages for pipeline_parallel_degree {pp}; use a multi-stage schedule "
            f"(e.g. Interleaved1F1B) or {-(-n_layers // pp)} layers per stage")
    if not single and per_rank < 2:
        raise ValueError(
            f"{name} needs at least 2 stages per rank, but pipeline_parallel_layers_per_stage {layers_per_stage} "
            f"gives {num_stages} stages for pipeline_parallel_degree {pp}; use fewer layers per stage or 1F1B")
    if name in V_SCHEDULES and per_rank != 2:
        raise ValueError(
            f"{name} needs exactly 2 stages per rank, but pipeline_parallel_layers_per_stage {layers_per_stage} "
            f"gives {per_rank}; use {-(-n_layers // (2 * pp))} layers per stage")
    return PipelineLayout(pp=pp, layers=tuple(layers), v_shaped=name in V_SCHEDULES)


def _stages_at(layers: int, layers_per_stage: int, pp: int, described: str) -> int:
    """How many stages `layers` (effective) layers make at layers_per_stage; ValueError in one
    sentence when that is not a multiple of the pipeline degree. described: the layers, as counted."""
    if layers_per_stage < 1:
        raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage must be at least 1, got {layers_per_stage}")
    num_stages = -(-layers // layers_per_stage)
    if num_stages % pp:
        raise ValueError(f"{described} at pipeline_parallel_layers_per_stage {layers_per_stage} make {num_stages} "
                         f"stages, not a multiple of pipeline_parallel_degree {pp}")
    return num_stages


def _weighted_layers(n_layers: int, pp: int, single: bool, layers_per_stage: int | None, first: int,
                     last: int) -> list[int]:
    """Layers per stage by torchtitan's rule (parallelism.pipeline_parallel_{first,last}_stage_less_layers)."""
    effective = n_layers + first + last
    if layers_per_stage is None:
        num_stages = pp * (1 if single else 2)
    else:
        num_stages = _stages_at(effective, layers_per_stage, pp,
                                f"{n_layers} layers + {first} (first stage) + {last} (last stage)")
    base, extra = divmod(effective, num_stages)
    layers = [base + (s < extra) for s in range(num_stages)]
    layers[0] -= first
    layers[-1] -= last
    for end, less, stage in (("first", first, 0), ("last", last, num_stages - 1)):
        if layers[stage] < 1:
            raise ValueError(
                f"with parallelism.pipeline_parallel_{end}_stage_less_layers {less}, the {end} of {num_stages} "
                f"stages over {n_layers} layers would hold no transformer layer; lower it")
    if min(layers) < 1:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} pipeline stages with at least one layer each")
    return layers


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage: contiguous runs of `costs` (one per layer, in order), each stage at least
    one layer, minimizing the largest stage's summed cost (dynamic programming, exact). Among equally
    good splits, earlier stages take the longer runs: the last stage also holds the output
    projection, which the layer costs do not count."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest-stage cost of layers i.. split into k stages;
    # cut[k][i]: where the first of those k stages ends.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(n - k + 1, i, -1):  # first stage i..j-1; the longest first on ties
                value = max(prefix[j] - prefix[i], best[k - 1][j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    layers, i = [], 0
    for k in range(num_stages, 0, -1):
        layers.append(cut[k][i] - i)
        i = cut[k][i]
    return layers


def microbatch_problem(schedule: str, n_microbatches: int, layout: PipelineLayout) -> str | None:
    """Why torch's schedule refuses this many microbatches, or None.

    Mirrors the checks in torch.distributed.pipelining.schedules (verified by running each
    schedule at pp 2 and 4 for 1..2*stages+2 microbatches: every accepted count is exact).
    """
    name, pp = schedule_name(schedule), layout.pp
    if name == "1F1B" and n_microbatches < pp:
        return f"1F1B needs at least as many microbatches as stages ({pp})"
    if name == "DualPipeV" and n_microbatches < layout.num_stages:
        return f"DualPipeV needs at least as many microbatches as stages ({layout.num_stages})"
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            ok = [n for n in range(1, 2 * n_microbatches) if n % max(1, n // pp) == 0]
            near = sorted(ok, key=lambda n: (abs(n - n_microbatches), n))[:2]
            return (f"{name} runs n microbatches in max(1, n // pipeline_parallel_degree) rounds, so n must be "
                    f"below 2 x {pp} or divisible by n // {pp} = {rounds} (e.g. {' or '.join(map(str, sorted(near)))})")
    return None


def pipeline_stage(model: nn.Module, ends: PipelineEnds, layer_keys: list[str], *, first: bool,
                   last: bool) -> nn.Module:
    """A copy of the (meta) model holding only layers `layer_keys`, the input ends if first and the
    output ends if last. The copy keeps the module tree and its keys, so every parameter keeps its
    full-model name and init_weights (seeded per name) gives it the value it has in the full model."""
    stage = copy.deepcopy(model)
    keep = set(layer_keys)
    for key in list(stage.layers.keys()):
        if key not in keep:
            del stage.layers[key]
    for name in [*(() if first else ends.inputs), *(() if last else ends.outputs)]:
        parent, _, attr = name.rpartition(".")
        setattr(stage.get_submodule(parent), attr, None)
    return stage


def end_module(model: nn.Module, name: str) -> nn.Module | None:
    """The pipeline end `name` (a dotted path, PipelineEnds) of a model or stage, None where it is not held."""
    parent, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(parent), attr)


def build_stage_modules(model: nn.Module, spec: ModelSpec, layout: PipelineLayout, pp_rank: int) -> list[nn.Module]:
    """The model parts (one per stage held by pp_rank) cut out of the meta model. Entries of
    `layers` after the trunk the layout cuts (multi-token-prediction modules, see the args'
    total_layers) go with the output end to the last stage."""
    names = list(model.layers.keys())
    parts = []
    for stage in layout.stages_of_rank(pp_rank):
        keep = [names[i] for i in layout.stage_layers(stage, len(names))]
        parts.append(pipeline_stage(model, spec.pipeline_ends, keep, first=stage == 0,
                                    last=stage == layout.num_stages - 1))
    return parts


def held_parameters(part: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a model part holds, by their full-model name (wrapper prefixes removed)."""
    from titanlike.models.common.init import canonical_fqn

    return {canonical_fqn(name): p for name, p in part.named_parameters(remove_duplicate=False)}


class TiedWeightSync:
    """Keeps the pipeline copies of tied weights equal: after backward, each copy's gradient
    becomes the sum over the copies (the gradient of the one tied parameter).

    A copy lives on the first stage (the owner name, e.g. tok_embeddings.weight) and one on the last
    (the alias, e.g. output.weight). On the same rank (V-shaped schedules put stage 0 and the last
    stage on rank 0) they are summed locally; otherwise over a two-rank group of the first and the
    last pipeline rank with the same position in every other mesh dimension. The copies are
    sharded alike by FSDP/TP (same shape, same placements), so the local shards are summed
    elementwise. `duplicates` names the copies that the gradient norm must not count twice.
    """

    def __init__(self, parts: list[nn.Module], layout: PipelineLayout, pp_mesh: DeviceMesh, world_mesh: DeviceMesh):
        self.pairs: list[tuple[str, str]] = []
        for part in parts:
            self.pairs += list(protocol.tied_weights(part).items())
        self.pairs = sorted(set(self.pairs))
        held: dict[str, nn.Parameter] = {}
        for part in parts:
            held.update(held_parameters(part))
        self.local = [(held[a], held[o]) for a, o in self.pairs if a in held and o in held and held[a] is not held[o]]
        self.remote = [held[a] if a in held else held[o] for a, o in self.pairs
                       if (a in held) != (o in held)]
        # The last stage's copy is left out of the norm: after the sum it equals the first's.
        self.duplicates = {id(held[a]) for a, _ in self.pairs if a in held}
        self.group = _end_stage_group(layout, pp_mesh, world_mesh) if self.pairs else None

    @property
    def active(self) -> bool:
        return bool(self.local or self.remote)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        # The local shards are summed elementwise, so each gradient must be laid out like its
        # parameter first. Under TP without FSDP torch leaves the vocabulary-sharded embedding's
        # gradient Replicate (a whole table); cutting it to the parameter's Shard(0) is local.
        for param in [p for pair in self.local for p in pair] + self.remote:
            _match_placements(param)
        for alias, owner in self.local:
            total = _local(alias.grad) + _local(owner.grad)
            _local(alias.grad).copy_(total)
            _local(owner.grad).copy_(total)
        if self.remote and self.group is not None:
            for param in self.remote:
                dist.all_reduce(_local(param.grad), op=dist.ReduceOp.SUM, group=self.group)


def _match_placements(param: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _end_stage_group(layout: PipelineLayout, pp_mesh: DeviceMesh, world_mesh: DeviceMesh):
    """This rank's process group of {pipeline rank holding stage 0, pipeline rank holding the last
    stage}, at its own position in the other mesh dimensions; None when one rank holds both.
    Every rank creates every such group (new_group is collective), in the same order."""
    first = next(r for r in range(layout.pp) if 0 in layout.stages_of_rank(r))
    last = next(r for r in range(layout.pp) if layout.num_stages - 1 in layout.stages_of_rank(r))
    if first == last:
        return None
    ranks = world_mesh.mesh
    pp_dim = world_mesh.mesh_dim_names.index("pp")
    columns = ranks.movedim(pp_dim, 0).reshape(layout.pp, -1)  # column c: the pp group of position c
    pairs = [[int(columns[first, c]), int(columns[last, c])] for c in range(columns.shape[1])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


class _Stage(PipelineStage):
    """A PipelineStage whose forward of microbatch i also gets `extra[i]` as keyword arguments.

    The schedule passes keyword arguments split along dim 0 with the activations, which fits
    neither per-step values shared by all samples (context-parallel RoPE positions) nor
    non-tensor values (document masks). The schedule tells the stage which microbatch it
    runs, so the right extras are added here, on every stage.
    """

    extra: list[dict] | None = None

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, *more, **more_kwargs):
        # *more: later torch versions add arguments (e.g. save_forward_output); pass them through.
        if self.extra is not None:
            kwargs = {**(kwargs or {}), **self.extra[fwd_chunk_id]}
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *more, **more_kwargs)

    # torch infers the shapes a stage sends by running its forward once on placeholder tensors (on
    # the first step, and again after switching between training and evaluation). Modules that
    # keep per-step statistics (MoE token counts for the bias update) must not count that forward:
    # they declare `record_statistics`, switched off here for its duration. The method's name
    # differs between torch releases.
    def _forward_metadata_inference(self, *args, **kwargs):
        with _statistics_paused(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):
        with _statistics_paused(self.submod):
            return super()._shape_inference(*args, **kwargs)

    # torch (2.13) also runs the loss once on the last stage while preparing backward, on the
    # placeholder outputs of that inference: the loss it runs then records nothing (an objective's
    # reported terms, train/step.py StepLoss.unrecorded), when the schedule was given one.
    inference_loss_fn: Callable | None = None

    def _prepare_backward_infra(self, *args, **kwargs):
        if self.inference_loss_fn is not None and kwargs.get("loss_fn") is not None:
            kwargs["loss_fn"] = self.inference_loss_fn
        return super()._prepare_backward_infra(*args, **kwargs)


@contextlib.contextmanager
def _statistics_paused(module: nn.Module):
    flagged = protocol.statistics_recorders(module)
    for m in flagged:
        protocol.set_record_statistics(m, False)
    try:
        yield
    finally:
        for m in flagged:
            protocol.set_record_statistics(m, True)


class _NamedTargets:
    """The schedule's loss on the last stage, over a microbatch's named targets.

    torch's schedules split one target tensor along the batch; the targets of an objective are
    several tensors of their own dtypes (token ids stay int64). So the schedule's target is the index of
    each pipeline microbatch (a CPU tensor, split like any target: reading it syncs nothing), and the
    loss gets that microbatch's targets by name. `rows` is set for the duration of one step."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn
        self.rows: list[dict] | None = None

    def __call__(self, output, index: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, self.rows[int(index)])


class PipelineRunner:
    """The schedule of this rank's stages, and what the trainer needs to drive it."""

    def __init__(self, schedule, layout: PipelineLayout, stages: list[_Stage], losses: list[_NamedTargets]):
        self.schedule = schedule
        self.layout = layout
        self.stages = stages
        self.losses = losses
        stage_ids = [stage.stage_index for stage in stages]
        self.has_first = 0 in stage_ids
        self.has_last = layout.num_stages - 1 in stage_ids

    def step(self, mb, microbatch_size: int, *, backward: bool = True) -> list[torch.Tensor]:
        """Forward and backward (or forward only) of one local batch `mb` (a Microbatch: inputs, named
        targets, the model's other inputs) cut into pipeline microbatches of microbatch_size samples;
        the per-microbatch losses where this rank holds the last stage, an empty list elsewhere."""
        starts = range(0, mb.inputs.shape[0], microbatch_size)
        losses: list[torch.Tensor] = []
        for stage in self.stages:
            stage.extra = [mb.rows(i, i + microbatch_size) for i in starts]
        for loss in self.losses:
            loss.rows = [mb.target_rows(i, i + microbatch_size) for i in starts] if self.has_last else None
        try:
            args = (mb.inputs,) if self.has_first else ()
            target = torch.arange(len(starts)) if self.has_last else None
            if backward:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.eval(*args, target=target, losses=losses)
        finally:
            for stage in self.stages:
                stage.extra = None
            for loss in self.losses:
                loss.rows = None
        return losses


def build_schedule(
    parts: list[nn.Module],
    layout: PipelineLayout,
    pp_mesh: DeviceMesh,
    device: torch.device,
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[object, dict], torch.Tensor],
    inference_loss_fn: Callable[[object, dict], torch.Tensor] | None = None,
) -> PipelineRunner:
    """Wrap this rank's (already parallelized and initialized) parts into stages and a schedule.
    loss_fn(output, targets): a pipeline microbatch's loss from its named targets; inference_loss_fn:
    loss_fn as torch's metadata inference may run it (recording nothing), if it differs."""
    name = schedule_name(schedule)
    rank = pp_mesh.get_local_rank()
    stage_ids = layout.stages_of_rank(rank)
    # Dynamic stages: shapes (and DTensor layouts) are learned from the first microbatch, so
    # TP, CP and any batch shape need no example inputs here.
    stages = [_Stage(part, index, layout.num_stages, device, group=pp_mesh.get_group())
              for part, index in zip(parts, stage_ids)]
    named = _NamedTargets(loss_fn)
    inference = _NamedTargets(inference_loss_fn) if inference_loss_fn is not None else None
    for stage in stages:
        stage.inference_loss_fn = inference
    cls = SCHEDULES[name]
    first_arg = stages[0] if is_single_stage(name) else stages
    sched = cls(first_arg, n_microbatches=n_microbatches, loss_fn=named, scale_grads=False)
    return PipelineRunner(sched, layout, stages, [named] + ([inference] if inference is not None else []))



def check_forward_only(schedule: str, what: str) -> None:
    """`what` (a companion model, named by the option that asks for it) runs forward-only passes, which
    torch's V-shaped schedules do not have: ValueError, one sentence."""
    name = schedule_name(schedule)
    if name in V_SCHEDULES:
        raise ValueError(f"{what} needs a forward-only pass, which the {name} pipeline schedule does not have "
                         "(torch's V-shaped schedules); use another schedule")


def plan_pipeline(p, *, model: str, n_layers: int, layer_costs: Sequence[float] | None, has_pipeline_ends: bool,
                  local_batch_size: int, fsdp_enabled: bool, compile_blocks: bool, ac_mode: str, ac_option: str,
                  validation_enabled: bool, validation_batch_size: int) -> PipelineLayout:
    """The job's pipeline layout (plan_layout over the [parallelism] section p, balanced by the layers'
    costs when they differ), checked against the schedule's rules before any process group:
    ValueError, one sentence naming the option. model: "name flavor" for messages."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    check(has_pipeline_ends, f"model {model.split()[0]} has no pipeline split rule, so pipeline_parallel_degree must be 1")
    name = schedule_name(p.pipeline_parallel_schedule)
    try:
        layout = plan_layout(n_layers, p.pipeline_parallel_degree, name, p.pipeline_parallel_layers_per_stage,
                             p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers,
                             layer_costs=layer_costs)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None
    mbs = p.pipeline_parallel_microbatch_size
    check(mbs >= 1, f"parallelism.pipeline_parallel_microbatch_size must be at least 1, got {mbs}")
    check(local_batch_size % mbs == 0,
          f"training.local_batch_size {local_batch_size} must be divisible by "
          f"parallelism.pipeline_parallel_microbatch_size {mbs}, which cuts it into pipeline microbatches")
    n_microbatches = local_batch_size // mbs
    if validation_enabled:
        check(name not in V_SCHEDULES,
              f"validation.enable does not work with the {name} pipeline schedule (torch's V-shaped schedules "
              "have no forward-only mode); use another schedule or disable validation")
        check(validation_batch_size in (-1, local_batch_size),
              "under pipeline parallelism validation.local_batch_size must equal training.local_batch_size "
              "(the schedule runs a fixed number of microbatches)")
    problem = microbatch_problem(name, n_microbatches, layout)
    check(problem is None,
          f"{problem}, but local_batch_size {local_batch_size} / pipeline_parallel_microbatch_size {mbs} "
          f"gives {n_microbatches}")
    if name in SPLIT_BACKWARD_SCHEDULES:
        check(not (fsdp_enabled and p.fsdp_reshard_after_forward == "always"),
              f"{name} computes weight gradients apart from input gradients, which gives wrong gradients "
              f"with parameters resharded after forward, so it needs fsdp_reshard_after_forward default or never")
        check(not compile_blocks,
              f"{name} splits the backward of each stage, which torch does not support for compiled "
              f"blocks, so it needs compile.enable off or compile.components without model")
        check(not (ac_mode == "selective" and ac_option == "op"),
              f"{name} runs two backward passes over each stage (input, then weight gradients), which op-level "
              f"selective activation checkpointing forbids, so use activation_checkpoint.mode full or a "
              f"block interval for selective_ac_option")
    return layout
