#!/usr/bin/env python
"""Benchmark of the Megatron-format data pipeline.

    python scripts/bench_data.py [--copies 8] [--workers 1,2] [--seq-len 2048]

Measures, on this machine:
1. preprocessing throughput (docs/s, tokens/s, MB/s) per worker count, on the shipped corpus
   repeated `--copies` times (generated text if the corpus is missing), and checks that every
   worker count writes the same bytes;
2. GPTDataset index build time, on the preprocessed data and on synthetic sequence lengths at
   billions of tokens (no .bin needed: the index depends on lengths only);
3. BlendedDataset index build time;
4. random-access sample reads/s from a cached GPTDataset.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from titanlike.data.blend import build_blending_indices  # noqa: E402
from titanlike.data.gpt_dataset import GPTDataset, build_gpt_indices  # noqa: E402
from titanlike.data.indexed import IndexedDataset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_preprocess():
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data",
                                                  os.path.join(HERE, "preprocess_data.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = mod  # worker processes find the task function by name
    spec.loader.exec_module(mod)
    return mod


def make_corpus(path: str, copies: int) -> str:
    try:
        from titanlike.data import DEFAULT_CORPUS_PATH
        with gzip.open(DEFAULT_CORPUS_PATH, "rb") as f:
            lines = [ln for ln in f if ln.strip()]
        source = f"{os.path.basename(DEFAULT_CORPUS_PATH)} x{copies}"
    except (ImportError, OSError):
        rnd = random.Random(0)
        words = [w for w in "the of and to in that he shall unto for his i they be is lord not "
                 "him them with all thou was which my said".split()]
        lines = [(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(700))}) + "\n"
                  ).encode() for _ in range(1200)]
        source = f"generated text x{copies}"
    with open(path, "wb") as out:
        for _ in range(copies):
            out.writelines(lines)
    return source


def file_digest(prefix: str) -> str:
    h = hashlib.sha256()
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def timed(fn, repeat: int = 1):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=8, help="repeat the corpus this many times")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--repeat", type=int, default=3,
                    help="preprocessing runs per worker count; the fastest is reported, as the "
                         "one least disturbed by other load on a shared machine")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--reads", type=int, default=20000, help="random sample reads to time")
    ap.add_argument("--synthetic-docs", type=int, default=10_000_000,
                    help="documents for the synthetic index build (mean 1000 tokens each)")
    ap.add_argument("--blend-samples", type=int, default=1_000_000)
    ap.add_argument("--workdir", default=None, help="keep files here instead of a temp dir")
    args = ap.parse_args(argv)

    pp = _load_preprocess()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_data_")
    os.makedirs(workdir, exist_ok=True)
    load = "n/a" if not hasattr(os, "getloadavg") else ", ".join(
        f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs, load average {load}, python "
          f"{sys.version.split()[0]}, numpy {np.__version__}")

    corpus = os.path.join(workdir, "corpus.jsonl")
    source = make_corpus(corpus, args.copies)
    size_mb = os.path.getsize(corpus) / 2**20
    print(f"\n[preprocess] input: {source}, {size_mb:.1f} MB, best of {args.repeat} runs")
    print(f"{'workers':>8} {'docs':>8} {'tokens':>11} {'seconds':>8} {'docs/s':>9} "
          f"{'tokens/s':>11} {'MB/s':>7}  sha256(bin+idx)")
    digests = set()
    prefix = None
    for w in [int(x) for x in args.workers.split(",")]:
        out = os.path.join(workdir, f"w{w}")
        runs = []
        for _ in range(max(1, args.repeat)):
            with open(os.devnull, "w") as quiet:
                runs.append(pp.preprocess(corpus, out, workers=w, append_eod=True,
                                          stream=quiet))
        s = min(runs, key=lambda r: r["seconds"])
        prefix = s["outputs"]["text"]
        digests.add(file_digest(prefix))
        print(f"{w:>8} {s['documents']:>8} {s['tokens']:>11} {s['seconds']:>8.2f} "
              f"{s['documents'] / s['seconds']:>9.0f} {s['tokens'] / s['seconds']:>11.0f} "
              f"{s['bytes'] / s['seconds'] / 2**20:>7.2f}  {file_digest(prefix)}")
    print(f"identical output across worker counts: {len(digests) == 1}")

    ds = IndexedDataset(prefix)
    seq = args.seq_len
    print(f"\n[GPTDataset index build] seq_len {seq}")
    for n_samples in (None, 100_000, 1_000_000):
        (_, sample_index, _, epochs), t = timed(lambda: build_gpt_indices(
            ds.sequence_lengths, np.arange(len(ds), dtype=np.int32), seq, n_samples, 1234))
        label = "1 epoch" if n_samples is None else f"{n_samples} samples"
        print(f"  corpus ({ds.num_tokens} tokens, {len(ds)} docs), {label}: "
              f"{sample_index.shape[0] - 1} samples over {epochs} epochs in {t:.3f}s")
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, args.synthetic_docs).astype(np.int32)
    total = int(lengths.sum(dtype=np.int64))
    n = (total - 1) // 4096
    (_, sample_index, _, _), t = timed(lambda: build_gpt_indices(
        lengths, np.arange(lengths.size, dtype=np.int32), 4096, n, 1234))
    print(f"  synthetic {lengths.size} docs / {total / 1e9:.1f}B tokens, seq_len 4096: "
          f"{n} samples in {t:.2f}s")

    print("\n[BlendedDataset index build]")
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2]):
        _, t = timed(lambda: build_blending_indices(weights, args.blend_samples))
        print(f"  {len(weights)} datasets, {args.blend_samples} samples: {t:.2f}s "
              f"({args.blend_samples / t / 1e6:.1f}M samples/s)")

    print(f"\n[random access] GPTDataset seq_len {seq}, cached index (mmap)")
    cache = os.path.join(workdir, "cache")
    GPTDataset(prefix, seq_len=seq, num_samples=200_000, seed=1, split="1", cache_dir=cache)
    (gds, t_load) = timed(lambda: GPTDataset(prefix, seq_len=seq, num_samples=200_000, seed=1,
                                              split="1", cache_dir=cache))
    assert gds.loaded_from_cache
    idx = rng.integers(0, len(gds), args.reads)
    for i in idx[:1000]:  # warm the page cache so the figure is not the disk's
        gds[int(i)]
    _, t = timed(lambda: [gds[int(i)] for i in idx], repeat=3)
    print(f"  cache load {t_load * 1e3:.1f} ms; {args.reads} random reads of {seq + 1} tokens: "
          f"{args.reads / t:.0f} samples/s ({args.reads * (seq + 1) / t / 1e6:.1f}M tokens/s), "
          f"{t / args.reads * 1e6:.1f} us/sample")
    if not args.workdir:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
