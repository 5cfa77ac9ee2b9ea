#!/usr/bin/env python
"""A roofline of GRPO's decode step on this CPU: what one step of scripts/bench_rl.py's batch computes,
the rate this core reaches on those matmuls alone, and the share of it titanlike's engine and
transformers' generate (what TRL's GRPOTrainer runs) achieve.

    python scripts/roofline_decode.py [--flavor debugmodel] [--prompts 4] [--generations 8]
                                      [--completion-length 64] [--rounds 3]

FLOPs: one decode step of prompts x generations rows at the middle of the completion, its weight
matmuls (the projections, the MLP, the output projection over the vocabulary) counted by
torch.utils.flop_counter, the attention over the cache by hand. The achievable rate: the same matmuls
(the step's own weights, in the step's order, so they stream from memory as in the step) in a loop, as
torch.mm (MKL's sgemm) and as oneDNN's product from prepacked weights (what the eager engine runs on a
CPU: titanlike/inference/packed.py), the faster of the two; and one large square matmul for the
core's peak. Achieved: the CPU time of the model's decode forward (titanlike's decode_step hook,
transformers' forward after the first call) and of the whole generate call per decode step (sampling
and bookkeeping included), from one generation of completion-length tokens for every row, sampled at
temperature 1 as the bench samples.

One thread, CPU time of the process (time.process_time), the two sides taking turns in each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rl import write_model  # noqa: E402


class Timed:
    """Wraps a callable and sums the CPU time of its calls after the first `skip`."""

    def __init__(self, fn, skip: int = 0):
        self.fn, self.skip, self.calls, self.seconds = fn, skip, 0, 0.0

    def __call__(self, *a, **kw):
        begin = time.process_time()
        out = self.fn(*a, **kw)
        if self.calls >= self.skip:
            self.seconds += time.process_time() - begin
        self.calls += 1
        return out

    @property
    def per_call(self) -> float:
        return self.seconds / max(1, self.calls - self.skip)


def prompt_ids(n: int, generations: int) -> list[list[int]]:
    """The bench's prompts ("add: a + b =", scripts/bench_rl.py write_prompts) as token ids, each G times."""
    import random

    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    rng = random.Random(0)
    texts = [f"add: {rng.randint(10, 49)} + {rng.randint(10, 49)} =" for _ in range(n)]
    return [tokenizer.encode(t, bos=True, eos=False) for t in texts for _ in range(generations)]


def step_flops(model, rows: int, position: int) -> tuple[int, list[tuple[int, int, int]]]:
    """FLOPs of one titanlike decode step at `position` and the (m, k, n) of its weight matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    cache = model.init_cache(rows, position + 1, device="cpu", dtype=torch.float32)
    tokens = torch.ones(rows, position, dtype=torch.long)
    model.prefill(tokens, torch.full((rows,), position), cache)
    counter = FlopCounterMode(display=False)
    with counter:
        model.decode_step(torch.ones(rows, dtype=torch.long), cache)
    shapes = [(rows, m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(2 * m * k * n for m, k, n in shapes)
    # The flop counter does not see the CPU attention kernel: scores and weighted values over the
    # position + 1 slots a new token reads, 2 x 2 x heads x head_dim FLOPs per slot, row and layer.
    args = model.model_args
    attention = 4 * rows * args.n_layers * args.dim * (position + 1)
    assert counter.get_total_flops() in (weights, weights + attention), "a matmul the count does not expect"
    return weights + attention, shapes


def _loop_seconds(weights: list[torch.Tensor], product, rows: int, repeats: int) -> float:
    """CPU seconds of product(x, w) for every weight in order, x (rows, in): one warm-up pass, then the
    mean of `repeats` passes."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    for w in weights:
        product(inputs[w.shape[1]], w)
    begin = time.process_time()
    for _ in range(repeats):
        for w in weights:
            product(inputs[w.shape[1]], w)
    return (time.process_time() - begin) / repeats


def mm_seconds(model, rows: int, repeats: int) -> float:
    """CPU seconds of the step's weight matmuls alone: x (rows, in) @ W.T for every Linear, in order."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return _loop_seconds(weights, lambda x, w: torch.mm(x, w.t()), rows, repeats)


def packed_mm_seconds(model, rows: int, repeats: int) -> float:
    """The same matmuls as oneDNN's product from prepacked weights (titanlike/inference/packed.py), what
    the eager engine runs on a CPU: on a CPU where MKL's sgemm takes a slow path (AVX2 on an AMD EPYC
    with AVX-512), this is the rate the core can reach, not torch.mm's."""
    from titanlike.inference.packed import PackedLinears

    packs = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PackedLinears.LAYOUT_ROWS)
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return _loop_seconds(packs, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                         rows, repeats)


def peak_gflops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    begin = time.process_time()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * n**3 * repeats / (time.process_time() - begin) / 1e9


def titanlike_run(model, prompts, new_tokens: int, engine=None) -> dict:
    from titanlike.inference.engine import Engine
    from titanlike.inference.sampling import SamplingParams

    engine = engine or Engine(model, context_len=len(prompts[0]) + new_tokens + 1)
    step = engine.decode_step
    engine.decode_step = Timed(step.fn if isinstance(step, Timed) else step)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0, logprobs=True)
    begin = time.process_time()
    completions, stats = engine.generate(prompts, params)
    whole = time.process_time() - begin
    return {"forward": engine.decode_step.per_call, "steps": stats.decode_steps, "whole": whole,
            "tokens": stats.new_tokens}


def transformers_run(hf, prompts, new_tokens: int) -> dict:
    ids = torch.tensor(prompts)
    forward = Timed(hf.forward, skip=1)  # the first call is the prefill
    hf.forward = forward
    try:
        begin = time.process_time()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0)
        whole = time.process_time() - begin
    finally:
        del hf.forward
    return {"forward": forward.per_call, "steps": forward.calls - 1, "whole": whole,
            "tokens": out.shape[0] * (out.shape[1] - ids.shape[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also titanlike's compiled decode step (static caches "
                        "of prompt + completion-length slots, compiled before the first round)")
    args = parser.parse_args()

    import transformers

    from titanlike.models.registry import get_model_spec

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    folder = os.path.join(tempfile.mkdtemp(prefix="roofline_"), "model")
    write_model(folder, args.flavor)
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[args.flavor])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()

    prompts = prompt_ids(args.prompts, args.generations)
    rows, new = len(prompts), args.completion_length
    middle = len(prompts[0]) + new // 2
    flops, shapes = step_flops(model, rows, middle)
    weight_flops = sum(2 * m * k * n for m, k, n in shapes)
    print(f"# llama3 {args.flavor}: {rows} rows, decode step at position {middle} (prompt {len(prompts[0])} + "
          f"{new // 2}); torch {torch.__version__}, transformers {transformers.__version__}; 1 thread, CPU time")
    print(f"FLOPs of one decode step: {flops / 1e6:.1f} M ({weight_flops / 1e6:.1f} M in the {len(shapes)} weight "
          f"matmuls, {(flops - weight_flops) / 1e6:.1f} M attention over the cache)")
    results: dict[str, list[float]] = {}

    def note(name, value):
        results.setdefault(name, []).append(value)

    sides = {"titanlike": lambda: titanlike_run(model, prompts, new),
             "transformers": lambda: transformers_run(hf, prompts, new)}
    if args.compile:
        from titanlike.inference.engine import Engine

        compiled = Engine(model, context_len=len(prompts[0]) + new + 1, compile=True)
        titanlike_run(model, prompts, new, compiled)  # the compile
        sides["titanlike compiled"] = lambda: titanlike_run(model, prompts, new, compiled)
    with torch.no_grad():
        for r in range(args.rounds):
            note("peak GFLOP/s (1024^3 mm)", peak_gflops())
            mm = mm_seconds(model, rows, 50)
            note("step's matmuls alone: ms", mm * 1e3)
            note("step's matmuls alone: GFLOP/s", weight_flops / mm / 1e9)
            packed = packed_mm_seconds(model, rows, 50)
            note("step's matmuls, oneDNN packed: ms", packed * 1e3)
            note("step's matmuls, oneDNN packed: GFLOP/s", weight_flops / packed / 1e9)
            for name, run in sides.items():
                f = run()
                whole_per_step = f["whole"] / (f["steps"] + 1)
                note(f"{name} decode forward: ms", f["forward"] * 1e3)
                note(f"{name} decode forward: GFLOP/s", flops / f["forward"] / 1e9)
                note(f"{name} generate per step: ms", whole_per_step * 1e3)
                note(f"{name} generate: tokens/s", f["tokens"] / f["whole"])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()), flush=True)
    median = {k: statistics.median(v) for k, v in results.items()}
    print("\nmedian of", args.rounds, "rounds:")
    for k, v in median.items():
        print(f"  {k:42s} {v:9.2f}")
    # The achievable rate: the faster of the two products of the step's matmuls.
    mm_rate = max(median["step's matmuls alone: GFLOP/s"], median["step's matmuls, oneDNN packed: GFLOP/s"])
    for name in sides:
        forward = median[f"{name} decode forward: GFLOP/s"]
        whole = flops / (median[f"{name} generate per step: ms"] / 1e3) / 1e9
        print(f"  {name}: decode forward at {forward / mm_rate:.0%} of the matmuls' achievable rate "
              f"({forward:.1f} / {mm_rate:.1f} GFLOP/s); the whole generate call at {whole / mm_rate:.0%}")
    theirs = median["transformers generate per step: ms"]
    floor = min(median["step's matmuls alone: ms"], median["step's matmuls, oneDNN packed: ms"])
    print(f"  2x transformers' generate: {theirs / 2:.2f} ms per step, against {floor:.2f} ms for the step's matmuls "
          f"alone: {floor / (theirs / 2):.0%} of the achievable rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
