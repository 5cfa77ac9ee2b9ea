"""Layout planner: enumerate layouts for a world size, keep those that fit, rank by a throughput model.

Enumeration. For N GPUs: tensor parallel t in {1, 2, 4, 8} (inside a node), pipeline p
in {1, 2, 4, ...} (1F1B and Interleaved1F1B), context parallel c in {1, 2, 4, 8},
data parallel dp = N / (t p c) split into HSDP replicas r and FSDP shards dp / r,
for mixture-of-experts models expert parallel e dividing both dp_shard x cp x tp and the
number of experts (dense models: 1), activation checkpointing from `plan_ac_modes`; for a model
whose last stage also carries layers after the trunk (multi-token prediction, args.total_layers)
both the trainer's default pipeline split and ceil(num_layers / stages) layers per stage, which
lightens the end stages (`stage_splits`). The global batch (in sequences) is the config's: global_batch_size,
or local_batch_size x the config's own data-parallel degree. Each layout gets the
largest microbatch that fits. Every candidate goes through the same validation as
train.py; rejected ones are counted by reason.

Fit. The analytic estimate (fast), with the verdict's fragmentation and reserved
memory; `plan_verify` re-checks the best layouts with the traced estimate.

Throughput model, per optimizer step, per GPU (stated, not measured):
  compute   = tokens x FLOPs/token / GPUs / (peak x MFU), FLOPs/token from the family's args
              (args.flops_per_token: 6 N + the attention term, e.g. 12 L H Q T; N counts the
              active parameters, of routed experts top_k, so MFU is that of the work done;
              multi-token prediction's depths count there too, each a block and one more
              pass through the output head),
              times 4/3 for full activation checkpointing (the forward runs twice),
              1 + 1/(3k) for every k-th block, and 1 for op-level (elementwise recompute only)
  TP        = per layer and microbatch, sequence parallelism moves 4 all-gathers or
              reduce-scatters of (t-1)/t of a b x s x h activation (h = args.hidden_size) in
              forward and 4 in backward (4 more when the forward is recomputed); not overlapped
              (no async TP)
  CP        = all-gather of K/V per layer in forward, reduce-scatter of their gradients in
              backward (widths from args.attention_shape()); not overlapped
  EP        = per MoE layer and microbatch, an all-to-all of the routed rows (tokens / tp x top_k
              x h) to dispatch and one to combine, in forward and backward (and the recompute);
              (e-1)/e of them leave the rank; not overlapped; an MoE layer's MLP has no TP collectives
  FSDP      = all-gather of bf16 parameters in forward and again in backward (when resharded),
              reduce-scatter of fp32 gradients, per microbatch (per step under PP, which
              accumulates unsharded); HSDP adds an all-reduce of the shards across replicas.
              Overlapped with compute: only what exceeds the compute time is exposed, plus
              one block's all-gather that nothing can hide; an MoE layer's routed experts (this
              rank's ep share) over efsdp, its router and shared experts over dp_shard x cp x tp
  bubble    = (p - 1) / (v m) of the pipeline's compute and TP/CP time (v stages per rank,
              m microbatches); point-to-point activations are small and overlapped (ignored)
Only bandwidth is modeled, not collective latency, so the ranking means little for
tiny models whose steps take microseconds.
Bandwidths: a group whose ranks all sit in one node (the mesh puts tp innermost, then cp,
dp_shard, dp_replicate, pp) uses NVLink, any other InfiniBand. Ring collectives move
(n-1)/n of the data per GPU. The figures (MFU, peak, bandwidths) are options.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from estimation.memory import GiB
from estimation.options import EstimateOptions, PreparedJob, prepare_job
from estimation.report import verdict
from titanlike.config.loader import ConfigError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    schedule: str | None
    ac: str
    local_batch_size: int
    microbatch: int
    peak_bytes: int = 0
    headroom_bytes: int = 0
    fits: bool = False
    step_seconds: float = 0.0
    tokens_per_second_per_gpu: float = 0.0
    mfu: float = 0.0
    time_parts: dict[str, float] = field(default_factory=dict)
    traced_peak_bytes: int | None = None
    why: str = ""
    ep: int = 1
    experts: bool = False  # the model has routed experts (the overrides then always set ep)
    layers_per_stage: int | None = None  # None: the trainer's default split

    def label(self) -> str:
        parts = [f"dp_shard {self.dp_shard}"]
        if self.dp_replicate > 1:
            parts.insert(0, f"dp_replicate {self.dp_replicate}")
        for name in ("cp", "tp", "pp", "ep"):
            if getattr(self, name) > 1:
                parts.append(f"{name} {getattr(self, name)}")
        if self.pp > 1:
            parts.append(self.schedule)
        if self.layers_per_stage:
            parts.append(f"{self.layers_per_stage} layers per stage")
        parts.append(f"AC {self.ac}")
        parts.append(f"microbatch {self.microbatch}")
        return ", ".join(parts)

    def overrides(self) -> list[str]:
        """The train.py options that select this layout."""
        ac_mode, option = {"none": ("none", "2"), "full": ("full", "2"), "op": ("selective", "op"),
                           "selective": ("selective", "2")}[self.ac]
        out = [f"--parallelism.data_parallel_replicate_degree {self.dp_replicate}",
               f"--parallelism.data_parallel_shard_degree {self.dp_shard}",
               f"--parallelism.tensor_parallel_degree {self.tp}",
               f"--parallelism.context_parallel_degree {self.cp}",
               f"--parallelism.pipeline_parallel_degree {self.pp}",
               f"--activation_checkpoint.mode {ac_mode}"]
        if self.experts or self.ep > 1:
            out.insert(5, f"--parallelism.expert_parallel_degree {self.ep}")
        if ac_mode == "selective":
            out.append(f"--activation_checkpoint.selective_ac_option {option}")
        out.append(f"--training.local_batch_size {self.local_batch_size}")
        if self.pp > 1:
            out += [f"--parallelism.pipeline_parallel_schedule {self.schedule}",
                    f"--parallelism.pipeline_parallel_microbatch_size {self.microbatch}"]
            if self.layers_per_stage:
                out.append(f"--parallelism.pipeline_parallel_layers_per_stage {self.layers_per_stage}")
        return out

    def as_dict(self) -> dict:
        return {"layout": self.label(), "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp, "pp": self.pp, "ep": self.ep, "pp_schedule": self.schedule,
                "layers_per_stage": self.layers_per_stage, "activation_checkpoint": self.ac,
                "local_batch_size": self.local_batch_size, "microbatch": self.microbatch,
                "peak_bytes": self.peak_bytes, "traced_peak_bytes": self.traced_peak_bytes,
                "headroom_bytes": self.headroom_bytes, "step_seconds": self.step_seconds,
                "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu, "mfu": self.mfu,
                "time_seconds": self.time_parts, "why": self.why, "overrides": " ".join(self.overrides())}


def _apply(cfg, c: Candidate, global_batch: int):
    out = copy.deepcopy(cfg)
    p = out.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = c.dp_replicate, c.dp_shard
    p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree = c.tp, c.cp, c.pp
    p.expert_parallel_degree, p.expert_tensor_parallel_degree = c.ep, 1
    p.pipeline_parallel_layers_per_stage = c.layers_per_stage
    if c.pp > 1:
        p.pipeline_parallel_schedule = c.schedule
        p.pipeline_parallel_microbatch_size = c.microbatch
    ac = out.activation_checkpoint
    ac.mode, ac.selective_ac_option = {"none": ("none", "2"), "full": ("full", "2"), "op": ("selective", "op"),
                                       "selective": ("selective", "2")}[c.ac]
    out.training.local_batch_size = c.local_batch_size
    out.training.global_batch_size = global_batch
    return out


Layout = tuple[int, int, int, int, int, str | None]  # dp_replicate, dp_shard, cp, tp, pp, schedule


def enumerate_layouts(world: int, num_layers: int, opts: EstimateOptions) -> list[Layout]:
    """(dp_replicate, dp_shard, cp, tp, pp, schedule) for every way to split `world` ranks."""
    out = []
    for tp in (1, 2, 4, 8):
        if world % tp or tp > opts.gpus_per_node:
            continue
        for pp in (d for d in _divisors(world // tp) if d == 1 or (d & (d - 1) == 0 and d <= num_layers // 2)):
            for cp in (1, 2, 4, 8):
                rest = world // tp
                if rest % (pp * cp):
                    continue
                dp = rest // (pp * cp)
                for rep in _divisors(dp):
                    for schedule in ((None,) if pp == 1 else ("1F1B", "Interleaved1F1B")):
                        out.append((rep, dp // rep, cp, tp, pp, schedule))
    return out


def stage_splits(args, pp: int, schedule: str | None) -> list[int | None]:
    """Pipeline splits to try: the trainer's default (None), and for a model with layers after its
    trunk (args.total_layers > num_layers: multi-token prediction, which rides on the last stage with
    the output head) also `ceil(num_layers / stages)` layers per stage, which takes the shortfall
    off the end stages (the last first) when that is a valid layout."""
    if pp == 1 or args.total_layers == args.num_layers:
        return [None]
    from titanlike.parallel.pipeline import is_single_stage, plan_layout, schedule_name

    stages = pp * (1 if is_single_stage(schedule_name(schedule)) else 2)
    per_stage = -(-args.num_layers // stages)
    try:
        split = plan_layout(args.num_layers, pp, schedule, per_stage)
    except ValueError:
        return [None]
    return [None] if split.layers == plan_layout(args.num_layers, pp, schedule, None).layers else [None, per_stage]


def expert_degrees(span: int, num_experts: int) -> list[int]:
    """Expert-parallel degrees to try: those dividing both the ranks experts are spread over
    (dp_shard x cp x tp) and the number of experts."""
    return [d for d in _divisors(span) if num_experts % d == 0]


def throughput(prep: PreparedJob, c: Candidate, global_batch: int, opts: EstimateOptions) -> None:
    """Fill c's step time, tokens/s per GPU and MFU from the model in the module docstring."""
    from estimation.analytic import Sharding, _stage_param_bytes, model_shape, stage_layout

    args, cfg, dims = prep.model_args, prep.cfg, prep.dims
    world = dims.world_size
    seq = cfg.training.seq_len
    e = 4 if cfg.training.mixed_precision_param == "float32" else 2
    # Training FLOPs per token from the args contract: of a mixture of experts, the active parameters.
    flops_per_token = args.flops_per_token(seq)
    # Op-level recompute redoes only elementwise ops: few FLOPs, but memory-bound time (assumed 5%).
    recompute = {"none": 1.0, "op": 1.05, "full": 4 / 3, "selective": 1 + 1 / 6}[c.ac]
    peak = opts.device_tflops * 1e12
    tokens = global_batch * seq
    compute = tokens * flops_per_token * recompute / world / (peak * opts.plan_mfu)

    def bw(span: int) -> float:
        return (opts.nvlink_gbps if span <= opts.gpus_per_node else opts.ib_gbps) * 1e9

    per_rank, shapes = stage_layout(prep)
    ms = model_shape(prep)
    blocks = ms.require_known()
    # The busiest pipeline rank: its layers, and how many of them are MoE layers.
    layers_per_rank = args.num_layers / c.pp
    moe_layers = max(sum(blocks[i].moe is not None for s in stages for i in shapes[s].layers) for stages in per_rank)
    microbatches = c.local_batch_size // c.microbatch
    seq_local = seq // c.cp
    act = c.microbatch * seq_local * args.hidden_size * e
    passes = 3 if c.ac in ("full", "selective") else 2
    tp_time = 0.0
    if c.tp > 1:
        # 4 collectives per layer and pass; an MoE layer's MLP works on the sequence slice (2).
        collectives = 4 * (layers_per_rank - moe_layers) + 2 * moe_layers
        tp_time = microbatches * collectives * passes * (c.tp - 1) / c.tp * act / bw(c.tp)
    cp_time = 0.0
    heads = args.attention_shape()
    if c.cp > 1 and heads is not None:
        kv = c.microbatch * seq_local * heads.kv_heads * heads.head_dim * e * 2 / c.tp
        cp_time = layers_per_rank * microbatches * passes * (c.cp - 1) * kv / bw(c.tp * c.cp)
    ep_time = 0.0
    moe = args.moe_args()
    if c.ep > 1 and moe is not None:
        # Dispatch and combine all-to-alls of the routed rows (top_k per token) per MoE layer and
        # pass, (ep - 1) / ep of them leaving the rank; not overlapped.
        routed = c.microbatch * seq_local // c.tp * moe.top_k * args.hidden_size * e
        ep_time = moe_layers * microbatches * 2 * passes * (c.ep - 1) / c.ep * routed / bw(c.ep)

    # FSDP traffic per placement: dense parameters over dp_shard x cp, an MoE layer's router and
    # shared experts over dp_shard x cp x tp, its routed experts (this rank's ep share) over efsdp.
    sh = Sharding.of(dims)
    per_stage = {s: _stage_param_bytes(ms, shapes[s], Sharding.of(dims, fsdp=False), 1)
                 for stages in per_rank for s in stages}
    sizes = [per_stage[s] for s in max(per_rank, key=lambda stages: sum(per_stage[s].model_local for s in stages))]
    expert_local = sum(x.expert_local for x in sizes)
    token_local = sum(x.token_local for x in sizes)
    dense_local = sum(x.model_local for x in sizes) - expert_local - token_local
    span = c.tp * c.cp * c.dp_shard
    per_pass = 1 if c.pp > 1 else microbatches
    gathers = 1 if c.pp > 1 else (2 if cfg.parallelism.fsdp_reshard_after_forward != "never" else 1)
    fsdp_time = 0.0
    for local, shard, on in ((dense_local, c.dp_shard * c.cp, dims.fsdp_enabled),
                             (token_local, sh.token, sh.token > 1 or c.dp_replicate > 1),
                             (expert_local, sh.expert, sh.expert > 1 or c.dp_replicate > 1)):
        if not local or not on:
            continue
        ring = (shard - 1) / shard if shard > 1 else 0
        fsdp_time += per_pass * ring * local * (gathers * e + 4) / bw(span)
        if c.dp_replicate > 1:
            fsdp_time += 2 * (c.dp_replicate - 1) / c.dp_replicate * local * 4 / shard / opts.ib_gbps / 1e9
    per_block = fsdp_time / max(layers_per_rank, 1)
    exposed_fsdp = max(0.0, fsdp_time - compute) + per_block
    bubble = 0.0
    if c.pp > 1:
        v = 2 if c.schedule == "Interleaved1F1B" else 1
        bubble = (c.pp - 1) / (v * microbatches) * (compute + tp_time + cp_time + ep_time)
    step = compute + tp_time + cp_time + ep_time + exposed_fsdp + bubble
    c.step_seconds = step
    c.tokens_per_second_per_gpu = tokens / step / world
    c.mfu = c.tokens_per_second_per_gpu * flops_per_token / peak
    c.time_parts = {"compute": compute, "tp": tp_time, "cp": cp_time, "ep": ep_time, "fsdp_exposed": exposed_fsdp,
                    "pp_bubble": bubble}


def _why(c: Candidate) -> str:
    parts = c.time_parts
    step = c.step_seconds
    main = [f"compute {parts['compute']:.3g}s"]
    for key, label in (("tp", "TP comm"), ("cp", "CP comm"), ("ep", "EP all-to-all"), ("fsdp_exposed", "exposed FSDP"),
                       ("pp_bubble", "pipeline bubble")):
        if parts[key] > 0.005 * step:
            main.append(f"{label} {parts[key]:.3g}s")
    return (f"{_size(c.headroom_bytes)} headroom; step {step:.3g}s = " + " + ".join(main)
            + f"; {c.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, MFU {c.mfu:.0%}")


def run_plan(cfg, opts: EstimateOptions, log=None) -> dict:
    from estimation.analytic import UnknownBlockError, estimate_analytic, model_shape

    log = log or (lambda msg: None)
    began = time.perf_counter()
    if opts.device_memory_gib is None:
        raise ConfigError("the planner needs --estimate.device_memory_gib (GPU memory in GiB)")
    base = prepare_job(cfg, opts.world_size)  # the config as written must be valid for this world size
    try:
        model_shape(base).require_known()  # the planner ranks layouts by the analytic estimate
    except UnknownBlockError as err:
        raise ConfigError(f"the planner needs the analytic estimate, but {err}") from None
    world = base.dims.world_size
    t = base.cfg.training
    global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * base.dims.dp_degree
    counts = {"layouts": 0, "rejected": 0, "do_not_fit": 0, "fit": 0}
    rejected: dict[str, int] = {}
    fitting: list[tuple[Candidate, PreparedJob]] = []
    moe = base.model_args.moe_args()
    for rep, shard, cp, tp, pp, schedule in enumerate_layouts(world, base.model_args.num_layers, opts):
        dp = rep * shard
        eps = expert_degrees(shard * cp * tp, moe.num_experts) if moe is not None else [1]
        if global_batch % dp:
            reason = f"global batch {global_batch} is not divisible by the data-parallel degree"
            rejected[reason] = rejected.get(reason, 0) + len(opts.plan_ac_modes) * len(eps)
            counts["layouts"] += len(opts.plan_ac_modes) * len(eps)
            continue
        local = global_batch // dp
        splits = stage_splits(base.model_args, pp, schedule)
        for ep, ac, split in ((ep, ac, split) for ep in eps for ac in opts.plan_ac_modes for split in splits):
            counts["layouts"] += 1
            reasons: list[str] = []
            validated = False

            def probe(micro: int):
                """(candidate, prepared job) with its peak and verdict; None when validation refuses it."""
                nonlocal validated
                c = Candidate(rep, shard, cp, tp, pp, schedule, ac,
                              local_batch_size=local if pp > 1 else micro, microbatch=micro, ep=ep,
                              experts=moe is not None, layers_per_stage=split)
                try:
                    # From the user's config, not base.cfg: prepare_job's own edits (a missing tokenizer
                    # dropped for the flavor's vocabulary) must not be prepared twice.
                    prep = prepare_job(_apply(cfg, c, global_batch), world)
                except ConfigError as err:
                    reasons.append(str(err).split(",")[0])
                    return None
                validated = True
                estimates, _ = estimate_analytic(prep, opts.alloc_granularity)
                c.peak_bytes = max(e.peak_bytes for e in estimates)
                v = verdict(c.peak_bytes, opts)
                c.fits, c.headroom_bytes = v["fits"], v["headroom_bytes"]
                return c, prep

            # Memory does not shrink as the microbatch grows (under PP, microbatch x chunks in flight
            # does not either): the microbatches that fit are the smallest ones. Without PP the largest
            # of them is the fastest (fewer FSDP gathers per step): found by bisection. Under PP more
            # microbatches shrink the bubble, so every one that fits is ranked, smallest first.
            micros = _divisors(local)
            found = None
            if pp == 1:
                lo, hi = 0, len(micros)  # micros[:lo] known to fit, micros[hi:] known not to
                for i in dict.fromkeys((len(micros) - 1, 0)):  # the largest, then the smallest
                    got = probe(micros[i])
                    if got is not None and got[0].fits:
                        found, lo = got, i + 1
                        break
                    hi = i
                while lo < hi:
                    mid = (lo + hi) // 2
                    got = probe(micros[mid])
                    if got is not None and got[0].fits:
                        found, lo = got, mid + 1
                    else:
                        hi = mid
                if found is not None:
                    throughput(found[1], found[0], global_batch, opts)
            else:
                for micro in micros:
                    got = probe(micro)
                    if got is None:
                        continue
                    if not got[0].fits:
                        break
                    throughput(got[1], got[0], global_batch, opts)
                    if found is None or got[0].tokens_per_second_per_gpu > found[0].tokens_per_second_per_gpu:
                        found = got
            if not validated:
                rejected[reasons[0]] = rejected.get(reasons[0], 0) + 1
            elif found is None:
                counts["do_not_fit"] += 1
            else:
                counts["fit"] += 1
                fitting.append(found)
    counts["rejected"] = sum(rejected.values())
    # Fastest first; between equals, the one with more headroom.
    fitting.sort(key=lambda cp_: (-round(cp_[0].tokens_per_second_per_gpu, 6), cp_[0].peak_bytes))
    verified: list[Candidate] = []
    notes: list[str] = []
    from estimation.traced import untraceable

    refusal = untraceable(base)
    if opts.plan_verify and refusal is not None:
        notes.append(f"plan_verify skipped: {refusal}")
    elif opts.plan_verify:
        from estimation.traced import estimate_traced

        for c, prep in fitting[:opts.plan_verify]:
            log(f"tracing {c.label()}")
            traced, _ = estimate_traced(prep, granularity=opts.alloc_granularity)
            c.traced_peak_bytes = max(e.peak_bytes for e in traced)
            v = verdict(c.traced_peak_bytes, opts)
            c.fits, c.headroom_bytes = v["fits"], v["headroom_bytes"]
            verified.append(c)
    top = [c for c, _ in fitting if c.fits][:opts.plan_top]
    for c in top:
        c.why = _why(c)
    return {
        "model": base.plan.model_name,
        "world_size": world,
        "device_memory_gib": opts.device_memory_gib,
        "seq_len": t.seq_len,
        "global_batch_size": global_batch,
        "parameters": base.model_args.num_params(),
        "active_parameters": base.model_args.num_params(active=True),
        "flops_per_token": base.model_args.flops_per_token(t.seq_len),
        "assumptions": {"mfu": opts.plan_mfu, "device_tflops": opts.device_tflops,
                        "gpus_per_node": opts.gpus_per_node, "nvlink_GBps": opts.nvlink_gbps,
                        "ib_GBps": opts.ib_gbps, "reserved_gib": opts.reserved_gib,
                        "fragmentation": opts.fragmentation},
        "counts": counts,
        "rejected_by_validation": dict(sorted(rejected.items(), key=lambda kv: -kv[1])),
        "verified_by_trace": [c.label() for c in verified],
        "top": [c.as_dict() for c in top],
        "notes": notes,
        "seconds": round(time.perf_counter() - began, 1),
    }


def _parameters(total: int, active: int) -> str:
    """'8.03B parameters', or for a mixture of experts '30.5B parameters, 3.34B active per token'."""
    def short(n: int) -> str:
        return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"

    text = f"{short(total)} parameters"
    return text if active == total else f"{text}, {short(active)} active per token"


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def format_plan(plan: dict) -> str:
    a = plan["assumptions"]
    lines = [
        f"{plan['model']} on {plan['world_size']} GPUs of {plan['device_memory_gib']:g} GiB, seq_len "
        f"{plan['seq_len']}, global batch {plan['global_batch_size']} sequences",
        f"{_parameters(plan['parameters'], plan['active_parameters'])}; {plan['flops_per_token'] / 1e9:.3g} "
        f"GFLOP per token (forward + backward{', active parameters' if plan['active_parameters'] != plan['parameters'] else ''})",
        f"assumed: matmuls at {a['mfu']:.0%} of {a['device_tflops']:g} TFLOP/s, {a['gpus_per_node']} GPUs per "
        f"NVLink node at {a['nvlink_GBps']:g} GB/s, InfiniBand {a['ib_GBps']:g} GB/s per GPU, "
        f"{a['reserved_gib']:g} GiB reserved + {a['fragmentation']:.0%} fragmentation",
        f"{plan['counts']['layouts']} layout x {'EP x ' if plan['active_parameters'] != plan['parameters'] else ''}"
        f"AC-mode candidates: {plan['counts']['fit']} fit, "
        f"{plan['counts']['do_not_fit']} do not fit (analytic), {plan['counts']['rejected']} rejected by validation",
        "",
    ]
    if not plan["top"]:
        lines.append("no layout fits; try more GPUs, a shorter sequence or a smaller global batch")
    for i, c in enumerate(plan["top"], 1):
        traced = f", traced {_size(c['traced_peak_bytes'])}" if c["traced_peak_bytes"] else ""
        lines += [f"{i}. {c['layout']}: peak {_size(c['peak_bytes'])} (analytic){traced}",
                  f"   {c['why']}",
                  f"   {c['overrides']}"]
    if plan["rejected_by_validation"]:
        lines += ["", "rejected by validation (count: first clause of the message):"]
        lines += [f"  {n}: {reason}" for reason, n in list(plan["rejected_by_validation"].items())[:6]]
    if plan["notes"]:
        lines += ["", "notes:"] + [f"  - {n}" for n in plan["notes"]]
    lines.append(f"\nplanned in {plan['seconds']} s")
    return "\n".join(lines)
