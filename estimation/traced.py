"""Traced memory estimate: the real model, parallelize and optimizer on fake tensors.

How. The process joins a fake process group (torch's FakeStore, backend "fake") as
rank 0 of the requested world size, builds the job's DeviceMesh, and assembles the model
as the trainer does (titanlike/train/model_parts.py): the family's model on meta from the
job's args, the job's model converters (float8: torchao's Float8Linear, with its float8
casts, scales and float8 FSDP all-gather), the pipeline split by the family's pipeline
ends, then the real `parallelize_model` with the family's shard function (TP, CP,
AC, FSDP) and the family's loss. It materializes the parts inside FakeTensorMode: tensors
carry shapes, dtypes and storages but no data, and collectives return without
communicating. torch's memory trackers then
count every storage the step creates and frees: `FSDPMemTracker` when the model is
FSDP-wrapped (it tells sharded from all-gathered parameters and gradients),
otherwise the generic `MemTracker`. Which rank joins does not matter: every rank
runs the same shapes except along pipeline parallelism (TP rank 0 holds the larger
shard of an uneven vocabulary, so it is the one to measure).

What runs. Without pipeline parallelism, one training step as the trainer runs it:
forward, loss, backward for the first microbatch (and a second when gradients
accumulate, since later microbatches start with gradients allocated), gradient
clipping, the optimizer step and zero_grad. The optimizer state is created by one
step before tracking: created inside the tracker, FSDPMemTracker counts its
temporaries as state (seen at 8B: 101 GiB instead of 7.5).

With pipeline parallelism, tracing every pipeline rank's whole schedule would repeat
the same stage many times. Instead each distinct stage (layer count, with or without
the embedding, with or without the output) is traced once, through the phases a
torch pipeline stage goes through: two forwards, two backwards without gradient
sync (as torch's stage runs them under FSDP, accumulating unsharded gradients),
the final gradient reduction (`PipelineStage.perform_reduce_grad`), and the optimizer
step. That gives, per stage, the memory each action adds and its transient peak.
Every pipeline rank's peak is then replayed from the action list of the real torch
schedule (`schedule.pipeline_order`), so warm-up depth, interleaving and the V
placement come from torch itself. Split backward (the zero-bubble schedules' I and
W actions) is replayed as a full backward whose weight-gradient inputs stay alive
until W; that share is estimated, not traced.

float8. The matmuls are emulated (validation refuses float8 without an SM 8.9+ GPU): that
changes only the kernels, which run inside torchao's tensor subclass dispatch, where the
trackers do not see temporaries; the tensors they count (float8 casts of weights and inputs,
scales, FSDP's float8 all-gather buffers, outputs) have the same sizes as on a GPU.

Device. Tensors are fake CPU tensors: a CPU-only torch cannot create CUDA tensors
even in fake mode (FSDP asks the CUDA runtime for the current device). Each storage
is rounded up to `alloc_granularity` bytes (512, the CUDA caching allocator's
block) so that counts match what a GPU allocates; GPU-only memory (CUDA context,
NCCL buffers, allocator fragmentation) is outside the trace and added by the verdict.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from estimation.memory import Breakdown, RankEstimate
from estimation.options import PreparedJob

DEVICE = torch.device("cpu")
_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # compute dtypes other than float32

# torch's tracker categories -> our buckets. Anything unknown counts as transient.
_CATEGORY = {
    # FSDPMemTracker
    "Sharded Param": "parameters", "Buffer": "parameters", "Unsharded Param": "gathered_parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "OptState": "optimizer_state",
    "Activation": "activations", "Inputs": "activations", "Temp": "transient",
    "All Gather": "transient", "Reduce Scatter": "transient",
    # MemTracker
    "Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer_state", "Other": "transient",
}


def _to_breakdown(snapshot: dict) -> Breakdown:
    out = Breakdown()
    for dev_snap in snapshot.values():
        for key, nbytes in dev_snap.items():
            name = getattr(key, "value", key)
            if name == "Total":
                continue
            bucket = _CATEGORY.get(name, "transient")
            setattr(out, bucket, getattr(out, bucket) + nbytes)
    return out


@contextlib.contextmanager
def _allocation_granularity(granularity: int):
    """Round every tracked storage up to `granularity` bytes, on any device.

    MemTracker rounds only CUDA storages (to 512 bytes); ours are fake CPU tensors
    standing in for CUDA ones.
    """
    from torch.distributed._tools import mem_tracker

    info = getattr(mem_tracker, "_WeakRefInfo", None)
    original = getattr(info, "_calculate_mem_consumed", None)
    if original is None:
        yield False
        return

    def rounded(self) -> int:
        nbytes = self.size * self.element_size
        return math.ceil(nbytes / granularity) * granularity

    info._calculate_mem_consumed = rounded
    try:
        yield True
    finally:
        info._calculate_mem_consumed = original


@contextlib.contextmanager
def _separate_propagation_mode():
    """Make DTensor's sharding propagation use a fake mode of its own.

    DTensor derives output shapes by running each op on global-shape fake tensors in
    `detect_fake_mode() or FakeTensorMode()`. In eager there is no active fake mode, so
    it gets a private one, and the memory trackers skip its ops by comparing modes.
    Under our FakeTensorMode it would reuse ours, and the trackers would count those
    global-shape tensors as allocations: with loss parallel, an fp32 tensor of the whole
    vocabulary per token (seen as +8 GiB at Llama 3 8B, seq 8192, TP 8). Handing it its
    own mode restores the eager behavior.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    original = getattr(_sharding_prop, "detect_fake_mode", None)
    if original is None:
        yield False
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: mode
    try:
        yield True
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _float8_flatten_without_data(enabled: bool):
    """Let the memory trackers list the storages of torchao's float8 FSDP weights under FakeTensorMode.

    The trackers find a tensor subclass's storages through `__tensor_flatten__`. torchao's
    `WeightWithDynamicFloat8CastTensor.__tensor_flatten__` (torchao 0.18, float8/fsdp_utils.py) tests
    `if self._precomputed_scale:`, the truth value of a 0-d tensor: a data read, which a fake tensor
    refuses (DataDependentOutputException on aten._local_scalar_dense) once
    `precompute_float8_dynamic_scale_for_fsdp` has set the scale. A precomputed scale is never zero
    (float8 max over a clamped amax), so testing `is not None` lists the same tensors as a real run.
    """
    if not enabled:
        yield
        return
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as weight_cls
    except ImportError:
        yield
        return
    original = weight_cls.__dict__.get("__tensor_flatten__")

    def flatten(self):
        tensors = ["_tensor"]
        if getattr(self, "_precomputed_scale", None) is not None:
            tensors.append("_precomputed_scale")
        return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}

    weight_cls.__tensor_flatten__ = flatten
    try:
        yield
    finally:
        if original is not None:
            weight_cls.__tensor_flatten__ = original


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A fake process group for (rank, world_size); destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; the estimator needs its own fake one")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _storage_bytes(tensors, granularity: int) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        key = id(st) if not hasattr(st, "_cdata") else st._cdata
        if key in seen:
            continue
        seen.add(key)
        total += math.ceil(st.nbytes() / granularity) * granularity
    return total


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer, granularity: int) -> int:
    return _storage_bytes((v for state in optimizer.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor)), granularity)


class _Tracker:
    """One torch tracker over a model part, plus per-phase peaks."""

    def __init__(self, part: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple = ()):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        if isinstance(part, FSDPModule):
            self.tracker = FSDPMemTracker(part, optimizer)
            self.tracker.track_inputs(inputs)
        else:
            self.tracker = MemTracker()
            self.tracker.track_external(part, optimizer, *inputs)
        self.kind = type(self.tracker).__name__

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)

    def current(self) -> Breakdown:
        return _to_breakdown(self.tracker.get_tracker_snapshot("current"))

    def peak(self) -> Breakdown:
        return _to_breakdown(self.tracker.get_tracker_snapshot("peak"))

    def reset_peak(self) -> None:
        # No public API: the peak is the largest snapshot seen since these were set.
        snap = self.tracker.get_tracker_snapshot("current")
        self.tracker._peak_mem = {dev: s["Total"] for dev, s in snap.items()}
        self.tracker._peak_mem_snap = copy.deepcopy(snap)

    def retag_accumulated_grads(self, part: nn.Module) -> None:
        """File FSDP's unsharded gradient accumulators under gradients.

        Without gradient sync (pipeline microbatches), FSDP accumulates unsharded gradients
        in the reduce dtype; FSDPMemTracker sees them created in backward and calls them
        temporaries, though they live until the end-of-step reduction.
        """
        from torch.distributed.fsdp import FSDPModule

        kind = getattr(getattr(self.tracker, "_ref_class", None), "UNSHARDED_GRAD", None)
        if kind is None:
            return
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", []):
                for grad in (getattr(fsdp_param, "unsharded_accumulated_grad", None),
                             getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)):
                    if isinstance(grad, torch.Tensor):
                        try:
                            self.tracker._update_and_maybe_create_winfos(grad, kind, update_existing=True)
                        except KeyError:  # created outside the tracker's view: nothing to move
                            pass

    def per_module(self, depth: int) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for stats in self.tracker.memory_tracking.values():
            fqn = stats.mod_fqn
            if fqn.count(".") > depth:
                continue
            fwd = bwd = 0
            for state, snaps in stats.snapshots.items():
                name = getattr(state, "value", str(state))
                if not name.lower().startswith("peak"):
                    continue
                best = max((sum(d["Total"] for d in snap.values()) for snap in snaps), default=0)
                if "forward" in name.lower():
                    fwd = max(fwd, best)
                else:
                    bwd = max(bwd, best)
            prev = out.get(fqn, (0, 0))
            out[fqn] = (max(prev[0], fwd), max(prev[1], bwd))
        return out


def _fix_optimizer(b: Breakdown, persistent: int) -> Breakdown:
    """Optimizer-step temporaries are tagged as state by the trackers; keep only the real state."""
    extra = b.optimizer_state - persistent
    if extra <= 0:
        return b
    return dataclasses.replace(b, optimizer_state=persistent, transient=b.transient + extra)


@dataclass
class _Context:
    prep: PreparedJob
    granularity: int
    spec: object
    autocast_dtype: torch.dtype | None  # bf16 / fp16 compute without FSDP: the trainer's autocast
    loss_parallel: bool
    mode: object
    parallelize: object = None       # ParallelizeOptions, as the trainer derives them
    objective: object = None         # the job's objective: its batch and its loss (sum over target tokens)
    converters: object = None
    positions: torch.Tensor | None = None
    global_tokens: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)

    def autocast(self):
        return torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()

    def loss_ctx(self):
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, logits, labels):
        # As the trainer: the objective's loss summed over target tokens, over the step's global token count.
        return self.objective.loss(logits, labels) / self.global_tokens


def _warm_optimizer(parts: list[nn.Module], cfg, converters=None) -> torch.optim.Optimizer:
    from titanlike.train.optimizer import build_optimizer

    optimizer = build_optimizer(parts, cfg.optimizer)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    if converters is not None:
        # As the trainer does after every step (float8: precomputed all-gather scales, kept on the weights).
        converters.post_optimizer_step(parts)
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def untraceable(prep: PreparedJob) -> str | None:
    """Why this job cannot be traced (one sentence), or None.

    Mixture-of-experts layers size their tensors from the routing itself (bincount of the chosen
    experts, `counts.tolist()` for the all-to-all splits, `int(counts.sum())`): a fake tensor has
    no values, so FakeTensorMode raises on the first of them. Making them traceable would mean
    replacing the layer's routing with a made-up one, which would no longer be the real model.
    Multi-token prediction needs the lookahead tokens the trainer builds; the trace does not feed
    them, so it would count the model without its prediction modules."""
    if prep.model_args.moe_args() is not None:
        return ("the traced estimate cannot run mixture-of-experts models (their token dispatch sizes tensors "
                "from routing values, which fake tensors do not have); use the analytic estimate "
                "(--estimate.mode analytic)")
    if prep.cfg.training.enable_cpu_offload:
        return ("the traced estimate does not model FSDP CPU offload (it runs on one fake device, so it cannot "
                "tell host from device memory); use the analytic estimate (--estimate.mode analytic)")
    if prep.model_args.lookahead_tokens > 0:
        return ("the traced estimate does not run multi-token prediction (it feeds the model no lookahead "
                "tokens, so the prediction modules would be skipped); use the analytic estimate "
                "(--estimate.mode analytic)")
    return None


def estimate_traced(prep: PreparedJob, *, granularity: int = 512, per_module: bool = False,
                    module_depth: int = 2, log=None) -> tuple[list[RankEstimate], list[str]]:
    """Trace the job; returns one estimate per pipeline rank and notes on what was approximated.
    Raises ConfigError (one sentence) for a job the trace cannot run (see `untraceable`)."""
    from titanlike.config.loader import ConfigError

    refusal = untraceable(prep)
    if refusal is not None:
        raise ConfigError(refusal)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanlike.models.converters import build_model_converters
    from titanlike.models.registry import get_model_spec
    from titanlike.parallel.context import load_balanced_positions
    from titanlike.parallel.parallel_dims import ParallelDims

    log = log or (lambda msg: None)
    # DTensor warns on every gradient-norm redistribution over a 2-D mesh; the trace is not the place.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg, args = prep.cfg, prep.model_args
    d = prep.dims
    dims = ParallelDims(d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.ep, d.world_size)
    spec = get_model_spec(cfg.model.name)
    start = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    float8 = "float8" in cfg.model.converters
    with fake_world(dims.world_size), _allocation_granularity(granularity) as rounded, \
            _separate_propagation_mode() as separated, _float8_flatten_without_data(float8):
        dims.build_mesh(DEVICE.type)
        with torch.device("meta"):
            model = spec.model_cls(args)
        # As the trainer (model_parts.build_model_parts): converters (float8) swap modules of the whole
        # meta model, before any pipeline split.
        converters = build_model_converters(cfg.model.converters, cfg.float8, lambda name: getattr(cfg, name))
        converters.convert(model)
        # One mode for the whole estimate: fake tensors of different modes cannot meet in one op.
        # Non-fake inputs are allowed because DeviceMesh keeps real rank tensors.
        ctx = _Context(prep, granularity, spec,
                       autocast_dtype=prep.plan.precision.autocast_dtype,
                       loss_parallel=dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
                       mode=FakeTensorMode(allow_non_fake_inputs=True), parallelize=prep.plan.parallelize,
                       objective=prep.objective,
                       converters=converters)
        with ctx.mode:
            if dims.cp_enabled:
                ctx.positions = load_balanced_positions(cfg.training.seq_len, dims.cp, 0, DEVICE)
            ctx.global_tokens = torch.tensor(float(cfg.training.local_batch_size * cfg.training.seq_len), device=DEVICE)
        if not separated:
            ctx.notes.append("this torch's DTensor could not be given its own fake mode: global-shape "
                             "propagation tensors may be counted, so the estimate may err high")
        if not rounded and granularity > 1:
            ctx.notes.append("this torch's MemTracker could not be told to round allocations; exact bytes counted")
        try:
            if dims.pp_enabled:
                estimates = _trace_pipeline(ctx, model, dims, per_module, module_depth, log)
            else:
                estimates = [_trace_step(ctx, model, dims, per_module, module_depth, log)]
        finally:
            if gc_was_enabled:
                gc.enable()
    log(f"traced in {time.perf_counter() - start:.1f} s")
    return estimates, ctx.notes


def _fake_microbatch(ctx: _Context, batch: int):
    """One microbatch as the trainer hands it to the step: the objective's sample fields (token
    windows, BERT's, T5's), prepared by the objective (masks, the context-parallel cut, multi-token
    prediction's lookahead)."""
    from titanlike.objectives.base import BatchContext

    t = ctx.prep.cfg.training
    fields = {name: torch.zeros((batch, *shape), dtype=getattr(torch, dtype), device=DEVICE)
              for name, (shape, dtype) in ctx.objective.sample_fields(t.seq_len).items()}
    # Token values do not matter to fake tensors: 0 stands in for the tokenizer's end of document.
    batch_ctx = BatchContext(DEVICE, cp_positions=ctx.positions,
                             mask_kernel=None if ctx.positions is not None else "sdpa", eos_id=0,
                             lookahead_tokens=ctx.prep.model_args.lookahead_tokens)
    return ctx.objective.prepare(fields, batch_ctx)


def _trace_step(ctx: _Context, model: nn.Module, dims, per_module: bool, depth: int, log) -> RankEstimate:
    """One full training step of the whole model (no pipeline parallelism), run by the trainer's own
    TrainStep: its forward/backward per microbatch, then its update (scaling, clipping, optimizer)."""
    from titanlike.parallel.parallelize import parallelize_model
    from titanlike.train.step import StepLoss, TrainStep

    cfg = ctx.prep.cfg
    t = cfg.training
    model = parallelize_model(model, ctx.spec.shard, dims, ctx.parallelize)
    traced_microbatches = min(ctx.prep.plan.batch.grad_accum_steps, 2)
    with ctx.mode:
        model.to_empty(device=DEVICE)
        model.train()
        optimizer = _warm_optimizer([model], cfg, ctx.converters)
        persistent_opt = _optimizer_state_bytes(optimizer, ctx.granularity)
        microbatch = _fake_microbatch(ctx, t.local_batch_size)
        tokens, labels, kwargs = microbatch.inputs, microbatch.labels, microbatch.forward_kwargs()
        step = TrainStep(model_parts=[model], step_loss=StepLoss(ctx.objective.loss, None), optimizer=optimizer,
                         device=DEVICE, max_norm=t.max_norm, tp_mesh=dims.mesh("tp"), autocast=ctx.autocast(),
                         loss_parallel=ctx.loss_parallel, converters=ctx.converters,
                         reported_losses=ctx.prep.model_args.reported_losses())
        modules: dict[str, tuple[int, int]] = {}
        peak_phase, best = "", Breakdown()
        phases: dict[str, Breakdown] = {}
        # Fake tensors are freed by reference counting (the trackers see it through storage weakrefs);
        # the cyclic collector only costs time on the millions of objects a trace creates.
        gc.collect()
        gc.disable()
        fields = tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v is not ctx.positions)
        with _Tracker(model, optimizer, (tokens, labels, *fields)) as tr:
            for mb in range(traced_microbatches):
                if mb:
                    modules = tr.per_module(depth) if per_module else modules
                    tr.tracker.reset_mod_stats()
                tr.reset_peak()
                step.forward_backward(microbatch)
                phase_peak = tr.peak()
                phases[f"forward/backward of microbatch {mb}"] = phase_peak
                if phase_peak.total > best.total:
                    best, peak_phase = phase_peak, f"forward/backward of microbatch {mb}"
                log(f"  microbatch {mb}: peak {phase_peak.total / 2**30:.3f} GiB")
            tr.reset_peak()
            step.update(torch.zeros((), device=DEVICE), ctx.global_tokens, torch.zeros(0, device=DEVICE))
            phase_peak = tr.peak()
            phases["optimizer step"] = phase_peak
            if phase_peak.total > best.total:
                best, peak_phase = phase_peak, "optimizer step"
            if per_module:
                for k, v in tr.per_module(depth).items():
                    prev = modules.get(k, (0, 0))
                    modules[k] = (max(prev[0], v[0]), max(prev[1], v[1]))
        gc.enable()
    log(f"  tracker: {tr.kind}")
    best = _fix_optimizer(best, persistent_opt)
    phases = {k: _fix_optimizer(v, persistent_opt) for k, v in phases.items()}
    return RankEstimate(rank=0, pp_rank=0, stages=[0], peak=best, peak_phase=peak_phase, per_module=modules,
                        phases=phases)


@dataclass
class _StageStats:
    """Per-stage memory from the phases of a pipeline stage (all Breakdowns)."""

    base: Breakdown
    f_excess: list[Breakdown]      # peak above the level before [first, later] forwards
    f_delta: list[Breakdown]       # level change of [first, later] forwards
    b_excess: list[Breakdown]
    b_delta: list[Breakdown]
    r_excess: Breakdown
    r_delta: Breakdown
    opt_excess: Breakdown
    modules: dict[str, tuple[int, int]]


def _stage_signature(layout, stage: int) -> tuple[int, bool, bool]:
    return layout.layers[stage], stage == 0, stage == layout.num_stages - 1


def _trace_pipeline(ctx: _Context, model: nn.Module, dims, per_module: bool, depth: int, log) -> list[RankEstimate]:
    from estimation.analytic import weight_grad_share
    from titanlike.parallel.pipeline import pipeline_stage, schedule_name

    cfg = ctx.prep.cfg
    p = cfg.parallelism
    layout = ctx.prep.plan.pipeline
    n_microbatches = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
    order = _pipeline_order(layout, dims, n_microbatches, p.pipeline_parallel_schedule)
    names = list(model.layers.keys())
    stats: dict[tuple[int, bool, bool], _StageStats] = {}
    for stage in range(layout.num_stages):
        sig = _stage_signature(layout, stage)
        if sig in stats:
            continue
        keep = [names[i] for i in layout.layer_indices(stage)]
        part = pipeline_stage(model, ctx.spec.pipeline_ends, keep, first=sig[1], last=sig[2])
        began = time.perf_counter()
        stats[sig] = _trace_stage(ctx, part, stage, layout, dims, per_module, depth)
        log(f"  stage {stage} ({sig[0]} layers{', embedding' if sig[1] else ''}{', output' if sig[2] else ''}) "
            f"traced in {time.perf_counter() - began:.1f} s")
    w_share = 0.0
    name = schedule_name(p.pipeline_parallel_schedule)
    if name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        known = weight_grad_share(ctx.prep)
        w_share = 0.5 if known is None else known
        why = "matmul inputs" if known is not None else "a guess: the analytic model does not know these blocks"
        ctx.notes.append(f"{name}: split backward replayed as full backward; {w_share:.0%} of a microbatch's "
                         f"activations ({why}) are assumed to stay until its weight-gradient step")
    estimates = []
    for pp_rank in range(dims.pp):
        held = layout.stages_of_rank(pp_rank)
        est = _replay(order.get(pp_rank, []), {s: stats[_stage_signature(layout, s)] for s in held}, w_share)
        est.rank = pp_rank * (dims.world_size // dims.pp)
        est.pp_rank = pp_rank
        est.stages = held
        if per_module:
            for s in held:
                for k, v in stats[_stage_signature(layout, s)].modules.items():
                    est.per_module[f"stage{s}:{k}"] = v
        estimates.append(est)
    return estimates


def _pipeline_order(layout, dims, n_microbatches: int, schedule: str) -> dict[int, list]:
    """torch's own action list for every pipeline rank (built with placeholder stages)."""
    from titanlike.parallel.pipeline import build_schedule

    parts = [nn.Linear(1, 1, bias=False, device="meta") for _ in layout.stages_of_rank(0)]
    runner = build_schedule(parts, layout, dims.mesh("pp"), DEVICE, schedule=schedule,
                            n_microbatches=n_microbatches, loss_fn=lambda out, target: out.sum())
    order = getattr(runner.schedule, "pipeline_order", None) or {}
    return {r: [a for a in actions if a is not None] for r, actions in order.items()}


def _trace_stage(ctx: _Context, part: nn.Module, stage_index: int, layout, dims, per_module: bool,
                 depth: int) -> _StageStats:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    from titanlike.parallel.parallelize import parallelize_model

    cfg, args = ctx.prep.cfg, ctx.prep.model_args
    t, p = cfg.training, cfg.parallelism
    part = parallelize_model(part, ctx.spec.shard, dims, ctx.parallelize)
    first, last = stage_index == 0, stage_index == layout.num_stages - 1
    mbs = p.pipeline_parallel_microbatch_size
    seq_local = t.seq_len // dims.cp
    fsdp = isinstance(part, FSDPModule)
    with ctx.mode:
        part.to_empty(device=DEVICE)
        part.train()
        optimizer = _warm_optimizer([part], cfg, ctx.converters)
        persistent_opt = _optimizer_state_bytes(optimizer, ctx.granularity)
        # Sequence parallelism hands the next stage its sequence shard; the dtype is that of the blocks.
        hidden_seq = seq_local // dims.tp if dims.tp_enabled else seq_local
        hidden_dtype = _HALF.get(t.mixed_precision_param, torch.float32) if fsdp else torch.float32
        stage = PipelineStage(part, stage_index, layout.num_stages, DEVICE, group=dims.mesh("pp").get_group())
        gc.collect()
        gc.disable()
        in_flight: list[tuple] = []
        levels: list[Breakdown] = []
        excess: list[Breakdown] = []
        with _Tracker(part, optimizer) as tr:
            def phase(fn):
                before = tr.current()
                tr.reset_peak()
                fn()
                excess.append(tr.peak() - before)
                tr.retag_accumulated_grads(part)
                levels.append(tr.current() - before)

            def forward(mb: int):
                if mb:
                    tr.tracker.reset_mod_stats()
                fake = _fake_microbatch(ctx, mbs)
                tokens, labels, kwargs = fake.inputs, fake.labels, fake.forward_kwargs()
                if first:
                    x = tokens
                else:
                    x = torch.empty(mbs, hidden_seq, args.hidden_size, dtype=hidden_dtype, device=DEVICE,
                                    requires_grad=True)
                with ctx.autocast():
                    out = part(x, **kwargs)
                if last:
                    with ctx.loss_ctx():
                        out_or_loss = (out, ctx.loss(out, labels))
                else:
                    out_or_loss = (out, None)
                in_flight.append((x, *out_or_loss))

            def backward():
                x, out, loss = in_flight.pop(0)
                if fsdp:
                    part.set_is_last_backward(False)
                    part.set_reshard_after_backward(False)
                    part.set_requires_gradient_sync(False)
                if loss is not None:
                    with ctx.loss_ctx():
                        loss.backward()
                else:
                    grad = torch.empty_like(out)
                    torch.autograd.backward(out, grad_tensors=grad)
                    del grad
                del x, out, loss

            def reduce():
                if fsdp:
                    stage.perform_reduce_grad(1)

            def step():
                optimizer.step()
                ctx.converters.post_optimizer_step([part])
                optimizer.zero_grad(set_to_none=True)

            base = tr.current()
            phase(lambda: forward(0))
            phase(lambda: forward(1))
            phase(backward)
            phase(backward)
            modules = tr.per_module(depth) if per_module else {}
            phase(reduce)
            phase(step)
        gc.enable()
    f_ex, f2_ex, b_ex, b2_ex, r_ex, o_ex = excess
    f_d, f2_d, b_d, b2_d, r_d, _ = levels
    # Accumulators created during a backward are retagged as gradients only after it; at its peak
    # they already exist, so file as gradients the part of the temporaries that outlives the phase.
    b_ex, b2_ex = (dataclasses.replace(ex, gradients=ex.gradients + moved, transient=ex.transient - moved)
                   for ex, d in ((b_ex, b_d), (b2_ex, b2_d))
                   for moved in [max(0, min(ex.transient, d.gradients - ex.gradients))])
    # The state existed before the step, so whatever the step adds under "state" is temporary; the
    # trackers file what is created outside forward and backward (reduce-scatter buffers) as activations.
    o_ex = dataclasses.replace(o_ex, optimizer_state=0, activations=0,
                               transient=o_ex.transient + o_ex.optimizer_state + o_ex.activations)
    r_ex = dataclasses.replace(r_ex, activations=0, transient=r_ex.transient + r_ex.activations)
    del persistent_opt
    return _StageStats(base=base, f_excess=[f_ex, f2_ex], f_delta=[f_d, f2_d], b_excess=[b_ex, b2_ex],
                       b_delta=[b_d, b2_d], r_excess=r_ex, r_delta=r_d, opt_excess=o_ex, modules=modules)


def _replay(actions: list, stats: dict[int, _StageStats], w_share: float) -> RankEstimate:
    """Walk one pipeline rank's actions, adding each stage's measured deltas; keep the peak."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    level = Breakdown()
    for s in stats.values():
        level = level + s.base
    peak, peak_phase = level, "start"
    forwards = {s: 0 for s in stats}
    backwards = {s: 0 for s in stats}
    waiting_w: dict[int, list[Breakdown]] = {s: [] for s in stats}
    reduced: set[int] = set()

    def flat(action_list):
        for a in action_list:
            if a.sub_actions:
                yield from a.sub_actions
            else:
                yield a

    def bump(candidate: Breakdown, what: str):
        nonlocal peak, peak_phase
        if candidate.total > peak.total:
            peak, peak_phase = candidate, what

    for a in flat(actions):
        s, kind = a.stage_index, a.computation_type
        if s not in stats:
            continue
        st = stats[s]
        if kind == C.FORWARD:
            k = min(forwards[s], 1)
            bump(level + st.f_excess[k], f"forward of stage {s}, microbatch {a.microbatch_index}")
            level = level + st.f_delta[k]
            forwards[s] += 1
        elif kind in (C.FULL_BACKWARD, C.BACKWARD_INPUT):
            k = min(backwards[s], 1)
            bump(level + st.b_excess[k], f"backward of stage {s}, microbatch {a.microbatch_index}")
            delta = st.b_delta[k]
            if kind == C.BACKWARD_INPUT:
                freed = max(0, -delta.activations)
                kept = Breakdown(activations=int(freed * w_share))
                waiting_w[s].append(kept)
                delta = delta + kept
            level = level + delta
            backwards[s] += 1
        elif kind == C.BACKWARD_WEIGHT:
            if waiting_w[s]:
                level = level - waiting_w[s].pop(0)
        elif kind == C.REDUCE_GRAD and s not in reduced:
            bump(level + st.r_excess, f"gradient reduction of stage {s}")
            level = level + st.r_delta
            reduced.add(s)
    # Stages whose schedule shows no reduction action still reduce before the optimizer step.
    for s, st in stats.items():
        if s not in reduced:
            bump(level + st.r_excess, f"gradient reduction of stage {s}")
            level = level + st.r_delta
    opt = Breakdown()
    for s, st in stats.items():
        opt = opt + st.opt_excess
    bump(level + opt, "optimizer step")
    return RankEstimate(rank=0, pp_rank=0, stages=list(stats), peak=peak, peak_phase=peak_phase,
                        phases={"optimizer step": level + opt})
