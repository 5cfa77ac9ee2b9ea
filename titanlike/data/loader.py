"""The stateful data loader: one global sample stream, sliced by data-parallel rank.

Contract (the parity tests across parallel layouts rely on it):

* A dataset kind resolves to a *global sample source*: global sample ``i`` is a window of
  ``seq_len + 1`` token ids, the same on every rank and for every layout.
* Global step ``k`` consumes samples ``[S_k, S_k + G_k)``: ``G_k = G = global_batch_size`` and
  ``S_k = k*G``, or, under a batch ramp-up, the batch and the samples before step ``k`` that
  :class:`~titanlike.data.batch_schedule.BatchSchedule` gives.
* With data-parallel degree ``D``, rank ``r`` takes the contiguous block of ``G_k/D`` samples
  starting at ``S_k + r*G_k/D`` and yields it as ``G_k/(D*L)`` consecutive microbatches of
  ``L = local_batch_size`` samples, each a dict of named tensors: ``{"inputs", "labels"}`` int64
  of shape ``(L, seq_len)`` with ``labels = window[1:]``, ``inputs = window[:-1]``.

So the union of all ranks' microbatches at a step does not depend on ``D`` or ``L``.

The training objective (titanlike/objectives/) chooses the source: next-token prediction reads the
token windows of the dataset kind; masked-LM (BERT) and span-corruption (T5) objectives build a
source whose global sample ``i`` is a dict of numpy arrays (:class:`GlobalSamples` ``fields``), and
each microbatch is a dict of those fields' tensors ``(L, ...)``. The slicing by rank and step is
the same.
Map-style sources wrap around into a new epoch (reshuffled from ``seed`` when the kind asks
for shuffling); streams are infinite by themselves. Every rank reads the whole stream of a
streaming source and keeps its own block: exact layout-independence costs ``D`` times the
tokenization, a fair price next to a training step.

Adding a kind (e.g. Megatron's ``GPTDataset``, map-style and already shuffled)::

    register_dataset_kind("megatron", lambda *, dataset_path, tokenizer, seq_len, seed: ...,
                          shuffle=False)
"""

from __future__ import annotations

import os

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlike.data.batch_schedule import BatchSchedule
from titanlike.data.errors import DataError
from titanlike.data.kinds import (DatasetKind, add_dataset_reader, dataset_kind, dataset_kinds, find_dataset_kind,
                                  register_dataset_kind)
from titanlike.data.text_datasets import (
    HuggingFaceDocuments,
    PackedStream,
    SampleStream,
    packed_text_corpus,
)
from titanlike.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "DatasetKind",
    "GlobalSamples",
    "MapSampleSource",
    "RankBatches",
    "add_dataset_reader",
    "build_dataloader",
    "build_dataloader_from_source",
    "dataset_kind",
    "dataset_kinds",
    "find_dataset_kind",
    "register_dataset_kind",
    "window_samples",
]


@runtime_checkable
class MapSampleSource(Protocol):
    """Global sample ``i`` (``0 <= i < len``) as ``seq_len + 1`` integer token ids."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


SampleSource = Union[MapSampleSource, SampleStream]
SourceFactory = Callable[..., SampleSource]



@dataclass(frozen=True)
class GlobalSamples:
    """A global sample source as the loader slices it (what an objective's `samples` returns)."""

    source: SampleSource
    shuffle: bool  # permute a map-style source's samples every epoch from the seed
    # Dict samples: field name -> (shape, dtype), microbatches stack each field. None: every sample
    # is a window of seq_len + 1 token ids, cut into inputs and labels.
    fields: dict[str, tuple[tuple[int, ...], Any]] | None = None


class SampleObjective(Protocol):
    """What the loader asks of a training objective (titanlike/objectives/): its global samples of a
    dataset kind; source_args: dataset_path, tokenizer, seq_len, seed, num_samples, split, split_name."""

    def samples(self, dataset: str, **source_args) -> GlobalSamples: ...


# The embedded corpus keeps its last 1% of samples out of training, for validation runs of the demo.
DEFAULT_CORPUS_SPLIT = "99,1"


def _default_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    from titanlike.data import DEFAULT_CORPUS_PATH

    return packed_text_corpus(DEFAULT_CORPUS_PATH, tokenizer, seq_len).split(DEFAULT_CORPUS_SPLIT, split_name)


def _whole_dataset_only(kind: str, split_name: str) -> None:
    if split_name != "train":
        raise DataError(f"dataset {kind!r} has no held-out {split_name!r} split; give the validation data its "
                         "own dataset_path")


def _text_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    _whole_dataset_only("text", split_name)
    return packed_text_corpus(dataset_path, tokenizer, seq_len)


def _huggingface_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    _whole_dataset_only("huggingface", split_name)
    return PackedStream(HuggingFaceDocuments(dataset_path), tokenizer, seq_len)


def _embedded_sentences(*, dataset_path, tokenizer, split: str | None, what: str):
    """The default kind's sentences: the embedded corpus, sentence-split in memory with the rule-based
    splitter; its last 1% of documents held out, as for GPT samples."""
    from titanlike.data import DEFAULT_CORPUS_PATH
    from titanlike.data.sentence_samples import sentence_split_corpus

    return sentence_split_corpus(DEFAULT_CORPUS_PATH, tokenizer), DEFAULT_CORPUS_SPLIT


def _prefix_sentences(*, dataset_path, tokenizer, split: str | None, what: str):
    """The megatron kind's sentences: one prefix of sentence-split data (preprocess_data.py
    --split-sentences); training.split divides its documents (Megatron splits BERT / T5 data by
    documents too)."""
    from titanlike.data.blend import parse_blend
    from titanlike.data.gpt_dataset import DEFAULT_SPLIT
    from titanlike.data.indexed import IndexedDataset, check_token_ids

    prefixes, _ = parse_blend(dataset_path)
    if len(prefixes) != 1:
        raise DataError(f"{what} samples read one Megatron prefix, not a blend of {len(prefixes)}; "
                        "merge the data into one prefix")
    data = IndexedDataset(prefixes[0])
    check_token_ids(prefixes[0], tokenizer.vocab_size)
    return data, split or DEFAULT_SPLIT


def _rows(dataset, dataset_path, **options) -> None:
    from titanlike.data.conversations import check_row_files

    check_row_files(dataset, dataset_path, **options)


register_dataset_kind("default", _default_source, shuffle=True, needs_path=False, held_out=True,
                      readers={"sentences": _embedded_sentences})
register_dataset_kind("text", _text_source, shuffle=True, readers={"rows": _rows})


def _megatron_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    # Megatron's GPT dataset shuffles documents and samples itself, epoch by epoch, for as
    # many epochs as num_samples needs; the loader must not reshuffle on top.
    from titanlike.data.blend import build_megatron_dataset, parse_blend
    from titanlike.data.gpt_dataset import DEFAULT_SPLIT
    from titanlike.data.indexed import check_token_ids

    for prefix in dict.fromkeys(parse_blend(dataset_path)[0]):  # every rank: all stop alike
        check_token_ids(prefix, tokenizer.vocab_size)
    return build_megatron_dataset(dataset_path, seq_len=seq_len, num_samples=num_samples, seed=seed,
                                  split=split or DEFAULT_SPLIT, split_name=split_name)


register_dataset_kind("megatron", _megatron_source, shuffle=False, held_out=True,
                      readers={"sentences": _prefix_sentences})
# `datasets` hands each torch loader worker a disjoint share of a stream's shards, while every
# worker here must see the whole stream to keep the global sample order.
register_dataset_kind("huggingface", _huggingface_source, shuffle=False, workers_ok=False, streaming=True)


# torchtitan's dataset names. c4 and c4_validation stream allenai/c4 (English) from the Hugging Face
# Hub, or from dataset_path when it names a copy `datasets` can read. c4_test is torchtitan's small
# local test set (2,000 C4 documents, no held-out split); no C4 text ships with titanlike, so here
# it is the embedded corpus's first C4_TEST_DOCUMENTS chapters (Genesis 1 to Leviticus 10, about
# 0.4 M characters, 110 K tokens with the debug tokenizer).
C4_HUB_NAME = "allenai/c4"
C4_TEST_DOCUMENTS = 100


def _c4_source(hf_split: str) -> SourceFactory:
    def factory(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
        kind = "c4" if hf_split == "train" else f"c4_{hf_split}"
        _whole_dataset_only(kind, split_name)
        name = dataset_path or C4_HUB_NAME
        try:
            documents = HuggingFaceDocuments(f"{name}:en:{hf_split}")
        except ImportError:
            raise DataError(f"dataset {kind} streams {name} through the `datasets` package, which is not "
                            "installed (pip install datasets); without it use c4_test or a text dataset") from None
        except Exception as e:  # the Hub or the files: any failure of load_dataset, said in one line
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            raise DataError(f"dataset {kind} could not open {name} (en, {hf_split} split) with `datasets` "
                            f"({type(e).__name__}: {reason}); offline, set training.dataset_path to a local "
                            "copy of C4 or use c4_test") from None
        return PackedStream(documents, tokenizer, seq_len)

    return factory


def _c4_test_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    from titanlike.data import DEFAULT_CORPUS_PATH

    _whole_dataset_only("c4_test", split_name)
    return packed_text_corpus(DEFAULT_CORPUS_PATH, tokenizer, seq_len, max_documents=C4_TEST_DOCUMENTS)


register_dataset_kind("c4", _c4_source("train"), shuffle=False, workers_ok=False, optional_path=True,
                      streaming=True)
register_dataset_kind("c4_validation", _c4_source("validation"), shuffle=False, workers_ok=False,
                      optional_path=True, streaming=True)
register_dataset_kind("c4_test", _c4_test_source, shuffle=True, needs_path=False)


def _check_field(index: int, name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    kind_ok = np.issubdtype(arr.dtype, np.floating if dtype.kind == "f" else np.integer)
    if arr.shape != shape or not kind_ok:
        raise DataError(f"global sample {index} field {name!r} has shape {arr.shape} and dtype {arr.dtype}; "
                        f"expected shape {shape} of {'floats' if dtype.kind == 'f' else 'integers'}")
    return arr


class _MapSamples:
    """Infinite global indexing over a map-style source: epoch ``e`` is ``source`` permuted by
    ``(seed, e)`` (or in order), so any sample is computable directly, on any rank."""

    def __init__(self, source: MapSampleSource, *, shuffle: bool, seed: int):
        self.source = source
        self.num = len(source)
        if self.num <= 0:
            raise DataError(f"dataset source {source!r} holds no samples")
        self.shuffle = shuffle
        self.seed = seed
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def sample(self, index: int) -> Any:
        epoch, i = divmod(index, self.num)
        if self.shuffle:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num)
                self._perm_epoch = epoch
            i = int(self._perm[i])
        return self.source[i]

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_samples") != self.num:
            logger.warning(
                "dataset holds %s samples now but %s when the checkpoint was saved: "
                "the resumed data order is not the one the original run would have seen",
                self.num, state.get("num_samples"),
            )


class RankBatches(IterableDataset):
    """This rank's microbatches of the global sample stream, forever (see the module docstring).

    Position is the index ``n`` of the next microbatch this rank yields. Every rank yields
    ``G_k/(D*L)`` microbatches at step ``k``, so ``n*D*L`` counts the samples of all ranks'
    microbatches before it: microbatch ``n`` belongs to the step that consumes sample ``n*D*L``
    (step ``n // M``, ``M = G/(D*L)``, without a ramp-up). With ``W`` loader workers, worker ``w``
    makes microbatches ``n = w, w+W, ...`` and the loader's round-robin restores the order.
    """

    def __init__(
        self,
        samples: _MapSamples | SampleStream,
        *,
        seq_len: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        rampup: list[int] | tuple[int, ...] = (),
        fields: dict[str, tuple[tuple[int, ...], Any]] | None = None,
    ):
        super().__init__()
        self.samples = samples
        # None: causal-LM windows (seq_len + 1 ids); else field name -> (shape, dtype) of dict samples.
        self.fields = None if fields is None else {k: (tuple(shape), np.dtype(dt)) for k, (shape, dt) in fields.items()}
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.batches = BatchSchedule(global_batch_size, rampup)
        self._next = 0
        self._pending: dict[str, Any] | None = None

    def _sample(self, index: int) -> np.ndarray:
        raw = self.samples.sample(index)
        arr = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
        if arr.shape != (self.seq_len + 1,) or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(
                f"global sample {index} has shape {arr.shape} and dtype {arr.dtype}; "
                f"expected {self.seq_len + 1} (seq_len + 1) integer token ids"
            )
        return arr

    def _dict_sample(self, index: int) -> dict[str, np.ndarray]:
        raw = self.samples.sample(index)
        if not isinstance(raw, dict) or set(raw) != set(self.fields):
            got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise DataError(f"global sample {index} is {got}; expected a dict of the fields {sorted(self.fields)}")
        return {name: _check_field(index, name, raw[name], shape, dtype)
                for name, (shape, dtype) in self.fields.items()}

    def microbatch(self, n: int) -> dict[str, torch.Tensor]:
        per_pass = self.dp_degree * self.local_batch_size
        step = self.batches.step_of_sample(n * per_pass)
        step_start = self.batches.samples_before(step)
        m = (n * per_pass - step_start) // per_pass
        start = step_start + self.dp_rank * (self.batches.batch_size(step) // self.dp_degree) + m * self.local_batch_size
        if self.fields is not None:
            samples = [self._dict_sample(start + j) for j in range(self.local_batch_size)]
            return {name: torch.from_numpy(np.stack([s[name] for s in samples]).astype(dtype))
                    for name, (_, dtype) in self.fields.items()}
        windows = np.stack([self._sample(start + j) for j in range(self.local_batch_size)]).astype(np.int64)
        batch = torch.from_numpy(windows)
        return {"inputs": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()}

    def __iter__(self):
        info = get_worker_info()
        num_workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._next = self._resume_position(state, num_workers)
            self.samples.load_state_dict(state["samples"])
        else:
            self._next = worker
            self.samples.reset()
        return self._generate(num_workers)

    def _generate(self, stride: int):
        while True:
            n = self._next
            batch = self.microbatch(n)
            # Advance before yielding: a state_dict taken while the consumer holds this batch
            # must already point past it.
            self._next = n + stride
            yield batch

    def check_state(self, state: Any) -> None:
        """A saved position (state_dict's) this run can resume from, checked when it is loaded:
        ValueError, one sentence naming what differs and the option that would carry it over.
        A position of another global sample stream (batch, sequence length, ramp-up, sample
        fields) cannot be carried over; another data-parallel layout can (at a step boundary)."""
        if not isinstance(state, dict):
            raise ValueError(f"the data position is {type(state).__name__}, not the loader's state")
        for key, minimum in (("next_microbatch", 0), ("dp_degree", 1), ("local_batch_size", 1),
                             ("global_batch_size", 1), ("seq_len", 1)):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**62:
                raise ValueError(f"the data position's {key} is {value!r:.60}, not an integer >= {minimum}")
        rampup = state.get("rampup", [])
        if not (isinstance(rampup, list) and len(rampup) in (0, 3) and all(type(v) is int for v in rampup)):
            raise ValueError(f"the data position's rampup is {rampup!r:.60}, not a batch ramp-up")
        if not isinstance(state.get("samples"), dict):
            raise ValueError("the data position has no state of its samples")
        saved_rampup = ",".join(map(str, rampup)) or "none"
        mine_fields = ",".join(sorted(self.fields)) if self.fields is not None else "none"
        for key, theirs, mine, option in (
                ("global_batch_size", state["global_batch_size"], self.global_batch_size, "training.global_batch_size"),
                ("seq_len", state["seq_len"], self.seq_len, "training.seq_len"),
                ("rampup_batch_size", saved_rampup, ",".join(map(str, self.batches.rampup)) or "none",
                 "training.rampup_batch_size"),
                ("sample_fields", state.get("sample_fields", "none"), mine_fields, None)):
            if theirs != mine:
                fix = f"resume with --{option} {theirs}, or" if option and theirs != "none" else "resume with the " \
                      "settings it was saved with, or"
                raise ValueError(
                    f"the data position was saved with {option or key} {theirs} but this run's is {mine}: the "
                    f"global sample stream differs, so the position cannot be carried over; {fix} start the data "
                    "over with --checkpoint.exclude_from_loading dataloader")

    def _resume_position(self, state: dict[str, Any], num_workers: int) -> int:
        self.check_state(state)
        n = int(state["next_microbatch"])
        if (state["dp_degree"], state["local_batch_size"]) == (self.dp_degree, self.local_batch_size):
            return n
        # Another data-parallel layout: the position is a global step, valid at a step boundary.
        consumed = n * state["dp_degree"] * state["local_batch_size"]
        step = self.batches.step_of_sample(consumed)
        within = (consumed - self.batches.samples_before(step)) // (state["dp_degree"] * state["local_batch_size"])
        if num_workers != 1 or within:
            old_m = self.batches.batch_size(step) // (state["dp_degree"] * state["local_batch_size"])
            raise ValueError(
                f"dataloader checkpoint was saved with dp_degree={state['dp_degree']}, "
                f"local_batch_size={state['local_batch_size']}"
                + (f" in the middle of a step (microbatch {within} of {old_m})" if within else "")
                + f"; resuming with dp_degree={self.dp_degree}, local_batch_size={self.local_batch_size}"
                + (f" and num_workers={num_workers}" if num_workers != 1 else "")
                + " is only possible at a step boundary with num_workers=0"
            )
        return consumed // (self.dp_degree * self.local_batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_microbatch": self._next,
            "dp_rank": self.dp_rank,
            "dp_degree": self.dp_degree,
            "local_batch_size": self.local_batch_size,
            "global_batch_size": self.global_batch_size,
            "rampup": list(self.batches.rampup),
            "seq_len": self.seq_len,
            "samples": self.samples.state_dict(),
            **({"sample_fields": ",".join(sorted(self.fields))} if self.fields is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Applied when the loader next calls iter(); only then is the worker layout known.
        self._pending = state


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _validate_layout(*, seq_len, local_batch_size, global_batch_size, dp_rank, dp_degree, num_workers,
                     rampup=()) -> None:
    _check_int("seq_len", seq_len, 1)
    _check_int("local_batch_size", local_batch_size, 1)
    _check_int("global_batch_size", global_batch_size, 1)
    _check_int("dp_degree", dp_degree, 1)
    _check_int("num_workers", num_workers, 0)
    _check_int("dp_rank", dp_rank, 0)
    if dp_rank >= dp_degree:
        raise ValueError(f"dp_rank must be in [0, dp_degree={dp_degree}), got {dp_rank}")
    if global_batch_size % (dp_degree * local_batch_size):
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by "
            f"local_batch_size * dp_degree ({local_batch_size} * {dp_degree} = {local_batch_size * dp_degree}): "
            "each step gives every data-parallel rank the same whole number of microbatches"
        )
    if rampup:
        validate_rampup(rampup, global_batch_size, local_batch_size * dp_degree)


def validate_rampup(rampup, global_batch_size: int, per_pass: int, *, option: str = "rampup_batch_size") -> None:
    """A batch ramp-up [start, increment, samples] that every step can split into whole microbatches
    of every data-parallel rank: ValueError, one sentence."""
    if len(rampup) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in rampup):
        raise ValueError(f"{option} must be three positive integers start,increment,samples, got {list(rampup)}")
    start, increment, _ = rampup
    if start % per_pass or increment % per_pass:
        raise ValueError(
            f"{option} start {start} and increment {increment} must be multiples of local_batch_size x "
            f"data-parallel degree ({per_pass}): every step's batch is split into whole microbatches of every rank")
    if start >= global_batch_size or (global_batch_size - start) % increment:
        raise ValueError(
            f"{option} start {start} must be below global_batch_size {global_batch_size} and increment "
            f"{increment} must divide their difference, so that the ramp ends exactly at global_batch_size")


def build_dataloader_from_source(
    source: SampleSource,
    *,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int = 0,
    shuffle: bool = False,
    num_workers: int = 0,
    rampup: list[int] | tuple[int, ...] = (),
    sample_fields: dict[str, tuple[tuple[int, ...], Any]] | None = None,
) -> StatefulDataLoader:
    """Loader over an already built global sample source (map-style or a :class:`SampleStream`).
    rampup: a batch ramp-up [start, increment, samples] (see :mod:`titanlike.data.batch_schedule`).
    sample_fields: for dict samples, field name -> (shape, dtype); microbatches are then dicts of
    tensors stacked along a new first dimension. None: ``seq_len + 1`` windows, yielded as
    ``{"inputs", "labels"}``."""
    _validate_layout(
        seq_len=seq_len, local_batch_size=local_batch_size, global_batch_size=global_batch_size,
        dp_rank=dp_rank, dp_degree=dp_degree, num_workers=num_workers, rampup=rampup,
    )
    if isinstance(source, SampleStream):
        samples = source
    elif isinstance(source, MapSampleSource):
        samples = _MapSamples(source, shuffle=shuffle, seed=seed)
    else:
        raise TypeError(f"{type(source).__name__} is neither map-style (__len__/__getitem__) nor a SampleStream")
    dataset = RankBatches(
        samples, seq_len=seq_len, local_batch_size=local_batch_size,
        global_batch_size=global_batch_size, dp_rank=dp_rank, dp_degree=dp_degree, rampup=rampup,
        fields=sample_fields,
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API torch has since deprecated; the warning is not actionable here.
        warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
        # batch_size=None: the dataset yields whole microbatches already.
        return ResumableLoader(dataset, batch_size=None, num_workers=num_workers)


class ResumableLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader over RankBatches whose load_state_dict checks a saved position
    at once (RankBatches.check_state), instead of when the next iterator applies it: a checkpoint
    whose position this run cannot take is refused while it is loaded, in one sentence."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for state in _dataset_states(state_dict):
            if isinstance(self.dataset, RankBatches):
                self.dataset.check_state(state)
        super().load_state_dict(state_dict)


def _dataset_states(state_dict: Any) -> list[Any]:
    """The dataset positions in a StatefulDataLoader state: its own (no workers) or each worker's."""
    if isinstance(state_dict, dict) and "dataset_state" in state_dict:
        return [state_dict["dataset_state"]]
    snapshot = state_dict.get("_snapshot") if isinstance(state_dict, dict) else None
    workers = snapshot.get("_worker_snapshots") if isinstance(snapshot, dict) else None
    if isinstance(workers, dict) and workers and all(isinstance(w, dict) and "dataset_state" in w
                                                     for w in workers.values()):
        return [w["dataset_state"] for w in workers.values()]
    raise ValueError("the data position is not a loader's state (it holds no dataset position)")


def validate_dataset(dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
    """A data source's path rules, before any process group: ValueError, one sentence.

    Cheap checks only, each stopping at the first answer: the path exists, a text folder holds
    text files and the text holds at least one usable document (read up to the first one), a
    Megatron prefix's index describes its .bin (validated once per process; the loader's own
    open is then free). A Hugging Face name is not looked up here.
    """
    if dataset in ("default", "c4_test") and dataset_path:
        raise DataError(f"{option}.dataset_path is only read by the text, huggingface and megatron datasets"
                        f"{' (and c4)' if dataset == 'c4_test' else ''}; the {dataset} dataset is the embedded corpus")
    if dataset in ("text", "huggingface", "megatron") and not dataset_path:
        raise DataError(f"{option}.dataset {dataset} needs {option}.dataset_path")
    if dataset == "text":
        if not os.path.exists(dataset_path):
            raise DataError(f"{option}.dataset_path {dataset_path} does not exist")
        from titanlike.data.text_datasets import ensure_document

        try:
            ensure_document(dataset_path)
        except DataError as e:
            raise DataError(f"{option}.dataset_path: {e}") from None
    if dataset == "megatron":
        from titanlike.data.blend import parse_blend
        from titanlike.data.indexed import IndexedDataset, data_file_path, index_file_path

        try:
            prefixes, _ = parse_blend(dataset_path)
        except ValueError as e:
            raise DataError(f"{option}.dataset_path: {e}") from None
        for prefix in prefixes:
            for path in (data_file_path(prefix), index_file_path(prefix)):
                if not os.path.isfile(path):
                    raise DataError(f"{option}.dataset_path names the Megatron prefix {prefix}, but {path} does not exist")
        for prefix in dict.fromkeys(prefixes):
            try:
                IndexedDataset(prefix)
            except DataError as e:
                raise DataError(f"{option}.dataset_path: {e}") from None


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    num_workers: int = 0,
    num_samples: int | None = None,
    split: str | None = None,
    split_name: str = "train",
    rampup: list[int] | tuple[int, ...] = (),
    objective: SampleObjective | None = None,
) -> StatefulDataLoader:
    """This data-parallel rank's infinite loader of microbatches, dicts of named tensors
    (``{"inputs", "labels"}`` token windows, or the fields of an ``objective``'s samples).

    ``dataset``: ``"default"`` (embedded corpus, ``dataset_path`` must be unset),
    ``"text"`` (``dataset_path``: a ``.txt``/``.jsonl``/``.jsonl.gz`` file or a directory of them),
    ``"huggingface"`` (``dataset_path``: ``NAME[:CONFIG[:SPLIT]]`` for ``datasets.load_dataset``
    with ``streaming=True``), ``"megatron"`` (``dataset_path``: a Megatron ``.bin``/``.idx`` prefix or a
    blend ``"0.7 prefix/a 0.3 prefix/b"``), torchtitan's ``"c4"`` / ``"c4_validation"`` (allenai/c4 streamed,
    or the copy ``dataset_path`` names) and ``"c4_test"`` (a slice of the embedded corpus), or a kind
    added with :func:`register_dataset_kind`.
    ``num_samples``: how many global samples the run will read (sizes Megatron's epochs).
    ``split``/``split_name``: which part of the data (``"train"``, ``"valid"``, ``"test"``): a Megatron
    split string such as ``"969,30,1"`` for ``megatron`` (that is the default); the embedded corpus
    holds out its last 1% (``DEFAULT_CORPUS_SPLIT``); other kinds have only ``"train"``, the whole data.
    ``rampup``: Megatron's batch-size ramp-up ``[start, increment, samples]``; the step's microbatches
    per rank then follow :class:`~titanlike.data.batch_schedule.BatchSchedule`.
    ``objective``: the training objective (titanlike/objectives/), whose ``samples(dataset, ...)`` gives
    the :class:`GlobalSamples` (BERT's masked-LM samples, T5's span corruption, ...); None: the token
    windows of the dataset kind (:func:`window_samples`, next-token prediction's).

    Data that cannot be trained on (a bad path, no usable document, a damaged Megatron index, too few
    tokens for one sample) raises :class:`~titanlike.data.DataError`, a ValueError whose message is one
    sentence: train.py reports it as ``data error: ...``.
    """
    _validate_layout(
        seq_len=seq_len, local_batch_size=local_batch_size, global_batch_size=global_batch_size,
        dp_rank=dp_rank, dp_degree=dp_degree, num_workers=num_workers, rampup=rampup,
    )
    kind = dataset_kind(dataset)
    dataset_path = dataset_path or None
    if kind.needs_path and dataset_path is None:
        raise DataError(f"dataset {dataset!r} needs dataset_path")
    if not kind.needs_path and not kind.optional_path and dataset_path is not None:
        raise DataError(f"dataset {dataset!r} takes no dataset_path (got {dataset_path!r}); use dataset 'text' for files")
    if num_workers and not kind.workers_ok:
        raise DataError(f"dataset {dataset!r} supports num_workers=0 only, got num_workers={num_workers}")
    if not all(hasattr(tokenizer, a) for a in ("encode", "bos_id", "eos_id")):
        raise TypeError(
            f"tokenizer must be a Tokenizer (titanlike.data.build_tokenizer(path)), got {type(tokenizer).__name__}"
        )
    source_args = dict(dataset_path=dataset_path, tokenizer=tokenizer, seq_len=seq_len, seed=seed,
                       num_samples=num_samples, split=split, split_name=split_name)
    # Next-token windows without an objective; else its samples of this dataset kind.
    samples = (window_samples if objective is None else objective.samples)(dataset, **source_args)
    return build_dataloader_from_source(
        samples.source, seq_len=seq_len, local_batch_size=local_batch_size, global_batch_size=global_batch_size,
        dp_rank=dp_rank, dp_degree=dp_degree, seed=seed, shuffle=samples.shuffle, num_workers=num_workers,
        rampup=rampup, sample_fields=samples.fields,
    )


def window_samples(dataset: str, **source_args) -> GlobalSamples:
    """The dataset kind's own samples, windows of seq_len + 1 token ids (next-token prediction's).
    source_args: dataset_path, tokenizer, seq_len, seed, num_samples, split, split_name."""
    kind = dataset_kind(dataset)
    return GlobalSamples(kind.factory(**source_args), shuffle=kind.shuffle)
