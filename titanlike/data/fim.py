"""Fill-in-the-Middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle"): pre-training samples cut at two random points and rearranged so the model learns to infill.

The rules are those of Megatron-LM's `GPTFIMDataset` (megatron/training/datasets/fim_dataset.py),
draw for draw, so that the same random stream gives the same tokens:

* a sample is cut at every end-of-document token; each segment is transformed alone and the
  end-of-document tokens kept between them (an empty segment is skipped, its end-of-document token
  with it; the segment after the last one is always transformed, even empty);
* with a split token (`split_sample`), a segment holding it is rearranged with probability `rate` and
  then each fragment between split tokens with probability `fragment_rate`; without one, or in a
  segment without one, the segment with probability `rate`;
* rearranging a piece works on characters: its ids, special tokens left out, are decoded; unless
  the text starts with `no_prefix`, two cut points drawn uniformly in [0, len(text)] give prefix,
  middle and suffix, each encoded again, and the piece becomes, with probability `spm_rate`, SPM
  `<PRE> <SUF> suffix <MID> prefix middle`, else PSM `<PRE> prefix <SUF> suffix <MID> middle`;
* the sample keeps its length: cut at the end when longer, padded with the pad token when shorter.

Random stream: Megatron's class draws from one `numpy.random.RandomState(seed)` per dataset, in the
order samples are read, so its samples depend on which samples a process read before (the
data-parallel rank, the loader's workers, a resume). Here sample i draws from its own
`RandomState((seed + i) % 2**32)` (Megatron's convention for its BERT and T5 samples), so every
layout and a resumed run see the same samples; sample 0 is Megatron's first sample, and
`megatron_stream` gives the samples of Megatron's one stream, for comparing with it. `i` is the number
of the sample in the source the loader reads (a blend's own number, where Megatron rearranges within
each member; a text corpus's window, which a second epoch then sees rearranged alike).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from titanlike.data.errors import DataError

__all__ = ["FimSamples", "FimTokens", "FimTransform", "fim_token_ids", "megatron_stream", "sample_rng", "token_id"]


@dataclass(frozen=True)
class FimTokens:
    """The ids FIM writes and reads: the three sentinels, padding, the end of a document, and the
    optional token fragments are split at."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None


def token_id(tokenizer, text: str) -> int | None:
    """The id of the one token spelled `text` (a special token, or a vocabulary entry as the
    tokenizer spells it: 'Ġthe' in a byte-level tokenizer.json), or None."""
    special = getattr(tokenizer, "special_tokens", None)
    if isinstance(special, dict) and text in special:
        return int(special[text])
    model = getattr(tokenizer, "model", None)
    if hasattr(model, "token_to_id"):  # tokenizer.json (data/tokenizer_json.py)
        found = model.token_to_id(text)
        return None if found is None else int(found)
    if hasattr(model, "encode_single_token"):  # tiktoken (data/tokenizer.py)
        try:
            return int(model.encode_single_token(text))
        except KeyError:
            return None
    return None


def fim_token_ids(tokenizer, *, prefix: str, middle: str, suffix: str, pad: str, eod: str = "",
                  split: str = "", option: str = "fim") -> FimTokens:
    """The ids of the tokens named by their text (eod "": the tokenizer's EOS; split "": none);
    DataError, one sentence, naming the first one the tokenizer lacks and how to get it."""
    where = getattr(tokenizer, "path", type(tokenizer).__name__)
    ids: dict[str, int | None] = {}
    for name, text in (("prefix_token", prefix), ("middle_token", middle), ("suffix_token", suffix),
                       ("pad_token", pad), ("eod_token", eod), ("split_sample", split)):
        if not text:
            ids[name] = int(tokenizer.eos_id) if name == "eod_token" else None
            continue
        found = token_id(tokenizer, text)
        if found is None:
            raise DataError(f"{option}.{name} {text!r} is not a token of the tokenizer {where}: add it to the "
                            "tokenizer (a special token in tokenizer.json's added_tokens, as StarCoder's tokenizer "
                            f"has <fim_prefix>) or name one it has, such as a Llama 3 tokenizer's "
                            f"<|reserved_special_token_2|>, with {option}.{name}")
        ids[name] = found
    return FimTokens(ids["prefix_token"], ids["middle_token"], ids["suffix_token"], ids["pad_token"],
                     ids["eod_token"], ids["split_sample"])


class FimTransform:
    """One sample in, the same number of token ids out, rearranged as the module docstring says;
    `rng` is a numpy RandomState drawn from in Megatron's order."""

    def __init__(self, tokenizer, tokens: FimTokens, *, rate: float, spm_rate: float,
                 fragment_rate: float | None = None, no_prefix: str = "") -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.rate = rate
        self.spm_rate = spm_rate
        self.fragment_rate = fragment_rate
        self.no_prefix = no_prefix or None
        # Megatron decodes without the special tokens, so a BOS or another sentinel never lands in a cut.
        self._special = np.fromiter(sorted(tokenizer.special_ids), dtype=np.int64)

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        sample = np.asarray(sample, dtype=np.int64)
        n = sample.shape[0]
        eod = self.tokens.eod
        pieces: list[np.ndarray] = []
        start = 0
        for end in np.flatnonzero(sample == eod):
            if end > start:
                pieces += [self._segment(sample[start:end], rng), np.array([eod], dtype=np.int64)]
            start = end + 1
        pieces.append(self._segment(sample[start:], rng))
        out = np.concatenate(pieces)
        if out.shape[0] >= n:
            return out[:n]
        return np.concatenate([out, np.full(n - out.shape[0], self.tokens.pad, dtype=np.int64)])

    def _segment(self, segment: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        split = self.tokens.split
        if split is None:
            return self._permute(segment, self.rate, rng)
        cuts = np.flatnonzero(segment == split)
        if cuts.size == 0:
            return self._permute(segment, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return segment
        pieces: list[np.ndarray] = []
        start = 0
        for end in cuts:
            if end > start:
                pieces += [self._permute(segment[start:end], self.fragment_rate, rng),
                           np.array([split], dtype=np.int64)]
            start = end + 1
        pieces.append(self._permute(segment[start:], self.fragment_rate, rng))
        return np.concatenate(pieces)

    def _permute(self, piece: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return piece
        text = self.tokenizer.decode(piece[~np.isin(piece, self._special)].tolist())
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return piece
        lo, hi = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        encode = self.tokenizer.encode
        prefix, middle, suffix = (np.asarray(encode(part, bos=False, eos=False), dtype=np.int64)
                                  for part in (text[:lo], text[lo:hi], text[hi:]))
        t = self.tokens
        if rng.binomial(1, self.spm_rate):
            parts = ([t.prefix, t.suffix], suffix, [t.middle], prefix, middle)
        else:
            parts = ([t.prefix], prefix, [t.suffix], suffix, [t.middle], middle)
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def sample_rng(seed: int, index: int) -> np.random.RandomState:
    """The random stream of sample `index`: its own, so any sample is computed alone."""
    return np.random.RandomState((int(seed) + int(index)) % 2**32)


class FimSamples:
    """A map-style source of token windows whose sample i is the FIM transform of the wrapped
    source's sample i, drawn from `sample_rng(seed, i)`."""

    def __init__(self, source, transform: FimTransform, seed: int) -> None:
        self.source = source
        self.transform = transform
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if index < 0:
            index += len(self.source)
        return self.transform(self.source[index], sample_rng(self.seed, index))

    def __repr__(self) -> str:
        return f"FimSamples({self.source!r}, rate={self.transform.rate}, spm_rate={self.transform.spm_rate})"


def megatron_stream(source, transform: FimTransform, seed: int, count: int) -> Iterator[np.ndarray]:
    """Samples 0 .. count-1 of `source` as Megatron-LM's GPTFIMDataset gives them when one process
    reads them in order from a fresh dataset: one RandomState(seed) for all of them."""
    rng = np.random.RandomState(seed)
    for i in range(count):
        yield transform(source[i], rng)
