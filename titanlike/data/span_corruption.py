"""T5's span-corruption samples from (sentence-split) documents.

Sample ``i`` (its fields: :func:`span_corruption_fields`):

1. Consecutive sentences of one document, concatenated up to ``raw_len`` tokens, the most that
   still fit once corrupted: the encoder's ``seq_len`` and the decoder's ``decoder_seq_len``
   (see :func:`corrupted_lengths`); with probability ``short_seq_prob`` a shorter random target
   (the packing of :mod:`titanlike.data.sentence_samples`).
2. Noise: T5's ``random_spans_noise_mask`` (:func:`random_spans_noise_mask`): ``round(n *
   mask_prob)`` noise tokens (at least 1, at most n - 1) in ``round(noise / mean_noise_span_length)``
   spans (at least 1), span lengths a uniformly random composition, the sequence starting with
   kept tokens and ending with noise.
3. Encoder ``inputs``: the kept tokens, each noise span replaced by one sentinel (sentinel_0,
   sentinel_1, ... in order), then [SEP] as the end-of-sequence token (T5's ``</s>``; the Llama 3
   ``<|end_of_text|>`` for our tokenizers), then [PAD]; ``document_ids`` 0 on real tokens, 1 on padding.
4. Decoder: targets = for every span k, sentinel_k then span k's tokens, then [SEP].
   ``decoder_inputs`` = [PAD] + targets[:-1] (the decoder start token is [PAD], as Hugging Face's T5
   ``decoder_start_token_id``), padded with [PAD]; ``labels`` = targets padded with -100. Both are
   ``decoder_seq_len`` long; ``labels[j]`` is predicted from ``decoder_inputs[:j + 1]``.

Random numbers come from a generator seeded with ``(seed, i)``.

The noise follows T5's own preprocessing (exact counts, uniformly random span lengths) rather than
Megatron's T5 dataset (n-gram spans of geometric length drawn like its BERT masking, [BOS] as the
decoder start), so that a model trained here sees what a Hugging Face T5 checkpoint was trained on.
"""

from __future__ import annotations

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.masked_lm import IGNORE_INDEX
from titanlike.data.sentence_samples import SentenceSamples, numpy_fields
from titanlike.data.special_tokens import sentinel_ids, special_token_ids

__all__ = ["SpanCorruptionSamples", "corrupted_lengths", "random_spans_noise_mask", "span_corruption_fields"]


def span_corruption_fields(seq_len: int, decoder_seq_len: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The fields of one sample, name -> (shape, dtype): ``inputs`` (seq_len,) the encoder's tokens with
    noise spans replaced by sentinels, then [PAD]; ``document_ids`` (seq_len,) 0 real, 1 padding;
    ``decoder_inputs`` and ``labels`` (decoder_seq_len,) the spans after their sentinels, labels one
    left of decoder_inputs, IGNORE_INDEX on padding."""
    tokens, decoder = ((seq_len,), "int64"), ((decoder_seq_len,), "int64")
    return {"inputs": tokens, "labels": decoder, "document_ids": tokens, "decoder_inputs": decoder}


def noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a sequence of ``length`` tokens (0, 0 below two tokens)."""
    if length < 2:
        return 0, 0
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(noise / mean_noise_span_length)), 1)
    # every span needs a kept token before it (T5 does not clamp; at high densities it would break)
    return noise, min(spans, noise, length - noise)


def corrupted_lengths(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(encoder tokens, decoder targets) of a sequence of ``length`` tokens once corrupted, end tokens
    included: kept + one sentinel per span + [SEP], and noise + one sentinel per span + [SEP]."""
    noise, spans = noise_counts(length, noise_density, mean_noise_span_length)
    return length - noise + spans + 1, noise + spans + 1


def raw_length_for(seq_len: int, decoder_seq_len: int, noise_density: float, mean_noise_span_length: float) -> int:
    """The longest raw length such that it and every shorter one fit both lengths once corrupted."""
    n = 0
    while True:
        enc, dec = corrupted_lengths(n + 1, noise_density, mean_noise_span_length)
        if enc > seq_len or dec > decoder_seq_len:
            return n
        n += 1


def _random_composition(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` positive integers summing to ``total``, uniformly among all such compositions."""
    cuts = np.sort(rng.choice(total - 1, size=parts - 1, replace=False)) + 1 if parts > 1 else np.zeros(0, np.int64)
    return np.diff(np.concatenate(([0], cuts, [total])))


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """T5's noise mask (bool, True = noise) of ``length`` tokens: kept and noise spans alternate,
    kept first; see the module docstring for the counts."""
    noise, spans = noise_counts(length, noise_density, mean_noise_span_length)
    if spans == 0:
        return np.zeros(length, dtype=bool)
    noise_lengths = _random_composition(noise, spans, rng)
    kept_lengths = _random_composition(length - noise, spans, rng)
    interleaved = np.stack((kept_lengths, noise_lengths), axis=1).reshape(-1)
    return np.repeat(np.tile(np.array([False, True]), spans), interleaved)


class SpanCorruptionSamples:
    """Map-style source of T5 span-corruption samples (module docstring): ``ds[i]`` is a dict of arrays.

    sentences: an IndexedDataset (sentence-split or not: a document of one sequence is one long
    sentence, cut to ``raw_len``) or :class:`InMemorySentences`. split / split_name / num_samples:
    as :class:`titanlike.data.masked_lm.MaskedLMSamples`.
    """

    def __init__(self, sentences, tokenizer, *, seq_len: int, decoder_seq_len: int, mask_prob: float = 0.15,
                 mean_noise_span_length: float = 3.0, short_seq_prob: float = 0.1, seed: int = 0,
                 split: str = "1", split_name: str = "train", num_samples: int | None = None):
        if not 0 < mask_prob < 1:
            raise ValueError(f"mask_prob must be between 0 and 1 (exclusive), got {mask_prob}")
        if mean_noise_span_length < 1:
            raise ValueError(f"mean_noise_span_length must be at least 1, got {mean_noise_span_length}")
        self.seq_len, self.decoder_seq_len = int(seq_len), int(decoder_seq_len)
        self.mask_prob, self.mean_noise_span_length = float(mask_prob), float(mean_noise_span_length)
        self.raw_len = raw_length_for(self.seq_len, self.decoder_seq_len, self.mask_prob, self.mean_noise_span_length)
        if self.raw_len < 2:
            raise DataError(f"span-corruption samples need seq_len and decoder_seq_len room for at least two tokens, "
                            f"one sentinel and an end token; seq_len {seq_len} / decoder_seq_len {decoder_seq_len} "
                            "are too short")
        ids = special_token_ids(tokenizer, ("sep", "pad"))
        self.sep_id, self.pad_id = ids["sep"], ids["pad"]
        max_spans = max(noise_counts(n, self.mask_prob, self.mean_noise_span_length)[1]
                        for n in range(self.raw_len + 1))
        self.sentinels = np.asarray(sentinel_ids(tokenizer, max_spans), dtype=np.int64)
        self.samples = SentenceSamples(
            sentences, split=split, split_name=split_name, max_len=self.raw_len, short_seq_prob=short_seq_prob,
            min_sentences=1, seed=seed, num_samples=num_samples, what="span-corruption")
        self.fields = numpy_fields(span_corruption_fields(self.seq_len, self.decoder_seq_len))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        first, end, goal = self.samples.packed_row(index)
        rng = self.samples.rng(index)
        tokens = np.concatenate(self.samples.sentence_tokens(first, end))[:min(goal, self.raw_len)]
        noise = random_spans_noise_mask(tokens.size, self.mask_prob, self.mean_noise_span_length, rng)
        starts = noise & ~np.concatenate(([False], noise[:-1]))
        span_of = np.cumsum(starts) - 1  # span number of each noise token
        sentinel_at = self.sentinels[np.maximum(span_of, 0)] if self.sentinels.size else np.zeros_like(tokens)
        encoder = np.where(starts, sentinel_at, tokens)[~noise | starts]
        # Targets: each noise token, preceded by its span's sentinel where a span starts; ordered by
        # key 2*position (sentinel) / 2*position + 1 (token).
        where = np.flatnonzero(noise)
        span_starts = np.flatnonzero(starts)
        keys = np.concatenate((2 * span_starts, 2 * where + 1))
        values = np.concatenate((sentinel_at[span_starts], tokens[where]))
        targets = np.concatenate((values[np.argsort(keys, kind="stable")], [self.sep_id]))
        encoder = np.concatenate((encoder, [self.sep_id]))
        decoder_inputs = np.concatenate(([self.pad_id], targets[:-1]))
        n, pad, dpad = encoder.size, self.seq_len - encoder.size, self.decoder_seq_len - targets.size
        return {
            "inputs": np.concatenate((encoder, np.full(pad, self.pad_id, np.int64))),
            "document_ids": np.concatenate((np.zeros(n, np.int64), np.ones(pad, np.int64))),
            "decoder_inputs": np.concatenate((decoder_inputs, np.full(dpad, self.pad_id, np.int64))),
            "labels": np.concatenate((targets, np.full(dpad, IGNORE_INDEX, np.int64))),
        }

    def __repr__(self) -> str:
        return (f"SpanCorruptionSamples(seq_len={self.seq_len}, decoder_seq_len={self.decoder_seq_len}, "
                f"raw_len={self.raw_len}, samples={len(self)})")
