"""Megatron-style GPT dataset over an MMIDIDX indexed dataset.

Semantics follow Megatron-LM's `GPTDataset` so that, for the same data, split, sequence length
and seed, the samples and their order are the same as Megatron's:

* split: `"969,30,1"` is normalized to fractions; split i covers sequences
  `[round(lo_i * S), round(hi_i * S))` of the S sequences (a "document" below is one sequence,
  as in Megatron's GPT path).
* document index: the split's documents repeated for as many epochs as `num_samples` needs,
  shuffled by `numpy.random.RandomState(seed)`. When the last epoch is used for less than 80%
  its documents are shuffled separately, so the extra epoch does not dilute the full ones.
* sample index: the shuffled documents are concatenated into one token stream; sample k is
  tokens `[k * seq_len, (k + 1) * seq_len]` (seq_len + 1 tokens, so consecutive samples share
  one token: the last label of one is the first input of the next). Row k of the index is the
  (document-index position, offset) of token k * seq_len.
* shuffle index: a permutation of the samples from the same RandomState (two permutations,
  full epochs then final epoch, when the final epoch is separate).

The indices are built with numpy (no Python loop per sample) and cached as `.npy` files keyed
by a hash of everything they depend on. Under torch.distributed rank 0 builds while the other
ranks wait at a barrier and then load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from typing import Callable

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.indexed import IndexedDataset, temp_path, data_file_path

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_SPLIT_ALIASES = {"train": 0, "valid": 1, "validation": 1, "val": 1, "test": 2}
# Bump when the layout or meaning of a cached array changes, so stale caches are not loaded.
_CACHE_FORMAT = 1
# Megatron separates the final epoch when it is used below this fraction.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_SAMPLE_CHUNK = 1 << 22


# ---------------------------------------------------------------------------------------------
# splits


# Megatron's default --split: train, valid, test.
DEFAULT_SPLIT = "969,30,1"


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` -> normalized `[train, valid, test]` fractions (missing ones are 0)."""
    parts = [float(p) for p in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3:
        raise DataError(f"split {split!r}: expected 1 to 3 non-negative numbers like '969,30,1'")
    parts += [0.0] * (3 - len(parts))
    w = np.array(parts, dtype=np.float64)
    if w.sum() <= 0:
        raise DataError(f"split {split!r}: the parts sum to zero")
    return (w / w.sum()).tolist()


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """Cumulative (lo, hi) per split; None for a split with no share."""
    vec = parse_split(split)
    edges = [0.0]
    for v in vec:
        edges.append(edges[-1] + v)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_index(split_name: str) -> int:
    try:
        return _SPLIT_ALIASES[split_name]
    except KeyError:
        raise DataError(f"unknown split name {split_name!r}; use one of {SPLIT_NAMES}") from None


def split_range(split: str, split_name: str, num_sequences: int) -> tuple[int, int]:
    """[begin, end) sequence range of one split, rounded the way Megatron rounds."""
    b = split_bookends(split)[split_index(split_name)]
    if b is None:
        raise DataError(f"split {split_name!r} has no share in split string {split!r}")
    return int(round(b[0] * float(num_sequences))), int(round(b[1] * float(num_sequences)))


# ---------------------------------------------------------------------------------------------
# index construction (pure functions, also used by the tests and the benchmark)


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_len: int) -> int:
    if num_samples is None:
        return 1
    # +1: the last sample needs one token past its seq_len inputs for its last label
    needed = num_samples * seq_len + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    out = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(out)
    return out


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_len: int,
                       num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2) array: row k = (position in document_index, offset) of token
    k * seq_len of the concatenated stream.

    Vectorized: a cumulative sum of document lengths and one binary search per sample, in
    chunks so the temporaries stay bounded whatever the number of samples.
    """
    doc_lens = np.asarray(sequence_lengths)[document_index]
    ends = np.cumsum(doc_lens, dtype=np.int64)
    del doc_lens
    total = int(ends[-1]) if ends.size else 0
    if num_samples * seq_len + 1 > total:
        raise DataError(f"{num_samples} samples of {seq_len}+1 tokens need "
                         f"{num_samples * seq_len + 1} tokens, the stream has {total}")
    big = document_index.shape[0] >= np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    seq_lengths = np.asarray(sequence_lengths)
    for lo in range(0, num_samples + 1, _SAMPLE_CHUNK):
        hi = min(num_samples + 1, lo + _SAMPLE_CHUNK)
        pos = np.arange(lo, hi, dtype=np.int64) * seq_len
        # side="right" picks the document that contains the token, skipping empty documents
        d = np.searchsorted(ends, pos, side="right")
        starts = ends[d] - seq_lengths[document_index[d]]
        out[lo:hi, 0] = d
        out[lo:hi, 1] = pos - starts
    # Megatron starts at (0, 0) even when the first document is empty; keep its exact index.
    out[0] = 0
    return out


def build_shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_first) followed by a permutation of [num_first, total)."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, seq_len: int,
                      num_samples: int | None, seed: int):
    """document_index, sample_index, shuffle_index and the epoch count for one split."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch < seq_len + 1:
        raise DataError(f"the split has {tokens_per_epoch} tokens, fewer than one sample of "
                         f"seq_len + 1 = {seq_len + 1}")
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_len)
    # The indices below hold every epoch's documents and samples: refuse, before allocating them, a
    # run so long (training.steps x global batch) that they would not fit this host's memory.
    index_bytes = num_epochs * len(documents) * 4 + (num_epochs * tokens_per_epoch // seq_len + 1) * 24
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if index_bytes > host:
        raise DataError(f"{num_samples} samples need {num_epochs} epochs of this split, whose sample index would "
                        f"take {index_bytes / 2**30:,.0f} GiB, more than this host's {host / 2**30:,.0f} GiB; "
                        "lower training.steps or add data")

    separate = False
    samples_sans_final = 0
    if num_epochs > 1:
        samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
        samples_per_epoch = (tokens_per_epoch - 1) // seq_len
        from_final = num_samples - samples_sans_final
        separate = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)

    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_len
    sample_index = build_sample_index(sequence_lengths, document_index, seq_len, total_samples)
    shuffle_index = build_shuffle_index(samples_sans_final if separate else total_samples,
                                        total_samples, rng)
    return document_index, sample_index, shuffle_index, num_epochs


# ---------------------------------------------------------------------------------------------
# build once, cache, share


def _default_rank_info() -> tuple[bool, Callable[[], None] | None]:
    # Look torch up instead of importing it: a process that never imported torch cannot have
    # an initialized process group, and preprocessing / worker processes stay torch-free.
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0, dist.barrier
    return True, None


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def _atomic_save_npy(path: str, arr: np.ndarray) -> None:
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
    os.replace(tmp, path)


class IndexCache:
    """Arrays cached under `{cache_dir}/{hash}-{stem}-{name}.npy`.

    The description JSON is written last and is what makes an entry valid: a crash while saving
    leaves no description, so the entry is rebuilt rather than loaded half-written.
    """

    def __init__(self, cache_dir: str | None, stem: str, description: dict) -> None:
        self.cache_dir = cache_dir
        self.description = description
        self.key = description_hash(description)
        self.base = f"{self.key}-{stem}"

    def path(self, name: str) -> str:
        assert self.cache_dir is not None
        return os.path.join(self.cache_dir, f"{self.base}-{name}")

    def load(self, names) -> dict[str, np.ndarray] | None:
        if not self.cache_dir:
            return None
        desc_path = self.path("description.json")
        try:
            with open(desc_path) as f:
                if json.load(f) != json.loads(json.dumps(self.description)):
                    logger.warning("cache entry %s describes other inputs; rebuilding", desc_path)
                    return None
            return {n: np.load(self.path(f"{n}.npy"), mmap_mode="r", allow_pickle=False)
                    for n in names}
        except (FileNotFoundError, ValueError, OSError):
            return None

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        if not self.cache_dir:
            return
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for n, a in arrays.items():
                _atomic_save_npy(self.path(f"{n}.npy"), a)
            desc_path = self.path("description.json")
            tmp = temp_path(desc_path)
            with open(tmp, "w") as f:
                json.dump(self.description, f, indent=2, sort_keys=True)
            os.replace(tmp, desc_path)
        except OSError as e:
            # A read-only data directory must not stop training: every rank then builds in
            # memory, which is slower but gives the same indices.
            logger.warning("could not write dataset index cache in %s (%s); continuing without",
                           self.cache_dir, e)


def load_or_build(cache: IndexCache, names, build: Callable[[], dict[str, np.ndarray]],
                  is_rank_zero: bool | None = None,
                  barrier: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], bool]:
    """Return (arrays, loaded_from_cache). Rank 0 builds first, the others load after a barrier.

    Every rank calls `barrier` exactly once, whatever happened, so a failure on rank 0 raises
    on every rank (they retry the build and fail the same way) instead of hanging them.
    """
    if is_rank_zero is None and barrier is None:
        is_rank_zero, barrier = _default_rank_info()
    elif is_rank_zero is None:
        is_rank_zero = True

    def attempt():
        arrays = cache.load(names)
        if arrays is not None:
            return arrays, True
        arrays = build()
        cache.save(arrays)
        return arrays, False

    if barrier is None:
        return attempt()
    if is_rank_zero:
        try:
            result = attempt()
        finally:
            barrier()
        return result
    barrier()
    return attempt()


# ---------------------------------------------------------------------------------------------
# the dataset


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)) or ".", "index-cache")


class GPTDataset:
    """Map-style source of global samples: `ds[i]` is an int64 array of `seq_len + 1` tokens.

    `len(ds)` is every sample the built epochs hold, at least `num_samples` (Megatron does the
    same: the tail of the last epoch is not thrown away).
    """

    def __init__(self, indexed: IndexedDataset | str, *, seq_len: int,
                 num_samples: int | None = None, seed: int = 1234, split: str = DEFAULT_SPLIT,
                 split_name: str = "train", cache_dir: str | None = None,
                 is_rank_zero: bool | None = None,
                 barrier: Callable[[], None] | None = None) -> None:
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.seq_len = int(seq_len)
        self.num_samples = num_samples
        self.seed = int(seed)
        self.split = split
        self.split_name = SPLIT_NAMES[split_index(split_name)]
        prefix = self.indexed.path_prefix
        self.split_range = split_range(split, split_name, len(self.indexed))
        if self.split_range[1] <= self.split_range[0]:
            raise DataError(f"split {self.split_name!r} of {prefix} is empty: {split!r} over "
                             f"{len(self.indexed)} sequences gives range {self.split_range}")

        self.description = {
            "class": "GPTDataset",
            "cache_format": _CACHE_FORMAT,
            "path_prefix": os.path.abspath(prefix),
            # identity of the data without hashing it: re-preprocessing into the same prefix
            # changes at least one of these in practice
            "data": {"sequences": len(self.indexed), "documents": self.indexed.num_documents,
                     "bin_bytes": os.path.getsize(data_file_path(prefix)),
                     "dtype": str(self.indexed.dtype)},
            "split": parse_split(split),
            "split_name": self.split_name,
            "split_range": list(self.split_range),
            "seq_len": self.seq_len,
            "seed": self.seed,
            "num_samples": num_samples,
        }
        cache = IndexCache(cache_dir, f"GPTDataset-{self.split_name}", self.description)
        self.cache_key = cache.key
        names = ("document_index", "sample_index", "shuffle_index")

        def build():
            t0 = time.perf_counter()
            documents = np.arange(*self.split_range, dtype=np.int32)
            d, s, sh, epochs = build_gpt_indices(self.indexed.sequence_lengths, documents,
                                                 self.seq_len, num_samples, self.seed)
            logger.info("built GPTDataset %s indices for %s: %d samples, %d epochs, %.2fs",
                        self.split_name, prefix, s.shape[0] - 1, epochs,
                        time.perf_counter() - t0)
            return {"document_index": d, "sample_index": s, "shuffle_index": sh}

        arrays, self.loaded_from_cache = load_or_build(cache, names, build, is_rank_zero,
                                                       barrier)
        self._cache_paths = ({n: cache.path(f"{n}.npy") for n in names}
                             if self.loaded_from_cache else None)
        self._set_arrays(arrays)
        if num_samples is not None and len(self) < num_samples:
            raise RuntimeError(f"built {len(self)} samples, fewer than the {num_samples} asked")

    def _set_arrays(self, arrays) -> None:
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        tokens = int(self.indexed.sequence_lengths[
            self.split_range[0]:self.split_range[1]].sum(dtype=np.int64))
        self.num_tokens_per_epoch = tokens
        self.num_epochs = self.document_index.shape[0] // max(
            1, self.split_range[1] - self.split_range[0])

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def sample_span(self, i: int) -> tuple[int, int, int, int]:
        """(first doc-index position, its offset, last position, its offset) of sample i."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        j = int(self.shuffle_index[i])
        d0, o0 = self.sample_index[j]
        d1, o1 = self.sample_index[j + 1]
        return int(d0), int(o0), int(d1), int(o1)

    def __getitem__(self, i: int) -> np.ndarray:
        d0, o0, d1, o1 = self.sample_span(int(i))
        get = self.indexed.get
        doc = self.document_index
        if d0 == d1:
            return get(int(doc[d0]), o0, o1 - o0 + 1).astype(np.int64)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        part = get(int(doc[d0]), o0)
        n = part.shape[0]
        out[:n] = part
        for d in range(d0 + 1, d1):
            part = get(int(doc[d]))
            out[n:n + part.shape[0]] = part
            n += part.shape[0]
        part = get(int(doc[d1]), 0, o1 + 1)
        out[n:n + part.shape[0]] = part
        assert n + part.shape[0] == self.seq_len + 1
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._cache_paths is not None:
            # Re-map from the cache where unpickled rather than copying the arrays through
            # the pickle (they can be gigabytes).
            for n in self._cache_paths:
                state.pop(n)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if self._cache_paths is not None:
            self._set_arrays({n: np.load(p, mmap_mode="r", allow_pickle=False)
                              for n, p in self._cache_paths.items()})

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.path_prefix!r}, split={self.split_name}, "
                f"range={self.split_range}, seq_len={self.seq_len}, samples={len(self)}, "
                f"epochs={self.num_epochs})")


def samples_for_weight(num_samples: int, weight: float, surplus: float = 0.0) -> int:
    """Megatron's per-dataset sample budget within a blend."""
    return int(math.ceil(math.ceil(num_samples * weight) * (1 + surplus)))
