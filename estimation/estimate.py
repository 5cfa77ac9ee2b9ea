"""Estimate the peak GPU memory of a training job, for any world size, without GPUs.

    python estimation/estimate.py --job.config_file train_configs/llama3_405b.toml --estimate.world_size 512
    python estimation/estimate.py --job.config_file train_configs/llama3_8b.toml --estimate.world_size 8 \\
        --activation_checkpoint.mode full --estimate.device_memory_gib 80 [--estimate.json] [--estimate.plan]

Takes every train.py option (the same TOML and overrides) plus the `--estimate.*` options listed by
--help. Plans the job as train.py does, runs its training step on fake tensors (one block of each
kind, estimation/probe.py) and lays that out along the model, the layout and the pipeline schedule
(estimation/layout.py); `--estimate.plan` ranks layouts instead (estimation/plan.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimation.layout import estimate  # noqa: E402
from estimation.options import EstimateOptions, GiB, command_line, prepare_job, verdict  # noqa: E402
from estimation.probe import probe  # noqa: E402

BUCKET_DOCS = {  # what each bucket holds, printed next to it
    "parameters": "parameter shards (fp32 masters) and buffers, as parallelized",
    "optimizer_state": "optimizer state in optimizer.state_dtype (AdamW exp_avg, exp_avg_sq, step; Muon's momentum "
                       "per matrix)",
    "gradients": "reduced gradients kept from earlier microbatches, or for the optimizer step",
    "activations": "what the step holds when the peak begins: saved activations, gathered weights, gradients "
                   "made so far, pipeline stage inputs, the batch",
    "transient": "the rise above that within the peak's stretch: recompute, collective buffers, temporaries (at "
                 "the optimizer step: the matrices Muon gathers whole)",
}


def run_estimate(cfg, opts: EstimateOptions) -> dict:
    """Plan the job, probe it, lay it out; the result as a JSON-able dict."""
    began = time.perf_counter()
    prep = prepare_job(cfg, opts.world_size)
    plan, dims, args, t, ac = prep.plan, prep.plan.dims, prep.plan.model_args, cfg.training, cfg.activation_checkpoint
    ac_mode = ac.mode + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else "")
    measured = probe(plan, granularity=opts.alloc_granularity, device=opts.device)
    ranks = estimate(plan, measured)
    top = max(ranks, key=lambda e: e.reserved)
    notes = prep.notes + measured.notes + [note for when, note in [
        (args.moe_args(), "mixture of experts: probed with balanced routing (every expert gets tokens x top_k / "
         "experts rows); real routing is uneven, and a rank whose experts get more holds more (moe.capacity_factor "
         "bounds it)"),
        (top.host, f"CPU offload: {top.host / GiB:.2f} GiB per rank of parameter shards, their gradients and "
         "optimizer state live in host memory (not in the peak), and the optimizer steps there"),
        (t.rampup_batch_size, f"batch ramp-up ({t.rampup_batch_size}): estimated at the final global batch, the "
         "largest accumulation"),
        (any(a[0] == "BACKWARD_INPUT" for acts in measured.actions.values() for a in acts),
         "split backward (I, then W): half of what a microbatch's backward frees is assumed kept until its "
         "weight-gradient step")] if when]
    g = measured.generation
    if g is not None:
        def size(n: int) -> str:
            return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"

        notes.append(f"generation (RL rollouts): {g.rows} rows per rank in a cache of {t.seq_len} tokens each, "
                     f"{size(g.cache)} after the prefill ({size(g.prefill)} at its highest)"
                     + (f"; the policy's whole copy it reads, {size(g.copy)} per rank, is counted in the "
                        "parameters" if g.copy else "") + "; the step trains the same rows")
    result = {
        "model": plan.model_name, "world_size": dims.world_size,
        "layout": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")} | {
                   "pp_schedule": cfg.parallelism.pipeline_parallel_schedule if dims.pp_enabled else None,
                   "activation_checkpoint": ac_mode},
        "seq_len": t.seq_len, "local_batch_size": t.local_batch_size, "mixed_precision_param": t.mixed_precision_param,
        "parameters": args.num_params(), "active_parameters": args.num_params(active=True),
        "flops_per_token": args.flops_per_token(t.seq_len), "device": opts.device,
        "peak_bytes": top.peak_bytes, "reserved_bytes": top.reserved, "peak_rank": top.rank,
        "peak_phase": top.peak_phase, "breakdown": top.peak.as_dict(),
        "collective_pools": {k: sum(v) for k, v in measured.pools.items()},
        "ranks": [e.as_dict() for e in ranks],
        "generation": None if g is None else {"rows": g.rows, "policy_copy_bytes": g.copy, "cache_bytes": g.cache,
                                              "prefill_peak_bytes": g.prefill},
        "probe": {"seconds": round(measured.seconds, 1), "layers": len(measured.kinds),
                  "probed_layers": measured.probed_layers, "kinds": len(set(measured.kinds)),
                  "microbatch": measured.microbatch},
        "notes": notes,
    }
    verdict_ = {"verdict": v} if (v := verdict(top.reserved, opts)) is not None else {}
    return result | verdict_ | {"seconds": round(time.perf_counter() - began, 1)}


def format_report(result: dict) -> str:
    lay, p, active = result["layout"], result["probe"], result["active_parameters"]
    unit, div = ("GiB", GiB) if result["reserved_bytes"] >= GiB else ("MiB", 2**20)
    pools = " + ".join(f"{v / div:.2f} {k.replace('foreach_', '')}" for k, v in result["collective_pools"].items())
    rows = [(k, result["breakdown"][k], doc) for k, doc in BUCKET_DOCS.items()] + [
            ("tensors", result["peak_bytes"], ""),
            ("reserved", result["reserved_bytes"], "what the CUDA caching allocator holds: the tensors"
             + (f" + FSDP's collective pools ({pools})" if pools else ""))]
    lines = [
        f"{result['model']} on {result['world_size']} ranks: dp_replicate {lay['dp_replicate']} x dp_shard "
        f"{lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']} x pp {lay['pp']}"
        + (f" ({lay['pp_schedule']})" if lay["pp_schedule"] else "") + (f", ep {lay['ep']}" if lay["ep"] > 1 else "")
        + (f", expert tp {lay['etp']}" if lay["etp"] > 1 else "")
        + f", activation checkpointing {lay['activation_checkpoint']}",
        f"seq_len {result['seq_len']}, local_batch_size {result['local_batch_size']}, params in "
        f"{result['mixed_precision_param']} for compute; {result['parameters']:,} parameters"
        + (f", {active:,} active per token" if active != result["parameters"] else "")
        + f"; {result['flops_per_token'] / 1e9:.3g} GFLOP per token (forward + backward)", "",
        *([f"per pipeline rank ({unit}): " + ", ".join(
            f"pp{r['pp_rank']} {r['peak_bytes'] / div:.2f} ({r['reserved_bytes'] / div:.2f} reserved)"
            for r in result["ranks"]), ""] if len(result["ranks"]) > 1 else []),
        f"peak of rank {result['peak_rank']} ({unit}), at {result['peak_phase']}:",
        *(f"  {k:<16}{n / div:10.2f}" + (f"   {doc}" if doc else "") for k, n, doc in rows),
        "", f"probed {p['probed_layers']} of {p['layers']} layers ({p['kinds']} kind(s)), microbatch "
            f"{p['microbatch']}, on fake tensors in {p['seconds']} s; {result['device']} kernels",
        *(["", "verdict: " + result["verdict"]["text"]] if result.get("verdict") else []),
        *(["", "notes:", *(f"  - {n}" for n in result["notes"])] if result["notes"] else [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "estimation/estimate.py") -> int:
    def run(cfg, opts: EstimateOptions):
        if opts.plan:
            from estimation.plan import format_plan, run_plan

            # The planner's progress goes to stderr: stdout keeps the JSON.
            return run_plan(cfg, opts, log=lambda msg: print(msg, file=sys.stderr, flush=True)), format_plan
        return run_estimate(cfg, opts), format_report

    return command_line(sys.argv[1:] if argv is None else argv, prog, run)


def console_main() -> None:
    """The `titanlike-estimate` console script."""
    sys.exit(main(prog="titanlike-estimate"))


if __name__ == "__main__":
    sys.exit(main())
