"""Generation speed when the rows' lengths have a long tail: Engine.generate with compaction (the rows
still running move to a smaller cache once half the rows or fewer run: titanlike/inference/engine.py)
against Engine(compact=False), which decodes every row until the longest ends.

    python scripts/bench_compaction.py                     # llama3 debugmodel, 8 prompts x 8 rows, 128 tokens
    python scripts/bench_compaction.py --rows 64 --prompts 8 --new-tokens 128 --mean-length 16 --rounds 5

A GRPO-like batch: --prompts prompts of --prompt-len random tokens, each --rows / --prompts times,
sampled at temperature 1 with a seed. The random model draws nearly uniformly, so a stop set of
vocabulary / --mean-length token ids ends a row with about that mean length (geometric lengths: most
rows end early, a few run far). Time is the process's CPU time at one thread (time.process_time), the
two engines taking turns within each round; the tokens of both are checked to be the same. Prints each
round's tokens per second of both, the rows the decode steps computed, and the median ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="a llama3 flavor")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts (rows share them, as GRPO's G)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mean-length", type=float, default=16.0, help="the rows' mean length (the stop set's size)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from titanlike.inference import Engine, SamplingParams
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    model_args = spec.flavors[args.flavor]
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.eval()
    vocab = model_args.vocab_size
    g = torch.Generator().manual_seed(0)
    distinct = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = [distinct[i % args.prompts] for i in range(args.rows)]
    stop = frozenset(range(3, 3 + max(1, round(vocab / args.mean_length))))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, stop_token_ids=stop)

    engines = {"compact": Engine(model), "every row": Engine(model, compact=False)}
    decoded = {}
    for name, engine in engines.items():  # the rows each decode step computes; one warm-up call each
        rows, real = [], engine.decode_step
        engine.decode_step = lambda tokens, cache, rows=rows, real=real: rows.append(cache.batch_size) or \
            real(tokens, cache)
        decoded[name] = rows
        engine.generate(prompts, params)
    lengths = None
    ratios = []
    print(f"# llama3 {args.flavor}, {args.rows} rows ({args.prompts} prompts), up to {args.new_tokens} tokens, "
          f"{len(stop)} stop ids; torch {torch.__version__}; 1 thread, CPU time")
    for r in range(args.rounds):
        rates = {}
        for name, engine in engines.items():
            decoded[name].clear()
            started = time.process_time()
            completions, stats = engine.generate(prompts, params)
            seconds = time.process_time() - started
            tokens = [c.tokens for c in completions]
            assert lengths is None or tokens == lengths, "the two engines drew different tokens"
            lengths = tokens
            rates[name] = stats.new_tokens / seconds
            print(f"round {r + 1} {name:9s} {rates[name]:8.1f} tok/s  {seconds:6.3f} s  {stats.new_tokens} tokens  "
                  f"{stats.decode_steps} decode steps  {sum(decoded[name])} rows decoded")
        ratios.append(rates["compact"] / rates["every row"])
    n = sorted(len(t) for t in lengths)
    print(f"lengths: min {n[0]}, median {n[len(n) // 2]}, max {n[-1]}, mean {sum(n) / len(n):.1f}")
    print(f"compact / every row: {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
