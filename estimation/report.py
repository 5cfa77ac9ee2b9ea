"""Run the estimates for a config and present them: text report, JSON object, verdict."""

from __future__ import annotations

import time
from dataclasses import fields

from estimation.memory import BUCKET_DOCS, GiB, Breakdown, RankEstimate
from estimation.options import EstimateOptions, PreparedJob, prepare_job
from titanlike.config import ConfigError


def verdict(peak_bytes: int, opts: EstimateOptions) -> dict | None:
    """Whether peak_bytes of tensors fit in the device, after fragmentation and reserved memory."""
    if opts.device_memory_gib is None:
        return None
    needed = peak_bytes * (1 + opts.fragmentation) + opts.reserved_gib * GiB
    capacity = opts.device_memory_gib * GiB
    headroom = capacity - needed
    fits = headroom >= 0
    text = (f"fits in {opts.device_memory_gib:g} GiB with {headroom / GiB:.1f} GiB headroom" if fits else
            f"does NOT fit in {opts.device_memory_gib:g} GiB: {-headroom / GiB:.1f} GiB short")
    return {"fits": fits, "device_memory_bytes": int(capacity), "needed_bytes": int(needed),
            "headroom_bytes": int(headroom),
            "text": f"{text} (peak {peak_bytes / GiB:.1f} GiB x {1 + opts.fragmentation:g} for allocator "
                    f"fragmentation + {opts.reserved_gib:g} GiB reserved for CUDA context and NCCL)"}


def _largest(estimates: list[RankEstimate]) -> RankEstimate:
    return max(estimates, key=lambda e: e.peak_bytes)


# Why the traced and analytic buckets can differ, by bucket; printed next to the difference.
_EXPLAIN = {
    "parameters": "the trace counts real shard shapes (FSDP pads dim 0 to the shard count) and buffers",
    "gathered_parameters": "analytic assumes about two gathered blocks besides the root; the trace sees FSDP's "
                           "actual prefetching (without FSDP the tracker files autocast's bf16 weight copies "
                           "under activations); with float8 all-gather, analytic halves the converted share of "
                           "the gathered bytes, the trace gathers the float8 weights as torchao does, plus a "
                           "persistent fp32 scale per weight",
    "gradients": "at the peak some gradients may already be reduced or not yet produced",
    "optimizer_state": "AdamW's step counters are tensors too",
    "activations": "the formula counts saved tensors per layer; the trace also holds the pipeline and loss "
                   "tensors exactly when they live, and files bf16 autocast weight copies here (and, with "
                   "float8, the eager casts' fp32 and float8 copies of weights and inputs made in forward)",
    "transient": "recompute, collective buffers and gradients of activations depend on the exact op order, "
                 "which only the trace follows",
}


def compare(traced: Breakdown, analytic: Breakdown) -> list[dict]:
    rows = []
    for f in fields(Breakdown):
        t, a = getattr(traced, f.name), getattr(analytic, f.name)
        rows.append({"bucket": f.name, "traced": t, "analytic": a, "difference": a - t,
                     "relative": (a - t) / t if t else None, "why": _EXPLAIN[f.name]})
    return rows


def run_estimate(cfg, opts: EstimateOptions, log=None) -> dict:
    """Prepare the job, run the requested estimates, and return the result as a JSON-able dict.

    A model whose blocks the analytic model does not know gets the traced estimate alone (with a
    note); asked for the analytic estimate alone, it is a ConfigError naming the traced one."""
    from estimation.analytic import UnknownBlockError, bytes_per_parameter, estimate_analytic, model_parameter_count

    log = log or (lambda msg: None)
    began = time.perf_counter()
    prep: PreparedJob = prepare_job(cfg, opts.world_size)
    dims = prep.dims
    result: dict = {
        "model": prep.plan.model_name,  # the flavor, or where the sizes came from ([model.args], an HF folder)
        "world_size": dims.world_size,
        "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp,
                   "pp": dims.pp, "ep": dims.ep, "efsdp": dims.efsdp,
                   "pp_schedule": cfg.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None,
                   "activation_checkpoint": cfg.activation_checkpoint.mode
                   + (f" ({cfg.activation_checkpoint.selective_ac_option})"
                      if cfg.activation_checkpoint.mode == "selective" else "")},
        "seq_len": cfg.training.seq_len,
        "local_batch_size": cfg.training.local_batch_size,
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "notes": list(prep.notes),
    }
    analytic = traced = None
    if opts.mode in ("both", "analytic"):
        try:
            analytic, details = estimate_analytic(prep, opts.alloc_granularity)
        except UnknownBlockError as err:
            if opts.mode == "analytic":
                raise ConfigError(str(err)) from None
            result["notes"].append(f"no analytic estimate: {err}")
    if analytic is not None:
        top_detail = details[max(range(len(analytic)), key=lambda i: analytic[i].peak_bytes)]
        result["analytic"] = {"peak_bytes": _largest(analytic).peak_bytes,
                              "model_parameters": model_parameter_count(prep.model_args),
                              "active_parameters": model_parameter_count(prep.model_args, active=True),
                              "flops_per_token": prep.model_args.flops_per_token(cfg.training.seq_len),
                              "bytes_per_model_parameter": bytes_per_parameter(prep),
                              "layer_activation_bytes": top_detail.layer_activation_bytes,
                              "stored_activation_bytes_per_microbatch": top_detail.stored_per_microbatch,
                              "microbatches_in_flight": top_detail.in_flight,
                              "ranks": [e.as_dict() for e in analytic]}
    moe = prep.model_args.moe_args()
    if analytic is not None and moe is not None and moe.capacity_factor is None:
        result["notes"].append("mixture of experts: routed-token activations counted at the average load (tokens "
                               "x top_k per rank); dropless routing can send one rank's experts more, which "
                               "moe.capacity_factor bounds")
    if analytic is not None and cfg.training.enable_cpu_offload and dims.fsdp_enabled:
        host = max(d.host_bytes for d in details)
        result["analytic"]["host_bytes"] = host
        result["notes"].append(f"CPU offload: {host / GiB:.2f} GiB per rank of sharded parameters, their gradients "
                               "and optimizer state live in host memory (not in the peak), and the optimizer "
                               "steps there")
    if analytic is not None and cfg.training.rampup_batch_size:
        result["notes"].append("batch ramp-up: estimated at the final global batch (global_batch_size), the "
                               "largest gradient accumulation")
    args = prep.model_args
    if analytic is not None and args.total_layers > args.num_layers:
        result["notes"].append(f"{args.total_layers - args.num_layers} layer(s) after the trunk (multi-token "
                               "prediction) counted on the last pipeline stage with the output end, each with "
                               "its own fp32 log-softmax over the vocabulary")
    from estimation.traced import untraceable

    refusal = untraceable(prep)
    if opts.mode == "both" and refusal is not None and analytic is not None:
        result["notes"].append(f"no traced estimate: {refusal}")
    elif opts.mode in ("both", "traced"):
        from estimation.traced import estimate_traced

        t0 = time.perf_counter()
        traced, notes = estimate_traced(prep, granularity=opts.alloc_granularity, per_module=opts.per_module,
                                        module_depth=opts.module_depth, log=log)
        if (prep.float8 is not None and not prep.float8.traced and prep.float8.fsdp_float8_all_gather
                and dims.fsdp_enabled):
            # Without torchao the trace ran in bf16: apply the analytic float8 all-gather saving.
            from estimation.analytic import float8_share

            share = float8_share(prep)
            for e in traced:
                cut = int(e.peak.gathered_parameters * share / 2)
                e.peak = e.peak - Breakdown(gathered_parameters=cut)
        result["notes"] += notes
        result["traced"] = {"peak_bytes": _largest(traced).peak_bytes, "seconds": round(time.perf_counter() - t0, 1),
                            "ranks": [e.as_dict() for e in traced]}
    main = traced or analytic
    top = _largest(main)
    result["source"] = "traced" if traced else "analytic"
    result["peak_bytes"] = top.peak_bytes
    result["peak_rank"] = top.rank
    result["peak_phase"] = top.peak_phase
    result["breakdown"] = top.peak.as_dict()
    if traced and analytic:
        a_top = next(e for e in analytic if e.pp_rank == top.pp_rank)
        result["comparison"] = compare(top.peak, a_top.peak)
    v = verdict(top.peak_bytes, opts)
    if v is not None:
        result["verdict"] = v
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def _unit(peak: int) -> tuple[str, int]:
    return ("GiB", GiB) if peak >= GiB else ("MiB", 2**20)


def _fmt(n: int, div: int) -> str:
    return f"{n / div:9.2f}"


def format_report(result: dict) -> str:
    lay = result["layout"]
    lines = [
        f"{result['model']} on {result['world_size']} ranks: dp_replicate {lay['dp_replicate']} x dp_shard "
        f"{lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']} x pp {lay['pp']}"
        + (f" ({lay['pp_schedule']})" if lay["pp_schedule"] else "")
        + (f"; experts over ep {lay['ep']} x efsdp {lay['efsdp']}" if lay.get("efsdp") and lay["ep"] > 1 else "")
        + f", activation checkpointing {lay['activation_checkpoint']}",
        f"seq_len {result['seq_len']}, local_batch_size {result['local_batch_size']}, "
        f"params in {result['mixed_precision_param']} for compute",
        "",
    ]
    sources = [s for s in ("traced", "analytic") if s in result]
    for source in sources:
        ranks = result[source]["ranks"]
        if len(ranks) > 1:
            u, dv = _unit(max(r["peak_bytes"] for r in ranks))
            lines.append(f"{source} peak per pipeline rank ({u}): "
                         + ", ".join(f"pp{r['pp_rank']} {r['peak_bytes'] / dv:.2f}" for r in ranks))
    if any(len(result[s]["ranks"]) > 1 for s in sources):
        lines.append("")
    top_pp = next(r for r in result[result["source"]]["ranks"] if r["rank"] == result["peak_rank"])["pp_rank"]
    unit, div = _unit(result["peak_bytes"])
    header = f"{'peak memory of rank ' + str(result['peak_rank']):<34}" + "".join(f"{s:>12}" for s in sources)
    lines += [header + f"   ({unit})", "-" * len(header)]
    per_source = {s: next(r for r in result[s]["ranks"] if r["pp_rank"] == top_pp)["breakdown"] for s in sources}
    for bucket in [*BUCKET_DOCS, "total"]:
        lines.append(f"  {bucket:<32}" + "".join(f"{_fmt(per_source[s][bucket], div):>12}" for s in sources))
    lines.append("")
    lines.append(f"peak at: {result['peak_phase']}")
    if "analytic" in result:
        a = result["analytic"]
        bpp = a["bytes_per_model_parameter"]
        moe = a["active_parameters"] != a["model_parameters"]
        count = (f"{a['model_parameters']:,} parameters, {a['active_parameters']:,} active per token"
                 if moe else f"{a['model_parameters']:,} parameters")
        experts = bpp.get("experts")
        expert_text = (f" (per routed-expert parameter {experts['parameters']:.3g} + {experts['gradients']:.3g} + "
                       f"{experts['optimizer_state']:.3g})" if experts else "")
        lines += ["", f"analytic: {count}; per model parameter this rank keeps "
                      f"{bpp['parameters']:.3g} bytes of fp32 weights + {bpp['gradients']:.3g} of gradients + "
                      f"{bpp['optimizer_state']:.3g} of AdamW state{expert_text}"
                      + (" in host memory (CPU offload)" if bpp.get("host_memory") else "")
                      + "; one layer's activations (no recompute) "
                      f"{a['layer_activation_bytes'] / div:.2f} {unit} per microbatch, "
                      f"{a['stored_activation_bytes_per_microbatch'] / div:.2f} {unit} stored per microbatch, "
                      f"{a['microbatches_in_flight']} in flight",
                  f"training FLOPs per token (forward + backward): {a['flops_per_token'] / 1e9:.3g} GFLOP"
                  + (" from the active parameters (top_k routed experts)" if moe else "")]
    if "comparison" in result:
        lines += ["", "analytic minus traced, and why they differ:"]
        for row in result["comparison"]:
            rel = f"{row['relative']:+.1%}" if row["relative"] is not None else "   n/a"
            if abs(row["difference"]) < result["peak_bytes"] / 1000:
                continue
            lines.append(f"  {row['bucket']:<20} {row['difference'] / div:+8.2f} {unit} ({rel}): {row['why']}")
        total_t, total_a = result["traced"]["peak_bytes"], result["analytic"]["peak_bytes"]
        lines.append(f"  total peak: analytic {total_a / div:.2f} {unit} vs traced {total_t / div:.2f} {unit} "
                     f"({(total_a - total_t) / total_t:+.1%})")
    if "traced" in result:
        lines.append("")
        lines.append(f"traced in {result['traced']['seconds']} s (fake process group + FakeTensorMode; "
                     f"{len(result['traced']['ranks'])} representative rank(s))")
        modules = next(r for r in result["traced"]["ranks"] if r["pp_rank"] == top_pp).get("per_module")
        if modules:
            lines += ["", f"{'module':<48}{'fwd peak':>12}{'bwd peak':>12}   ({unit}, whole rank while inside it)"]
            for name, m in modules.items():
                lines.append(f"  {name:<46}{_fmt(m['forward_peak_bytes'], div):>12}"
                             f"{_fmt(m['backward_peak_bytes'], div):>12}")
    if result.get("verdict"):
        lines += ["", "verdict: " + result["verdict"]["text"]]
    if result["notes"]:
        lines += ["", "notes:"] + [f"  - {n}" for n in result["notes"]]
    return "\n".join(lines)
