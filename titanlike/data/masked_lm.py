"""BERT's masked-LM samples from sentence-split documents (Megatron's ``BERTMaskedWordPieceDataset``).

Sample ``i`` (its fields: :func:`masked_lm_fields`):

1. Consecutive sentences of one document, packed up to a target length (``seq_len`` minus the
   special tokens, or shorter with probability ``short_seq_prob``; see
   :mod:`titanlike.data.sentence_samples`).
2. With ``sentence_pairs``: segment A = the sentences before a random boundary, B = the rest
   (so a document needs two sentences); with probability 0.5 A and B are swapped and
   ``binary_labels`` is 1 (Megatron's sentence-order prediction, its ``is_random``).
   Without: one segment, every sentence.
3. Too long: tokens are removed one at a time from the longer segment, each from its front or
   back with even odds, until ``[CLS] A [SEP] B [SEP]`` (or ``[CLS] A [SEP]``) fits ``seq_len``.
4. Masking: ``max(1, round(mask_prob * n))`` of the ``n`` maskable tokens (every segment token
   that is not a special token: [CLS], [SEP], [PAD], [MASK] and the tokenizer's end-of-text never
   are) are chosen uniformly; each becomes [MASK] with probability 0.8, a random ordinary token
   with 0.1, and stays itself with 0.1. ``labels`` holds the original token there, -100 elsewhere.
5. Padding with [PAD] to ``seq_len``: ``document_ids`` 1 there (0 on real tokens),
   ``token_types`` 0 for [CLS] A [SEP] and padding, 1 for B [SEP]; ``binary_weights`` = the
   number of labels (the weight of the sample's binary loss).

Random numbers come from a generator seeded with ``(seed, i)``: a sample does not depend on which
rank, or how many, read it.

Differences from Megatron-LM, on purpose: tokens are masked one by one (the original BERT's and
Hugging Face's collator's rule; Megatron masks whole words in n-grams of up to 3 with WordPiece
``##`` continuations, which a byte-level BPE does not mark), the count is taken over the maskable
tokens (Megatron's includes [CLS]/[SEP]), and the random generator is numpy's ``Generator``, so
the samples are Megatron's in distribution, not bit for bit.
"""

from __future__ import annotations

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.sentence_samples import SentenceSamples, numpy_fields
from titanlike.data.special_tokens import ordinary_token_ids, special_token_ids
from titanlike.models.outputs import IGNORE_INDEX


__all__ = ["MaskedLMSamples", "mask_tokens", "masked_lm_fields"]


def masked_lm_fields(seq_len: int, sentence_pairs: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """The fields of one sample, name -> (shape, dtype): ``inputs`` [CLS] A [SEP] B [SEP] with masked
    tokens, then [PAD]; ``labels`` the original token where one was masked, IGNORE_INDEX elsewhere;
    ``token_types`` 0 for segment A (its [CLS] and [SEP] too) and padding, 1 for segment B;
    ``document_ids`` 0 for real tokens, 1 for padding; with sentence_pairs also ``binary_labels`` 1
    where the two segments were swapped, else 0, and ``binary_weights`` the sample's number of labels
    that are not IGNORE_INDEX (the binary loss's weight, see the BERT model)."""
    tokens = ((seq_len,), "int64")
    fields = {"inputs": tokens, "labels": tokens, "document_ids": tokens, "token_types": tokens}
    if sentence_pairs:
        fields.update(binary_labels=((), "int64"), binary_weights=((), "float32"))
    return fields


def mask_tokens(tokens: np.ndarray, maskable: np.ndarray, *, mask_prob: float, mask_id: int,
                random_pool: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) after BERT's 80/10/10 masking of ``round(mask_prob * n)`` (at least one) of the
    ``n`` positions where ``maskable`` is True."""
    inputs = tokens.copy()
    labels = np.full_like(tokens, IGNORE_INDEX)
    candidates = np.flatnonzero(maskable)
    if candidates.size == 0:
        return inputs, labels
    count = min(candidates.size, max(1, int(round(mask_prob * candidates.size))))
    chosen = np.sort(rng.choice(candidates, size=count, replace=False))
    labels[chosen] = tokens[chosen]
    action = rng.random(count)
    to_mask = chosen[action < 0.8]
    to_random = chosen[(action >= 0.8) & (action < 0.9)]
    inputs[to_mask] = mask_id
    inputs[to_random] = random_pool[rng.integers(0, random_pool.size, size=to_random.size)]
    return inputs, labels


def _truncate_pair(a: np.ndarray, b: np.ndarray, budget: int, rng: np.random.Generator):
    """Trim the longer segment a token at a time (front or back, even odds) until both fit ``budget``."""
    la, lb = a.size, b.size
    if la + lb <= budget:
        return a, b
    # Repeatedly shortening the longer one ends at these lengths (ties shorten b, as its later start).
    excess = la + lb - budget
    diff = abs(la - lb)
    first = min(excess, diff)  # shortens only the longer one until they are even
    rest = excess - first
    cut_a = (first if la > lb else 0) + rest // 2
    cut_b = excess - cut_a
    out = []
    for seg, cut in ((a, cut_a), (b, cut_b)):
        front = int(rng.binomial(cut, 0.5)) if cut else 0
        out.append(seg[front:seg.size - (cut - front)])
    return out[0], out[1]


class MaskedLMSamples:
    """Map-style source of masked-LM samples (module docstring): ``ds[i]`` is a dict of numpy arrays.

    sentences: an IndexedDataset of sentence-split documents, or :class:`InMemorySentences`.
    split / split_name: a Megatron split string and its part, applied to documents.
    num_samples: samples the run reads (sizes the epochs; None: one epoch).
    """

    def __init__(self, sentences, tokenizer, *, seq_len: int, sentence_pairs: bool, mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, seed: int = 0, split: str = "1", split_name: str = "train",
                 num_samples: int | None = None):
        specials = 3 if sentence_pairs else 2
        if seq_len < specials + (2 if sentence_pairs else 1):
            raise DataError(f"masked-LM samples of seq_len {seq_len} leave no room for two segments and "
                            f"{specials} special tokens; use a longer seq_len")
        if not 0 < mask_prob < 1:
            raise ValueError(f"mask_prob must be between 0 and 1 (exclusive), got {mask_prob}")
        self.seq_len = int(seq_len)
        self.sentence_pairs = bool(sentence_pairs)
        self.mask_prob = float(mask_prob)
        ids = special_token_ids(tokenizer, ("cls", "sep", "mask", "pad"))
        self.cls_id, self.sep_id, self.mask_id, self.pad_id = ids["cls"], ids["sep"], ids["mask"], ids["pad"]
        # Never masked, even inside a segment (an --append-eod corpus holds end-of-text tokens).
        self.unmaskable = np.asarray(sorted({*ids.values(), int(tokenizer.eos_id), int(tokenizer.bos_id)}), np.int64)
        self.random_pool = np.setdiff1d(ordinary_token_ids(tokenizer), self.unmaskable)
        self.samples = SentenceSamples(
            sentences, split=split, split_name=split_name, max_len=self.seq_len - specials,
            short_seq_prob=short_seq_prob, min_sentences=2 if sentence_pairs else 1, seed=seed,
            num_samples=num_samples, what="masked-LM sentence-pair" if sentence_pairs else "masked-LM")
        self.fields = numpy_fields(masked_lm_fields(self.seq_len, self.sentence_pairs))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        first, end, _ = self.samples.packed_row(index)
        rng = self.samples.rng(index)
        sentences = [s for s in self.samples.sentence_tokens(first, end) if s.size]
        swapped = False
        if self.sentence_pairs:
            pivot = int(rng.integers(1, len(sentences)))  # the packing gives >= 2 non-empty sentences
            a, b = np.concatenate(sentences[:pivot]), np.concatenate(sentences[pivot:])
            swapped = bool(rng.random() < 0.5)
            if swapped:
                a, b = b, a
            a, b = _truncate_pair(a, b, self.seq_len - 3, rng)
            tokens = np.concatenate(([self.cls_id], a, [self.sep_id], b, [self.sep_id]))
            token_types = np.concatenate((np.zeros(a.size + 2, np.int64), np.ones(b.size + 1, np.int64)))
            segment = np.zeros(tokens.size, bool)
            segment[1:1 + a.size] = True
            segment[a.size + 2:a.size + 2 + b.size] = True
        else:
            a, _ = _truncate_pair(np.concatenate(sentences), np.zeros(0, np.int64), self.seq_len - 2, rng)
            tokens = np.concatenate(([self.cls_id], a, [self.sep_id]))
            token_types = np.zeros(tokens.size, np.int64)
            segment = np.zeros(tokens.size, bool)
            segment[1:1 + a.size] = True
        maskable = segment & ~np.isin(tokens, self.unmaskable)
        inputs, labels = mask_tokens(tokens, maskable, mask_prob=self.mask_prob, mask_id=self.mask_id,
                                     random_pool=self.random_pool, rng=rng)
        n, pad = tokens.size, self.seq_len - tokens.size
        sample = {
            "inputs": np.concatenate((inputs, np.full(pad, self.pad_id, np.int64))),
            "labels": np.concatenate((labels, np.full(pad, IGNORE_INDEX, np.int64))),
            "token_types": np.concatenate((token_types, np.zeros(pad, np.int64))),
            "document_ids": np.concatenate((np.zeros(n, np.int64), np.ones(pad, np.int64))),
        }
        if self.sentence_pairs:
            sample["binary_labels"] = np.asarray(int(swapped), dtype=np.int64)
            sample["binary_weights"] = np.asarray(np.count_nonzero(labels != IGNORE_INDEX), dtype=np.float32)
        return sample

    def __repr__(self) -> str:
        return (f"MaskedLMSamples(seq_len={self.seq_len}, sentence_pairs={self.sentence_pairs}, "
                f"samples={len(self)})")
