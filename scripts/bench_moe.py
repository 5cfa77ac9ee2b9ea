"""Benchmark mixture-of-experts training on this machine, in three parts (pick with --parts):

  layer   the MoE layer (router, grouping, experts, combine) forward + backward, with the experts
          computed by torch._grouped_mm or by the per-expert loop, at several expert counts; fixed
          tokens, dim and expert hidden size; ms per iteration (median of alternating rounds) and
          the grouped_mm speedup, per dtype.
  ep      the step time of the qwen3 debugmodel_moe through train.py: one process against
          torchrun with 2 ranks and --parallelism.expert_parallel_degree 2, same global batch.
  models  tokens/s and peak memory (max_rss) of qwen3 debugmodel_moe against llama3 debugmodel
          through train.py, one process, same settings.

The train.py parts read tps and max_rss from metrics.jsonl and skip the first --warmup steps.
Step time = global tokens per step / (tps x ranks), the median over the measured steps.

    python scripts/bench_moe.py --parts layer --experts 8,32,128 --dtypes float32,bfloat16
    python scripts/bench_moe.py --parts ep,models --steps 10 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlike.models.common.moe import MoE, MoEArgs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# Part 1: the layer --------------------------------------------------------------------------------


def build_layer(dim: int, hidden: int, experts: int, top_k: int, impl: str, dtype: torch.dtype) -> MoE:
    # Same seed for both impls: the same weights, so the same routing and the same work.
    torch.manual_seed(0)
    layer = MoE(dim, MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=hidden, aux_loss_coeff=0.01,
                             experts_impl=impl))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, dim ** -0.5)
    return layer.to(dtype).train()


def time_layer(layer: MoE, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    """Seconds per forward + backward."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)  # GPU kernels run asynchronously
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        layer(x).backward(grad)
    sync()
    return (time.perf_counter() - start) / iters


def bench_layer(args) -> None:
    device = torch.device(args.device)
    print(f"MoE layer forward+backward on {device}: {args.tokens} tokens, dim {args.dim}, expert hidden "
          f"{args.hidden}, top_k {args.top_k}, {torch.get_num_threads()} CPU threads; median of {args.rounds} "
          f"alternating rounds of {args.iters} iterations after {args.layer_warmup} warm-up")
    print(f"{'dtype':9s} {'experts':>7s} {'grouped_mm ms':>14s} {'loop ms':>10s} {'speedup':>8s}")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for experts in (int(e) for e in args.experts.split(",")):
            torch.manual_seed(1)
            x = torch.randn(1, args.tokens, args.dim, dtype=dtype, device=device, requires_grad=True)
            # A dense upstream gradient: grouped_mm's backward rejects an expanded (stride-0) one,
            # as .sum().backward() would give; in a model the gradient is always materialized.
            grad = torch.randn(1, args.tokens, args.dim, dtype=dtype, device=device)
            layers = {impl: build_layer(args.dim, args.hidden, experts, args.top_k, impl, dtype).to(device)
                      for impl in ("grouped_mm", "loop")}
            times: dict[str, list[float]] = {impl: [] for impl in layers}
            for impl, layer in layers.items():
                time_layer(layer, x, grad, args.layer_warmup)
            for _ in range(args.rounds):
                for impl, layer in layers.items():
                    times[impl].append(time_layer(layer, x, grad, args.iters))
            g, lp = (statistics.median(times[i]) * 1e3 for i in ("grouped_mm", "loop"))
            print(f"{dtype_name:9s} {experts:7d} {g:14.2f} {lp:10.2f} {lp / g:7.2f}x", flush=True)


# Parts 2 and 3: train.py runs ---------------------------------------------------------------------


def train_run(name: str, argv: list[str], *, nproc: int, threads: int, args, folder: Path) -> dict:
    """Run train.py (under torchrun when nproc > 1); its step time, tokens/s and peak RSS."""
    dump = folder / name
    job = [str(REPO / "train.py"), "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
           "--training.steps", str(args.warmup + args.steps), "--training.seq_len", str(args.seq_len),
           "--training.global_batch_size", str(args.global_batch),
           "--training.local_batch_size", str(args.global_batch // nproc),
           "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--metrics.enable_jsonl",
           "--metrics.no_enable_tensorboard", "--job.dump_folder", str(dump), *argv]
    cmd = [sys.executable, *job] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *job]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["step"] > args.warmup]
    tokens_per_step = args.global_batch * args.seq_len
    # tps is per device: tokens per step per device over the time since the last log.
    step_s = statistics.median(tokens_per_step / (r["tps"] * nproc) for r in measured)
    params = re.search(r"model \S+ \S+: ([\d,]+) parameters(?: \(([\d,]+) active)?", proc.stdout + proc.stderr)
    return {"name": name, "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_step / step_s,
            "max_rss_gib": max(r["max_rss"] for r in records), "loss": records[-1]["loss"],
            "params": params.group(1) if params else "?",
            "active": (params.group(2) or params.group(1)) if params else "?"}


def print_runs(title: str, runs: list[dict]) -> None:
    print(title)
    print(f"{'run':28s} {'ms/step':>9s} {'tokens/s':>9s} {'max_rss GiB':>12s} {'params (active)':>24s} "
          f"{'last loss':>9s}")
    for r in runs:
        print(f"{r['name']:28s} {r['step_ms']:9.1f} {r['tokens_per_s']:9,.0f} {r['max_rss_gib']:12.2f} "
              f"{r['params'] + ' (' + r['active'] + ')':>24s} {r['loss']:9.4f}", flush=True)


def bench_train(args, part: str) -> None:
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--moe.experts_impl", args.experts_impl]
    setting = (f"global batch {args.global_batch} x seq {args.seq_len}, fp32, {args.threads} threads in all; "
               f"median of steps {args.warmup + 1}..{args.warmup + args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if part == "ep":
            runs = []
            for rep in range(args.repeats):  # alternate, so that load from other jobs hits both
                runs.append(train_run(f"1 process #{rep + 1}", moe, nproc=1, threads=args.threads,
                                      args=args, folder=folder))
                # Each rank one thread (2 ranks on 2 cores): the same cores in all.
                runs.append(train_run(f"EP2 (2 ranks) #{rep + 1}", [*moe, "--parallelism.expert_parallel_degree", "2"],
                                      nproc=2, threads=max(1, args.threads // 2), args=args, folder=folder))
            print_runs(f"qwen3 debugmodel_moe, 1 process vs EP2: {setting}", runs)
        else:
            runs = []
            for rep in range(args.repeats):
                runs.append(train_run(f"qwen3 debugmodel_moe #{rep + 1}", moe, nproc=1, threads=args.threads,
                                      args=args, folder=folder))
                runs.append(train_run(f"llama3 debugmodel #{rep + 1}", [], nproc=1, threads=args.threads,
                                      args=args, folder=folder))
            print_runs(f"one process: {setting}", runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="layer,ep,models", help="comma-separated: layer, ep, models")
    g = ap.add_argument_group("layer")
    g.add_argument("--experts", default="8,32,128", help="comma-separated expert counts")
    g.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    g.add_argument("--tokens", type=int, default=4096, help="tokens per forward (batch x sequence)")
    g.add_argument("--dim", type=int, default=256)
    g.add_argument("--hidden", type=int, default=256, help="each expert's SwiGLU hidden size")
    g.add_argument("--top-k", type=int, default=2)
    g.add_argument("--device", default="cpu", help="cpu or cuda (layer part only)")
    g.add_argument("--iters", type=int, default=5, help="iterations per round")
    g.add_argument("--rounds", type=int, default=3, help="rounds, alternating grouped_mm and loop")
    g.add_argument("--layer-warmup", type=int, default=2, help="warm-up iterations per implementation")
    t = ap.add_argument_group("ep, models (train.py runs)")
    t.add_argument("--steps", type=int, default=8, help="measured steps per run")
    t.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    t.add_argument("--global-batch", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--threads", type=int, default=2, help="CPU threads in all (split over the ranks)")
    t.add_argument("--repeats", type=int, default=1, help="alternating repeats of each run")
    t.add_argument("--experts-impl", default="grouped_mm", choices=("grouped_mm", "loop"))
    args = ap.parse_args()

    parts = args.parts.split(",")
    unknown = set(parts) - {"layer", "ep", "models"}
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}; choose from layer, ep, models")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if "layer" in parts:
        bench_layer(args)
    for part in ("ep", "models"):
        if part in parts:
            bench_train(args, part)


if __name__ == "__main__":
    main()
