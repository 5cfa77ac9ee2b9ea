#!/usr/bin/env python
"""Tokenize JSONL into Megatron's MMIDIDX `.bin`/`.idx` (drop-in for Megatron's
tools/preprocess_data.py).

    python scripts/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/corpus \\
        --json-keys text --append-eod --workers 8 [--tokenizer-model path]

writes `data/corpus_text_document.bin` and `.idx` (one pair per JSON key). The files are
byte-compatible with Megatron's: Megatron-LM can train on them and we can train on theirs.

With `--split-sentences` (the data of masked-LM / span-corruption models, BERT and T5), each
sentence of a document is one sequence and the `.idx` document index groups a document's
sentences, as Megatron writes them; the outputs are then `{prefix}_{key}_sentence.bin/.idx`.
Sentences are split by NLTK's punkt when NLTK and its data are already installed, otherwise
by titanlike's rule-based splitter (`--sentence-splitter`, see titanlike/data/sentences.py).

Differences from Megatron, on purpose:
* a malformed line (bad JSON, missing key, value neither a string nor a list of strings) is
  counted, reported at the end and skipped; but an input with no valid line (empty, or every
  line malformed) or no token under a key is an error that writes nothing;
* outputs appear atomically (temporary names renamed at the end); a failed run leaves no
  half-written `.bin`/`.idx` and says "wrote" for nothing;
* tokenizer flags other than `--tokenizer-model` are accepted and ignored: the tokenizer is
  whatever `titanlike.data.tokenizer.build_tokenizer(--tokenizer-model)` loads.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from typing import Callable, Iterator

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from titanlike.data.errors import DataError  # noqa: E402
from titanlike.data.indexed import (  # noqa: E402
    IndexedDatasetWriter,
    data_file_path,
    index_file_path,
    optimal_dtype,
)

MALFORMED_KINDS = ("bad_json", "not_an_object", "missing_key", "not_text")

# Megatron flags that mean nothing here; accepted so existing command lines keep working.
_IGNORED_FLAGS = {
    "--tokenizer-type": 1, "--vocab-file": 1, "--merge-file": 1, "--vocab-size": 1,
    "--vocab-extra-ids": 1, "--tokenizer-hf-use-fast": 0,
    "--tokenizer-hf-include-special-tokens": 0,
    "--tiktoken-pattern": 1, "--tiktoken-num-special-tokens": 1, "--tiktoken-special-tokens": "+",
    "--tokenizer-metadata": 1, "--tokenizer-special-tokens": "+", "--tokenizer-prompt-format": 1,
    "--lang": 1, "--keep-newlines": 0, "--partitions": 1, "--keep-sequential-samples": 0,
    "--find-optimal-num-workers": 0, "--workers-to-check": "+", "--max-documents": 1,
    "--performance-dir": 1, "--make-vocab-size-divisible-by": 1,
    # older Megatron / Megatron-DeepSpeed command lines
    "--dataset-impl": 1, "--keep-empty": 0, "--chunk-size": 1, "--log-interval-seconds": 1,
}


def default_tokenizer_path() -> str | None:
    try:
        from titanlike.data import DEFAULT_TOKENIZER_PATH
    except ImportError:
        return None
    return DEFAULT_TOKENIZER_PATH


def load_tokenizer(path: str):
    from titanlike.data.tokenizer import build_tokenizer
    return build_tokenizer(path)


# -- worker side ---------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(loader: Callable, tokenizer_path: str, json_keys: list[str], append_eod: bool,
                 dtype: str, splitter: str | None = None) -> None:
    tok = loader(tokenizer_path)
    split = None
    if splitter is not None:
        from titanlike.data.sentences import sentence_splitter
        split = sentence_splitter(splitter)[1]
    _WORKER.update(tok=tok, keys=json_keys, eod=append_eod, dtype=np.dtype(dtype),
                   eos=tok.eos_id, split=split)


def _encode_chunk(chunk: tuple[int, list[bytes]]):
    """Tokenize a chunk of lines; returns per-key (token bytes, sequence lengths, sequences per
    document) plus the malformed lines as (line number, kind)."""
    first_line, lines = chunk
    tok, keys, eod, dtype = _WORKER["tok"], _WORKER["keys"], _WORKER["eod"], _WORKER["dtype"]
    out = {k: ([], [], []) for k in keys}  # token arrays, sequence lengths, sequences per doc
    bad: list[tuple[int, str]] = []
    n_bytes = 0
    for lineno, line in enumerate(lines, start=first_line):
        n_bytes += len(line)
        try:
            obj = json.loads(line)
        except ValueError:  # includes UnicodeDecodeError
            bad.append((lineno, "bad_json"))
            continue
        if not isinstance(obj, dict):
            bad.append((lineno, "not_an_object"))
            continue
        texts = {}
        for k in keys:
            if k not in obj:
                bad.append((lineno, "missing_key"))
                break
            v = obj[k]
            # Megatron reads a list of strings as pre-split sentences: one sequence each
            if isinstance(v, str):
                texts[k] = [v]
            elif isinstance(v, list) and all(isinstance(s, str) for s in v):
                texts[k] = v
            else:
                bad.append((lineno, "not_text"))
                break
            if _WORKER["split"] is not None:  # --split-sentences: one sequence per sentence
                texts[k] = [s for text in texts[k] for s in _WORKER["split"](text)]
        else:
            for k in keys:
                toks, lens, docs = out[k]
                doc: list[int] = []
                seq_lens: list[int] = []
                for sentence in texts[k]:
                    ids = tok.encode(sentence, bos=False, eos=False)
                    if ids:
                        doc.extend(ids)
                        seq_lens.append(len(ids))
                # as in Megatron: an empty document stays a document with no sequences, and
                # gets no end-of-document token
                if doc and eod:
                    doc.append(_WORKER["eos"])
                    seq_lens[-1] += 1
                toks.append(np.asarray(doc, dtype=np.int64))
                lens.extend(seq_lens)
                docs.append(len(seq_lens))
    result = {}
    for k, (toks, lens, docs) in out.items():
        flat = np.concatenate(toks) if toks else np.zeros(0, np.int64)
        if flat.size:
            info = np.iinfo(dtype)
            if flat.min() < info.min or flat.max() > info.max:
                raise ValueError(f"token ids [{flat.min()}, {flat.max()}] do not fit {dtype}: "
                                 "the tokenizer's vocab_size is wrong")
        result[k] = (flat.astype(dtype).tobytes(), np.asarray(lens, np.int64),
                     np.asarray(docs, np.int64))
    return result, bad, len(lines), n_bytes


# -- main side -----------------------------------------------------------------------------------


def _open_input(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _chunks(f, chunk_lines: int) -> Iterator[tuple[int, list[bytes]]]:
    lineno = 1
    while True:
        lines = list(itertools.islice(f, chunk_lines))
        if not lines:
            return
        yield lineno, lines
        lineno += len(lines)


def _ordered_results(func, chunks, workers: int, initargs) -> Iterator:
    """Results of func over chunks, in input order.

    At most a few chunks per worker are in flight: Pool.imap reads its whole input ahead and
    buffers results without bound, which for a multi-GB input is that much RAM.
    """
    if workers <= 1:
        _init_worker(*initargs)
        for c in chunks:
            yield func(c)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for c in chunks:
            pending.append(pool.apply_async(func, (c,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """Megatron prints every --log-interval documents; with chunked workers we check once per
    chunk, and never print more than once a second."""

    def __init__(self, every_docs: int, stream) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.every = max(1, every_docs)
        self.next_at = self.every
        self.stream = stream

    def line(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> str:
        el = max(time.perf_counter() - self.start, 1e-9)
        return (f"{'done:' if final else 'processed'} {docs} docs in {el:.1f}s "
                f"({docs / el:.0f} docs/s, {tokens / el:.0f} tokens/s, "
                f"{nbytes / el / 2**20:.2f} MB/s)")

    def tick(self, docs: int, tokens: int, nbytes: int) -> None:
        if docs < self.next_at:
            return
        self.next_at = (docs // self.every + 1) * self.every
        now = time.perf_counter()
        if now - self.last >= 1.0:
            self.last = now
            print(self.line(docs, tokens, nbytes), file=self.stream, flush=True)


def _check_usable(input_path: str, json_keys: list[str], lines: int, docs: int,
                  key_tokens: dict[str, int], bad_total: dict[str, int],
                  bad_examples: list[tuple[int, str]]) -> None:
    """DataError (one sentence) for an input that would give an empty dataset; the caller then
    removes the temporary outputs, so nothing is published."""
    if lines == 0:
        raise DataError(f"input {input_path} is empty: no line to tokenize, nothing written")
    keys = ", ".join(repr(k) for k in json_keys)
    if docs == 0:
        detail = ", ".join(f"{k}={v}" for k, v in bad_total.items() if v)
        first = ", ".join(f"line {n}: {k}" for n, k in bad_examples[:3])
        raise DataError(f"no valid line in {input_path}: all {lines} lines are malformed ({detail}; first: "
                        f"{first}), nothing written; each line must be a JSON object with the key(s) {keys} "
                        "(--json-keys) holding text")
    empty = [k for k, n in key_tokens.items() if n == 0]
    if empty:
        raise DataError(f"the {docs} valid lines of {input_path} hold no token under "
                        f"{', '.join(repr(k) for k in empty)} (every document is empty), nothing written")


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    """Megatron's output name: level "document", or "sentence" with --split-sentences."""
    return f"{output_prefix}_{key}_{level}"


def preprocess(input_path: str, output_prefix: str, *, json_keys=("text",),
               append_eod: bool = False, workers: int = 1, tokenizer_path: str | None = None,
               tokenizer_loader: Callable = load_tokenizer, chunk_lines: int = 256,
               log_interval: int = 1000, stream=sys.stderr, split_sentences: bool = False,
               sentence_splitter: str = "auto") -> dict:
    """Tokenize one JSONL(.gz) file; returns a summary dict (counts, outputs, timings).

    split_sentences: one sequence per sentence, split by `sentence_splitter` ("auto", "nltk",
    "regex"; see titanlike.data.sentences), written under the "sentence" level name.
    """
    json_keys = list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ValueError(f"--json-keys must be distinct and non-empty: {json_keys}")
    if tokenizer_path is None:
        tokenizer_path = default_tokenizer_path()
        if tokenizer_path is None:
            raise RuntimeError("no --tokenizer-model given and titanlike.data has no "
                               "DEFAULT_TOKENIZER_PATH")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input not found: {input_path}")
    splitter = None
    if split_sentences:
        from titanlike.data.sentences import sentence_splitter as resolve_splitter
        splitter = resolve_splitter(sentence_splitter)[0]  # "auto" settles here, once for every worker
        print(f"splitting sentences with the {splitter} splitter", file=stream, flush=True)
    tok = tokenizer_loader(tokenizer_path)
    dtype = optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    level = "sentence" if split_sentences else "document"
    prefixes = {k: output_prefix_for(output_prefix, k, level) for k in json_keys}
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    docs = tokens = nbytes = lines = 0
    key_tokens = {k: 0 for k in json_keys}
    bad_total = {kind: 0 for kind in MALFORMED_KINDS}
    bad_examples: list[tuple[int, str]] = []
    progress = _Progress(log_interval, stream)
    initargs = (tokenizer_loader, tokenizer_path, json_keys, append_eod, dtype.str, splitter)
    try:
        with _open_input(input_path) as f:
            for result, bad, n_lines, n_bytes in _ordered_results(
                    _encode_chunk, _chunks(f, chunk_lines), workers, initargs):
                for k, (tok_bytes, lens, per_doc) in result.items():
                    writers[k].add_encoded(tok_bytes, lens, per_doc)
                    key_tokens[k] += len(tok_bytes) // dtype.itemsize
                lines += n_lines
                docs += n_lines - len(bad)
                tokens += len(result[json_keys[0]][0]) // dtype.itemsize
                nbytes += n_bytes
                for lineno, kind in bad:
                    bad_total[kind] += 1
                    if len(bad_examples) < 10:
                        bad_examples.append((lineno, kind))
                progress.tick(docs, tokens, nbytes)
        _check_usable(input_path, json_keys, lines, docs, key_tokens, bad_total, bad_examples)
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    elapsed = time.perf_counter() - progress.start
    print(progress.line(docs, tokens, nbytes, final=True), file=stream, flush=True)
    n_bad = sum(bad_total.values())
    if n_bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad_total.items() if v)
        examples = ", ".join(f"line {n}: {k}" for n, k in bad_examples)
        print(f"skipped {n_bad} malformed line(s) ({detail}); first: {examples}", file=stream,
              flush=True)
    for k, p in prefixes.items():
        print(f"wrote {data_file_path(p)} and {index_file_path(p)}", file=stream, flush=True)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "malformed": n_bad,
            "malformed_by_kind": bad_total, "malformed_examples": bad_examples,
            "outputs": prefixes, "dtype": str(dtype), "seconds": elapsed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, optionally gzip-compressed (.gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; one output pair per key (default: text)")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence, documents grouped in the index (BERT / T5 data); "
                        "writes {prefix}_{key}_sentence.bin/.idx")
    g.add_argument("--sentence-splitter", choices=("auto", "nltk", "regex"), default="auto",
                   help="auto: NLTK punkt when NLTK and its data are installed, else the rule-based "
                        "regex splitter (default auto)")
    g = p.add_argument_group("tokenization")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer path for titanlike's build_tokenizer (default: the shipped "
                        "debug tokenizer)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document (eos) token to every non-empty document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines (at most one a second)")
    g.add_argument("--chunk-lines", type=int, default=256, help="lines per task sent to a worker")
    g = p.add_argument_group("accepted for Megatron compatibility and ignored")
    for flag, nargs in _IGNORED_FLAGS.items():
        if nargs == 0:
            g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, nargs=None if nargs == 1 else nargs, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None, tokenizer_loader: Callable = load_tokenizer) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    given = [f for f in _IGNORED_FLAGS
             if getattr(args, f.lstrip("-").replace("-", "_")) not in (None, False)]
    if given:
        print(f"note: ignoring Megatron flag(s) {', '.join(given)}: the tokenizer comes from "
              "--tokenizer-model and work is split across --workers", file=sys.stderr)
    try:
        summary = preprocess(args.input, args.output_prefix, json_keys=args.json_keys,
                             append_eod=args.append_eod, workers=args.workers,
                             tokenizer_path=args.tokenizer_model,
                             tokenizer_loader=tokenizer_loader, chunk_lines=args.chunk_lines,
                             log_interval=args.log_interval, split_sentences=args.split_sentences,
                             sentence_splitter=args.sentence_splitter)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # An input with nothing usable (empty, every line malformed: usually the wrong --json-keys)
    # raised above and wrote nothing.
    return 0 if summary["documents"] else 1


if __name__ == "__main__":
    sys.exit(main())
