"""Benchmark the hybrid debug model (Mamba-2 + attention + MLP layers) against the Llama 3 debug model
as the sequence grows, on this machine: training step time and peak memory at each sequence length.

Both models are the width of the Llama debug model (dim 256); the hybrid's 16 layers are 7 Mamba-2,
2 attention and 7 MLP layers, Llama's 8 blocks are 8 attention + 8 MLPs (`--models` adds `mamba2`,
8 Mamba-2 layers and nothing else). Every run trains on the same
number of tokens per step (--tokens, split into sequences of the length under test), so a model
whose cost per token is constant (Mamba-2's chunked scan) keeps its step time, while attention's
grows with the sequence. Each run is a fresh process (so its peak RSS is its own): the model built
as train.py builds it, fp32, AdamW, --warmup steps then --steps measured (median). The RoPE table
of the Llama debug model is sized for the run (its flavor's context is 2048), the only change.

    python scripts/bench_hybrid.py --seq-lens 1024,4096,16384 --tokens 16384 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"hybrid": ("hybrid", "debugmodel"), "llama3": ("llama3", "debugmodel"),
          "mamba2": ("hybrid", "debugmodel_mamba2")}
VOCAB = 2256  # the debug tokenizer's


def _rss_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_one(model_key: str, seq_len: int, tokens: int, steps: int, warmup: int) -> dict:
    """Build, then time `warmup + steps` training steps of batch tokens // seq_len; in this process."""
    import torch

    from titanlike.models.registry import get_model_spec

    torch.manual_seed(0)
    name, flavor = MODELS[model_key]
    spec = get_model_spec(name)
    # As the trainer sizes a model for a job (the RoPE table: seq_len positions); no validation, which
    # would refuse Llama's debug flavor beyond its 2048-token context.
    args = spec.flavors[flavor].update_from_config(vocab_size=VOCAB, seq_len=seq_len)
    before = _rss_gib()
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = max(1, tokens // seq_len)
    data = torch.randint(0, VOCAB, (batch, seq_len + 1))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"model": f"{name} {flavor}", "seq_len": seq_len, "batch": batch, "step_ms": step_s * 1e3,
            "tokens_per_s": batch * seq_len / step_s, "peak_rss_gib": _rss_gib(),
            "growth_gib": _rss_gib() - before, "params": args.num_params(),
            "gflop_per_token": args.flops_per_token(seq_len) / 1e9, "loss": loss.item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="1024,4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per training step (batch = tokens / seq)")
    ap.add_argument("--models", default="hybrid,llama3",
                    help="comma-separated: hybrid, llama3, mamba2 (the pure Mamba-2 debug model, 8 layers)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads per run")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "SEQ"), help=argparse.SUPPRESS)  # a child run
    args = ap.parse_args()

    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.tokens, args.steps, args.warmup)))
        return 0
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        ap.error(f"unknown model(s) {sorted(unknown)}; choose from {', '.join(MODELS)}")
    print(f"{os.cpu_count()} CPUs, {args.threads} threads per run, load average {os.getloadavg()[0]:.1f}; "
          f"{args.tokens} tokens per step, fp32, median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'model':26s} {'seq':>6s} {'batch':>5s} {'ms/step':>9s} {'tokens/s':>9s} {'peak RSS GiB':>12s} "
          f"{'GFLOP/token':>11s}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for model in models:  # alternating, so that load from other jobs hits both
            cmd = [sys.executable, __file__, "--one", model, str(seq), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{model} seq {seq}: failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{r['model']:26s} {seq:6d} {r['batch']:5d} {r['step_ms']:9.0f} {r['tokens_per_s']:9,.0f} "
                  f"{r['peak_rss_gib']:12.2f} {r['gflop_per_token']:11.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
