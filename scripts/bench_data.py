#!/usr/bin/env python
"""Benchmark of the Megatron-format data pipeline.

    python scripts/bench_data.py [--copies 8] [--workers 1,2] [--seq-len 2048] [--compare-megatron]

Measures, on this machine:
1. preprocessing throughput (docs/s, tokens/s, MB/s) per worker count, on the shipped corpus
   repeated `--copies` times (generated text if the corpus is missing), and checks that every
   worker count writes the same bytes; with `--compare-megatron`, the same for Megatron-LM's
   pipeline structure (tools/preprocess_data.py) with megatron-core's writer and our tokenizer,
   run alternately with ours, and checks that both write the same bytes;
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
import multiprocessing
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

    if "preprocess_data" in sys.modules:  # already loaded (e.g. by a test): keep one copy
        return sys.modules["preprocess_data"]
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


def file_digest(prefix: str) -> tuple[str, str]:
    """Short sha256 of the .bin and of the .idx."""
    out = []
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as f:
            out.append(hashlib.sha256(f.read()).hexdigest()[:11])
    return tuple(out)


# -- Megatron's pipeline structure, for --compare-megatron ----------------------------------------
#
# Megatron-LM's tools/preprocess_data.py (no --split-sentences, one partition) cannot run here: it
# needs Megatron-LM's training package for its arguments and tokenizer. What follows reproduces its
# structure: the main process builds a tokenizer and opens the input as text, a
# multiprocessing.Pool(workers) whose initializer builds each worker's tokenizer tokenizes one
# JSON line per task through Pool.imap(encode, lines, chunksize=32), and the main process hands
# each document's token list and sentence lengths to megatron-core's IndexedDatasetBuilder
# (add_document), then finalize(). The tokenizer is ours, behind the two names Megatron's code
# uses (`tokenize`, `eod`), so that both sides tokenize the same way.


class _MegatronStyleTokenizer:
    def __init__(self, path: str) -> None:
        from titanlike.data.tokenizer import build_tokenizer
        self._tok = build_tokenizer(path)
        self.vocab_size = self._tok.vocab_size
        self.eod = self._tok.eos_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, bos=False, eos=False)


class _MegatronStyleEncoder:
    """Megatron's Encoder: an object whose bound `encode` is the Pool's task, with the worker's
    tokenizer kept on the class by the Pool initializer."""

    tokenizer = None

    def __init__(self, tokenizer_path: str, json_keys: list[str], append_eod: bool) -> None:
        self.tokenizer_path = tokenizer_path
        self.json_keys = json_keys
        self.append_eod = append_eod

    def initializer(self) -> None:
        _MegatronStyleEncoder.tokenizer = _MegatronStyleTokenizer(self.tokenizer_path)

    def encode(self, json_line: str):
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in self.json_keys:
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            doc_ids: list[int] = []
            sentence_lens: list[int] = []
            for sentence in sentences:
                sentence_ids = _MegatronStyleEncoder.tokenizer.tokenize(sentence)
                if sentence_ids:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if doc_ids and self.append_eod:
                doc_ids.append(_MegatronStyleEncoder.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key] = doc_ids
            lens[key] = sentence_lens
        return ids, lens, len(json_line)


def megatron_style_preprocess(input_path: str, output_prefix: str, tokenizer_path: str,
                              workers: int, json_keys=("text",), append_eod: bool = True) -> dict:
    """Megatron's process_json_file on megatron-core's IndexedDatasetBuilder; returns counts and
    the wall time from tokenizer load to finalized files (as `preprocess` measures ours)."""
    from megatron.core.datasets import indexed_dataset as mid

    json_keys = list(json_keys)
    t0 = time.perf_counter()
    encoder = _MegatronStyleEncoder(tokenizer_path, json_keys, append_eod)
    tokenizer = _MegatronStyleTokenizer(tokenizer_path)
    docs = tokens = nbytes = 0
    with open(input_path, "r", encoding="utf-8") as fin:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        try:
            encoded_docs = pool.imap(encoder.encode, fin, 32)
            prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
            builders = {k: mid.IndexedDatasetBuilder(
                p + ".bin", dtype=mid.DType.optimal_dtype(tokenizer.vocab_size))
                for k, p in prefixes.items()}
            for doc, sentence_lens, bytes_processed in encoded_docs:
                nbytes += bytes_processed
                for key in doc:
                    builders[key].add_document(doc[key], sentence_lens[key])
                docs += 1
                tokens += len(doc[json_keys[0]])
            for k, p in prefixes.items():
                builders[k].finalize(p + ".idx")
            pool.close()
            pool.join()
        finally:
            pool.terminate()  # only matters when something above raised
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "outputs": prefixes,
            "seconds": time.perf_counter() - t0}


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
    ap.add_argument("--compare-megatron", action="store_true",
                    help="also run Megatron-LM's preprocessing structure (Pool.imap of one line "
                         "per task, megatron-core's IndexedDatasetBuilder) with our tokenizer, "
                         "and check that it writes the same bytes")
    ap.add_argument("--preprocess-only", action="store_true",
                    help="stop after the preprocessing section")
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
    def run_ours(out: str, w: int) -> dict:
        with open(os.devnull, "w") as quiet:
            return pp.preprocess(corpus, out, workers=w, append_eod=True, stream=quiet)

    sides = [("ours", run_ours)]
    if args.compare_megatron:
        import warnings
        with warnings.catch_warnings():  # megatron.core warns that Apex/TE are missing
            warnings.simplefilter("ignore")
            try:
                import megatron.core
                import megatron.core.datasets.indexed_dataset  # noqa: F401
            except ImportError as e:
                print(f"--compare-megatron needs megatron-core: {e}", file=sys.stderr)
                return 2
        tok_path = pp.default_tokenizer_path()
        sides.append(("megatron", lambda out, w: megatron_style_preprocess(
            corpus, out, tok_path, w, append_eod=True)))
    print(f"\n[preprocess] input: {source}, {size_mb:.1f} MB, best of {args.repeat} runs, "
          "--append-eod, wall time from tokenizer load to finalized files")
    if args.compare_megatron:
        print("  ours     = scripts/preprocess_data.py (preprocess())\n"
              "  megatron = Megatron's pipeline structure with megatron-core's writer and our "
              f"tokenizer\n             (megatron-core {megatron.core.__version__} "
              "IndexedDatasetBuilder; not Megatron-LM's script itself, which needs\n"
              "             Megatron-LM's training package); runs alternate between the two")
    print(f"{'pipeline':>9} {'workers':>8} {'docs':>8} {'tokens':>11} {'seconds':>8} "
          f"{'docs/s':>9} {'tokens/s':>11} {'MB/s':>7}  sha256(bin) sha256(idx)")
    digests: dict[str, set] = {name: set() for name, _ in sides}
    prefix = None
    for w in [int(x) for x in args.workers.split(",")]:
        best: dict[str, dict] = {}
        for _ in range(max(1, args.repeat)):
            for name, run in sides:
                t0 = time.perf_counter()
                r = run(os.path.join(workdir, f"{name}_w{w}"), w)
                r["wall"] = time.perf_counter() - t0
                if name not in best or r["wall"] < best[name]["wall"]:
                    best[name] = r
        for name, _ in sides:
            s = best[name]
            p = s["outputs"]["text"]
            d = file_digest(p)
            digests[name].add(d)
            if name == "ours":
                prefix = p
            t = s["wall"]
            print(f"{name:>9} {w:>8} {s['documents']:>8} {s['tokens']:>11} {t:>8.2f} "
                  f"{s['documents'] / t:>9.0f} {s['tokens'] / t:>11.0f} "
                  f"{os.path.getsize(corpus) / t / 2**20:>7.2f}  {' '.join(d)}")
        if args.compare_megatron:
            print(f"{'':>9} {w:>8} ours / megatron: "
                  f"{best['megatron']['wall'] / best['ours']['wall']:.2f}x the throughput")
    same = all(len(d) == 1 for d in digests.values())
    print(f"identical output across worker counts: {same}")
    if args.compare_megatron:
        same_as_megatron = digests["ours"] == digests["megatron"]
        print(f"ours byte-identical to the Megatron-structured pipeline (.bin and .idx): "
              f"{same_as_megatron}")
        same = same and same_as_megatron
    if args.preprocess_only:
        if not args.workdir:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)
        return 0 if same else 1

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
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
