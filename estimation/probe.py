"""Run a planned job's training step on fake tensors, one block of each kind, and measure it.

The probe is the trainer's own code: the family's model on meta from the plan's args, the job's
converters (float8; LoRA, whose frozen base gets no gradient and no optimizer state), the real
`parallelize_model` (the family's TP plan, CP, EP, activation checkpointing, compile, FSDP) over a
DeviceMesh of a fake process group of the job's world size, the real optimizer and the real
`TrainStep` (`forward_backward` per microbatch, `update`), all inside FakeTensorMode: tensors have
shapes, dtypes and storages, no data. It knows no module type and no family; how steps run on fake
tensors is estimation/fake.py.

One block per kind. A block's kind is its signature (its module tree as printed, its parameter
shapes, how activation checkpointing wraps it). The probe keeps the first and last block and, for
every pair of kinds that follow each other, one such pair of blocks; the others are deleted before
parallelization (a model runs on any subset of its layers, as the pipeline split relies on).

What is measured. `LiveBytes` counts the bytes of every tensor storage the step creates while it
lives, and marks split the step into windows: each block's forward (from its start to the next
block's) and backward (from the gradient of its output to that of the previous block's), and the
ends', which estimation/layout.py lays out along the real model and the schedule. Two microbatches
are probed: the first creates gradients (and, under pipeline parallelism, FSDP's unsharded
accumulators), the second finds them. What parameters, gradients and optimizer state hold between
steps is read from the parallelized parameters and the optimizer's state tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import time
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from estimation.fake import (DEVICE, AssumedValues, LiveBytes, collective_buffers, fake_kernels, fake_mode, fake_world,
                             round_up)


@dataclass
class Window:
    """A stretch of the step: the bytes it leaves (`keep`, negative when it frees more than it makes)
    and how far it rises above where it began (`over`)."""

    keep: int = 0
    over: int = 0


@dataclass
class Static:
    """What a group of parameters (a kind of block, an end of the model) holds between steps."""

    params: int = 0     # local shards (and buffers), as parallelized
    grads: int = 0      # their gradients, once reduced (the shards' shapes)
    optimizer: int = 0  # the optimizer's state tensors for them

    def __add__(self, o: Static) -> Static:
        return Static(self.params + o.params, self.grads + o.grads, self.optimizer + o.optimizer)

    def __mul__(self, k: int) -> Static:
        return Static(self.params * k, self.grads * k, self.optimizer * k)


@dataclass
class Probe:
    """What one probe of a plan measured, for its busiest tensor-parallel rank (rank 0)."""

    kinds: list[str]                 # the kind (signature) of every layer of the model, in order
    static: dict[str, Static]        # one block of each kind; the ends: "input", "output", "shared", "tied"
    # Per probed microbatch, by (a, b): the forward window of a block of kind a followed by one of kind
    # b; "input" (before the first block), "first" (the first block), "tail" (the last block, the output
    # end, the loss). Backward: of a block of kind a preceded by one of kind b; "output" (the output
    # end's), "last", "head" (the first block's and the input end's) and "release" (after backward: the
    # step lets go of the output and the batch).
    forward: list[dict]
    backward: list[dict]
    reduce: Window = field(default_factory=Window)  # pipeline parallel: the gradient reduction at the end
    update: Window = field(default_factory=Window)  # clipping and the optimizer step
    stage_input: int = 0             # bytes of the hidden state entering a block (a pipeline stage's input)
    # The two largest buffers one FSDP all-gather ("foreach_all_gather") and one reduce-scatter
    # ("foreach_reduce") allocate.
    pools: dict[str, list[int]] = field(default_factory=dict)
    probed: Static = field(default_factory=Static)  # what the probed blocks and ends hold
    microbatch: int = 0              # samples per probed microbatch
    probed_layers: int = 0
    # Pipeline parallel: every pipeline rank's actions in torch's own schedule, as (computation type,
    # stage, microbatch), e.g. ("FORWARD", 0, 3).
    actions: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # The objective's frozen other models (companions of Source.CHECKPOINT: a distillation teacher), each as
    # (its plan: the job's layout and its own pipeline split, its own probe).
    frozen: list[tuple] = field(default_factory=list)
    sharded: bool = False            # parameters are DTensor shards (FSDP, TP)
    generation: Generation | None = None  # a generating companion's (RL rollouts)


@dataclass
class Generation:
    """What a generating companion (RL rollouts, train/companions.py) holds on a rank: `rows` sequences
    (local_batch_size x completions per prompt) in the engine's cache of up to seq_len tokens each.
    copy: the policy's whole copy the generator reads under FSDP or TP (PolicyWeights; 0 where ranks hold
    whole parameters and it reads the trained module); cache: the cache after the prefill of the longest
    prompts; prefill: the highest the prefill rises, the cache included."""

    rows: int = 0
    copy: int = 0
    cache: int = 0
    prefill: int = 0


def rows_per_sample(plan) -> int:
    """Rows of the trained microbatch per loader sample: a generating companion's completions per prompt."""
    return max([c.completions for c in plan.objective.companions if c.rollout is not None], default=1)


def probed_layers(kinds: list[str]) -> dict[tuple[str, str], int]:
    """For every pair of kinds that follow each other somewhere in the model, the first layer i with
    (kinds[i], kinds[i + 1]) that pair, preferring pairs away from the ends (the first block's forward
    and the last block's backward also do the ends' work)."""
    where: dict[tuple[str, str], int] = {}
    inner = lambda i: 1 <= i and i + 2 < len(kinds)  # noqa: E731
    for i, pair in enumerate(zip(kinds, kinds[1:])):
        if pair not in where or (inner(i) and not inner(where[pair])):
            where[pair] = i
    return where


def _kept(kinds: list[str], where: dict) -> list[int]:
    """The layers a probe keeps: the first, the last, and each probed pair."""
    return sorted({0, len(kinds) - 1, *where.values(), *(i + 1 for i in where.values())})


def _storage_bytes(tensors, granularity: int, seen: set) -> int:
    total = 0
    for t in tensors:
        for st in get_untyped_storages(t.to_local() if isinstance(t, DTensor) else t):
            if st._cdata not in seen and st.nbytes():
                seen.add(st._cdata)
                total += round_up(st.nbytes(), granularity)
    return total


def _static(params, buffers, optimizer, granularity: int) -> Static:
    seen: set = set()
    s = Static()
    for p in params:
        n = _storage_bytes([p], granularity, seen)
        state = [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)] if n else []
        s = s + Static(n, n if p.requires_grad else 0, _storage_bytes(state, granularity, set()))
    return s + Static(params=_storage_bytes(buffers, granularity, seen))


def _statics(part: nn.Module, optimizer, kinds: dict[str, str], ends, granularity: int) -> dict[str, Static]:
    """Parameter, gradient and optimizer bytes of one block of each kind (blocks of a kind hold the same),
    and of each end ("input", "output", "shared": held by every pipeline stage), plus "tied": what both
    ends hold (a tied embedding), counted once on a stage that holds both."""
    from titanlike.models.common.init import canonical_fqn

    out = {kinds[k]: _static(b.parameters(), list(b.buffers()), optimizer, granularity) for k, b in part.layers.items()}
    in_blocks = {id(t) for b in part.layers.values() for t in [*b.parameters(), *b.buffers()]}
    under = lambda name, ends_: any(f"{canonical_fqn(name)}.".startswith(f"{e}.") for e in ends_)  # noqa: E731
    held: dict[str, tuple[list, list]] = {"input": ([], []), "output": ([], []), "shared": ([], [])}
    for i, items in enumerate((part.named_parameters(remove_duplicate=False), part.named_buffers())):
        for name, t in items:
            if id(t) not in in_blocks:  # ends may be dotted paths (PipelineEnds)
                end = "input" if ends and under(name, ends.inputs) else "output" if ends and under(
                    name, ends.outputs) else "shared"
                held[end][i].append(t)
    out |= {end: _static(*held[end], optimizer, granularity) for end in held}
    both = [p for p in held["input"][0] if any(p is q for q in held["output"][0])]
    return out | {"tied": _static(both, [], optimizer, granularity)}


def _fake_microbatch(plan, batch: int, positions):
    """One microbatch as the trainer hands it to the step (the objective's fields, prepared)."""
    fields = {name: torch.zeros((batch, *shape), dtype=getattr(torch, dtype), device=DEVICE)
              for name, (shape, dtype) in plan.objective.sample_fields(plan.cfg.training.seq_len).items()}
    return plan.objective.prepare(fields, _context(plan, positions))


def _context(plan, positions):
    """The BatchContext of the trainer's microbatches (no cp mesh: the probe traces one rank's work)."""
    from titanlike.objectives.base import BatchContext

    # Values do not matter to fake tensors: token 0 stands in for the end of document.
    return BatchContext(DEVICE, cp_positions=positions, mask_kernel=None if positions is not None else "sdpa",
                        eos_id=0, lookahead_tokens=plan.model_args.lookahead_tokens)


def probe(plan, *, granularity: int = 512, device: str = "cuda") -> Probe:
    """Probe `plan` (a JobPlan), and each other checkpoint its objective runs beside the model (a
    companion of Source.CHECKPOINT: objectives/companion.py), planned as the trainer builds it
    (train/plan.py other_model_plan) with its family's own objective. Where the compiled probe fails (a graph dynamo or AOT autograd cannot
    take on fake tensors), the job is probed in eager mode, which errs high, and `Probe.notes` says so."""
    from titanlike.checkpoint.hf import checkpoint_model
    from titanlike.objectives.companion import Source
    from titanlike.objectives.registry import family_objective
    from titanlike.train.plan import other_model_plan

    out = _probe_plan(plan, granularity, device)
    out.generation, note = probe_generation(plan, sharded=out.sharded, granularity=granularity, device=device)
    out.notes += [note] if note else []
    for companion in plan.objective.companions:
        if companion.source is not Source.CHECKPOINT:
            continue
        folder, spec, args = checkpoint_model(companion.path)
        other = other_model_plan(plan, spec, args, model=folder)
        other = dataclasses.replace(other, objective=family_objective(other.cfg, spec, other.model_args))
        out.frozen.append((other, _probe_plan(other, granularity, device)))
    return out


def _probe_plan(plan, granularity: int, device: str) -> Probe:
    compiled = plan.cfg.compile.enable
    try:
        return _probe(plan, granularity, device)
    except Exception as e:  # noqa: BLE001 (any failure of the compiler's stack; eager must then run)
        if not compiled:
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
    finally:
        if compiled:  # the fake graphs serve no trainer in this process and count against its recompile limit
            torch._dynamo.reset()
    objective = copy.copy(plan.objective)
    objective._compile_backend = None
    objective.__dict__.pop("_cross_entropy", None)
    eager = dataclasses.replace(plan, objective=objective,
                                parallelize=dataclasses.replace(plan.parallelize, compile_blocks=False))
    out = _probe(eager, granularity, device)
    out.notes.append(f"compile: the compiled probe failed ({reason}); estimated in eager mode, which errs high")
    return out


def _probe(plan, granularity: int, device: str) -> Probe:
    from torch.distributed.fsdp import FSDPModule

    from titanlike.models.converters import build_model_converters
    from titanlike.parallel.activation_checkpoint import checkpointing
    from titanlike.parallel.context import load_balanced_positions, require_context_parallel_hooks
    from titanlike.parallel.parallelize import parallelize_model
    from titanlike.train.optimizer import build_optimizer
    from titanlike.train.step import StepLoss, TrainStep

    began = time.perf_counter()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg, args, spec, t = plan.cfg, plan.model_args, plan.spec, plan.cfg.training
    dims = dataclasses.replace(plan.dims)  # its own meshes, of the fake world
    ac = (plan.parallelize.activation_checkpoint_mode, plan.parallelize.selective_ac_option)
    pipelined = dims.pp_enabled
    batch = (plan.batch.pipeline_microbatch_size if pipelined else t.local_batch_size) * rows_per_sample(plan)
    passes = 2 if pipelined or plan.batch.grad_accum_steps > 1 else 1
    marks: list[tuple] = []
    inputs: list[int] = []
    pools: dict[str, list[int]] = {}
    gc_was = gc.isenabled()
    with fake_world(dims.world_size), fake_kernels(device == "cuda"):
        dims.build_mesh(DEVICE.type, experts=args.moe_args() is not None)
        actions = _schedule_actions(plan, dims) if pipelined else {}
        with torch.device("meta"):
            model = spec.model_cls(args)
        # float8 matmuls as on the GPU (torch._scaled_mm, whose fake kernel runs anywhere) rather than
        # emulated in fp32, which a job needs on CPU only.
        job = dataclasses.replace(cfg, float8=dataclasses.replace(cfg.float8, emulate=False)) if device == "cuda" else cfg
        converters = build_model_converters(cfg.model.converters, job)
        converters.convert(model)
        keys = list(model.layers.keys())
        kinds = [f"{b!r}|{[(n, tuple(p.shape), p.dtype) for n, p in b.named_parameters()]}|{checkpointing(k, *ac)}"
                 for k, b in model.layers.items()]
        where = probed_layers(kinds)
        kept = _kept(kinds, where)
        for i, k in enumerate(keys):
            if i not in kept:
                del model.layers[k]
        kind_of = {keys[i]: kinds[i] for i in kept}
        if dims.cp_enabled:
            require_context_parallel_hooks(model)
        part = parallelize_model(model, spec.shard, dims, plan.parallelize)
        fsdp = part if pipelined and isinstance(part, FSDPModule) else None
        with fake_mode(), AssumedValues():
            part.to_empty(device=DEVICE)
            part.train()
            optimizer = build_optimizer([part], cfg.optimizer)
            # Take one step first: optimizer state is made once, not every step.
            for p in part.parameters():
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            optimizer.step()
            converters.post_optimizer_step([part])
            optimizer.zero_grad(set_to_none=True)
            static = _statics(part, optimizer, kind_of, spec.pipeline_ends, granularity)
            positions = load_balanced_positions(t.seq_len, dims.cp, 0, DEVICE) if dims.cp_enabled else None
            tokens = torch.tensor(float(t.local_batch_size * t.seq_len), device=DEVICE)
            scale = torch.ones((), device=DEVICE) if plan.precision.loss_scaling != "none" else None

            def started(grad):
                mark("backward")
                torch.autograd.Variable._execution_engine.queue_callback(lambda: mark("backward done"))

            def loss_fn(output, targets, ctx, *, correct=False):
                # The companions' outputs (no companion runs here) as the trained model's own would be:
                # the same names, shapes and dtypes.
                with torch.no_grad():
                    for companion in plan.objective.companions:
                        if companion.outputs is not None:  # a generator without a forward adds none
                            targets = targets | companion.outputs(output, targets)
                terms = plan.objective.loss(output, targets, ctx, correct=correct)
                terms.value.register_hook(started)
                return terms

            step = TrainStep.for_plan(plan, dims, model_parts=[part], device=DEVICE, optimizer=optimizer,
                                      step_loss=StepLoss(plan.objective, _context(plan, positions), scale,
                                                         loss_fn=loss_fn),
                                      converters=converters)
            live = LiveBytes(granularity)

            def mark(label):
                marks.append((label, *live.reset()))

            def on_output(key):
                def hook(module, args_, output):
                    out = next((o for o in tree_leaves(output) if isinstance(o, torch.Tensor) and o.requires_grad),
                               None)
                    if out is not None:
                        out.register_hook(lambda g: mark(("b", key)))
                return hook

            def on_input(key):
                def hook(module, args_):
                    x = next((a for a in tree_leaves(args_) if isinstance(a, torch.Tensor)), None)
                    x = x.to_local() if isinstance(x, DTensor) else x
                    inputs.append(x.numel() * x.element_size() if x is not None else 0)
                    mark(("f", key))
                return hook

            # Before FSDP's own hooks: a block's window holds the gathering of its weights, forward and backward.
            # Kept out of a compiled block's graph, as FSDP keeps its hooks: they run when the block does.
            for key, block in part.layers.items():
                block.register_forward_pre_hook(torch._dynamo.disable(on_input(key)), prepend=True)
                block.register_forward_hook(torch._dynamo.disable(on_output(key)), prepend=True)
            gc.collect()
            gc.disable()  # fake tensors are freed by reference counting; the collector only costs time
            try:
                with live, collective_buffers(live, pools):
                    for i in range(passes):
                        mark(("start", i))
                        if fsdp is not None:  # as torch's pipeline stage runs every backward
                            fsdp.set_is_last_backward(False)
                            fsdp.set_reshard_after_backward(False)
                            fsdp.set_requires_gradient_sync(False)
                        step.forward_backward(_fake_microbatch(plan, batch, positions))
                        mark(("end", i))
                    if fsdp is not None:
                        from torch.distributed.pipelining.stage import _PipelineStageBase

                        _PipelineStageBase.perform_reduce_grad(types.SimpleNamespace(submod=fsdp), 1)
                    mark("reduced")
                    step.update(torch.zeros((), device=DEVICE), tokens, torch.zeros(0, device=DEVICE))
                    mark("updated")
            finally:
                if gc_was:
                    gc.enable()
    out = Probe(kinds=kinds, static=static, forward=[], backward=[], microbatch=batch, probed_layers=len(kept),
                stage_input=max(inputs, default=0), actions=actions, pools=pools,
                sharded=any(isinstance(p, DTensor) for p in part.parameters()))
    out.probed = sum((static[k] for k in [*kind_of.values(), "input", "output", "shared"]), static["tied"] * -1)
    _windows(out, marks, where, keys, passes)
    out.seconds = time.perf_counter() - began
    return out


def probe_generation(plan, *, sharded: bool, granularity: int = 512,
                     device: str = "cuda") -> tuple[Generation | None, str | None]:
    """(the memory of the job's generating companion on one rank, None without one; a note when its
    prefill could not run on fake tensors and its cache is left out). sharded: the trained parameters are
    DTensor shards, so the generator reads a whole copy."""
    generator = next((c for c in plan.objective.companions if c.rollout is not None), None)
    if generator is None:
        return None, None
    try:
        return _generation(plan, generator, granularity, device, sharded=sharded), None
    except Exception as e:  # noqa: BLE001 (a family's prefill the fake tensors cannot run: say so, go on)
        return (_generation(plan, generator, granularity, device, sharded=sharded, prefill=False),
                f"generation: the prefill could not run on fake tensors ({type(e).__name__}); the generator's "
                "cache is not counted")


def _generation(plan, generator, granularity: int, device: str, *, sharded: bool, prefill: bool = True) -> Generation:
    """The generator's memory on one rank (Generation): the whole model on fake tensors, as PolicyWeights
    builds its copy (the job's converters), prefilling the longest prompts the job allows (seq_len less
    the completion length) into a cache of seq_len tokens, as the engine sizes it (rl/rollout.py);
    without `prefill`, the copy alone."""
    from titanlike.models.converters import build_model_converters

    t = plan.cfg.training
    rows = t.local_batch_size * generator.completions
    prompt = max(1, t.seq_len - generator.max_new_tokens)
    with torch.device("meta"):
        model = plan.spec.model_cls(plan.model_args)
    build_model_converters(plan.cfg.model.converters, plan.cfg).convert(model)
    copy = sum(round_up(x.numel() * x.element_size(), granularity)
               for x in [*model.parameters(), *model.buffers()]) if sharded else 0
    dtype = next(model.parameters()).dtype
    if not prefill:
        return Generation(rows=rows, copy=copy)
    with fake_kernels(device == "cuda"), fake_mode(), AssumedValues():
        model.to_empty(device=DEVICE)
        model.eval()
        live = LiveBytes(granularity)
        with live, torch.no_grad():
            cache = model.init_cache(rows, t.seq_len, device=DEVICE, dtype=dtype)
            tokens = torch.zeros(rows, prompt, dtype=torch.long, device=DEVICE)
            logits = model.prefill(tokens, torch.full((rows,), prompt, device=DEVICE), cache)
            del logits, tokens
            held = live.now
        del cache
    return Generation(rows=rows, copy=copy, cache=held, prefill=live.high)


def _schedule_actions(plan, dims) -> dict[int, list[tuple[str, int, int]]]:
    """torch's action list for every pipeline rank (its schedule built on placeholder stages)."""
    from titanlike.parallel.pipeline import build_schedule

    layout, schedule = plan.pipeline, plan.cfg.parallelism.pipeline_parallel_schedule
    parts = [nn.Linear(1, 1, bias=False, device="meta") for _ in layout.stages_of_rank(0)]
    runner = build_schedule(parts, layout, dims.mesh("pp"), DEVICE, schedule=schedule,
                            n_microbatches=plan.batch.pipeline_microbatches, loss_fn=lambda out, target: out.sum())
    order = getattr(runner.schedule, "pipeline_order", None) or {}
    return {rank: [(x.computation_type.name, x.stage_index, x.microbatch_index)
                   for a in actions if a is not None for x in (a.sub_actions or [a])]
            for rank, actions in order.items()}


def _windows(out: Probe, marks: list, where: dict, keys: list[str], passes: int) -> None:
    """The windows between marks (label, live bytes, peak since the previous mark) of every pass."""
    at = {m[0]: i for i, m in enumerate(marks)}
    w = lambda a, b: Window(marks[b][1] - marks[a][1], max(m[2] for m in marks[a + 1:b + 1]) - marks[a][1])  # noqa
    for p in range(passes):
        start, end = at[("start", p)], at[("end", p)]
        here = range(start, end + 1)
        local = {marks[i][0]: i for i in here}
        f, b = ([i for i in here if isinstance(marks[i][0], tuple) and marks[i][0][0] == d] for d in "fb")
        bwd, done = (next(i for i in here if marks[i][0] == label) for label in ("backward", "backward done"))
        fw = {"input": w(start, f[0]), "first": w(f[0], f[1] if len(f) > 1 else bwd), "tail": w(f[-1], bwd)}
        bw = {"output": w(bwd, b[0]), "last": w(b[0], b[1] if len(b) > 1 else done), "head": w(b[-1], done),
              "release": w(done, end)}
        for pair, i in where.items():
            for d, x, y, into, key in (("f", i, i + 1, fw, pair), ("b", i + 1, i, bw, pair[::-1])):
                x, y = local.get((d, keys[x]), -1), local.get((d, keys[y]), -1)
                if start < x < y < end:
                    into[key] = w(x, y)
        out.forward.append(fw)
        out.backward.append(bw)
    out.reduce = w(at[("end", passes - 1)], at["reduced"])
    out.update = w(at["reduced"], at["updated"])
