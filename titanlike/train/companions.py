"""The home of the models that run beside the one being trained (companions).

An objective declares its companions (objectives/companion.py: a frozen copy of the model as the run
started, the model itself as it is now, or another checkpoint; and what each adds to a microbatch's
targets). Here they are built on this rank with the job's layout (FSDP, TP, CP, their own pipeline
split over the same stages), loaded sharded, and run forward-only on every microbatch before the
step: `Companions.fill(mb)` adds their outputs to `mb.targets` where the loss runs (the last pipeline
stage). The trainer asks for nothing else; the estimator counts their memory from the same
declarations (estimation/layout.py, estimation/probe.py).

Sources:
  - FROZEN_COPY: a second copy of the model, planned and parallelized like it, parameters only (no
    gradients, no optimizer state): its weights are the model's before the first update, or, in a
    resumed run, its initialization and initial load again (the run's start, as the first launch had it).
  - POLICY: the model's own parts, no copy (RL's old policy; with the converters off, DPO's reference
    as the base model without LoRA adapters).
  - CHECKPOINT: another model (a DCP checkpoint or a Hugging Face folder): build_frozen_model.

What reads the policy to generate from it (RL rollouts) takes its weights through PolicyWeights:
the module itself on one process, one gather per update under FSDP or TP. A generating companion
(Companion.rollout) is the one seam RL needs in the loop: `Companions.batches` wraps the trainer's
loader iterator so that each step's loader batches of prompts become batches of rollouts, each
generation trained `iterations` optimizer steps. A generation is made with the policy as of the step
it is made at, from seeds of (debug.seed, the first step that trains it, the microbatch's place in the
global batch): a run is deterministic, draws the same rollouts on every layout, and needs no sampler
state to resume. Its own outputs (the old policy's log-probabilities) are computed right after it is
made, with the weights that made it. Generation may run ahead of training by `ahead` steps (a
generation first trained at step t is made before step t - ahead trains; the lag t - version is
logged as rollout/lag), and a short batch (dynamic sampling) is refilled from more loader batches in
rounds that every data-parallel rank runs alike (one all-reduce of a flag per round). The generations
made and not yet trained (InFlight) are a checkpoint's per-rank state, so a resumed run trains what
the uninterrupted one did even where the weights that made them are gone. Without a generating
companion, the iterator is the loader's.

Why generating ahead in the same thread rather than in a background one: on one process the policy's
weights are the trained module itself (no copy), which a generator thread would read while the
optimizer writes them; made in order between steps, each generation sees exactly the weights of its
version, at the price of no overlap of generation and training (the lag's semantics, not its speed).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from titanlike.objectives.base import Microbatch
from titanlike.objectives.companion import Companion, Source, Targets

if TYPE_CHECKING:
    from titanlike.train.plan import JobPlan

logger = logging.getLogger("titanlike")


class PolicyWeights:
    """The trained model's current weights as one whole module on every rank, for what reads the policy
    without training it (RL's rollouts through the generation engine, titanlike/inference).

    On one process, and wherever a rank holds whole parameters, it is the trained module itself: no
    copy. Under FSDP or TP (parameters are DTensor shards) it is a plain copy of the model on each rank,
    refreshed by one gather of the weights per update: `module(version)` gathers only when `version`
    (the caller's count of optimizer steps) moved since the last call. `gathered_bytes` counts what the
    gathers brought in (each parameter's or buffer's full size minus this rank's shard), `gather_bytes` what one
    gather brings in, `copy_bytes` the whole copy's parameters."""

    def __init__(self, plan: JobPlan, parts: list[nn.Module], device: torch.device, build_converters):
        from torch.distributed.tensor import DTensor

        self.parts, self.device = parts, device
        self.sharded = any(isinstance(p, DTensor) for part in parts for p in part.parameters())
        self._copy: nn.Module | None = None
        self._version: int | None = None
        self.gathers, self.gathered_bytes = 0, 0
        self.gather_bytes = sum((p.numel() - p.to_local().numel()) * p.element_size() for part in parts
                                for p in [*part.parameters(), *part.buffers()] if isinstance(p, DTensor))
        self.copy_bytes = 0
        if len(parts) != 1:
            raise ValueError("the policy's weights for generation need every layer on each rank; pipeline "
                             "parallelism splits them over stages")
        if self.sharded:
            from titanlike.models.common.init import canonical_fqn

            with torch.device("meta"):
                model = plan.spec.model_cls(plan.model_args)
            build_converters().convert(model)
            model.to_empty(device=device)
            model.init_weights(seed=plan.cfg.debug.seed)  # buffers (RoPE tables); every weight is gathered
            model.requires_grad_(False)
            model.eval()
            self._copy = model
            self.copy_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            # Buffers too: some change as the model trains (an MoE router's expert_bias under aux-loss-free
            # balancing, models/common/moe.py), and a stale one would route the copy's tokens differently.
            own = dict(model.named_parameters()) | dict(model.named_buffers())
            self._pairs = [(own[canonical_fqn(name)], p) for name, p in
                           [*parts[0].named_parameters(), *parts[0].named_buffers()]]

    @torch.no_grad()
    def module(self, version: int) -> nn.Module:
        """The policy's whole module as of `version`."""
        if not self.sharded:
            return self.parts[0]
        if version != self._version:
            from torch.distributed.tensor import DTensor

            for whole, param in self._pairs:
                if isinstance(param, DTensor):
                    full = param.full_tensor()
                    self.gathered_bytes += (full.numel() - param.to_local().numel()) * full.element_size()
                else:
                    full = param
                whole.copy_(full)
            self.gathers += 1
            self._version = version
        return self._copy


class ForwardOnly:
    """Forward passes without gradients of model parts as the training step runs its own (autocast,
    loss parallelism, the pipeline schedule: a forward-only schedule of their own per set of parts),
    returning fn(output, targets) of a microbatch, its samples concatenated along the batch, on the
    ranks that hold the last pipeline stage, and None on the others (where no loss runs)."""

    def __init__(self, step, plan: JobPlan, pp_mesh, device: torch.device):
        self.step, self.plan, self.pp_mesh, self.device = step, plan, pp_mesh, device
        self._schedules: dict[int, tuple] = {}  # id(parts) -> (runner, kept outputs)

    @torch.no_grad()
    def __call__(self, parts: list[nn.Module], mb: Microbatch, fn: Callable[[object, Targets], Targets]
                 ) -> Targets | None:
        step = self.step
        loss_context = torch.distributed.tensor.parallel.loss_parallel() if step.loss_parallel \
            else contextlib.nullcontext()
        if self.plan.pipeline is None:
            with step.autocast, loss_context:
                return fn(parts[0](mb.inputs, **mb.forward_kwargs()), mb.targets)
        runner, kept = self._runner(parts, fn)
        kept.clear()
        with step.autocast, loss_context:
            runner.step(mb, step.pipeline_microbatch_size, backward=False)
        if not runner.has_last:
            return None
        return {name: torch.cat([out[name] for out in kept]) for name in kept[0]}

    def _runner(self, parts: list[nn.Module], fn):
        from titanlike.parallel.pipeline import build_schedule

        if id(parts) not in self._schedules:
            kept: list[Targets] = []
            zero = torch.zeros((), device=self.device)

            def keep(output, targets: Targets) -> torch.Tensor:
                # The schedule's "loss": the companion's outputs of this pipeline microbatch, in order.
                kept.append(fn(output, targets))
                return zero

            runner = build_schedule(parts, self.plan.pipeline, self.pp_mesh, self.device,
                                    schedule=self.plan.cfg.parallelism.pipeline_parallel_schedule,
                                    n_microbatches=self.plan.batch.pipeline_microbatches, loss_fn=keep)
            self._schedules[id(parts)] = runner, kept
        return self._schedules[id(parts)]


@dataclass
class Generation:
    """One generation's batches (one per microbatch of a step), trained at steps first..last; version:
    the step before whose update the policy made them."""

    first: int
    last: int
    version: int
    batches: list[dict[str, torch.Tensor]]


class InFlight:
    """The generations made and not yet wholly trained on this rank: a checkpoint saves them (per
    data-parallel rank, checkpoint/states.py ROLLOUTS) so that a resumed run trains the batches the
    uninterrupted one would, old log-probabilities included, without the weights that made them."""

    def __init__(self, dp_degree: int):
        self.dp_degree = dp_degree
        self.generations: list[Generation] = []
        self.served = 0  # the step whose batches were handed out last

    def state_dict(self) -> dict:
        live = [g for g in self.generations if g.last > self.served]
        return {"dp_degree": self.dp_degree,
                "generations": [{"first": g.first, "last": g.last, "version": g.version, "batches": g.batches}
                                for g in live]}

    def load_state_dict(self, state: dict) -> None:
        generations = [Generation(g["first"], g["last"], g["version"], g["batches"]) for g in state["generations"]]
        if generations and state["dp_degree"] != self.dp_degree:
            raise ValueError(f"its rollouts in flight were generated for {state['dp_degree']} data-parallel ranks and "
                             f"this run has {self.dp_degree}: resume with the same data-parallel degree, or generate "
                             "them anew with --checkpoint.exclude_from_loading rollouts")
        self.generations = generations


def rollout_seed(seed: int, step: int, position: int) -> int:
    """The sampling seed of one generated microbatch: a function of (debug.seed, step: the first step that
    trains it, the microbatch's position in the step's global batch), so that a resumed run draws what the
    uninterrupted one drew, tensor-parallel ranks of one data-parallel rank draw the same samples, and a
    layout draws what one process draws for the same prompts. The position is (refill round x
    data-parallel ranks + data-parallel rank) x microbatches per rank + microbatch, the loader's order
    (data/loader.py: a round draws the next global batch), so one process accumulating D microbatches and
    D data-parallel ranks of one microbatch each generate the same rollouts."""
    return ((seed * 1_000_003 + step) * 16_843_009 + position) % (2 ** 63)  # 16_843_009 positions per step


class Companions:
    """This rank's companions of a job, built; `fill` runs them on a microbatch, `batches` turns the
    loader's batches into generated ones when a companion generates."""

    def __init__(self, companions: tuple[Companion, ...], parts: list[list[nn.Module]], forward: ForwardOnly,
                 disabled: Callable[[list[nn.Module]], contextlib.AbstractContextManager], *,
                 rollout=None, weights: PolicyWeights | None = None, seed: int = 0, rank: int = 0, ranks: int = 1,
                 dp_group=None, device: torch.device | None = None, in_flight: InFlight | None = None):
        """parts: each companion's model parts; disabled(parts): the converters switched off on them;
        rollout, weights: the generating companion's Rollout and the policy's weights it reads; seed: the
        job's (debug.seed); rank, ranks: the data-parallel rank and their count (a microbatch's place in
        the global batch: rollout_seed); dp_group: the data-parallel process group (None: one
        data-parallel rank), over which the rollouts' figures and refill rounds are agreed, on `device`;
        in_flight: the generations not yet trained (a checkpoint's state; a new one if None)."""
        self.companions, self.parts, self.forward, self.disabled = companions, parts, forward, disabled
        self.rollout, self.weights, self.seed, self.rank, self.ranks = rollout, weights, seed, rank, ranks
        self.dp_group, self.device = dp_group, device
        self.in_flight = in_flight if in_flight is not None else InFlight(ranks)
        self._figures: dict[str, list[float]] = {}  # per generation: rollout/rounds, dropped and missing prompts
        self._calls = 0  # the rollout's generate calls since the last metrics()
        self._lag: int | None = None  # of the step served last
        self._generating = 0.0  # seconds spent generating since the last metrics()
        self._gathered = (0, 0)  # the policy's weights' (gathers, bytes) at the last metrics()
        self._latest: dict[str, float] = {}  # the rollouts' figures of the latest log step that generated
        self._since = time.perf_counter()

    def __bool__(self) -> bool:
        return bool(self.companions)

    def _run(self, companion: Companion, parts: list[nn.Module], mb: Microbatch) -> Targets | None:
        modes = [part.training for part in parts]
        for part in parts:
            part.eval()
        try:
            with self.disabled(parts) if companion.converters_off else contextlib.nullcontext():
                return self.forward(parts, mb, companion.outputs)
        finally:
            for part, mode in zip(parts, modes):
                part.train(mode)

    def fill(self, mb: Microbatch) -> Microbatch:
        """Add every companion's outputs to the microbatch's targets (where the loss runs); a generating
        companion's were added to its batch when it was generated (batches)."""
        for companion, parts in zip(self.companions, self.parts):
            if companion.rollout is not None or companion.outputs is None:
                continue
            out = self._run(companion, parts, mb)
            if out is not None:
                mb.targets.update(out)
        return mb

    def batches(self, data: Iterator[dict], *, step: Callable[[], int], microbatches: Callable[[int], int],
                prepare: Callable[[dict], Microbatch]) -> Iterator[dict]:
        """The loader's batches, or, with a generating companion, batches of rollouts (module docstring):
        step(): the step about to train (the policy's version); microbatches(step): that step's count;
        prepare: a batch as the objective prepares it (for the old policy's forward)."""
        if self.rollout is None:
            return data
        return self._rollouts(data, step, microbatches, prepare)

    def _rollouts(self, data, step, microbatches, prepare) -> Iterator[dict]:
        flight, every, ahead = self.in_flight, self.rollout.iterations, self.rollout.ahead
        while True:
            now = step()
            flight.served = now
            flight.generations = [g for g in flight.generations if g.last >= now]
            # Make every generation due by now: the one step `now` trains, and those up to `ahead` steps later.
            first = flight.generations[-1].last + 1 if flight.generations else now - (now - 1) % every
            while first - ahead <= now:
                flight.generations.append(self._generate(data, first, first + every - 1, now, microbatches(first),
                                                         prepare))
                first += every
            current = flight.generations[0]
            self._lag = current.first - current.version
            yield from current.batches

    def _generate(self, data, first: int, last: int, version: int, count: int, prepare) -> Generation:
        """A generation of `count` microbatches trained at steps first..last, made with the policy as of
        `version`: one loader batch each, and, while any data-parallel rank's is short, rounds of one more
        loader batch per microbatch (drawn on every rank alike, so the loader's position stays every rank's;
        a batch already full leaves its draw unused), then the old policy's outputs with the same weights."""
        companion, parts = next((c, p) for c, p in zip(self.companions, self.parts) if c.rollout is not None)
        started = time.perf_counter()
        policy = self.weights.module(version)
        modes = [part.training for part in parts]
        slots: list[dict | None] = [None] * count
        drawn = generated = rounds = 0
        try:
            for round_ in range(self.rollout.rounds):
                rounds += 1
                for i in range(count):
                    prompts = next(data)
                    drawn = len(next(iter(prompts.values())))
                    if slots[i] is None or self.rollout.missing(slots[i]):
                        position = (round_ * self.ranks + self.rank) * count + i
                        slots[i] = self.rollout.generate(prompts, policy, seed=rollout_seed(self.seed, first, position),
                                                         joining=slots[i])
                        generated += drawn
                        self._calls += 1
                missing = sum(self.rollout.missing(b) for b in slots)
                if round_ + 1 == self.rollout.rounds or not self._anywhere(missing > 0):
                    break
        finally:
            for part, mode in zip(parts, modes):
                part.train(mode)
        self.rollout.complete(slots, self._total)
        if self.rollout.rounds > 1:
            kept = drawn * count - missing
            for name, value in (("rollout/rounds", rounds), ("rollout/dropped_prompts", generated - kept),
                                ("rollout/missing_prompts", missing)):
                self._figures.setdefault(name, []).append(float(value))
        if companion.outputs is not None:  # the old policy: the weights that generated, before any update
            for batch in slots:
                out = self._run(companion, parts, prepare(batch))
                if out is not None:
                    batch.update(out)
        self._generating += time.perf_counter() - started
        return Generation(first, last, version, slots)

    def _total(self, values: torch.Tensor) -> torch.Tensor:
        """values summed over the data-parallel ranks (one all-reduce), on the host."""
        if self.dp_group is None:
            return values
        import torch.distributed as dist

        values = values.to(self.device)
        dist.all_reduce(values, group=self.dp_group)
        return values.cpu()

    def _anywhere(self, flag: bool) -> bool:
        """Whether `flag` holds on any data-parallel rank (one all-reduce of one value)."""
        return bool(self._total(torch.tensor([int(flag)])).item() > 0)

    def metrics(self) -> dict[str, float]:
        """The generating companion's figures of the rollouts generated since the last call (the latest
        ones again when none was: steps on earlier rollouts, num_iterations > 1; nothing without one),
        with the share of the wall time since the last call spent generating and, under FSDP or TP, the
        bytes each gather of the policy's weights brought into this rank (policy_gather_bytes)."""
        if self.rollout is None:
            return {}
        now = time.perf_counter()
        figures = self.rollout.metrics()  # means over this rank's generated batches
        weights = {name: float(self._calls) for name in figures}
        own, self._figures, self._calls = self._figures, {}, 0
        figures.update({name: sum(values) / len(values) for name, values in own.items()})
        out = self._over_data_parallel_ranks(figures, weights, summed=("rollout/dropped_prompts",
                                                                       "rollout/missing_prompts"))
        # Log steps that generated nothing (num_iterations > 1) trained on the latest rollouts: theirs again
        # (every rank generates on the same steps).
        if figures:
            self._latest = dict(out)
        else:
            out = dict(self._latest)
        if self._lag is not None:
            out["rollout/lag"] = float(self._lag)
        out["generation_share"] = self._generating / max(now - self._since, 1e-9)
        self._generating, self._since = 0.0, now
        gathers, gathered = self.weights.gathers - self._gathered[0], self.weights.gathered_bytes - self._gathered[1]
        if gathers:
            out["policy_gather_bytes"] = gathered / gathers
        self._gathered = (self.weights.gathers, self.weights.gathered_bytes)
        return out

    def samples(self, step: int) -> list[tuple[str, str, dict[str, float]]]:
        """The generating companion's sample completions (prompt, completion, scores) of this rank's latest
        rollouts when `step` is one of its sample steps (Rollout.sample_freq); else, or without one, none."""
        every = 0 if self.rollout is None else self.rollout.sample_freq
        return self.rollout.samples() if every and step % every == 0 else []

    def _over_data_parallel_ranks(self, figures: dict[str, float], weights: dict[str, float],
                                  summed: tuple[str, ...] = ()) -> dict[str, float]:
        """The rollouts' figures of every data-parallel rank: the mean of the ranks' finite values weighted
        by `weights` (the batches each rank generated: refill rounds may differ per rank; 1 where absent),
        the largest for a */max figure, the sum for the counts `summed`, so that what is logged is the
        global batch's on every layout. Every rank calls it on the same log steps with the same names (one
        generating code path), as the step's own reduction of the logged values."""
        if self.dp_group is None or not figures:
            return figures
        import torch.distributed as dist

        values = torch.tensor(list(figures.values()), dtype=torch.float64, device=self.device)
        weight = torch.tensor([weights.get(name, 1.0) for name in figures], dtype=torch.float64, device=self.device)
        finite = values.isfinite()
        weight = torch.where(finite, weight, 0.0)
        sums = torch.cat([torch.where(finite, values * weight, 0.0), weight])
        largest = torch.where(finite, values, -torch.inf)
        dist.all_reduce(sums, group=self.dp_group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.dp_group)
        n = len(figures)
        means = torch.where(sums[n:] > 0, sums[:n] / sums[n:].clamp(min=1e-30), torch.nan)
        read = torch.cat([means, largest, sums[:n]]).tolist()  # one read
        means, largest, totals = read[:n], read[n:2 * n], read[2 * n:]
        return {name: largest[i] if name.endswith("/max") else totals[i] if name in summed else means[i]
                for i, name in enumerate(figures)}


def frozen_copy(plan: JobPlan, source: list[nn.Module], device: torch.device, *, resumed: bool,
                load_start: Callable[[list[nn.Module]], None], build_converters) -> list[nn.Module]:
    """A frozen copy of the model being trained, planned and parallelized like it: the source's weights
    (a fresh run, before its first update), or (resumed) its initialization and the run's initial load
    again (load_start). build_converters(): the job's converters, new."""
    from titanlike.train.model_parts import build_model_parts

    seed = plan.cfg.debug.seed
    converters = build_converters()
    parts = build_model_parts(plan, converters)
    for part, own in zip(parts, source):
        part.to_empty(device=device)
        if resumed:
            part.init_weights(seed=seed)
            converters.init_weights(part, seed)
        else:
            with torch.no_grad():
                state = dict(own.named_parameters()) | dict(own.named_buffers())
                for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                    tensor.copy_(state[name])
    if resumed:
        load_start(parts)
    for part in parts:
        part.requires_grad_(False)
        part.eval()
    return parts


def build_companions(companions: tuple[Companion, ...], plan: JobPlan, policy: list[nn.Module], *,
                     forward: ForwardOnly, device: torch.device, resumed: bool,
                     load_start: Callable[[list[nn.Module]], None], build_converters, converters,
                     log: bool, in_flight: InFlight | None = None) -> Companions:
    """Build each companion's parts on this rank (module docstring). load_start(parts): the run's
    initial load into a fresh copy (its converters' state included); build_converters(): new converters
    of the job; converters: the policy's (their `disabled`); in_flight: the generations not yet trained, as
    a checkpoint restored them."""
    from titanlike.train.model_parts import build_frozen_model

    built, rollout, weights = [], None, None
    for companion in companions:
        if companion.rollout is not None:
            if rollout is not None:
                raise ValueError("a job has at most one companion that generates")
            rollout = companion.rollout(plan)
            weights = PolicyWeights(plan, policy, device, build_converters)
        if companion.source is Source.POLICY:
            parts = policy
        elif companion.source is Source.FROZEN_COPY:
            parts = frozen_copy(plan, policy, device, resumed=resumed, load_start=load_start,
                                build_converters=build_converters)
        else:
            parts = build_frozen_model(plan, companion.path, device, seed=plan.cfg.debug.seed)
        built.append(parts)
        if log:
            rebuilt = " (rebuilt from its initialization and initial load)" if (
                resumed and companion.source is Source.FROZEN_COPY) else ""
            logger.info(f"{plan.objective.name} companion {companion.describe()}, sharded like the model{rebuilt}")
    if log and weights is not None and weights.sharded:
        logger.info(f"generation reads the policy through a whole copy on each rank ({weights.copy_bytes / 2**20:.2f} "
                    f"MiB), refreshed by one gather per update that brings {weights.gather_bytes / 2**20:.2f} MiB "
                    "into rank 0")
    dp = plan.dims.mesh("dp")
    return Companions(companions, built, forward, converters.disabled, rollout=rollout, weights=weights,
                      seed=plan.cfg.debug.seed, rank=plan.dims.dp_rank(), ranks=plan.dims.dp_degree,
                      dp_group=None if dp is None else dp.get_group(), device=device, in_flight=in_flight)


__all__ = ["Companions", "ForwardOnly", "Generation", "InFlight", "PolicyWeights", "build_companions", "frozen_copy",
           "rollout_seed"]
