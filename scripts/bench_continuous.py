"""Continuous batching's cost per token: the debug llama (random weights) through ContinuousBatch
with --slots rows, 1, 4 and 16 concurrent requests of --new-tokens greedy tokens each, one thread.

    python scripts/bench_continuous.py               # eager
    python scripts/bench_continuous.py --compile     # the compiled decode step, every shape compiled first

The figure is CPU milliseconds per generated token (process time: a shared machine's load changes
wall time far more than the work done), the best of --repeats runs of each count. The greedy tokens
of the first request are printed so two versions can be checked to agree.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from titanlike.inference import ContinuousBatch, Engine, SamplingParams  # noqa: E402
from titanlike.models.registry import get_model_spec  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[args.flavor])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    engine = Engine(model.eval(), compile=args.compile)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (16 + 3 * i,), generator=generator).tolist() for i in range(16)]
    batch = ContinuousBatch(engine, slots=args.slots)
    print(f"llama3 {args.flavor}, context {engine.context_len}, {args.slots} slots, compiled {engine.compiled}")
    if args.compile:  # every shape before serving: OpenAIServer.warm_up (titanlike-serve compiles in the background)
        cpu, wall = time.process_time(), time.perf_counter()
        shapes = batch.warm_up()
        workers = os.times()
        print(f"compiled {shapes} shapes in {time.perf_counter() - wall:.1f} s ({time.process_time() - cpu:.1f} s of "
              f"CPU, {workers.children_user + workers.children_system:.1f} s in compile workers)", flush=True)
    for count in (1, 4, 16):
        best, first = None, None
        for _ in range(args.repeats):
            seqs = [batch.submit(p, SamplingParams(max_new_tokens=args.new_tokens)) for p in prompts[:count]]
            started = time.process_time()
            batch.run()
            ms = 1000 * (time.process_time() - started) / sum(len(s.completion.tokens) for s in seqs)
            best = ms if best is None else min(best, ms)
            first = first or seqs[0].completion.tokens
        print(f"{count:2d} requests: {best:6.2f} ms CPU per token; first request's tokens {first[:8]}", flush=True)


if __name__ == "__main__":
    main()
