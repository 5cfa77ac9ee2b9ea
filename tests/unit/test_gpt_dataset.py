"""GPTDataset and BlendedDataset: Megatron's sample semantics, determinism, caching. Against Megatron-LM
itself: tests/integration/test_gpt_dataset_megatron.py."""

import os
import pickle
import threading

import numpy as np
import pytest

from titanlike.data.blend import (
    BlendedDataset,
    build_blending_indices,
    build_megatron_dataset,
    parse_blend,
)
from titanlike.data.gpt_dataset import (
    GPTDataset,
    build_sample_index,
    split_range,
)
from titanlike.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 16


def write_unique_tokens(prefix, lengths, first_token=0):
    """One sequence per length; token ids are the global token positions (all distinct), so
    where each token of a sample came from is unambiguous."""
    with IndexedDatasetWriter(str(prefix), np.int32) as w:
        pos = first_token
        for n in lengths:
            w.add_document(np.arange(pos, pos + n))
            pos += n


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 300).tolist()
    lengths[10] = 0  # an empty sequence must simply be skipped
    lengths[11] = 3 * SEQ  # a document longer than several samples
    write_unique_tokens(tmp_path / "c", lengths)
    return str(tmp_path / "c"), lengths


def in_stream_order(ds):
    """Samples in sample-index order (undoing the shuffle)."""
    inverse = np.argsort(np.asarray(ds.shuffle_index), kind="stable")
    return [ds[int(k)] for k in inverse]


def reference_sample_index(sizes, doc_index, seq_len, num_samples):
    """Megatron's helpers.cpp build_sample_idx loop, transcribed as plain Python."""
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= num_samples:
        remaining = seq_len + 1
        while remaining != 0:
            doc_len = sizes[doc_index[d]] - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                d += 1
                off = 0
        out.append((d, off))
    return np.array(out)


# -- splits ------------------------------------------------------------------------------------


def test_split_ranges_follow_megatron_rounding():
    assert split_range("969,30,1", "train", 1000) == (0, 969)
    assert split_range("969,30,1", "valid", 1000) == (969, 999)
    assert split_range("969,30,1", "test", 1000) == (999, 1000)
    assert split_range("98,2", "valid", 7) == (7, 7)  # round(0.98 * 7) = 7: an empty split
    assert split_range("1", "train", 5) == (0, 5)
    with pytest.raises(ValueError, match="no share"):
        split_range("99,1", "test", 100)
    with pytest.raises(ValueError, match="unknown split name"):
        split_range("99,1", "dev", 100)


def test_splits_are_disjoint_document_ranges(corpus):
    prefix, lengths = corpus
    seen = set()
    for name in ("train", "valid", "test"):
        ds = GPTDataset(prefix, seq_len=4, split="80,15,5", split_name=name, seed=1)
        lo, hi = ds.split_range
        docs = set(np.asarray(ds.document_index).tolist())
        assert docs <= set(range(lo, hi))
        assert not docs & seen
        seen |= docs
    assert seen == set(range(len(lengths)))


def test_empty_split_is_a_clear_error(corpus):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="split 'test' .* is empty"):
        GPTDataset(prefix, seq_len=4, split="999,1,0.001", split_name="test")


# -- one epoch ---------------------------------------------------------------------------------


def test_one_epoch_covers_every_token_once(corpus):
    prefix, lengths = corpus
    ds = GPTDataset(prefix, seq_len=SEQ, split="1", seed=3)
    total = sum(lengths)
    assert ds.num_epochs == 1
    assert len(ds) == (total - 1) // SEQ
    samples = in_stream_order(ds)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]  # one shared token: the last label is the next first input
    assert all(s.shape == (SEQ + 1,) and s.dtype == np.int64 for s in samples)
    covered = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    assert len(np.unique(covered)) == len(covered)  # no token twice
    assert len(covered) == len(ds) * SEQ + 1
    assert total - len(covered) < SEQ  # only the tail that cannot fill a sample is dropped
    # the stream is the documents in document_index order, each intact
    stream = np.concatenate([np.asarray(IndexedDataset(prefix)[int(d)])
                             for d in ds.document_index])
    assert np.array_equal(covered, stream[:len(covered)])


def test_sample_index_matches_megatron_loop(corpus):
    prefix, lengths = corpus
    ds = GPTDataset(prefix, seq_len=SEQ, num_samples=2000, split="1", seed=5)
    ref = reference_sample_index(lengths, np.asarray(ds.document_index), SEQ, len(ds))
    assert np.array_equal(np.asarray(ds.sample_index), ref)
    # and directly, with empty documents first and boundaries exactly on document ends
    sizes = np.array([0, 4, 4, 0, 8, 1, 7, 4], dtype=np.int32)
    doc_index = np.array([0, 1, 2, 3, 4, 5, 6, 7], dtype=np.int32)
    for seq_len in (2, 3, 4, 8):
        n = (int(sizes.sum()) - 1) // seq_len
        assert np.array_equal(build_sample_index(sizes, doc_index, seq_len, n),
                              reference_sample_index(sizes, doc_index, seq_len, n)), seq_len


def test_shuffle_is_a_permutation_and_seed_dependent(corpus):
    prefix, _ = corpus
    a = GPTDataset(prefix, seq_len=SEQ, split="1", seed=1)
    b = GPTDataset(prefix, seq_len=SEQ, split="1", seed=2)
    assert sorted(np.asarray(a.shuffle_index).tolist()) == list(range(len(a)))
    assert not np.array_equal(a.shuffle_index, b.shuffle_index)
    assert not np.array_equal(a.document_index, b.document_index)


def test_document_shuffle_uses_numpy_randomstate(corpus):
    # Megatron: RandomState(seed) shuffles the epoch-tiled document ids, then the samples.
    prefix, _ = corpus
    ds = GPTDataset(prefix, seq_len=SEQ, split="1", seed=1234)
    rng = np.random.RandomState(1234)
    docs = np.arange(len(IndexedDataset(prefix)), dtype=np.int32)
    rng.shuffle(docs)
    assert np.array_equal(ds.document_index, docs)
    perm = np.arange(len(ds), dtype=np.uint32)
    rng.shuffle(perm)
    assert np.array_equal(ds.shuffle_index, perm)


# -- several epochs ----------------------------------------------------------------------------


def test_multiple_epochs(corpus):
    prefix, lengths = corpus
    total = sum(lengths)
    per_epoch = (total - 1) // SEQ
    want = 3 * per_epoch + per_epoch // 2  # 3.5 epochs: final epoch at 50%, shuffled apart
    ds = GPTDataset(prefix, seq_len=SEQ, num_samples=want, split="1", seed=7)
    assert ds.num_epochs == 4
    assert len(ds) >= want
    assert len(ds) == (4 * total - 1) // SEQ
    counts = np.bincount(np.asarray(ds.document_index), minlength=len(lengths))
    assert (counts == 4).all()
    # the first three epochs hold each document three times, before the separate final epoch
    first = np.asarray(ds.document_index[:3 * len(lengths)])
    assert (np.bincount(first, minlength=len(lengths)) == 3).all()
    # Megatron's draws from one RandomState, in order: 3 epochs of documents, the final
    # epoch's documents, the samples of the full epochs, the samples of the final epoch
    sans = (3 * total - 1) // SEQ
    rng = np.random.RandomState(7)
    docs = np.tile(np.arange(len(lengths), dtype=np.int32), 3)
    rng.shuffle(docs)
    last = np.arange(len(lengths), dtype=np.int32)
    rng.shuffle(last)
    assert np.array_equal(ds.document_index, np.concatenate([docs, last]))
    first_perm = np.arange(sans, dtype=np.uint32)
    rng.shuffle(first_perm)
    last_perm = np.arange(sans, len(ds), dtype=np.uint32)
    rng.shuffle(last_perm)
    assert np.array_equal(ds.shuffle_index, np.concatenate([first_perm, last_perm]))
    # every token is used as often as its epochs say: 3 or 4 times over the built samples
    samples = in_stream_order(ds)
    covered = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    uses = np.bincount(covered, minlength=total)
    nonempty = np.repeat(np.array(lengths) > 0, lengths)
    assert uses.min() >= 3 and uses.max() <= 4 and nonempty.all()


def test_last_sample_needs_one_token_past_the_epoch(tmp_path):
    # 3 samples of 11 need 34 tokens (the last label is one past); 33 per epoch is not enough
    write_unique_tokens(tmp_path / "t", [10, 12, 11])
    ds = GPTDataset(str(tmp_path / "t"), seq_len=11, num_samples=3, split="1")
    assert ds.num_epochs == 2 and len(ds) == (66 - 1) // 11


def test_final_epoch_mixed_in_when_mostly_used(corpus):
    prefix, lengths = corpus
    per_epoch = (sum(lengths) - 1) // SEQ
    ds = GPTDataset(prefix, seq_len=SEQ, num_samples=per_epoch + per_epoch * 9 // 10,
                    split="1", seed=7)
    assert ds.num_epochs == 2
    # not separated: one shuffle over all samples, so the first half holds some from epoch 2
    sans = (sum(lengths) - 1) // SEQ
    assert np.asarray(ds.shuffle_index[:sans]).max() >= sans


# -- cache and build-once ----------------------------------------------------------------------


def test_cache_hit_gives_same_samples(corpus, tmp_path):
    prefix, _ = corpus
    cache = tmp_path / "cache"
    a = GPTDataset(prefix, seq_len=SEQ, num_samples=500, seed=9, cache_dir=str(cache))
    assert not a.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert not [f for f in files if ".tmp." in f]
    assert len([f for f in files if f.endswith(".npy")]) == 3
    b = GPTDataset(prefix, seq_len=SEQ, num_samples=500, seed=9, cache_dir=str(cache))
    assert b.loaded_from_cache and b.cache_key == a.cache_key
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    # any input that changes the indices changes the key
    for kw in (dict(seed=10), dict(num_samples=501), dict(split="90,10")):
        args = dict(seq_len=SEQ, num_samples=500, seed=9, cache_dir=str(cache)) | kw
        c = GPTDataset(prefix, **args)
        assert not c.loaded_from_cache and c.cache_key != a.cache_key
    c = GPTDataset(prefix, seq_len=SEQ + 1, num_samples=500, seed=9, cache_dir=str(cache))
    assert not c.loaded_from_cache


def test_cache_without_description_is_rebuilt(corpus, tmp_path):
    prefix, _ = corpus
    cache = tmp_path / "cache"
    a = GPTDataset(prefix, seq_len=SEQ, seed=9, cache_dir=str(cache))
    desc = [f for f in os.listdir(cache) if f.endswith("description.json")]
    assert len(desc) == 1
    os.remove(cache / desc[0])  # as if the writer died before committing the entry
    b = GPTDataset(prefix, seq_len=SEQ, seed=9, cache_dir=str(cache))
    assert not b.loaded_from_cache
    assert np.array_equal(a.shuffle_index, b.shuffle_index)


def test_rank_zero_builds_others_wait_and_load(corpus, tmp_path):
    prefix, _ = corpus
    barrier = threading.Barrier(2, timeout=60)
    results, errors = {}, []

    def rank(r):
        try:
            results[r] = GPTDataset(prefix, seq_len=SEQ, num_samples=300, seed=4,
                                    cache_dir=str(tmp_path / "cache"), is_rank_zero=(r == 0),
                                    barrier=barrier.wait)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert not results[0].loaded_from_cache
    assert results[1].loaded_from_cache
    assert np.array_equal(results[0].shuffle_index, results[1].shuffle_index)


def test_rank_zero_failure_does_not_hang_others(tmp_path):
    write_unique_tokens(tmp_path / "tiny", [3, 2])
    barrier = threading.Barrier(2, timeout=30)
    errors = {}

    def rank(r):
        try:
            GPTDataset(str(tmp_path / "tiny"), seq_len=SEQ, split="1", cache_dir=str(tmp_path),
                       is_rank_zero=(r == 0), barrier=barrier.wait)
        except Exception as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert set(errors) == {0, 1}
    assert all("fewer than one sample" in str(e) for e in errors.values())


def test_pickled_dataset_gives_same_samples(corpus, tmp_path):
    prefix, _ = corpus
    GPTDataset(prefix, seq_len=SEQ, seed=2, cache_dir=str(tmp_path / "cache"))
    ds = GPTDataset(prefix, seq_len=SEQ, seed=2, cache_dir=str(tmp_path / "cache"))
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # the cached index is re-mapped, not copied
    back = pickle.loads(blob)
    assert all(np.array_equal(ds[i], back[i]) for i in range(0, len(ds), 7))


def test_index_errors(corpus):
    prefix, _ = corpus
    ds = GPTDataset(prefix, seq_len=SEQ, split="1")
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert np.array_equal(ds[-1], ds[len(ds) - 1])


# -- blending ----------------------------------------------------------------------------------


def test_parse_blend():
    assert parse_blend("0.7 a 0.3 b") == (["a", "b"], [0.7, 0.3])
    assert parse_blend("30 a 70 b")[1] == pytest.approx([0.3, 0.7])
    assert parse_blend("path/a") == (["path/a"], None)
    assert parse_blend("a b") == (["a", "b"], None)
    with pytest.raises(ValueError, match="do not pair up"):
        parse_blend("0.5 a b")
    with pytest.raises(ValueError):
        parse_blend("")


def reference_blending(weights, size):
    """Megatron's build_blending_indices, transcribed."""
    counts = [0] * len(weights)
    di, dsi = [], []
    for s in range(size):
        sd = max(float(s), 1.0)
        errs = [w * sd - c for w, c in zip(weights, counts)]
        j = max(range(len(weights)), key=lambda k: (errs[k], -k))
        di.append(j)
        dsi.append(counts[j])
        counts[j] += 1
    return np.array(di), np.array(dsi)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.3], [0.2, 0.3, 0.5], [1 / 3] * 3,
                                     [0.1, 0.0, 0.9]])
def test_blending_indices_match_megatron_rule(weights):
    di, dsi = build_blending_indices(weights, 3000)
    ref_di, ref_dsi = reference_blending(weights, 3000)
    assert np.array_equal(di, ref_di) and np.array_equal(dsi, ref_dsi)


def test_blend_proportions_and_sources(tmp_path):
    # dataset a's tokens are < 10**6, b's are >= 10**6, so a sample shows where it came from
    rng = np.random.default_rng(1)
    write_unique_tokens(tmp_path / "a", rng.integers(1, 40, 400).tolist())
    write_unique_tokens(tmp_path / "b", rng.integers(1, 40, 300).tolist(), first_token=10**6)
    n = 100_000
    blend = build_megatron_dataset(f"0.7 {tmp_path}/a 0.3 {tmp_path}/b", seq_len=8,
                                   num_samples=n, seed=11, split="1",
                                   cache_dir=str(tmp_path / "cache"))
    assert isinstance(blend, BlendedDataset)
    assert len(blend) >= n
    share = np.bincount(np.asarray(blend.dataset_index), minlength=2) / len(blend)
    assert abs(share[0] - 0.7) < 1e-3 and abs(share[1] - 0.3) < 1e-3
    # every prefix of the blend is within a sample of exact, not just the total
    prefix_a = np.cumsum(np.asarray(blend.dataset_index) == 0)
    k = np.arange(1, len(blend) + 1)
    assert np.abs(prefix_a - 0.7 * k).max() <= 1.0
    for i in rng.integers(0, len(blend), 200):
        src, _ = blend.source_of(int(i))
        s = blend[int(i)]
        assert s.shape == (9,) and ((s >= 10**6).all() if src == 1 else (s < 10**6).all())
    again = build_megatron_dataset(f"0.7 {tmp_path}/a 0.3 {tmp_path}/b", seq_len=8,
                                   num_samples=n, seed=11, split="1",
                                   cache_dir=str(tmp_path / "cache"))
    assert again.loaded_from_cache
    assert all(d.loaded_from_cache for d in again.datasets)
    assert np.array_equal(again.dataset_index, blend.dataset_index)
    for i in (0, 1, 777, len(blend) - 1):
        assert np.array_equal(again[i], blend[i])


def test_single_prefix_and_unweighted_blend(tmp_path):
    write_unique_tokens(tmp_path / "a", [30] * 40)
    write_unique_tokens(tmp_path / "b", [30] * 20, first_token=10**6)
    one = build_megatron_dataset(str(tmp_path / "a"), seq_len=8, num_samples=100, seed=1,
                                 split="1", cache_dir=str(tmp_path / "cache"))
    assert isinstance(one, GPTDataset) and len(one) >= 100
    both = build_megatron_dataset(f"{tmp_path}/a {tmp_path}/b", seq_len=8, num_samples=10**6,
                                  seed=1, split="1", cache_dir=str(tmp_path / "cache"))
    sizes = [len(d) for d in both.datasets]
    assert len(both) == sum(sizes)  # capped at one epoch of each, blended by size
    assert np.bincount(np.asarray(both.dataset_index)).tolist() == sizes
    epoch = build_megatron_dataset(str(tmp_path / "a"), seq_len=8, num_samples=None, seed=1,
                                   split="1", cache_dir=str(tmp_path / "cache"))
    assert epoch.num_epochs == 1 and len(epoch) == (40 * 30 - 1) // 8
    with pytest.raises(ValueError, match="weighted blend needs num_samples"):
        build_megatron_dataset(f"0.5 {tmp_path}/a 0.5 {tmp_path}/b", seq_len=8,
                               num_samples=None, seed=1, split="1")


def test_blend_that_overdraws_a_member_is_an_error(tmp_path):
    write_unique_tokens(tmp_path / "a", [30] * 10)
    small = GPTDataset(str(tmp_path / "a"), seq_len=8, split="1")
    with pytest.raises(RuntimeError, match="has only"):
        BlendedDataset([small, small], [0.5, 0.5], 4 * len(small))


def test_serves_the_stateful_loader_and_resumes_exactly(corpus, tmp_path):
    from titanlike.data import build_dataloader_from_source

    prefix, _ = corpus
    ds = build_megatron_dataset(prefix, seq_len=SEQ, num_samples=64, seed=1, split="1",
                                cache_dir=str(tmp_path / "cache"))

    def loader(rank):
        return build_dataloader_from_source(ds, seq_len=SEQ, local_batch_size=2,
                                            global_batch_size=4, dp_rank=rank, dp_degree=2)

    it0, it1 = iter(loader(0)), iter(loader(1))
    (x0, y0), (x1, y1) = ((b["inputs"], b["labels"]) for b in (next(it0), next(it1)))
    windows = np.stack([ds[i] for i in range(4)])  # step 0 is global samples 0..3, in order
    assert np.array_equal(np.concatenate([x0.numpy(), x1.numpy()]), windows[:, :-1])
    assert np.array_equal(np.concatenate([y0.numpy(), y1.numpy()]), windows[:, 1:])
    dl = loader(0)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    expected = next(it)
    resumed = loader(0)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert got.keys() == expected.keys() == {"inputs", "labels"}
    assert all(np.array_equal(got[name].numpy(), expected[name].numpy()) for name in got)
