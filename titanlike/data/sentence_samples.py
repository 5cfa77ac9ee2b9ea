"""Sentence-split documents and Megatron's packing of them into samples (shared by the masked-LM and
span-corruption sources).

The data is what ``preprocess_data.py --split-sentences`` writes: every sequence of a Megatron
``.bin``/``.idx`` pair is a sentence and the index's document boundaries group them. An
:class:`IndexedDataset` answers with it directly; :class:`InMemorySentences` holds the same
layout for text split and tokenized in memory (the embedded corpus).

Packing (Megatron's ``build_mapping``): walk the documents of a split in order; in each, add
consecutive sentences until their tokens reach a *target length*, then cut a sample there and
draw the next target. The target is the longest allowed, or, with probability
``short_seq_prob``, a random length in ``[2, longest]`` so the model also sees short inputs. A
sample is not cut while fewer than ``min_sentences`` sentences are in it or fewer than
``min_sentences`` would stay for the next one; the document's end always cuts. Documents with
fewer than ``min_sentences`` non-empty sentences give no sample (a sentence-order pair needs two).
The packing is drawn once from the seed; the sources permute the samples every epoch.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.token_cache import cached_arrays, corpus_cache_key, ids_within_vocabulary

__all__ = ["InMemorySentences", "SentenceSamples", "numpy_fields", "pack_sentences", "sentence_documents",
           "sentence_split_corpus", "split_documents", "validate_sentence_dataset"]


class InMemorySentences:
    """Tokenized sentences grouped into documents, with an IndexedDataset's reading interface
    (``sequence_lengths``, ``document_indices``, ``get``)."""

    def __init__(self, documents: Iterable[Sequence[Sequence[int]]], *, name: str = "sentences"):
        lengths: list[int] = []
        bounds = [0]
        chunks: list[np.ndarray] = []
        for doc in documents:
            for sentence in doc:
                arr = np.asarray(sentence, dtype=np.int64).reshape(-1)
                chunks.append(arr)
                lengths.append(arr.size)
            bounds.append(len(lengths))
        self._hold(np.concatenate(chunks) if chunks else np.zeros(0, np.int64), np.asarray(lengths, dtype=np.int64),
                   np.asarray(bounds, dtype=np.int64), name)

    def _hold(self, tokens: np.ndarray, sequence_lengths: np.ndarray, document_indices: np.ndarray, name: str) -> None:
        self.tokens, self.sequence_lengths, self.document_indices = tokens, sequence_lengths, document_indices
        self.sequence_pointers = np.concatenate(([0], np.cumsum(sequence_lengths)))[:-1].astype(np.int64)
        self.path_prefix = name

    # The arrays that hold it all (sequence_pointers derive from the lengths), as the disk cache stores them.
    ARRAYS = ("tokens", "sequence_lengths", "document_indices")

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @staticmethod
    def consistent(tokens: np.ndarray, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> bool:
        """Whether arrays read back (from a cache) describe sentences of `tokens` grouped into documents."""
        return (tokens.dtype == sequence_lengths.dtype == document_indices.dtype == np.int64
                and len(document_indices) >= 1 and document_indices[0] == 0
                and document_indices[-1] == len(sequence_lengths)
                and bool(np.all(np.diff(document_indices) >= 0)) and bool(np.all(sequence_lengths >= 0))
                and int(sequence_lengths.sum()) == len(tokens))

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, sequence_lengths: np.ndarray, document_indices: np.ndarray, *,
                    name: str = "sentences") -> InMemorySentences:
        self = cls.__new__(cls)
        self._hold(tokens, sequence_lengths, document_indices, name)
        return self

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.sequence_pointers[i]) + offset
        end = int(self.sequence_pointers[i]) + int(self.sequence_lengths[i]) if length is None else start + length
        return self.tokens[start:end]


def split_documents(num_documents: int, split: str, split_name: str, *, name: str) -> tuple[int, int]:
    """[begin, end) documents of one part of a Megatron split string (``"969,30,1"``): a document-level
    split, as Megatron splits its BERT and T5 datasets."""
    from titanlike.data.gpt_dataset import split_range

    begin, end = split_range(split, split_name, num_documents)
    if end <= begin:
        raise DataError(f"the {split_name!r} part of split {split!r} of the {num_documents} documents of {name} "
                        "holds no document")
    return begin, end


def pack_sentences(sentence_lengths: np.ndarray, document_indices: np.ndarray, documents: range, *,
                   max_len: int, short_seq_prob: float, min_sentences: int,
                   rng: np.random.Generator) -> np.ndarray:
    """``(num_samples, 3)`` int64 rows ``(first sentence, end sentence, target length)`` (module docstring).

    Empty sentences are left out of the count, so a document of empty sentences gives nothing.
    """
    lengths = np.asarray(sentence_lengths, dtype=np.int64)
    bounds = np.asarray(document_indices, dtype=np.int64)
    rows: list[tuple[int, int, int]] = []
    # Plain Python ints in the loop below: numpy scalars cost several times more per sentence.
    nonempty_before = np.concatenate(([0], np.cumsum(lengths > 0))).tolist()
    length_of = lengths.tolist()
    bound_of = bounds.tolist()

    def target() -> int:
        if short_seq_prob > 0 and rng.random() < short_seq_prob:
            return int(rng.integers(2, max_len + 1)) if max_len >= 2 else max_len
        return max_len

    for d in documents:
        first, last = bound_of[d], bound_of[d + 1]
        remaining = nonempty_before[last] - nonempty_before[first]
        if remaining < min_sentences:
            continue
        goal = target()
        start, tokens, count = first, 0, 0
        for s in range(first, last):
            size = length_of[s]
            if size == 0:
                continue
            tokens += size
            count += 1
            remaining -= 1
            if (tokens >= goal and count >= min_sentences and remaining >= min_sentences) or remaining == 0:
                rows.append((start, s + 1, goal))
                start, tokens, count = s + 1, 0, 0
                goal = target()
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


class SentenceSamples:
    """The packed samples of one split, in a fresh order every epoch.

    Global sample ``i`` (``0 <= i < len``) is packed sample ``perm_e[i mod P]`` of epoch
    ``e = i // P`` (``P`` packed samples, ``perm_e`` a permutation drawn from ``(seed, e)``), and
    gets its own random generator from ``(seed, i)``: masks differ between epochs, and any sample
    is reproducible alone, on any rank, at any data-parallel degree.
    """

    # Salts keep the packing, epoch order and per-sample streams independent of each other.
    _PACK, _ORDER, _SAMPLE = 0x9ACC, 0x0DE2, 0x5A3E

    def __init__(self, sentences, *, split: str, split_name: str, max_len: int, short_seq_prob: float,
                 min_sentences: int, seed: int, num_samples: int | None, what: str):
        self.sentences = sentences
        self.seed = int(seed)
        name = os.fspath(getattr(sentences, "path_prefix", "the data"))
        begin, end = split_documents(sentences.num_documents, split, split_name, name=name)
        self.documents = range(begin, end)
        self.packed = pack_sentences(sentences.sequence_lengths, sentences.document_indices, self.documents,
                                     max_len=max_len, short_seq_prob=short_seq_prob, min_sentences=min_sentences,
                                     rng=np.random.default_rng([self.seed, self._PACK]))
        if not len(self.packed):
            need = f"at least {min_sentences} non-empty sentences" if min_sentences > 1 else "a token"
            hint = " (preprocess with --split-sentences)" if min_sentences > 1 else ""
            raise DataError(f"no document of the {split_name!r} part of {name} holds {need}{hint}, so it gives no "
                            f"{what} sample")
        self.per_epoch = len(self.packed)
        self.num_epochs = 1 if num_samples is None else max(1, -(-int(num_samples) // self.per_epoch))
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return self.per_epoch * self.num_epochs

    def packed_row(self, index: int) -> tuple[int, int, int]:
        """(first sentence, end sentence, target length) of global sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        epoch, j = divmod(index, self.per_epoch)
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, self._ORDER, epoch]).permutation(self.per_epoch)
            self._order_epoch = epoch
        first, end, goal = self.packed[int(self._order[j])]
        return int(first), int(end), int(goal)

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self._SAMPLE, index])

    def sentence_tokens(self, first: int, end: int) -> list[np.ndarray]:
        return [np.asarray(self.sentences.get(s), dtype=np.int64) for s in range(first, end)]


_CORPUS_CACHE: dict[tuple, InMemorySentences] = {}
_CORPUS_LOCK = threading.Lock()


def sentence_split_corpus(path: str | os.PathLike, tokenizer) -> InMemorySentences:
    """Every document under ``path`` (text files, as the ``text`` dataset reads them) split into
    sentences by the rule-based splitter and tokenized, once per process (keyed on the files and the
    tokenizer), and once on disk while the files, tokenizer and code stay the same
    (titanlike/data/token_cache.py): the embedded corpus's masked-LM / span-corruption data."""
    from titanlike.data.text_datasets import list_text_files

    files = list_text_files(path)
    key = (tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files), tokenizer.fingerprint)
    with _CORPUS_LOCK:
        cached = _CORPUS_CACHE.get(key)
        if cached is None:
            arrays = _split_and_encode(path, files, tokenizer)
            cached = _CORPUS_CACHE[key] = InMemorySentences.from_arrays(**arrays, name=f"corpus {os.fspath(path)}")
    return cached


def _split_and_encode(path: str | os.PathLike, files: list[str], tokenizer) -> dict[str, np.ndarray]:
    """InMemorySentences.ARRAYS of the corpus, through the disk cache."""
    from titanlike.data import sentences, text_datasets

    def build() -> dict[str, np.ndarray]:
        documents = []
        for text in text_datasets.iter_documents(path):
            # One call per sentence: cheaper here than the threaded batch encoder for short texts.
            encoded = (tokenizer.encode(s, bos=False, eos=False) for s in sentences.regex_split_sentences(text))
            documents.append([ids for ids in encoded if ids])
        return InMemorySentences(documents).arrays()

    def valid(arrays: dict[str, np.ndarray]) -> bool:
        return InMemorySentences.consistent(**arrays) and ids_within_vocabulary(arrays["tokens"], tokenizer.vocab_size)

    key = corpus_cache_key(path, files, tokenizer, kind="sentences",
                           readers=(text_datasets, sentences, sys.modules[__name__]))
    return cached_arrays(key, InMemorySentences.ARRAYS, build, valid)


def numpy_fields(shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Field name -> (shape, numpy dtype) of one sample, from its (shape, dtype name) table: what a
    sample source checks its samples against."""
    return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()}


def validate_sentence_dataset(dataset: str, what: str, *, option: str = "training") -> None:
    """DataError (one sentence) when `dataset` cannot give sentence-split documents for `what` samples
    (a kind that can has a "sentences" reader, data/loader.py DatasetKind)."""
    from titanlike.data.kinds import find_dataset_kind

    kind = find_dataset_kind(dataset)
    if kind is None or not kind.gives("sentences"):
        raise DataError(f"{option}.dataset {dataset!r} cannot give {what} samples, which need sentence-split "
                        "documents; use dataset 'megatron' (data from preprocess_data.py --split-sentences) or "
                        "'default'")


def sentence_documents(dataset: str, *, dataset_path, tokenizer, split: str | None, what: str):
    """(sentence-split documents, the split string over them) of a dataset kind, for `what` samples."""
    from titanlike.data.kinds import dataset_kind

    validate_sentence_dataset(dataset, what)
    return dataset_kind(dataset).readers["sentences"](dataset_path=dataset_path, tokenizer=tokenizer, split=split,
                                                      what=what)

