"""Megatron-LM's MMIDIDX (v1) indexed dataset: a `.bin` of raw tokens plus an `.idx` index.

Layout of `{prefix}.idx`, little-endian, no padding:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (always 1)
    u8        dtype code of the tokens in the .bin (see DTYPE_CODES)
    u64       sequence count S
    u64       document count D (= number of documents + 1)
    i32[S]    sequence lengths, in tokens
    i64[S]    sequence pointers, byte offsets into the .bin
    i64[D]    document indices: sequence index where each document starts, then the total S

`{prefix}.bin` is the tokens of every sequence back to back. Megatron's multimodal variant
appends i8[S] sequence modes after the document indices; we read past them and never write them.

numpy only (no torch) so the preprocessing workers and DataLoader workers stay light.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from typing import Iterable, Sequence

import numpy as np

from titanlike.data.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# The fixed part of the header: magic, version, dtype code, sequence count, document count.
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDatasetError(DataError):
    """A `.bin`/`.idx` pair that exists but cannot be read as MMIDIDX v1, or whose index does not
    describe its `.bin` (one sentence naming the file and the first bad sequence)."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype Megatron picks for a vocabulary.

    The cut-off is 65500, not 65536, because Megatron's tools use exactly that number; matching
    it keeps our files byte-identical to theirs for the same tokenizer.
    """
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
                         f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}") from None


def encode_index(dtype, sequence_lengths, document_indices) -> bytes:
    """The complete `.idx` bytes for the given lengths and document boundaries."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError("sequence lengths must be non-negative")
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed (int32 lengths)")
    docs = np.asarray(document_indices, dtype=np.int64)
    if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or np.any(np.diff(docs) < 0):
        raise ValueError("document indices must start at 0, be non-decreasing and end at the "
                         f"sequence count ({lengths.size}); got {docs[:3]}...{docs[-3:]}")
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(dtype), lengths.size, docs.size)
    return b"".join((header, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
                     docs.astype("<i8").tobytes()))


def temp_path(path: str) -> str:
    # unique per process and thread so concurrent writers of the same output (several ranks,
    # two runs) never interleave bytes in one temporary file; the last rename wins, complete.
    return f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin` / `{prefix}.idx`.

    `get` returns numpy views into the mapping (no copy). Picklable: a pickled dataset carries
    only its prefix and maps the files again where it is unpickled (DataLoader workers).
    """

    def __init__(self, prefix: str, *, validate: bool = True) -> None:
        """validate: check every size, pointer and document index against the `.bin` (vectorised,
        about a second per 10^8 sequences, once per process and file version); False checks only
        the header and the file sizes (for re-opening a dataset already validated)."""
        self.path_prefix = os.fspath(prefix)
        self._open(validate=validate)

    # -- opening and validation ---------------------------------------------------------

    def _open(self, validate: bool = True) -> None:
        idx_path = index_file_path(self.path_prefix)
        bin_path = data_file_path(self.path_prefix)
        for path, what in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"Megatron indexed dataset {what} file not found: {path} (prefix "
                    f"{self.path_prefix!r}: expected both {os.path.basename(bin_path)} and "
                    f"{os.path.basename(idx_path)}; write them with scripts/preprocess_data.py)")

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: bad magic {head[:len(INDEX_MAGIC)]!r}, expected {INDEX_MAGIC!r}; "
                "not a Megatron MMIDIDX index (the legacy lazy/cached formats are not supported)")
        if len(head) < _HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: truncated header ({idx_size} bytes)")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != INDEX_VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported MMIDIDX version {version}, only {INDEX_VERSION} is read")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])

        needed = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if idx_size < needed:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: header promises {n_seq} sequences and {n_doc} "
                f"document indices ({needed} bytes) but the file has {idx_size} bytes")

        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += n_seq * 4
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
        self._idx_map = idx

        if n_doc == 0 or self.document_indices[-1] != n_seq:
            last = self.document_indices[-1] if n_doc else "nothing"
            raise IndexedDatasetError(
                f"{idx_path}: inconsistent index: document indices end at {last}, "
                f"expected the sequence count {n_seq}")

        bin_size = os.path.getsize(bin_path)
        itemsize = self.dtype.itemsize
        if validate:
            key = _file_identity(idx_path, bin_path)
            if key not in _VALIDATED:
                _check_documents(idx_path, self.document_indices, n_seq)
                _check_sequences(idx_path, bin_path, self.sequence_lengths, self.sequence_pointers,
                                 self.document_indices, itemsize, bin_size)
                _VALIDATED.add(key)
        # The writer lays sequences out back to back, so the last pointer plus the last length
        # is the exact .bin size: an O(1) check that catches a truncated or overlong .bin (with
        # validate, the scan above has already checked every sequence this way).
        expected = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
                    if n_seq else 0)
        if bin_size != expected:
            raise _bin_size_error(idx_path, bin_path, bin_size, expected, self.dtype, n_seq,
                                  self.document_indices)
        if bin_size % itemsize:
            raise IndexedDatasetError(f"{bin_path}: size {bin_size} is not a multiple of "
                                      f"{itemsize} ({self.dtype})")
        # mmap of an empty file fails, and an empty dataset needs no mapping.
        self._tokens = (np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size
                        else np.empty(0, dtype=self.dtype))

    # -- access -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._tokens.shape[0])

    @property
    def tokens(self) -> np.ndarray:
        """All tokens as one flat read-only array (a view of the mapping)."""
        return self._tokens

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `i`, as a view (no copy)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"span [{offset}, {offset + length}) outside sequence {i} of "
                             f"length {seq_len}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    @staticmethod
    def exists(prefix: str) -> bool:
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))

    def __getstate__(self):
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state) -> None:
        # Validated where it was pickled (DataLoader workers re-open it): header and sizes only.
        self.path_prefix = state["path_prefix"]
        self._open(validate=False)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
                f"documents={self.num_documents}, tokens={self.num_tokens}, dtype={self.dtype})")


# -- token ids against the vocabulary ----------------------------------------------------------

_TOKEN_CHUNK = 1 << 22  # tokens per pass of the scan (16 MB of int32)
# (data file identity, vocabulary size) already scanned in this process.
_IDS_CHECKED: set[tuple] = set()


def check_token_ids(prefix: str, vocab_size: int) -> None:
    """Every token id of `{prefix}.bin` lies in [0, vocab_size): IndexedDatasetError naming the file,
    the first bad id and its document otherwise (an id past the embedding table fails the first
    batch that holds it, on one rank, many steps in). Free when the token dtype cannot hold an id
    outside the range (uint16 tokens and a vocabulary of 65536 or more); otherwise one vectorised
    pass over the mapped tokens in chunks (min/max per chunk; a few GB/s), once per process and
    file version."""
    data = IndexedDataset(prefix, validate=False)
    info = np.iinfo(data.dtype) if data.dtype.kind in "iu" else None
    if info is not None and info.min >= 0 and info.max < vocab_size:
        return
    bin_path = data_file_path(prefix)
    key = (_file_identity(bin_path), vocab_size)
    if key in _IDS_CHECKED:
        return
    tokens = data.tokens
    for lo in range(0, tokens.shape[0], _TOKEN_CHUNK):
        chunk = tokens[lo:lo + _TOKEN_CHUNK]
        if chunk.max() < vocab_size and chunk.min() >= 0 and (data.dtype.kind in "iu" or
                                                               bool((chunk == np.floor(chunk)).all())):
            continue
        bad = (chunk < 0) | (chunk >= vocab_size)
        if data.dtype.kind not in "iu":
            bad |= chunk != np.floor(chunk)
        position = lo + int(np.flatnonzero(bad)[0])
        starts = data.sequence_pointers // data.dtype.itemsize
        sequence = max(int(np.searchsorted(starts, position, side="right")) - 1, 0)
        document = _document_of(data.document_indices, sequence)
        value = tokens[position]
        raise IndexedDatasetError(
            f"{bin_path}: token id {value.item()!r} in document {document} (sequence {sequence}, token "
            f"{position - int(starts[sequence])}) is outside this job's vocabulary of {vocab_size} ids; was it "
            "tokenized with another tokenizer (scripts/preprocess_data.py --tokenizer)?")
    _IDS_CHECKED.add(key)


# -- validation of the index against the .bin ---------------------------------------------------
#
# Megatron's _IndexWriter (and ours, encode_index) writes pointer[0] = 0 and
# pointer[i + 1] = pointer[i] + size[i] * itemsize: the sequences lie back to back in the .bin,
# and the last one ends exactly at its end. document_indices starts at 0, never decreases and
# ends at the sequence count (an empty document repeats a value). Anything else is damage: read
# as is, it trains on nothing or on the wrong tokens, or fails many steps later. The checks run
# in chunks, so their temporaries stay bounded (~100 MB) whatever the number of sequences.

_CHUNK = 1 << 16  # elements per vectorised pass: temporaries stay in cache (measured fastest)
# (index, data) file identities already validated in this process: re-opening one (every rank's
# loader after validation, a blend naming a prefix twice) costs a stat, not a scan.
_VALIDATED: set[tuple] = set()


def _file_identity(*paths: str) -> tuple:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.abspath(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return tuple(out)


def _document_of(document_indices: np.ndarray, sequence: int) -> int:
    """The document holding `sequence` (document indices already checked monotone)."""
    return max(int(np.searchsorted(document_indices, sequence, side="right")) - 1, 0)


def _check_documents(idx_path: str, docs: np.ndarray, n_seq: int) -> None:
    """document_indices: starts at 0, within [0, n_seq], never decreasing."""
    if int(docs[0]) != 0:
        raise IndexedDatasetError(
            f"{idx_path}: damaged index: document 0 starts at sequence {int(docs[0])}, "
            "but Megatron's document indices start at 0")
    n = docs.shape[0]
    for lo in range(0, n, _CHUNK):
        chunk = docs[lo:lo + _CHUNK + 1]  # one past the chunk: the step across chunks
        # as unsigned, a negative index is huge: one comparison checks both ends of the range
        out_of_range = (chunk.view(np.uint64) > n_seq).any()
        if not out_of_range and not (chunk[1:] < chunk[:-1]).any():
            continue
        if out_of_range:
            k = lo + int(np.flatnonzero(chunk.view(np.uint64) > n_seq)[0])
            raise IndexedDatasetError(
                f"{idx_path}: damaged index: document {k} starts at sequence {int(docs[k])}, "
                f"outside the {n_seq} sequences of the index")
        k = lo + int(np.flatnonzero(chunk[1:] < chunk[:-1])[0]) + 1
        raise IndexedDatasetError(
            f"{idx_path}: damaged index: document indices are not monotone: document {k} "
            f"starts at sequence {int(docs[k])}, before document {k - 1} (at {int(docs[k - 1])})")


def _check_sequences(idx_path: str, bin_path: str, lengths: np.ndarray, pointers: np.ndarray,
                     docs: np.ndarray, itemsize: int, bin_size: int) -> None:
    """Every size non-negative and no larger than the .bin, every pointer the sum of the sizes
    before it; the first bad sequence is named with its document."""
    n = lengths.shape[0]
    base = 0  # byte offset where this chunk's first sequence must start
    for lo in range(0, n, _CHUNK):
        nbytes = lengths[lo:lo + _CHUNK].astype(np.int64)
        if itemsize != 1:
            nbytes *= itemsize
        ends = np.cumsum(nbytes)
        ends += base
        ptr = pointers[lo:lo + _CHUNK]
        # negative or larger than the whole .bin in one unsigned comparison
        if ((nbytes.view(np.uint64) > bin_size).any() or int(ptr[0]) != base
                or (ptr[1:] != ends[:-1]).any()):
            _raise_first_bad_sequence(idx_path, bin_path, lo, nbytes, ends, ptr, lengths, docs,
                                      itemsize, bin_size)
        base = int(ends[-1])


def _raise_first_bad_sequence(idx_path, bin_path, lo, nbytes, ends, ptr, lengths, docs, itemsize,
                              bin_size) -> None:
    starts = ends - nbytes
    bad_size = (nbytes < 0) | (nbytes > bin_size)
    j = int(np.flatnonzero(bad_size | (ptr != starts))[0])
    i = lo + j
    where = f"{idx_path}: damaged index: sequence {i} (document {_document_of(docs, i)})"
    size = int(lengths[i])
    bin_name = os.path.basename(bin_path)
    if size < 0:
        raise IndexedDatasetError(f"{where} has a negative size of {size} tokens")
    if bad_size[j]:
        raise IndexedDatasetError(
            f"{where} has {size} tokens ({size * itemsize} bytes), more than the whole "
            f"{bin_name} holds ({bin_size} bytes)")
    p = int(ptr[j])
    past = f", past the end of {bin_name} ({bin_size} bytes)" if not 0 <= p < bin_size else ""
    raise IndexedDatasetError(
        f"{where} points at byte {p}{past}, but the sizes before it place it at byte "
        f"{int(starts[j])} (Megatron's pointers are the running sum of sizes x {itemsize} bytes)")


def _bin_size_error(idx_path: str, bin_path: str, bin_size: int, expected: int, dtype: np.dtype,
                    n_seq: int, docs: np.ndarray) -> IndexedDatasetError:
    if bin_size < expected:
        last = n_seq - 1
        return IndexedDatasetError(
            f"{bin_path}: data file is truncated: {bin_size} bytes on disk, but the index "
            f"{os.path.basename(idx_path)} describes {expected} bytes ({n_seq} sequences of {dtype}; "
            f"the last, sequence {last} of document {_document_of(docs, last)}, ends at byte {expected})")
    return IndexedDatasetError(
        f"{bin_path}: data file is larger than its index says: {bin_size} bytes on disk, the index "
        f"{os.path.basename(idx_path)} describes {expected} bytes ({n_seq} sequences of {dtype})")


class IndexedDatasetWriter:
    """Streams tokens to `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Both files are written under temporary names and renamed into place only by `finalize()`,
    so a crash or an exception never leaves a half-written pair that looks complete. As a
    context manager, leaving the block normally finalizes; leaving it by an exception removes
    the temporaries.
    """

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes the format cannot name before writing anything
        self._bin_tmp = temp_path(data_file_path(self.prefix))
        self._idx_tmp = temp_path(index_file_path(self.prefix))
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []  # sequences per document
        self._pending = 0  # sequences of the document not yet ended (add_item path)
        self._done = False

    def _write_tokens(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(arr.dtype, np.integer) and np.issubdtype(
                    self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(f"token id range [{lo}, {hi}] does not fit {self.dtype}")
            arr = arr.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(arr).astype(self.dtype.newbyteorder("<"),
                                                         copy=False).tobytes())
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """One sequence of the current document; close the document with `end_document()`."""
        self._lengths.append(np.array([self._write_tokens(tokens)], dtype=np.int64))
        self._pending += 1

    def end_document(self) -> None:
        self._docs.append(np.array([self._pending], dtype=np.int64))
        self._pending = 0

    def add_document(self, tokens, lengths: Sequence[int] | None = None) -> None:
        """A whole document: `tokens` flat, split into sequences of `lengths` (default: one).

        An empty `lengths` records a document with no sequences, as Megatron does for an empty
        text.
        """
        n = self._write_tokens(tokens)
        lengths = np.array([n] if lengths is None else lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != n:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {n} tokens were given")
        self.add_encoded(None, lengths, np.array([lengths.size], dtype=np.int64))

    def add_encoded(self, token_bytes: bytes | None, sequence_lengths: np.ndarray,
                    sequences_per_document: np.ndarray) -> None:
        """Bulk path for pre-encoded chunks: raw token bytes already in the target dtype."""
        if self._pending:
            raise RuntimeError("add_item() sequences are pending: call end_document() first")
        if token_bytes is not None:
            self._bin.write(token_bytes)
        self._lengths.append(np.asarray(sequence_lengths, dtype=np.int64))
        self._docs.append(np.asarray(sequences_per_document, dtype=np.int64))

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (Megatron's merge of shards)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} ({other.dtype}) into a {self.dtype} dataset")
        self._bin.flush()
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)
        self.add_encoded(None, np.asarray(other.sequence_lengths),
                         np.diff(np.asarray(other.document_indices)))

    def finalize(self) -> None:
        if self._done:
            return
        if self._pending:
            self.end_document()
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        per_doc = np.concatenate(self._docs) if self._docs else np.zeros(0, np.int64)
        docs = np.zeros(per_doc.size + 1, dtype=np.int64)
        np.cumsum(per_doc, out=docs[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(encode_index(self.dtype, lengths, docs))
        # .bin first: a reader that sees the new .idx then also sees the matching .bin.
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix: str, documents: Iterable[Sequence[int]], dtype) -> None:
    """Convenience: one sequence per document."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(np.asarray(doc))
