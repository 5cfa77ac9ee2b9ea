"""Tokenize JSONL into Megatron's MMIDIDX `.bin`/`.idx` (drop-in for Megatron's
tools/preprocess_data.py).

    titanlike-preprocess-data --input corpus.jsonl[.gz] --output-prefix data/corpus \\
        --json-keys text --append-eod --workers 8 [--tokenizer-model path]
    titanlike-preprocess-data --input corpus.jsonl --output-prefix data/corpus --append-eod \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

(scripts/preprocess_data.py in a checkout) writes `data/corpus_text_document.bin` and `.idx` (one pair
per JSON key). The files are
byte-compatible with Megatron's: Megatron-LM can train on them and we can train on theirs.

Tokenizers: without --tokenizer-type, titanlike's own (`--tokenizer-model`: a tiktoken ranks file or
a tokenizer.json folder; default the shipped debug tokenizer). With Megatron's --tokenizer-type
(GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer / GPTSentencePieceTokenizer /
Llama2Tokenizer, TikTokenizer, NullTokenizer) and the files it reads, the ids are megatron-core
0.16.1's (titanlike/data/megatron_tokenizers.py has the table). Nothing is downloaded. The end of the
run prints the train.py flags that give training this data's vocabulary (GPT2BPETokenizer writes a
tokenizer.json folder `{prefix}_tokenizer` for it); where titanlike cannot train with the tokenizer
type (SentencePiece, Megatron's TikTokenizer .json, NullTokenizer) a note says so before tokenizing.

With `--split-sentences` (the data of masked-LM / span-corruption models, BERT and T5), each
sentence of a document is one sequence and the `.idx` document index groups a document's
sentences, as Megatron writes them; the outputs are then `{prefix}_{key}_sentence.bin/.idx`.
Sentences are split by NLTK's punkt when NLTK and its data are already installed, otherwise
by titanlike's rule-based splitter (`--sentence-splitter`, see titanlike/data/sentences.py);
`--keep-newlines` keeps the newlines after a sentence with it, `--lang` is punkt's language.

`--partitions N` orders the documents as Megatron's partitioned run does (document i goes to
partition i mod N, partitions concatenated; `--keep-sequential-samples` keeps the input order), with
`--input` then a glob of files (read in sorted order); no partition file is written. `--max-documents N`
reads the first N documents only.

Differences from Megatron, on purpose:
* a malformed line (bad JSON, missing key, value neither a string nor a list of strings) is
  counted, reported at the end and skipped; but an input with no valid line (empty, or every
  line malformed) or no token under a key is an error that writes nothing;
* outputs appear atomically (temporary names renamed at the end); a failed run leaves no
  half-written `.bin`/`.idx` and says "wrote" for nothing;
* a Megatron flag this script does not implement is an error naming it (exit 2), as is a missing
  vocabulary, merges or model file.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from typing import Callable, Iterator

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.indexed import (
    IndexedDatasetWriter,
    data_file_path,
    index_file_path,
    optimal_dtype,
)

MALFORMED_KINDS = ("bad_json", "not_an_object", "missing_key", "not_text")

# Megatron flags (megatron-core 0.16.1's tools/preprocess_data.py, Megatron-LM's main, older
# Megatron-DeepSpeed command lines) this script does not implement: each is an error naming it.
_UNIMPLEMENTED = {
    "--legacy-tokenizer": "titanlike encodes as megatron-core's tokenizers, Megatron's default",
    "--tokenizer-metadata": "pass --tokenizer-type and the tokenizer's files instead of a metadata file",
    "--tokenizer-prompt-format": "preprocessing encodes raw text; no prompt format or chat template is applied",
    "--chat-template": "preprocessing encodes raw text; no prompt format or chat template is applied",
    "--tokenizer-sentencepiece-legacy": "SentencePiece's legacy wrapper (special tokens added by Megatron) is not "
                                        "implemented; SentencePiece models are read as they are",
    "--tokenizer-sentencepiece-ignore-extra-whitespaces": "SentencePiece models are read as they are",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": "SentencePiece models are read as they are",
    "--tokenizer-hf-no-use-fast": "titanlike reads a Hugging Face folder's tokenizer.json (the fast tokenizer) only",
    "--trust-remote-code": "titanlike runs no code from a tokenizer folder",
    "--use-gigatoken": "titanlike has no gigatoken tokenizer implementation",
    "--null-tokenizer-eod-id": "this NullTokenizer is megatron-core 0.16.1's: the end of document is --vocab-size",
    "--null-tokenizer-pad-id": "this NullTokenizer is megatron-core 0.16.1's: it has no pad id",
    "--vocab-extra-ids": "extra ids are added to the vocabulary at training time (Megatron's preprocess_data.py "
                         "resets it to 0)",
    "--padded-vocab-size": "the model's vocabulary is padded at training time, not by preprocessing",
    "--make-vocab-size-divisible-by": "the model's vocabulary is padded at training time, not by preprocessing",
    "--find-optimal-num-workers": "the worker-count search is not implemented; pass --workers",
    "--workers-to-check": "the worker-count search is not implemented; pass --workers",
    "--performance-dir": "the worker-count search is not implemented; pass --workers",
    "--keep-empty": "an empty document is always kept, as a document with no sequence (current Megatron's layout)",
    "--log-interval-seconds": "progress is printed every --log-interval documents, at most once a second",
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


def _init_worker(loader: Callable, tokenizer_path, json_keys: list[str], append_eod: bool,
                 dtype: str, splitter: tuple[str, str, bool] | None = None) -> None:
    tok = loader(tokenizer_path)
    split = None
    if splitter is not None:  # (kind, lang, keep_newlines)
        from titanlike.data.sentences import sentence_splitter
        kind, lang, newlines = splitter
        split = sentence_splitter(kind, lang=lang, newlines=newlines)[1]
    _WORKER.update(tok=tok, keys=json_keys, eod=append_eod, dtype=np.dtype(dtype),
                   eos=tok.eos_id, split=split)


def _encode_chunk(chunk: tuple[list[int], list[bytes]]):
    """Tokenize a chunk of lines; returns per-key (token bytes, sequence lengths, sequences per
    document) plus the malformed lines as (line number, kind)."""
    linenos, lines = chunk
    tok, keys, eod, dtype = _WORKER["tok"], _WORKER["keys"], _WORKER["eod"], _WORKER["dtype"]
    out = {k: ([], [], []) for k in keys}  # token arrays, sequence lengths, sequences per doc
    bad: list[tuple[int, str]] = []
    n_bytes = 0
    for lineno, line in zip(linenos, lines):
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
                    try:
                        ids = tok.encode(sentence, bos=False, eos=False)
                    except ValueError as e:  # a text the tokenizer cannot read (NullTokenizer's ids)
                        raise ValueError(f"line {lineno}, key {k!r}: {e}") from None
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


def input_files(input_path: str, partitions: int) -> list[str]:
    """The files to read: --input itself, or with --partitions > 1 the files its glob matches
    (Megatron globs there), in sorted order."""
    if partitions > 1:
        files = sorted(glob.glob(input_path))
        if not files:
            raise FileNotFoundError(f"input not found: no file matches {input_path}")
        return files
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input not found: {input_path}")
    return [input_path]


def _numbered_lines(files: list[str], max_documents: int | None) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the files read one after the other, the first max_documents only."""
    n = 0
    for path in files:
        with _open_input(path) as f:
            for line in f:
                if max_documents is not None and n >= max_documents:
                    return
                n += 1
                yield n, line


def _ordered_lines(files: list[str], partitions: int, keep_sequential: bool,
                   max_documents: int | None) -> Iterator[tuple[int, bytes]]:
    """The input lines in the order Megatron's --partitions run writes their documents: line i goes to
    partition i mod N (round-robin over every file), the partitions' outputs are concatenated; with
    --keep-sequential-samples the partitions are consecutive runs of lines, which keeps the input order."""
    if partitions <= 1 or keep_sequential:
        yield from _numbered_lines(files, max_documents)
        return
    for p in range(partitions):  # one pass over the input per partition: nothing is held in memory
        for lineno, line in _numbered_lines(files, max_documents):
            if (lineno - 1) % partitions == p:
                yield lineno, line


def _chunks(lines: Iterator[tuple[int, bytes]], chunk_lines: int) -> Iterator[tuple[list[int], list[bytes]]]:
    while True:
        batch = list(itertools.islice(lines, chunk_lines))
        if not batch:
            return
        yield [n for n, _ in batch], [line for _, line in batch]


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
               append_eod: bool = False, workers: int = 1, tokenizer_path=None,
               tokenizer_loader: Callable = load_tokenizer, chunk_lines: int = 256,
               log_interval: int = 1000, stream=sys.stderr, split_sentences: bool = False,
               sentence_splitter: str = "auto", lang: str = "english", keep_newlines: bool = False,
               partitions: int = 1, keep_sequential_samples: bool = False,
               max_documents: int | None = None) -> dict:
    """Tokenize one JSONL(.gz) file (or, with partitions > 1, the files a glob matches); returns a
    summary dict (counts, outputs, timings, the train.py flags for the data's vocabulary).

    tokenizer_path: what tokenizer_loader builds the tokenizer from: a path for titanlike's
    build_tokenizer, or a TokenizerChoice with tokenizer_loader=build_choice (Megatron's types).
    split_sentences: one sequence per sentence, split by `sentence_splitter` ("auto", "nltk",
    "regex"; see titanlike.data.sentences) for `lang`, newlines kept with `keep_newlines`, written
    under the "sentence" level name.
    partitions, keep_sequential_samples: Megatron's document order of a partitioned run.
    max_documents: read the first ones only.
    """
    from titanlike.data.megatron_tokenizers import GPT2BPE, TokenizerChoice

    json_keys = list(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ValueError(f"--json-keys must be distinct and non-empty: {json_keys}")
    if tokenizer_path is None:
        tokenizer_path = default_tokenizer_path()
        if tokenizer_path is None:
            raise RuntimeError("no --tokenizer-model given and titanlike.data has no "
                               "DEFAULT_TOKENIZER_PATH")
    if partitions < 1 or (max_documents is not None and max_documents < 1):
        raise ValueError("--partitions and --max-documents must be at least 1")
    files = input_files(input_path, partitions)
    splitter = None
    if split_sentences:
        from titanlike.data.sentences import sentence_splitter as resolve_splitter
        # "auto" settles here, once for every worker
        splitter = (resolve_splitter(sentence_splitter, lang=lang, newlines=keep_newlines)[0], lang, keep_newlines)
        print(f"splitting sentences with the {splitter[0]} splitter", file=stream, flush=True)
    tok = tokenizer_loader(tokenizer_path)
    if append_eod and tok.eos_id is None:
        raise ValueError("--append-eod: the tokenizer has no end-of-document token")
    dtype = optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    level = "sentence" if split_sentences else "document"
    prefixes = {k: output_prefix_for(output_prefix, k, level) for k in json_keys}
    # GPT2BPETokenizer: its vocabulary as a tokenizer.json folder beside the data, for training.
    folder = f"{output_prefix}_tokenizer" if isinstance(tok, GPT2BPE) else None
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    docs = tokens = nbytes = lines = 0
    key_tokens = {k: 0 for k in json_keys}
    bad_total = {kind: 0 for kind in MALFORMED_KINDS}
    bad_examples: list[tuple[int, str]] = []
    progress = _Progress(log_interval, stream)
    initargs = (tokenizer_loader, tokenizer_path, json_keys, append_eod, dtype.str, splitter)
    chunks = _chunks(_ordered_lines(files, partitions, keep_sequential_samples, max_documents), chunk_lines)
    try:
        for result, bad, n_lines, n_bytes in _ordered_results(_encode_chunk, chunks, workers, initargs):
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
        if folder is not None:
            tmp = f"{folder}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tok.save_folder(tmp)
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        if folder is not None:
            shutil.rmtree(f"{folder}.tmp{os.getpid()}", ignore_errors=True)
        raise
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(f"{folder}.tmp{os.getpid()}", folder)
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
    if folder is not None:
        print(f"wrote {folder} (tokenizer.json, tokenizer_config.json: the data's vocabulary for training)",
              file=stream, flush=True)
    flags = None
    if isinstance(tokenizer_path, TokenizerChoice):
        flags = tokenizer_path.training_flags(folder)
    elif isinstance(tokenizer_path, str) and tokenizer_loader is load_tokenizer:
        default = tokenizer_path == default_tokenizer_path()
        flags = TokenizerChoice(model=None if default else tokenizer_path).training_flags()
    if flags is not None:
        first = next(iter(prefixes.values()))
        print(f"train on it: python train.py ... --training.dataset megatron --training.dataset_path {first}"
              + (f" {flags}" if flags else " (the debug tokenizer is train.py's default)"), file=stream, flush=True)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "malformed": n_bad,
            "malformed_by_kind": bad_total, "malformed_examples": bad_examples,
            "outputs": prefixes, "dtype": str(dtype), "seconds": elapsed, "tokenizer_folder": folder,
            "training_flags": flags}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="JSONL file, optionally gzip-compressed (.gz); with --partitions > 1 a glob of them")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; one output pair per key (default: text)")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence, documents grouped in the index (BERT / T5 data); "
                        "writes {prefix}_{key}_sentence.bin/.idx")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: a sentence keeps the newlines that follow it")
    g.add_argument("--lang", default="english",
                   help="with --split-sentences: NLTK punkt's language (the rule-based splitter is English only)")
    g.add_argument("--sentence-splitter", choices=("auto", "nltk", "regex"), default="auto",
                   help="auto: NLTK punkt when NLTK and its data are installed, else the rule-based "
                        "regex splitter (default auto)")
    g = p.add_argument_group("tokenization (Megatron's flags; titanlike/data/megatron_tokenizers.py)")
    g.add_argument("--tokenizer-type", default=None,
                   help="Megatron's tokenizer type: GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, NullTokenizer (default: "
                        "titanlike's tokenizer, --tokenizer-model)")
    g.add_argument("--tokenizer-model", default=None,
                   help="without --tokenizer-type: a tiktoken ranks file or tokenizer.json folder for titanlike's "
                        "build_tokenizer (default: the shipped debug tokenizer); HuggingFaceTokenizer: a local "
                        "folder with tokenizer.json; SentencePiece types: the .model file; TikTokenizer: a tiktoken "
                        "ranks file, or Megatron's vocabulary .json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids 0..V-1 (end of document V); TikTokenizer .json: ids in all "
                        f"(default {2**17})")
    g.add_argument("--tiktoken-pattern", default=None, choices=("v1", "v2"),
                   help="TikTokenizer .json: Megatron's pre-tokenization regex (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer .json: special token slots before the ranks (default 1000)")
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", dest="special_tokens", nargs="+",
                   default=None, help="TikTokenizer .json: the special tokens, holding <unk> <s> </s> <mask> <pad> "
                                      "<cls> <sep>")
    g.add_argument("--tokenizer-hf-include-special-tokens", dest="hf_include_special_tokens", action="store_true",
                   default=False, help="HuggingFaceTokenizer: add the tokenizer's special tokens (BOS, ...) as its "
                                       "post-processor does (megatron-core 0.16.1's default: not added)")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", dest="hf_include_special_tokens",
                   action="store_false", help="HuggingFaceTokenizer: add no special token (the default)")
    g.add_argument("--tokenizer-hf-use-fast", action="store_true",
                   help="HuggingFaceTokenizer: the fast tokenizer (tokenizer.json), which is what titanlike reads")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every non-empty document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--dataset-impl", choices=("mmap",), default="mmap",
                   help="older Megatron's output format flag: mmap, the only one written")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--partitions", type=int, default=1,
                   help="order the documents as Megatron's partitioned run does (document i in partition i mod N); "
                        "--input is then a glob")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: keep the input order (consecutive partitions)")
    g.add_argument("--max-documents", type=int, default=None, help="read the first N documents only")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress lines (at most one a second)")
    g.add_argument("--chunk-lines", "--chunk-size", dest="chunk_lines", type=int, default=256,
                   help="lines per task sent to a worker")
    return p


def main(argv: list[str] | None = None, tokenizer_loader: Callable | None = None, prog: str | None = None) -> int:
    from titanlike.data.megatron_tokenizers import TokenizerChoice, TokenizerChoiceError, build_choice

    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    megatron = [a.split("=", 1)[0] for a in rest if a.split("=", 1)[0] in _UNIMPLEMENTED]
    if megatron:
        print(f"error: Megatron's {megatron[0]} is not implemented by titanlike's preprocess_data.py: "
              f"{_UNIMPLEMENTED[megatron[0]]}", file=sys.stderr)
        return 2
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")  # exits 2
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    choice = TokenizerChoice(
        type=args.tokenizer_type, model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
        vocab_size=args.vocab_size, hf_include_special_tokens=args.hf_include_special_tokens,
        tiktoken_pattern=args.tiktoken_pattern, tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        special_tokens=tuple(args.special_tokens) if args.special_tokens else None)
    try:
        choice.check()
    except TokenizerChoiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tokenizer_hf_use_fast and choice.type != "HuggingFaceTokenizer":
        print(f"error: --tokenizer-hf-use-fast is not used with --tokenizer-type {choice.type}", file=sys.stderr)
        return 2
    cannot = choice.cannot_train()
    if cannot:
        print(f"note: {cannot}", file=sys.stderr, flush=True)
    if tokenizer_loader is not None:  # tests: a stand-in tokenizer built from --tokenizer-model
        source, loader = args.tokenizer_model, tokenizer_loader
    elif choice.type is None:
        source, loader = args.tokenizer_model, load_tokenizer
    else:
        source, loader = choice, build_choice
    try:
        summary = preprocess(args.input, args.output_prefix, json_keys=args.json_keys,
                             append_eod=args.append_eod, workers=args.workers,
                             tokenizer_path=source, tokenizer_loader=loader,
                             chunk_lines=args.chunk_lines, log_interval=args.log_interval,
                             split_sentences=args.split_sentences, sentence_splitter=args.sentence_splitter,
                             lang=args.lang, keep_newlines=args.keep_newlines, partitions=args.partitions,
                             keep_sequential_samples=args.keep_sequential_samples,
                             max_documents=args.max_documents)
    except TokenizerChoiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # An input with nothing usable (empty, every line malformed: usually the wrong --json-keys)
    # raised above and wrote nothing.
    return 0 if summary["documents"] else 1


def console_main() -> None:
    """The `titanlike-preprocess-data` console script."""
    sys.exit(main(prog="titanlike-preprocess-data"))
