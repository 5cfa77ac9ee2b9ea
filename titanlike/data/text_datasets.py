"""Global sample sources built from raw text.

A *global sample* is a window of ``seq_len + 1`` token ids; the loader (``loader.py``) decides
which rank gets which samples. Two shapes of source exist:

* map-style (``__len__`` + ``__getitem__(i)``): :class:`PackedTokens`, the whole corpus tokenized
  in memory. Used for the embedded default corpus and for local ``.txt``/``.jsonl`` files, which
  are small enough to tokenize at start (big corpora belong in the Megatron ``.bin/.idx``
  format, which is map-style too).
* streams (:class:`PackedStream`): documents pulled one at a time from an iterable, e.g. a
  Hugging Face streaming dataset, packed on the fly. Position is checkpointable.

Packing (both shapes, as torchtitan does): every document is encoded as
``[BOS] + tokens + [EOS]``, documents are concatenated in order, and the stream is cut into
*non-overlapping* windows of ``seq_len + 1`` tokens; inputs are ``window[:-1]``, labels
``window[1:]``. A map-style source drops the last partial window of the corpus (it is never
seen); a stream carries it over into the next epoch instead.

Local text files: a ``.txt`` file (or ``.txt.gz``) is ONE document: books and articles stay
whole, and blank lines inside them are text, not boundaries. For many documents per file use
JSONL: one ``{"text": ...}`` object per line (``.jsonl`` or ``.jsonl.gz``). A directory is
searched recursively for those suffixes, in sorted path order.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from titanlike.data.errors import DataError, DataPathError
from titanlike.data.token_cache import cached_arrays, corpus_cache_key, ids_within_vocabulary
from titanlike.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "TEXT_SUFFIXES",
    "DocumentSource",
    "HuggingFaceDocuments",
    "IterableDocuments",
    "PackedStream",
    "PackedTokens",
    "SampleStream",
    "ensure_document",
    "iter_documents",
    "list_text_files",
    "pack_documents",
    "packed_text_corpus",
]

TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")
_LARGE_CORPUS_BYTES = 1 << 30


# --------------------------------------------------------------------------- documents


def list_text_files(path: str | os.PathLike) -> list[str]:
    """The text files ``path`` names: itself, or those under it with a supported suffix."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(TEXT_SUFFIXES):
            raise DataError(f"{path!r} is not a text dataset file: expected one of {', '.join(TEXT_SUFFIXES)}")
        return [path]
    if not os.path.isdir(path):
        raise DataPathError(f"dataset_path {path!r} does not exist")
    files = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith(TEXT_SUFFIXES)
    )
    if not files:
        raise DataError(f"no {', '.join(TEXT_SUFFIXES)} files under directory {path!r}")
    return files


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class _Tally:
    """What reading a text dataset skipped, for the one sentence when nothing was usable."""

    def __init__(self) -> None:
        self.files = self.lines = self.bad = self.empty = 0
        self.first_bad = ""


def _iter_jsonl(path: str, text_key: str, tally: _Tally, *, warn: bool = True) -> Iterator[str]:
    bad = 0
    first_bad = ""
    total = 0
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            total += 1
            tally.lines += 1
            try:
                obj = json.loads(raw)
                text = obj[text_key]
                if not isinstance(text, str):
                    raise TypeError(f"{text_key!r} is {type(text).__name__}, not a string")
            except Exception as e:  # noqa: BLE001 - any bad line is skipped, never fatal
                bad += 1
                tally.bad += 1
                if not first_bad:
                    reason = f"missing key {text_key!r}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                    first_bad = f"line {lineno}: {reason}"
                    tally.first_bad = tally.first_bad or f"{path} {first_bad}"
                continue
            if text:
                yield text
            else:
                tally.empty += 1
    if bad and warn:
        logger.warning(
            "%s: skipped %d of %d lines that are not JSON objects with a string %r field (first: %s)",
            path, bad, total, text_key, first_bad,
        )


def iter_documents(path: str | os.PathLike, *, text_key: str = "text") -> Iterator[str]:
    """Documents of a text file or directory, in a fixed order (see the module docstring).

    DataError (one sentence saying why) when the whole of `path` holds no usable document.
    """
    tally = _Tally()
    found = False
    for file in list_text_files(path):
        tally.files += 1
        if file.endswith((".jsonl", ".jsonl.gz")):
            for text in _iter_jsonl(file, text_key, tally):
                found = True
                yield text
        else:
            with _open_binary(file) as f:
                # A stray invalid byte should not cost the whole file.
                text = f.read().decode("utf-8", errors="replace")
            if text:
                found = True
                yield text
            else:
                tally.empty += 1
    if not found:
        raise DataError(_no_document_reason(os.fspath(path), text_key, tally))


def _no_document_reason(path: str, text_key: str, t: _Tally) -> str:
    where = f"{path} holds no usable document"
    if t.bad:
        rest = f", the other {t.lines - t.bad} have an empty {text_key!r}" if t.lines > t.bad else ""
        return (f"{where}: {t.bad} of its {t.lines} lines are not JSON objects with a string {text_key!r} field "
                f"(first: {t.first_bad}){rest}")
    return f"{where}: its {t.files} text file(s) are empty or hold only empty {text_key!r} fields"


def ensure_document(path: str | os.PathLike, *, text_key: str = "text") -> None:
    """DataError (one sentence saying why) unless `path` holds a usable document. Cheap: reads no
    further than the first one (one byte of a text file, a JSONL file's lines up to its first
    usable one), so a whole corpus is read only when it holds nothing usable."""
    tally = _Tally()
    for file in list_text_files(path):
        tally.files += 1
        if file.endswith((".jsonl", ".jsonl.gz")):
            docs = _iter_jsonl(file, text_key, tally, warn=False)
            try:
                if next(docs, None) is not None:
                    return
            finally:
                docs.close()
        else:
            with _open_binary(file) as f:
                if f.read(1):
                    return
            tally.empty += 1
    raise DataError(_no_document_reason(os.fspath(path), text_key, tally))


# --------------------------------------------------------------------------- map-style


def _token_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.int32 if tokenizer.vocab_size < 2**31 else np.int64)


def pack_documents(documents: Iterable[str], tokenizer: Tokenizer, *, batch_docs: int = 512) -> np.ndarray:
    """All documents as one ``[BOS] doc [EOS] [BOS] doc [EOS] ...`` token array."""
    dtype = _token_dtype(tokenizer)
    parts: list[np.ndarray] = []
    docs = iter(documents)
    while batch := list(itertools.islice(docs, batch_docs)):
        for ids in tokenizer.encode_batch(batch, bos=True, eos=True):
            parts.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


class PackedTokens:
    """Map-style source: sample ``i`` is the ``i``-th ``seq_len + 1`` window of a token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, name: str = "corpus"):
        window = seq_len + 1
        if len(tokens) < window:
            raise DataError(
                f"{name} has only {len(tokens)} tokens, fewer than one sample of seq_len + 1 = {window}; "
                "use more text or a shorter seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._first = 0  # index of sample 0 among the windows of `tokens` (nonzero for a split part)
        self._num = len(tokens) // window

    def __len__(self) -> int:
        return self._num

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self._num:
            raise IndexError(f"sample {index} out of range [0, {self._num})")
        w = self.seq_len + 1
        start = (self._first + index) * w
        return self.tokens[start : start + w]

    def split(self, split: str, split_name: str) -> PackedTokens:
        """One part of a Megatron-style split (``"99,1"``, ``"train"``/``"valid"``/``"test"``): a
        contiguous range of this source's samples, so the parts never share a token."""
        from titanlike.data.gpt_dataset import split_range

        begin, end = split_range(split, split_name, self._num)
        if end <= begin:
            raise DataError(f"the {split_name!r} part of split {split!r} of {self._num} samples of "
                             f"seq_len {self.seq_len} holds no sample; use a shorter seq_len")
        part = PackedTokens.__new__(PackedTokens)
        part.tokens, part.seq_len = self.tokens, self.seq_len
        part._first, part._num = self._first + begin, end - begin
        return part


_PACK_CACHE: dict[tuple, np.ndarray] = {}
_PACK_LOCK = threading.Lock()


def packed_text_corpus(path: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, *,
                       max_documents: int | None = None) -> PackedTokens:
    """Tokenize (once per process, and once on disk while the files, tokenizer and code stay the
    same) every document under ``path`` (the first ``max_documents`` if given) into a
    :class:`PackedTokens`."""
    files = list_text_files(path)
    stats = [os.stat(f) for f in files]
    # Keyed on file identity and tokenizer ranks, not seq_len: every layout and seq_len of a
    # run (and every loader a test builds) shares one tokenization.
    key = (tuple((f, s.st_size, s.st_mtime_ns) for f, s in zip(files, stats)), tokenizer.fingerprint, max_documents)
    with _PACK_LOCK:
        tokens = _PACK_CACHE.get(key)
        if tokens is None:
            tokens = _pack_files(path, files, tokenizer, max_documents, nbytes=sum(s.st_size for s in stats))
            tokens.setflags(write=False)
            _PACK_CACHE[key] = tokens
    name = f"dataset {os.fspath(path)!r}" + (f" (its first {max_documents} documents)" if max_documents else "")
    return PackedTokens(tokens, seq_len, name=name)


def _pack_files(path: str | os.PathLike, files: list[str], tokenizer: Tokenizer, max_documents: int | None, *,
                nbytes: int) -> np.ndarray:
    """pack_documents of the corpus (`nbytes` of text in `files`), through the disk cache
    (titanlike/data/token_cache.py)."""
    dtype = _token_dtype(tokenizer)

    def pack() -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        tokens = pack_documents(itertools.islice(iter_documents(path), max_documents), tokenizer)
        logger.info("tokenized %s: %d files, %d tokens in %.1fs",
                    os.fspath(path), len(files), len(tokens), time.perf_counter() - t0)
        return {"tokens": tokens}

    if nbytes > _LARGE_CORPUS_BYTES:
        # Not cached either: a copy of this size in the user's cache folder is not wanted, and
        # preprocessing it once is the way (the .bin/.idx files are that cache).
        logger.warning(
            "tokenizing %.1f GiB of text in memory at start; corpora this size belong in the "
            "Megatron .bin/.idx format (scripts/preprocess_data.py)", nbytes / 2**30,
        )
        return pack()["tokens"]

    def valid(arrays: dict[str, np.ndarray]) -> bool:
        tokens = arrays["tokens"]
        return tokens.dtype == dtype and ids_within_vocabulary(tokens, tokenizer.vocab_size)

    key = corpus_cache_key(path, files, tokenizer, readers=(sys.modules[__name__],), kind="packed",
                           max_documents=max_documents)
    return cached_arrays(key, ("tokens",), pack, valid)["tokens"]


# --------------------------------------------------------------------------- streams


@runtime_checkable
class SampleStream(Protocol):
    """An infinite stream of global samples, read in increasing index order.

    ``sample(i)`` returns global sample ``i`` (``seq_len + 1`` ids); indices must not decrease,
    skipped ones are read and dropped. ``state_dict`` captures the position exactly.
    """

    def sample(self, index: int) -> np.ndarray: ...
    def reset(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DocumentSource(Protocol):
    """One epoch of documents at a time. Optional ``state_dict``/``load_state_dict`` let a
    resume jump to the position directly instead of re-reading the epoch up to it."""

    def documents(self, epoch: int) -> Iterator[str]: ...


class IterableDocuments:
    """Documents from a factory that returns a fresh, identically ordered iterable each epoch."""

    def __init__(self, factory: Callable[[], Iterable[str]]):
        self._factory = factory

    def documents(self, epoch: int) -> Iterator[str]:
        return iter(self._factory())


def _parse_hf_path(dataset_path: str) -> tuple[str, str | None, str]:
    # NAME[:CONFIG[:SPLIT]]; NAME may be a local directory of json/parquet/text files.
    parts = dataset_path.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(
            f"huggingface dataset_path {dataset_path!r}: expected NAME[:CONFIG[:SPLIT]], e.g. 'allenai/c4:en'"
        )
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


class HuggingFaceDocuments:
    """A ``datasets`` streaming dataset; its own ``state_dict`` makes resume exact without replay."""

    def __init__(self, dataset_path: str, *, text_column: str = "text"):
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                "dataset 'huggingface' needs the `datasets` package (pip install datasets); "
                "for local files without it use dataset 'text'"
            ) from e
        name, config, split = _parse_hf_path(dataset_path)
        self.dataset_path = dataset_path
        self.text_column = text_column
        self._ds = datasets.load_dataset(name, name=config, split=split, streaming=True)
        self._bad = 0

    def documents(self, epoch: int) -> Iterator[str]:
        # The dataset's saved position applies only to the epoch it was saved in; without
        # set_epoch every later pass would restart from that position too.
        self._ds.set_epoch(epoch)
        for example in self._ds:
            text = example.get(self.text_column) if isinstance(example, dict) else None
            if not isinstance(text, str):
                self._bad += 1
                # Powers of two keep the log readable over millions of bad rows.
                if self._bad & (self._bad - 1) == 0:
                    logger.warning(
                        "%s: skipped %d examples so far without a string %r column",
                        self.dataset_path, self._bad, self.text_column,
                    )
                continue
            if text:
                yield text

    def state_dict(self) -> dict[str, Any]:
        return self._ds.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ds.load_state_dict(state)


class PackedStream:
    """:class:`SampleStream` that packs documents from a :class:`DocumentSource` on the fly.

    Epochs repeat the source, so the stream is infinite; the token buffer carries over an
    epoch boundary. An epoch that yields no document is an error rather than an endless loop.
    """

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int):
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.reset()

    def reset(self) -> None:
        self._epoch = 0
        self._docs_in_epoch = 0  # consumed from the current epoch's iterator
        self._buffer: list[int] = []
        self._next_index = 0
        self._docs: Iterator[str] | None = None

    def _next_document(self) -> str:
        while True:
            if self._docs is None:
                self._docs = self.source.documents(self._epoch)
            doc = next(self._docs, None)
            if doc is not None:
                self._docs_in_epoch += 1
                return doc
            if self._docs_in_epoch == 0:
                raise DataError(f"dataset source {self.source!r} yielded no documents in epoch {self._epoch}")
            logger.info("dataset stream finished epoch %d; starting over", self._epoch)
            self._epoch += 1
            self._docs_in_epoch = 0
            self._docs = None

    def _next_window(self) -> np.ndarray:
        window = self.seq_len + 1
        while len(self._buffer) < window:
            self._buffer.extend(self.tokenizer.encode(self._next_document(), bos=True, eos=True))
        out = np.asarray(self._buffer[:window], dtype=np.int64)
        del self._buffer[:window]
        self._next_index += 1
        return out

    def sample(self, index: int) -> np.ndarray:
        if index < self._next_index:
            raise ValueError(
                f"stream is already past sample {index} (next is {self._next_index}); a stream is read forward only"
            )
        while self._next_index < index:
            self._next_window()
        return self._next_window()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "next_index": self._next_index,
            "epoch": self._epoch,
            "docs_in_epoch": self._docs_in_epoch,
            "buffer": list(self._buffer),
        }
        if hasattr(self.source, "state_dict"):
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_index = int(state["next_index"])
        self._epoch = int(state["epoch"])
        self._docs_in_epoch = int(state["docs_in_epoch"])
        self._buffer = list(state["buffer"])
        if "source" in state and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state["source"])
            self._docs = self.source.documents(self._epoch)
        else:
            self._docs = itertools.islice(self.source.documents(self._epoch), self._docs_in_epoch, None)
