"""T5 span-corruption samples (titanlike.data.span_corruption): T5's noise mask, sentinels in order,
lossless reconstruction, lengths that fit, determinism, data-parallel independence, hostile documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titanlike.data import DEFAULT_TOKENIZER_PATH, DataError, build_dataloader, build_tokenizer
from titanlike.data.loader import build_dataloader_from_source
from titanlike.data.masked_lm import IGNORE_INDEX
from titanlike.data.sentence_samples import InMemorySentences
from titanlike.data.span_corruption import (
    SpanCorruptionSamples,
    corrupted_lengths,
    noise_counts,
    random_spans_noise_mask,
    raw_length_for,
)
from titanlike.data.special_tokens import sentinel_ids, special_token_ids
from titanlike.objectives import SpanCorruption, SpanCorruptionOptions

SEQ, DEC = 64, 24


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 1700, size=int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 8)))]
            for _ in range(80)]
    return InMemorySentences(docs, name="random")


def build(data, tok, **kw):
    return SpanCorruptionSamples(data, tok, **{"seq_len": SEQ, "decoder_seq_len": DEC, "seed": 3, **kw})


def test_noise_mask_counts_and_shape():
    rng = np.random.default_rng(0)
    spans_total = noise_total = 0
    for length in range(2, 200):
        mask = random_spans_noise_mask(length, 0.15, 3.0, rng)
        noise, spans = noise_counts(length, 0.15, 3.0)
        assert mask.shape == (length,) and mask.sum() == noise == min(max(round(length * 0.15), 1), length - 1)
        starts = np.flatnonzero(mask & ~np.concatenate(([False], mask[:-1])))
        assert len(starts) == spans and not mask[0] and mask[-1]  # kept tokens first, noise last
        spans_total += spans
        noise_total += noise
    assert abs(noise_total / spans_total - 3.0) < 0.15
    assert not random_spans_noise_mask(1, 0.15, 3.0, rng).any()
    # the composition of span lengths is random: two draws differ
    assert not np.array_equal(random_spans_noise_mask(100, 0.3, 3.0, rng), random_spans_noise_mask(100, 0.3, 3.0, rng))


def test_raw_length_fits_both_ends():
    for seq, dec in ((64, 24), (512, 114), (512, 128), (16, 4)):
        raw = raw_length_for(seq, dec, 0.15, 3.0)
        assert all(corrupted_lengths(n, 0.15, 3.0)[0] <= seq and corrupted_lengths(n, 0.15, 3.0)[1] <= dec
                   for n in range(raw + 1))
        enc, dec_len = corrupted_lengths(raw + 1, 0.15, 3.0)
        assert enc > seq or dec_len > dec
    assert raw_length_for(512, 114, 0.15, 3.0) == 568  # T5's random_spans_helper: 568 tokens -> 512 / 114


def reconstruct(sample, sentinels, sep):
    """The raw tokens back from encoder inputs and decoder labels, checking the sentinel order."""
    enc = sample["inputs"][sample["document_ids"] == 0]
    targets = sample["labels"][sample["labels"] != IGNORE_INDEX]
    assert enc[-1] == sep and targets[-1] == sep
    enc, targets = enc[:-1], targets[:-1]
    in_enc = [t for t in enc.tolist() if t in sentinels]
    in_dec = [t for t in targets.tolist() if t in sentinels]
    assert in_enc == in_dec == sentinels[:len(in_enc)]  # sentinel_0, sentinel_1, ... in order, once each
    spans, current = [], None
    for t in targets.tolist():
        if t in sentinels:
            current = []
            spans.append(current)
        else:
            current.append(t)
    assert all(spans), "every noise span holds a token"
    out = []
    for t in enc.tolist():
        out.extend(spans[sentinels.index(t)] if t in sentinels else [t])
    return np.asarray(out), spans


def test_samples_reconstruct_their_text(data, tok):
    ds = build(data, tok, short_seq_prob=0.3)
    ids = special_token_ids(tok, ("sep", "pad"))
    sentinels = sentinel_ids(tok, 40)
    span_lengths, noise, raw_total = [], 0, 0
    for i in range(len(ds)):
        s = ds[i]
        assert {k: v.shape for k, v in s.items()} == {"inputs": (SEQ,), "document_ids": (SEQ,),
                                                       "decoder_inputs": (DEC,), "labels": (DEC,)}
        assert all(v.dtype == np.int64 for v in s.values())
        first, end, goal = ds.samples.packed_row(i)
        raw = np.concatenate([data.get(k) for k in range(first, end)])[:min(goal, ds.raw_len)]
        rebuilt, spans = reconstruct(s, sentinels, ids["sep"])
        np.testing.assert_array_equal(rebuilt, raw)
        span_lengths += [len(x) for x in spans]
        noise += sum(len(x) for x in spans)
        raw_total += raw.size
        # padding: encoder [PAD] with document_ids 1 at the end; decoder start [PAD], labels shifted one left
        n = int((s["document_ids"] == 0).sum())
        assert (s["document_ids"][n:] == 1).all() and (s["inputs"][n:] == ids["pad"]).all()
        m = int((s["labels"] != IGNORE_INDEX).sum())
        assert s["decoder_inputs"][0] == ids["pad"]
        np.testing.assert_array_equal(s["decoder_inputs"][1:m], s["labels"][:m - 1])
        assert (s["decoder_inputs"][m:] == ids["pad"]).all() and (s["labels"][m:] == IGNORE_INDEX).all()
    assert abs(noise / raw_total - 0.15) < 0.02
    assert abs(np.mean(span_lengths) - 3.0) < 0.4


def test_deterministic_and_data_parallel_independent(data, tok):
    a, b = build(data, tok, num_samples=300), build(data, tok, num_samples=300)
    assert len(a) >= 300
    for i in (0, 17, 299):
        for k in a[i]:
            np.testing.assert_array_equal(a[i][k], b[i][k])
    common = dict(seq_len=SEQ, global_batch_size=4, seed=0, sample_fields=a.fields)
    one = iter(build_dataloader_from_source(a, local_batch_size=4, dp_rank=0, dp_degree=1, **common))
    ranks = [iter(build_dataloader_from_source(a, local_batch_size=1, dp_rank=r, dp_degree=4, **common))
             for r in range(4)]
    for _ in range(3):
        whole = next(one)
        parts = [next(r) for r in ranks]
        for k in whole:
            assert torch.equal(whole[k], torch.cat([p[k] for p in parts])), k


def test_hostile_documents(tok):
    docs = [[], [[]], [[7]], [[5, 6]], [np.arange(1, 500)], [[], [8, 9, 10], []]]
    ds = build(InMemorySentences(docs, name="hostile"), tok, short_seq_prob=0.0)
    assert len(ds) == 4  # the documents holding a token
    sentinels = sentinel_ids(tok, 20)
    sep = special_token_ids(tok, ("sep",))["sep"]
    lengths = []
    for i in range(len(ds)):
        rebuilt, _ = reconstruct(ds[i], sentinels, sep)
        lengths.append(rebuilt.size)
    assert sorted(lengths) == [1, 2, 3, ds.raw_len]  # a one-sequence document is cut to raw_len
    with pytest.raises(DataError, match="too short"):
        build(InMemorySentences(docs), tok, seq_len=2)
    with pytest.raises(DataError, match="holds a token"):
        build(InMemorySentences([[], [[]]], name="empty"), tok)


def test_embedded_corpus_loader(tok):
    objective = SpanCorruption(SpanCorruptionOptions(decoder_seq_len=DEC))
    loader = build_dataloader(dataset="default", dataset_path=None, tokenizer=tok, seq_len=SEQ, local_batch_size=2,
                              global_batch_size=2, dp_rank=0, dp_degree=1, seed=0, objective=objective)
    batch = next(iter(loader))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "inputs": (2, SEQ), "document_ids": (2, SEQ), "decoder_inputs": (2, DEC), "labels": (2, DEC)}
