"""Blending several GPT datasets in fixed proportions, Megatron-style.

Sample s of the blend goes to the dataset whose share is most behind: the argmax over j of
`w_j * max(s, 1) - count_j` (first index on ties), the greedy error-minimizing rule of
Megatron's `build_blending_indices`. It is deterministic, needs no RNG, and keeps every prefix
of the blend within one sample of the exact proportions per dataset; the sample order inside
each dataset comes from that dataset's own shuffle. Being a deterministic map-style index,
the blend resumes at an exact sample from nothing but the sample number.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from typing import Callable, Sequence

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.gpt_dataset import (
    DEFAULT_SPLIT,
    GPTDataset,
    IndexCache,
    default_cache_dir,
    load_or_build,
    samples_for_weight,
)

logger = logging.getLogger(__name__)

# Megatron builds each member this much larger than its share so the blend never runs out.
MID_LEVEL_SURPLUS = 0.005


def parse_blend(spec: str | Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`"0.7 path/a 0.3 path/b"` -> (prefixes, normalized weights); `"path/a"` -> ([a], None).

    A list of prefixes without weights (odd count, or any non-number where a weight would be)
    returns weights None, as Megatron's `get_blend_from_list` does.
    """
    items = spec.split() if isinstance(spec, str) else [str(s).strip() for s in spec]
    items = [i for i in items if i]
    if not items:
        raise DataError("empty dataset path / blend specification")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            prefixes = items[1::2]
            if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
                raise DataError(f"blend weights must be non-negative with a positive sum: "
                                 f"{weights}")
            w = np.array(weights, dtype=np.float64)
            return prefixes, (w / w.sum()).tolist()
    for i in items:
        try:
            float(i)
        except ValueError:
            continue
        raise DataError(f"blend {spec!r}: {i!r} looks like a weight but the items do not pair "
                         "up as 'weight prefix weight prefix ...'")
    return items, None


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) for `size` blended samples.

    Each error is recomputed from scratch in double precision, exactly as Megatron's C++ does,
    so ties break identically and the two produce the same index. The loop only decides the
    dataset; the per-dataset sample numbers are filled in vectorized afterwards.
    """
    w = [float(x) for x in weights]
    k = len(w)
    if k == 0 or k >= 32767:
        raise DataError(f"need 1 to 32766 datasets, got {k}")
    counts = [0] * k
    choice = array("h", bytes(2 * size))
    if k == 2:
        w0, w1 = w
        c0 = c1 = 0
        for s in range(size):
            sd = s if s > 0 else 1.0
            if w1 * sd - c1 > w0 * sd - c0:
                choice[s] = 1
                c1 += 1
            else:
                c0 += 1
    else:
        rng_k = range(1, k)
        for s in range(size):
            sd = float(s) if s > 0 else 1.0
            best = 0
            best_err = w[0] * sd - counts[0]
            for j in rng_k:
                e = w[j] * sd - counts[j]
                if e > best_err:
                    best, best_err = j, e
            choice[s] = best
            counts[best] += 1
    dataset_index = np.frombuffer(choice, dtype=np.int16).copy()
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for j in range(k):
        mask = dataset_index == j
        dataset_sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Map-style blend: `ds[i]` is sample `dataset_sample_index[i]` of dataset
    `dataset_index[i]`."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], size: int, *,
                 cache_dir: str | None = None, is_rank_zero: bool | None = None,
                 barrier: Callable[[], None] | None = None) -> None:
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w < 0) or w.sum() <= 0:
            raise DataError(f"weights must be non-negative with a positive sum: {list(weights)}")
        # normalizing again keeps the floats bit-identical to Megatron's for the same input
        self.weights = (w / w.sum()).tolist()
        self.datasets = list(datasets)
        self.size = int(size)
        self.description = {
            "class": "BlendedDataset",
            "datasets": [getattr(d, "description", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": self.size,
        }
        cache = IndexCache(cache_dir, "BlendedDataset", self.description)
        self.cache_key = cache.key
        names = ("dataset_index", "dataset_sample_index")

        def build():
            t0 = time.perf_counter()
            di, dsi = build_blending_indices(self.weights, self.size)
            logger.info("built blend of %d datasets, %d samples, %.2fs", len(self.datasets),
                        self.size, time.perf_counter() - t0)
            return {"dataset_index": di, "dataset_sample_index": dsi}

        arrays, self.loaded_from_cache = load_or_build(cache, names, build, is_rank_zero,
                                                       barrier)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for j, d in enumerate(self.datasets):
            used = int(np.count_nonzero(np.asarray(self.dataset_index) == j))
            if used > len(d):
                raise RuntimeError(f"blend draws {used} samples from dataset {j} ({d!r}) which "
                                   f"has only {len(d)}; build it with more samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def source_of(self, i: int) -> tuple[int, int]:
        """(dataset number, sample number within it) of blended sample i."""
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def __repr__(self) -> str:
        return f"BlendedDataset({len(self.datasets)} datasets, weights={self.weights}, " \
               f"size={self.size})"


def build_megatron_dataset(dataset_path: str, *, seq_len: int, num_samples: int | None,
                           seed: int, split: str = DEFAULT_SPLIT, split_name: str = "train",
                           cache_dir: str | None = None,
                           is_rank_zero: bool | None = None,
                           barrier: Callable[[], None] | None = None):
    """The map-style global sample source for `[training] dataset = "megatron"`.

    `dataset_path` is one prefix or a blend `"0.7 path/a 0.3 path/b"`. Every rank must call
    this (collectively when torch.distributed is initialized: rank 0 builds the index caches,
    the others wait and load). `cache_dir` defaults to `index-cache/` beside the first prefix.

    One prefix gives a `GPTDataset` with at least `num_samples` samples. A weighted blend gives
    a `BlendedDataset` of `sum_j ceil(num_samples * w_j)` samples (>= num_samples), each member
    built with Megatron's 0.5% surplus. Prefixes without weights are blended in proportion to
    their one-epoch sizes, capped at the total available. `num_samples=None` builds one epoch
    (of each prefix); a weighted blend needs a number, as in Megatron.
    """
    prefixes, weights = parse_blend(dataset_path)
    if cache_dir is None:
        cache_dir = default_cache_dir(prefixes[0])
    common = dict(seq_len=seq_len, seed=seed, split=split, split_name=split_name,
                  cache_dir=cache_dir, is_rank_zero=is_rank_zero, barrier=barrier)
    if len(prefixes) == 1:
        return GPTDataset(prefixes[0], num_samples=num_samples, **common)
    if weights is None:
        members = [GPTDataset(p, num_samples=None, **common) for p in prefixes]
        sizes = [len(m) for m in members]
        size = sum(sizes) if num_samples is None else min(num_samples, sum(sizes))
        return BlendedDataset(members, sizes, size, cache_dir=cache_dir,
                              is_rank_zero=is_rank_zero, barrier=barrier)
    if num_samples is None:
        raise DataError(f"a weighted blend needs num_samples (the weights say how to share "
                         f"them): {dataset_path!r}")
    members = [GPTDataset(p, num_samples=samples_for_weight(num_samples, w, MID_LEVEL_SURPLUS),
                          **common) for p, w in zip(prefixes, weights)]
    size = sum(samples_for_weight(num_samples, w) for w in weights)
    return BlendedDataset(members, weights, size, cache_dir=cache_dir,
                          is_rank_zero=is_rank_zero, barrier=barrier)
