"""MMIDIDX reader/writer: byte compatibility with the format as Megatron documents it."""

import pickle
import struct

import numpy as np
import pytest

from titanlike.data.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    optimal_dtype,
    write_indexed_dataset,
)

# Megatron's dtype codes, written out independently of the module under test.
CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.int64): 5,
         np.dtype(np.uint8): 1}
TOKEN_FORMAT = {np.dtype(np.uint16): "<H", np.dtype(np.int32): "<i", np.dtype(np.int64): "<q",
                np.dtype(np.uint8): "<B"}


def reference_files(documents, dtype):
    """(.bin bytes, .idx bytes) straight from the format description.

    `documents` is a list of documents, each a list of sequences (lists of token ids).
    """
    dtype = np.dtype(dtype)
    bin_parts, lengths, pointers, doc_idx = [], [], [], [0]
    ptr = 0
    for doc in documents:
        for seq in doc:
            bin_parts.append(b"".join(struct.pack(TOKEN_FORMAT[dtype], t) for t in seq))
            lengths.append(len(seq))
            pointers.append(ptr)
            ptr += len(seq) * dtype.itemsize
        doc_idx.append(len(lengths))
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1)
    idx += struct.pack("<B", CODES[dtype])
    idx += struct.pack("<Q", len(lengths))
    idx += struct.pack("<Q", len(doc_idx))
    idx += b"".join(struct.pack("<i", n) for n in lengths)
    idx += b"".join(struct.pack("<q", p) for p in pointers)
    idx += b"".join(struct.pack("<q", d) for d in doc_idx)
    return b"".join(bin_parts), idx


def sample_documents(vocab):
    rng = np.random.default_rng(1)
    docs = []
    for i in range(40):
        if i == 7:
            docs.append([])  # an empty document: a boundary with no sequences
            continue
        n_seq = 1 if i % 5 else 3  # some documents with several sequences (sentences)
        docs.append([rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in range(n_seq)])
    docs[3][0][0] = vocab - 1  # the largest id must survive
    return docs


def write_with_writer(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            flat = [t for seq in doc for t in seq]
            w.add_document(np.array(flat, dtype=np.int64), [len(s) for s in doc])


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65535), (np.int32, 200_000)])
def test_writer_bytes_equal_reference(tmp_path, dtype, vocab):
    docs = sample_documents(vocab)
    ref_bin, ref_idx = reference_files(docs, dtype)
    write_with_writer(str(tmp_path / "ours"), docs, dtype)
    assert (tmp_path / "ours.bin").read_bytes() == ref_bin
    assert (tmp_path / "ours.idx").read_bytes() == ref_idx


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65535), (np.int32, 200_000)])
def test_reader_reads_reference_files(tmp_path, dtype, vocab):
    docs = sample_documents(vocab)
    ref_bin, ref_idx = reference_files(docs, dtype)
    (tmp_path / "ref.bin").write_bytes(ref_bin)
    (tmp_path / "ref.idx").write_bytes(ref_idx)
    ds = IndexedDataset(str(tmp_path / "ref"))
    seqs = [s for d in docs for s in d]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(seqs)
    assert ds.num_documents == len(docs)
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    expected_doc_idx = np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert ds.document_indices.tolist() == expected_doc_idx
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    s = seqs[5]
    assert ds.get(5, offset=1, length=len(s) - 2).tolist() == s[1:-1]
    assert ds.get(5, offset=2).tolist() == s[2:]
    assert ds.get(-1).tolist() == seqs[-1]


def test_get_is_a_zero_copy_view(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), [[1, 2, 3, 4], [5, 6]], np.uint16)
    ds = IndexedDataset(str(tmp_path / "d"))
    v = ds.get(0, 1, 2)
    assert not v.flags.owndata and not v.flags.writeable
    assert np.shares_memory(v, ds.tokens)
    with pytest.raises(IndexError):
        ds.get(1, offset=1, length=2)
    with pytest.raises(IndexError):
        ds.get(2)


def test_optimal_dtype_matches_megatron_cutoff():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="does not fit uint16"):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document(np.array([1, 70000]))
    assert list(tmp_path.iterdir()) == []  # the failed write left nothing behind


def test_add_item_end_document_and_merge_match_one_pass(tmp_path):
    docs = sample_documents(1000)
    write_with_writer(str(tmp_path / "all"), docs, np.uint16)
    write_with_writer(str(tmp_path / "p1"), docs[:20], np.uint16)
    with IndexedDatasetWriter(str(tmp_path / "merged"), np.uint16) as w:
        w.add_index(str(tmp_path / "p1"))
        for doc in docs[20:]:
            for seq in doc:
                w.add_item(seq)
            w.end_document()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"all{ext}").read_bytes()


def test_pickle_reopens_by_prefix(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), [[1, 2, 3], [4]], np.uint16)
    ds = IndexedDataset(str(tmp_path / "d"))
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # carries the prefix, not the tokens
    assert pickle.loads(blob)[0].tolist() == [1, 2, 3]


def test_empty_dataset(tmp_path):
    write_indexed_dataset(str(tmp_path / "e"), [], np.uint16)
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


# -- errors name the file ----------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    write_indexed_dataset(str(tmp_path / "g"), [[1, 2, 3], [4, 5]], np.uint16)
    return tmp_path / "g"


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_missing_file(good, ext):
    path = good.with_suffix(ext)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=str(path)):
        IndexedDataset(str(good))


def test_bad_magic(good):
    idx = good.with_suffix(".idx")
    idx.write_bytes(b"TNTIDX\x00\x00\x00" + idx.read_bytes()[9:])
    with pytest.raises(IndexedDatasetError, match=f"{idx}: bad magic"):
        IndexedDataset(str(good))


def test_unsupported_version(good):
    idx = good.with_suffix(".idx")
    raw = bytearray(idx.read_bytes())
    raw[9:17] = struct.pack("<Q", 2)
    idx.write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="unsupported MMIDIDX version 2"):
        IndexedDataset(str(good))


def test_truncated_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=f"{b}: data file is truncated: 8 bytes"):
        IndexedDataset(str(good))


def test_overlong_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes() + b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match="larger than its index"):
        IndexedDataset(str(good))


def test_truncated_idx(good):
    idx = good.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-5])
    with pytest.raises(IndexedDatasetError, match=f"{idx}: truncated index"):
        IndexedDataset(str(good))


# -- a damaged index is refused when opened, naming the file and the first bad sequence ----------
#
# Megatron's _IndexWriter (and ours) writes pointer[0] = 0, pointer[i+1] = pointer[i] + size[i] *
# itemsize, and document indices 0, ..., S, non-decreasing. Before these checks, a negative size
# trained silently and a pointer past the end of the .bin failed steps later ("global sample 0 has
# shape (0,)").

HEADER = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8


@pytest.fixture
def damaged(tmp_path):
    """A Megatron-written pair of 5 sequences in 5 documents (one empty, one of two sequences), and a
    patcher of its index: sequences start at bytes 0, 6, 10, 12, 20 of a 22-byte .bin; documents at 0, 1, 3, 3, 4, 5."""
    docs = [[[1, 2, 3]], [[4, 5], [6]], [], [[7, 8, 9, 10]], [[11]]]
    bin_bytes, idx_bytes = reference_files(docs, np.uint16)
    prefix = tmp_path / "d"
    prefix.with_suffix(".bin").write_bytes(bin_bytes)
    prefix.with_suffix(".idx").write_bytes(idx_bytes)
    assert IndexedDataset(str(prefix)).num_documents == 5  # intact, it opens

    def patch(field, i, value):
        n_seq = 5
        off = {"size": (HEADER, "<i4"), "pointer": (HEADER + 4 * n_seq, "<i8"),
               "document": (HEADER + 12 * n_seq, "<i8")}[field]
        raw = bytearray(prefix.with_suffix(".idx").read_bytes())
        width = np.dtype(off[1]).itemsize
        raw[off[0] + i * width: off[0] + (i + 1) * width] = np.array([value], dtype=off[1]).tobytes()
        prefix.with_suffix(".idx").write_bytes(bytes(raw))
        return str(prefix)

    return patch


@pytest.mark.parametrize("field, i, value, message", [
    ("size", 2, -4, r"d\.idx: damaged index: sequence 2 \(document 1\) has a negative size of -4 tokens"),
    ("size", 0, 2**31 - 1, r"sequence 0 \(document 0\) has 2147483647 tokens \(4294967294 bytes\), more "
                           r"than the whole d\.bin holds \(22 bytes\)"),
    ("pointer", 3, 4096, r"sequence 3 \(document 3\) points at byte 4096, past the end of d\.bin \(22 bytes\), "
                         r"but the sizes before it place it at byte 12"),
    ("pointer", 1, 2, r"sequence 1 \(document 1\) points at byte 2, but the sizes before it place it at byte 6 "
                      r"\(Megatron's pointers are the running sum of sizes x 2 bytes\)"),
    ("size", 1, 1, r"sequence 2 \(document 1\) points at byte 10, but the sizes before it place it at byte 8"),
    ("document", 3, 0, r"document indices are not monotone: document 3 starts at sequence 0, before document 2 "
                       r"\(at 3\)"),
    ("document", 3, 99, r"document 3 starts at sequence 99, outside the 5 sequences of the index"),
    ("document", 1, -1, r"document 1 starts at sequence -1, outside the 5 sequences"),
    ("document", 0, 1, r"document 0 starts at sequence 1, but Megatron's document indices start at 0"),
])
def test_damaged_index_names_the_first_bad_sequence(damaged, field, i, value, message):
    prefix = damaged(field, i, value)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(prefix)
    assert "\n" not in str(err.value) and str(err.value).startswith(prefix + ".idx: damaged index")


def test_last_sequence_ending_past_the_bin_names_it(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=r"the last, sequence 1 of document 1, ends at byte 10"):
        IndexedDataset(str(good))


def test_damage_found_across_chunk_boundaries(tmp_path, monkeypatch):
    import titanlike.data.indexed as indexed

    monkeypatch.setattr(indexed, "_CHUNK", 4)  # 11 sequences: three chunks
    docs = [[[j] * (1 + j % 3)] for j in range(11)]
    for where in ("size", "document"):
        bin_bytes, idx_bytes = reference_files(docs, np.uint16)
        prefix = tmp_path / where
        prefix.with_suffix(".bin").write_bytes(bin_bytes)
        raw = bytearray(idx_bytes)
        if where == "size":  # sequence 7, last of chunk 2, claims 1 token instead of 2: the pointer of
            # sequence 8, first of chunk 3, then disagrees with the running sum carried across
            raw[HEADER + 7 * 4: HEADER + 8 * 4] = np.array([1], "<i4").tobytes()
        else:  # document 8 (first of the third chunk) steps back below document 7
            raw[HEADER + 12 * 11 + 8 * 8: HEADER + 12 * 11 + 9 * 8] = np.array([2], "<i8").tobytes()
        prefix.with_suffix(".idx").write_bytes(bytes(raw))
        match = ("sequence 8 \\(document 8\\) points at byte 30, but the sizes before it place it at byte 28"
                 if where == "size"
                 else "not monotone: document 8 starts at sequence 2, before document 7")
        with pytest.raises(IndexedDatasetError, match=match):
            IndexedDataset(str(prefix))


def test_validation_runs_once_per_file_version(tmp_path, monkeypatch):
    import titanlike.data.indexed as indexed

    prefix = str(tmp_path / "v")
    write_indexed_dataset(prefix, [[1, 2, 3], [4]], np.uint16)
    calls = []
    real = indexed._check_sequences
    monkeypatch.setattr(indexed, "_check_sequences", lambda *a: calls.append(1) or real(*a))
    IndexedDataset(prefix)
    IndexedDataset(prefix)
    pickle.loads(pickle.dumps(IndexedDataset(prefix)))  # a loader worker re-opening it
    IndexedDataset(prefix, validate=False)
    assert len(calls) == 1
    write_indexed_dataset(prefix, [[1, 2, 3], [4], [5, 6]], np.uint16)  # rewritten: checked again
    IndexedDataset(prefix)
    assert len(calls) == 2


def test_index_errors_are_data_errors():
    from titanlike.data import DataError

    assert issubclass(IndexedDatasetError, DataError) and issubclass(DataError, ValueError)
