"""Generation speed: titanlike's KV-cache engine against transformers' generate (static cache) on the
Hugging Face export of the same random model, and against the uncached loop the engine replaced,
in one process on the same machine.

    python scripts/bench_generate.py                       # llama3 debugmodel, batch 1 and 8
    python scripts/bench_generate.py --flavor debugmodel --dim 512 --n-layers 8 --markdown
    python scripts/bench_generate.py --compile --device cuda --dtype bfloat16   # + the compiled decode step
    python scripts/bench_generate.py --family t5 --flavor debugmodel --compile --skip-hf --skip-uncached

For each batch size: time to first token (the prefill and the first sample) and tokens per second
over the whole call (every row's new tokens / wall time, the prefill included), greedy, prompts of
--prompt-len random tokens, --new-tokens each (no stop token: every row runs to the end). Each
figure is the median of --repeats timed runs after one warm-up run, the three paths taking turns
within each repeat (a shared machine's load then hits them alike). The greedy tokens of the three
paths are compared (they must agree: the same weights, fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def ours(model, prompts, new_tokens: int, compile: bool = False):
    """A run function of the KV-cache engine: () -> (time to first token, tokens/s, tokens).
    compile: the torch.compile'd decode step on static caches of prompt + new tokens (its compile
    falls in the warm-up run)."""
    from titanlike.inference import Engine, SamplingParams

    engine = Engine(model, compile=compile, context_len=len(prompts[0]) + new_tokens if compile else None)
    params = SamplingParams(max_new_tokens=new_tokens)

    def run():
        completions, stats = engine.generate(prompts, params)
        return stats.time_to_first_token, stats.new_tokens / stats.total_time, [c.tokens for c in completions]

    return run


def transformers_static(hf, prompts, new_tokens: int):
    """transformers' generate with its static cache (time to first token: a call for one token)."""
    ids = torch.tensor(prompts, device=hf.device)  # equal lengths: no padding

    def generate(n: int):
        return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static", pad_token_id=0)

    def run():
        started = time.perf_counter()
        generate(1)
        first = time.perf_counter() - started
        started = time.perf_counter()
        out = generate(new_tokens)
        total = time.perf_counter() - started
        return first, len(prompts) * new_tokens / total, out[:, ids.shape[1]:].tolist()

    return run


def uncached(model, prompts, new_tokens: int):
    """The loop scripts/generate.py ran before the cache: a full forward over the whole sequence per token."""
    @torch.no_grad()
    def run():
        tokens = torch.tensor(prompts, device=next(model.parameters()).device)
        started = time.perf_counter()
        first = None
        for _ in range(new_tokens):
            next_ids = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_ids], dim=1)
            if first is None:
                first = time.perf_counter() - started
        total = time.perf_counter() - started
        return first, len(prompts) * new_tokens / total, tokens[:, len(prompts[0]):].tolist()

    return run


def measure(runs: dict, repeats: int) -> dict:
    """{name: ((median time to first token, median tokens/s), tokens)}: one warm-up run each, then the
    paths in turn within every repeat, so that a change in the machine's load hits them alike."""
    for run in runs.values():
        run()
    results = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return {name: ((statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)), rs[-1][2])
            for name, rs in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--dim", type=int, default=None, help="override the flavor's width")
    parser.add_argument("--n-layers", type=int, default=None, help="override the flavor's depth")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's "
                        "own); on a machine shared with other jobs 1 avoids OpenMP threads spinning against them")
    parser.add_argument("--skip-uncached", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers column: the engine against itself "
                        "(with --compile, eager against compiled tokens, for a family transformers cannot run)")
    parser.add_argument("--compile", action="store_true", help="also time the engine with its decode step "
                        "compiled (Engine(compile=True)), as a column of its own")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from titanlike.checkpoint.hf import write_hf
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(args.family)
    model_args = spec.flavors[args.flavor]
    changes = {k: v for k, v in (("dim", args.dim), ("n_layers", args.n_layers)) if v is not None}
    model_args = dataclasses.replace(model_args, **changes)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device=args.device)
    model.init_weights(seed=0)
    dtype = getattr(torch, args.dtype)
    model.to(dtype).eval()
    hf = None
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as folder:
            write_hf(model.state_dict(), spec, model_args, folder)
            architecture = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
            hf = getattr(transformers, architecture).from_pretrained(folder).to(args.device, dtype).eval()
    g = torch.Generator().manual_seed(0)
    params = model_args.num_params()
    print(f"# {args.family} {args.flavor} {changes or ''} ({params / 1e6:.1f}M parameters), prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, {args.dtype} on {args.device}; "
          f"torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs; median of "
          f"{args.repeats} after a warm-up, the paths in turn")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = torch.randint(3, model_args.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        runs = {"ours": ours(model, prompts, args.new_tokens)}
        if hf is not None:
            runs["hf"] = transformers_static(hf, prompts, args.new_tokens)
        if not args.skip_uncached:
            runs["uncached"] = uncached(model, prompts, args.new_tokens)
        if args.compile:
            runs["compiled"] = ours(model, prompts, args.new_tokens, compile=True)
        got = measure(runs, args.repeats)
        (ours_first, ours_rate), ours_tokens = got["ours"]
        same, row = True, [batch, ours_first, ours_rate]
        if hf is not None:
            (hf_first, hf_rate), hf_tokens = got["hf"]
            same = ours_tokens == hf_tokens
            row += [hf_first, hf_rate, ours_rate / hf_rate]
        if not args.skip_uncached:
            (un_first, un_rate), un_tokens = got["uncached"]
            same = same and un_tokens == ours_tokens
            row += [un_first, un_rate, ours_rate / un_rate]
        if args.compile:
            (c_first, c_rate), c_tokens = got["compiled"]
            same = same and c_tokens == ours_tokens
            row += [c_first, c_rate, c_rate / ours_rate]
        rows.append(row + [same])
    head = ["batch", "titanlike TTFT ms", "titanlike tok/s"]
    if hf is not None:
        head += ["HF static TTFT ms", "HF static tok/s", "vs HF"]
    if not args.skip_uncached:
        head += ["uncached TTFT ms", "uncached tok/s", "vs uncached"]
    if args.compile:
        head += ["compiled TTFT ms", "compiled tok/s", "vs eager"]
    head.append("same tokens")

    def cells(row):
        out = [str(row[0])]
        for i, value in enumerate(row[1:-1], 1):
            out.append(f"{value:.2f}x" if head[i].startswith("vs") else
                       f"{1000 * value:.0f}" if "TTFT" in head[i] else f"{value:.1f}")
        return out + ["yes" if row[-1] else "NO"]

    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(cells(row)) + " |")
    else:
        for row in [head] + [cells(r) for r in rows]:
            print("  ".join(f"{c:>17}" for c in row))
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
