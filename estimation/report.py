"""Run the estimate for a config and present it: text report, JSON object, verdict."""

from __future__ import annotations

import time

from estimation.layout import estimate
from estimation.options import EstimateOptions, PreparedJob, prepare_job
from estimation.probe import probe


GiB = 2**30
# What each bucket holds, in the words printed next to it.
BUCKET_DOCS = {
    "parameters": "parameter shards (fp32 masters) and buffers, as parallelized",
    "optimizer_state": "optimizer state (AdamW exp_avg, exp_avg_sq, step)",
    "gradients": "reduced gradients kept from earlier microbatches, or for the optimizer step",
    "activations": "what the step holds when the peak begins: saved activations, gathered weights, gradients "
                   "made so far, pipeline stage inputs, the batch",
    "transient": "the rise above that within the peak's stretch: recompute, collective buffers, temporaries",
}


def verdict(reserved_bytes: int, opts: EstimateOptions) -> dict | None:
    """Whether what the allocator reserves, plus the memory outside it, fits the device."""
    if opts.device_memory_gib is None:
        return None
    needed = reserved_bytes + opts.reserved_gib * GiB
    capacity = opts.device_memory_gib * GiB
    headroom = capacity - needed
    text = (f"fits in {opts.device_memory_gib:g} GiB with {headroom / GiB:.1f} GiB headroom" if headroom >= 0 else
            f"does NOT fit in {opts.device_memory_gib:g} GiB: {-headroom / GiB:.1f} GiB short")
    return {"fits": headroom >= 0, "device_memory_bytes": int(capacity), "needed_bytes": int(needed),
            "headroom_bytes": int(headroom),
            "text": f"{text} ({reserved_bytes / GiB:.1f} GiB reserved by the allocator + {opts.reserved_gib:g} GiB "
                    "outside it for the CUDA context and NCCL)"}


def estimate_prepared(prep: PreparedJob, opts: EstimateOptions):
    """(one RankEstimate per pipeline rank, the probe) for a prepared job."""
    measured = probe(prep.plan, granularity=opts.alloc_granularity, device=opts.device)
    return estimate(prep.plan, measured), measured


def run_estimate(cfg, opts: EstimateOptions, log=None) -> dict:
    """Plan the job, probe it, lay it out; the result as a JSON-able dict."""
    began = time.perf_counter()
    prep = prepare_job(cfg, opts.world_size)
    plan, dims, args = prep.plan, prep.plan.dims, prep.plan.model_args
    ranks, measured = estimate_prepared(prep, opts)
    top = max(ranks, key=lambda e: e.reserved)
    moe = args.moe_args()
    notes = list(prep.notes) + measured.notes
    if moe is not None:
        notes.append("mixture of experts: probed with balanced routing (every expert gets tokens x top_k / experts "
                     "rows); real routing is uneven, and a rank whose experts get more holds more "
                     "(moe.capacity_factor bounds it)")
    if top.host:
        notes.append(f"CPU offload: {top.host / GiB:.2f} GiB per rank of parameter shards, their gradients and optimizer "
                     "state live in host memory (not in the peak), and the optimizer steps there")
    if t_rampup := cfg.training.rampup_batch_size:
        notes.append(f"batch ramp-up ({t_rampup}): estimated at the final global batch, the largest accumulation")
    if plan.pipeline is not None and any(kind in ("BACKWARD_INPUT",) for acts in measured.actions.values()
                                         for kind, _, _ in acts):
        notes.append("split backward (I, then W): half of what a microbatch's backward frees is assumed kept "
                     "until its weight-gradient step")
    t = cfg.training
    result = {
        "model": plan.model_name,
        "world_size": dims.world_size,
        "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp,
                   "pp": dims.pp, "ep": dims.ep,
                   "pp_schedule": cfg.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None,
                   "activation_checkpoint": cfg.activation_checkpoint.mode
                   + (f" ({cfg.activation_checkpoint.selective_ac_option})"
                      if cfg.activation_checkpoint.mode == "selective" else "")},
        "seq_len": t.seq_len, "local_batch_size": t.local_batch_size,
        "mixed_precision_param": t.mixed_precision_param,
        "parameters": args.num_params(), "active_parameters": args.num_params(active=True),
        "flops_per_token": args.flops_per_token(t.seq_len),
        "device": opts.device,
        "peak_bytes": top.peak_bytes, "reserved_bytes": top.reserved, "peak_rank": top.rank,
        "peak_phase": top.peak_phase, "breakdown": top.peak.as_dict(),
        "collective_pools": {k: sum(v) for k, v in measured.pools.items()},
        "ranks": [e.as_dict() for e in ranks],
        "probe": {"seconds": round(measured.seconds, 1), "layers": len(measured.kinds),
                  "probed_layers": measured.probed_layers, "kinds": len(set(measured.kinds)),
                  "microbatch": measured.microbatch},
        "notes": notes,
    }
    v = verdict(top.reserved, opts)
    if v is not None:
        result["verdict"] = v
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def format_report(result: dict) -> str:
    lay, p = result["layout"], result["probe"]
    unit, div = ("GiB", GiB) if result["reserved_bytes"] >= GiB else ("MiB", 2**20)
    count = f"{result['parameters']:,} parameters" + (
        f", {result['active_parameters']:,} active per token" if result["active_parameters"] != result["parameters"]
        else "")
    lines = [
        f"{result['model']} on {result['world_size']} ranks: dp_replicate {lay['dp_replicate']} x dp_shard "
        f"{lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']} x pp {lay['pp']}"
        + (f" ({lay['pp_schedule']})" if lay["pp_schedule"] else "") + (f", ep {lay['ep']}" if lay["ep"] > 1 else "")
        + f", activation checkpointing {lay['activation_checkpoint']}",
        f"seq_len {result['seq_len']}, local_batch_size {result['local_batch_size']}, params in "
        f"{result['mixed_precision_param']} for compute; {count}; "
        f"{result['flops_per_token'] / 1e9:.3g} GFLOP per token (forward + backward)", ""]
    if len(result["ranks"]) > 1:
        lines += ["per pipeline rank (" + unit + "): " + ", ".join(
            f"pp{r['pp_rank']} {r['peak_bytes'] / div:.2f} ({r['reserved_bytes'] / div:.2f} reserved)"
            for r in result["ranks"]), ""]
    lines.append(f"peak of rank {result['peak_rank']} ({unit}), at {result['peak_phase']}:")
    for bucket, doc in BUCKET_DOCS.items():
        lines.append(f"  {bucket:<16}{result['breakdown'][bucket] / div:10.2f}   {doc}")
    lines.append(f"  {'tensors':<16}{result['peak_bytes'] / div:10.2f}")
    pools = " + ".join(f"{v / div:.2f} {k.replace('foreach_', '')}" for k, v in result["collective_pools"].items())
    lines.append(f"  {'reserved':<16}{result['reserved_bytes'] / div:10.2f}   what the CUDA caching allocator "
                 f"holds: the tensors" + (f" + FSDP's collective pools ({pools})" if pools else ""))
    lines += ["", f"probed {p['probed_layers']} of {p['layers']} layers ({p['kinds']} kind(s)), microbatch "
                  f"{p['microbatch']}, on fake tensors in {p['seconds']} s; {result['device']} kernels"]
    if result.get("verdict"):
        lines += ["", "verdict: " + result["verdict"]["text"]]
    if result["notes"]:
        lines += ["", "notes:"] + [f"  - {n}" for n in result["notes"]]
    return "\n".join(lines)
