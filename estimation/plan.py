"""Rank training layouts for a model, a GPU count, GPU memory and a sequence length.

    python estimation/plan.py --job.config_file train_configs/llama3_70b.toml --estimate.world_size 64 \\
        --estimate.device_memory_gib 80 [--training.seq_len 8192] [--estimate.plan_top 5] [--estimate.json]

The same as `estimation/estimate.py --estimate.plan`. Enumeration, for N GPUs and the config's global
batch: tensor parallel t in {1, 2, 4, 8} (inside a node), pipeline p in {1, 2, 4, ...} (1F1B and
Interleaved1F1B), context parallel c in {1, 2, 4, 8}, data parallel dp = N / (t p c) split into HSDP
replicas and FSDP shards; for mixture-of-experts models every expert-parallel degree dividing both
dp_shard x cp x tp and the expert count, with expert tensor parallelism 1 and, under TP, for coarse
experts (hidden size at least the model's, as Mixtral's) also equal to t (each expert's hidden units
split inside the TP group; fine-grained experts' matmuls are too small to split); the `plan_ac_modes`; every microbatch dividing the local
batch (accumulated, or pipeline microbatches); for a model whose last stage carries layers after the
trunk (multi-token prediction), also ceil(num_layers / stages) layers per stage. Every candidate is
planned by train.py's own `plan_job` (those it refuses are counted by reason), then estimated in the
order of its modeled throughput, at most `plan_probes` of them, skipping those a smaller one already
showed cannot fit; a candidate fits when what the allocator reserves plus `reserved_gib` fits.

Throughput model, per optimizer step, per GPU (stated, not measured), from the args contract:
  compute   = tokens x FLOPs/token / GPUs / (peak x MFU) (args.flops_per_token: active parameters),
              x 4/3 with full checkpointing, 1 + 1/(3k) for every k-th block, 1.05 for op-level
  TP        = per layer and microbatch 4 all-gathers or reduce-scatters of (t-1)/t of a b x s x h
              activation in forward and 4 in backward (4 more when the forward is recomputed)
  CP        = all-gather of K/V per layer in forward, reduce-scatter of their gradients in backward
  EP        = per layer and microbatch, all-to-all of the routed rows (top_k per token) to dispatch and
              to combine, in forward and backward; (e-1)/e of them leave the rank
  ETP       = per layer and microbatch, all-gather of the routed rows over the etp ranks and
              reduce-scatter of their outputs, in forward and backward
  FSDP      = all-gather of 2-byte parameters in forward and backward, reduce-scatter of fp32 gradients,
              per microbatch (per step under PP); HSDP adds an all-reduce across replicas; overlapped
              with compute, so only what exceeds it is exposed, plus one layer's that nothing hides
  bubble    = (p - 1) / (v m) of the pipeline's compute and TP/CP time (v stages per rank, m microbatches)
Only bandwidth is modeled, not latency. A group inside a node (tp innermost, then cp, dp_shard,
dp_replicate, pp) uses NVLink, any other InfiniBand; ring collectives move (n-1)/n of the data.
"""

from __future__ import annotations

import copy
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimation.options import EstimateOptions, GiB, PreparedJob, command_line, prepare_job, verdict  # noqa: E402
from titanlike.config.loader import ConfigError  # noqa: E402

_AC = {"none": ("none", "2"), "full": ("full", "2"), "op": ("selective", "op"), "selective": ("selective", "2")}
_RECOMPUTE = {"none": 1.0, "op": 1.05, "full": 4 / 3, "selective": 1 + 1 / 6}
_MEMORY_ORDER = {"full": 0, "selective": 1, "op": 1, "none": 2}  # who never needs more than whom


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
    ep: int = 1
    etp: int = 1
    experts: bool = False  # the model has routed experts (the overrides then always set ep)
    layers_per_stage: int | None = None  # None: the trainer's default split
    peak_bytes: int = 0
    reserved_bytes: int = 0
    headroom_bytes: int = 0
    fits: bool | None = None  # None: not estimated
    step_seconds: float = 0.0
    tokens_per_second_per_gpu: float = 0.0
    mfu: float = 0.0
    time_parts: dict[str, float] = field(default_factory=dict)

    @property
    def shape(self) -> tuple:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.schedule, self.ep, self.etp,
                self.layers_per_stage)

    def label(self) -> str:
        parts = ([f"dp_replicate {self.dp_replicate}"] if self.dp_replicate > 1 else []) + [f"dp_shard {self.dp_shard}"]
        parts += [f"{name} {getattr(self, name)}" for name in ("cp", "tp", "pp", "ep", "etp") if getattr(self, name) > 1]
        parts += [self.schedule] if self.pp > 1 else []
        parts += [f"{self.layers_per_stage} layers per stage"] if self.layers_per_stage else []
        return ", ".join([*parts, f"AC {self.ac}", f"microbatch {self.microbatch}"])

    def settings(self) -> dict:
        """The train.py options that select this layout, as {"section.key": value}."""
        mode, option = _AC[self.ac]
        par = {"data_parallel_replicate_degree": self.dp_replicate, "data_parallel_shard_degree": self.dp_shard,
               "tensor_parallel_degree": self.tp, "context_parallel_degree": self.cp,
               "pipeline_parallel_degree": self.pp}
        par |= {"expert_parallel_degree": self.ep} if self.experts or self.ep > 1 else {}
        par |= {"expert_tensor_parallel_degree": self.etp} if self.etp > 1 else {}
        if self.pp > 1:
            par |= {"pipeline_parallel_schedule": self.schedule, "pipeline_parallel_microbatch_size": self.microbatch}
            par |= {"pipeline_parallel_layers_per_stage": self.layers_per_stage} if self.layers_per_stage else {}
        out = {f"parallelism.{k}": v for k, v in par.items()} | {"activation_checkpoint.mode": mode}
        out |= {"activation_checkpoint.selective_ac_option": option} if mode == "selective" else {}
        return out | {"training.local_batch_size": self.local_batch_size}

    def as_dict(self) -> dict:
        fields_ = {k: v for k, v in asdict(self).items() if k != "experts"}
        overrides = " ".join(f"--{key} {value}" for key, value in self.settings().items())
        return {"layout": self.label(), **fields_, "overrides": overrides}


def layouts(world: int, args, global_batch: int, opts: EstimateOptions, rejected: Counter):
    """Every candidate for `world` ranks (the module docstring's enumeration); layouts whose data-parallel
    degree does not divide the global batch are counted in `rejected`."""
    moe = args.moe_args()
    for tp in (t for t in (1, 2, 4, 8) if world % t == 0 and t <= opts.gpus_per_node):
        for pp in (d for d in _divisors(world // tp) if d == 1 or (d & (d - 1) == 0 and d <= args.num_layers // 2)):
            for cp in (c for c in (1, 2, 4, 8) if (world // tp) % (pp * c) == 0):
                dp = world // (tp * pp * cp)
                for rep, schedule in product(_divisors(dp), (None,) if pp == 1 else ("1F1B", "Interleaved1F1B")):
                    if global_batch % dp:
                        rejected[f"global batch {global_batch} is not divisible by the data-parallel degree"] += 1
                        continue
                    local = global_batch // dp
                    for (ep, etp), split, ac, micro in product(
                            expert_layouts(dp // rep * cp * tp, moe.num_experts,
                                           tp if moe.hidden_dim >= args.hidden_size else 1)
                            if moe is not None else [(1, 1)],
                            stage_splits(args, pp, schedule), opts.plan_ac_modes, _divisors(local)):
                        yield Candidate(rep, dp // rep, cp, tp, pp, schedule, ac, local if pp > 1 else micro, micro,
                                        ep=ep, etp=etp, experts=moe is not None, layers_per_stage=split)


def stage_splits(args, pp: int, schedule: str | None) -> list[int | None]:
    """The trainer's default split (None) and, for a model with layers after its trunk (multi-token
    prediction rides on the last stage), ceil(num_layers / stages) layers per stage when that differs."""
    if pp == 1 or args.total_layers == args.num_layers:
        return [None]
    from titanlike.parallel.pipeline import is_single_stage, plan_layout, schedule_name

    per_stage = -(-args.num_layers // (pp * (1 if is_single_stage(schedule_name(schedule)) else 2)))
    try:
        split = plan_layout(args.num_layers, pp, schedule, per_stage)
    except ValueError:
        return [None]
    return [None] if split.layers == plan_layout(args.num_layers, pp, schedule, None).layers else [None, per_stage]


def expert_degrees(span: int, num_experts: int) -> list[int]:
    """Expert-parallel degrees dividing both the ranks experts spread over (dp_shard x cp x tp) and the experts."""
    return [d for d in _divisors(span) if num_experts % d == 0]


def expert_layouts(span: int, num_experts: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs: expert tensor parallelism 1, or tp under TP, with every expert-parallel degree
    that divides the experts and, times etp, the ranks experts spread over (dp_shard x cp x tp)."""
    return [(ep, etp) for etp in sorted({1, tp}) if span % etp == 0
            for ep in expert_degrees(span // etp, num_experts)]


def throughput(plan, c: Candidate, opts: EstimateOptions) -> None:
    """Fill c's step time, tokens/s per GPU and MFU from the model in the module docstring, for its plan."""
    args, seq, world, e = plan.model_args, plan.cfg.training.seq_len, plan.dims.world_size, 2
    flops, peak, tokens = args.flops_per_token(seq), opts.device_tflops * 1e12, plan.batch.global_batch_size * seq
    bw = lambda span: (opts.nvlink_gbps if span <= opts.gpus_per_node else opts.ib_gbps) * 1e9  # noqa: E731
    layers, microbatches = args.num_layers / c.pp, plan.batch.grad_accum_steps * (plan.batch.pipeline_microbatches or 1)
    act = c.microbatch * seq / c.cp * args.hidden_size * e
    passes = 3 if c.ac in ("full", "selective") else 2
    heads, moe = args.attention_shape(), args.moe_args()
    t = {"compute": tokens * flops * _RECOMPUTE[c.ac] / world / (peak * opts.plan_mfu),
         "tp": microbatches * layers * 4 * passes * (c.tp - 1) / c.tp * act / bw(c.tp) if c.tp > 1 else 0.0,
         "cp": layers * microbatches * passes * (c.cp - 1) * (act / args.hidden_size * heads.kv_heads * heads.head_dim
                                                              * 2 / c.tp) / bw(c.tp * c.cp)
         if c.cp > 1 and heads is not None else 0.0,
         "ep": layers * microbatches * 2 * passes * (c.ep - 1) / c.ep * act / c.tp * moe.top_k / bw(c.ep)
         if c.ep > 1 and moe is not None else 0.0,
         # The rows reaching a rank's experts, about its own routed rows: gathered from etp - 1 ranks and
         # their partial outputs scattered back.
         "etp": layers * microbatches * 2 * passes * (c.etp - 1) * act / c.tp * moe.top_k / bw(c.etp)
         if c.etp > 1 and moe is not None else 0.0}
    # Parameters this rank gathers: routed experts (all but the active share) split by ep x etp, the rest by tp.
    total, active = args.num_params(), args.num_params(active=True)
    experts = (total - active) * moe.num_experts / (moe.num_experts - moe.top_k) if moe is not None else 0
    local, shard = ((total - experts) / c.tp + experts / (c.ep * c.etp)) / c.pp, c.dp_shard * c.cp
    fsdp = (1 if c.pp > 1 else microbatches) * (shard - 1) / shard * local * ((1 if c.pp > 1 else 2) * e + 4) / bw(
        c.tp * c.cp * c.dp_shard) if shard > 1 else 0.0
    if c.dp_replicate > 1:
        fsdp += 2 * (c.dp_replicate - 1) / c.dp_replicate * local * 4 / shard / (opts.ib_gbps * 1e9)
    t["fsdp_exposed"] = max(0.0, fsdp - t["compute"]) + fsdp / max(layers, 1)
    t["pp_bubble"] = (c.pp - 1) / ((2 if c.schedule == "Interleaved1F1B" else 1) * microbatches) * (
        t["compute"] + t["tp"] + t["cp"] + t["ep"] + t["etp"]) if c.pp > 1 else 0.0
    c.step_seconds, c.time_parts = sum(t.values()), t
    c.tokens_per_second_per_gpu = tokens / c.step_seconds / world
    c.mfu = c.tokens_per_second_per_gpu * flops / peak


def run_plan(cfg, opts: EstimateOptions, log=None) -> dict:
    # The probe's modules import torch._dynamo and DTensor: here, not at the top, so --help skips them.
    from estimation.layout import estimate
    from estimation.probe import probe

    log = log or (lambda msg: None)
    began = time.perf_counter()
    if opts.device_memory_gib is None:
        raise ConfigError("the planner needs --estimate.device_memory_gib (GPU memory in GiB)")
    base = prepare_job(cfg, opts.world_size)  # the config as written must be valid for this world size
    args, world = base.plan.model_args, base.plan.dims.world_size
    seq, global_batch = base.plan.cfg.training.seq_len, base.plan.batch.global_batch_size
    rejected: Counter = Counter()
    candidates: list[tuple[Candidate, PreparedJob]] = []
    for c in layouts(world, args, global_batch, opts, rejected):
        job = copy.deepcopy(cfg)
        p = job.parallelism
        p.expert_parallel_degree, p.expert_tensor_parallel_degree, p.pipeline_parallel_layers_per_stage = 1, 1, None
        for key, value in c.settings().items():
            section, name = key.split(".")
            setattr(getattr(job, section), name, value)
        job.training.global_batch_size = global_batch
        try:  # the vocabulary of the job as written, from its tokenizer: loaded once
            prep = prepare_job(job, world, vocab_size=args.vocab_size)
        except ConfigError as err:
            rejected[str(err).split(",")[0]] += 1
            continue
        throughput(prep.plan, c, opts)
        candidates.append((c, prep))
    candidates.sort(key=lambda cp_: -cp_[0].tokens_per_second_per_gpu)
    fitting, failed, probed = [], [], 0
    for c, prep in candidates:
        if len(fitting) >= opts.plan_top or probed >= opts.plan_probes:
            break
        if any(f.shape == c.shape and _MEMORY_ORDER[f.ac] <= _MEMORY_ORDER[c.ac] and f.microbatch <= c.microbatch
               for f in failed):
            continue  # a candidate needing no more memory than this one did not fit
        log(f"estimating {c.label()}")
        ranks = estimate(prep.plan, probe(prep.plan, granularity=opts.alloc_granularity, device=opts.device))
        probed += 1
        top = max(ranks, key=lambda r: r.reserved)
        c.peak_bytes, c.reserved_bytes = top.peak_bytes, top.reserved
        v = verdict(top.reserved, opts)
        c.fits, c.headroom_bytes = v["fits"], v["headroom_bytes"]
        (fitting if c.fits else failed).append(c)
    return {
        "model": base.plan.model_name, "world_size": world, "device_memory_gib": opts.device_memory_gib,
        "seq_len": seq, "global_batch_size": global_batch, "parameters": args.num_params(),
        "active_parameters": args.num_params(active=True), "flops_per_token": args.flops_per_token(seq),
        "assumptions": {"mfu": opts.plan_mfu, "device_tflops": opts.device_tflops, "gpus_per_node": opts.gpus_per_node,
                        "nvlink_GBps": opts.nvlink_gbps, "ib_GBps": opts.ib_gbps, "reserved_gib": opts.reserved_gib},
        "counts": {"candidates": len(candidates), "estimated": probed, "fit": len(fitting), "do_not_fit": len(failed),
                   "rejected": sum(rejected.values())},
        "rejected_by_validation": dict(rejected.most_common()),
        "top": [c.as_dict() for c in fitting],
        "seconds": round(time.perf_counter() - began, 1),
    }


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def format_plan(plan: dict) -> str:
    a, n = plan["assumptions"], plan["counts"]
    short = lambda x: f"{x / 1e9:.3g}B" if x >= 1e9 else f"{x / 1e6:.3g}M"  # noqa: E731
    params = short(plan["parameters"]) + (f", {short(plan['active_parameters'])} active per token"
                                          if plan["active_parameters"] != plan["parameters"] else "")
    lines = [
        f"{plan['model']} on {plan['world_size']} GPUs of {plan['device_memory_gib']:g} GiB, seq_len {plan['seq_len']}, "
        f"global batch {plan['global_batch_size']} sequences; {params} parameters; "
        f"{plan['flops_per_token'] / 1e9:.3g} GFLOP per token",
        f"assumed: matmuls at {a['mfu']:.0%} of {a['device_tflops']:g} TFLOP/s, {a['gpus_per_node']} GPUs per NVLink "
        f"node at {a['nvlink_GBps']:g} GB/s, InfiniBand {a['ib_GBps']:g} GB/s per GPU, {a['reserved_gib']:g} GiB "
        "outside the allocator",
        f"{n['candidates']} candidates planned ({n['rejected']} refused by validation); {n['estimated']} estimated, "
        f"fastest first: {n['fit']} fit, {n['do_not_fit']} do not", ""]
    if not plan["top"]:
        lines.append("no estimated layout fits; try more GPUs, a shorter sequence, a smaller global batch or more "
                     "--estimate.plan_probes")
    for i, c in enumerate(plan["top"], 1):
        parts = " + ".join(f"{k} {v:.3g}s" for k, v in c["time_parts"].items() if v > 0.005 * c["step_seconds"])
        lines += [f"{i}. {c['layout']}: {_size(c['reserved_bytes'])} reserved ({_size(c['peak_bytes'])} of tensors), "
                  f"{_size(c['headroom_bytes'])} headroom",
                  f"   step {c['step_seconds']:.3g}s = {parts}; {c['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, "
                  f"MFU {c['mfu']:.0%}", f"   {c['overrides']}"]
    if plan["rejected_by_validation"]:
        lines += ["", "refused by validation (count: first clause of the message):"]
        lines += [f"  {k}: {reason}" for reason, k in list(plan["rejected_by_validation"].items())[:6]]
    lines.append(f"\nplanned in {plan['seconds']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "estimation/plan.py") -> int:
    def run(cfg, opts: EstimateOptions):
        # The planner's progress goes to stderr: stdout keeps the JSON.
        return run_plan(cfg, opts, log=lambda msg: print(msg, file=sys.stderr, flush=True)), format_plan

    return command_line([*(sys.argv[1:] if argv is None else argv), "--estimate.plan"], prog, run)


def console_main() -> None:
    """The `titanlike-plan` console script."""
    sys.exit(main(prog="titanlike-plan"))


if __name__ == "__main__":
    sys.exit(main())
