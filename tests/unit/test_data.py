"""Datasets and the data-parallel loader: packing, rank slicing, resume, bad input. Resumed with DataLoader
worker processes: tests/integration/test_data_workers.py."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import pickle
import sys

import numpy as np
import pytest
import torch

from data_checks import G, SEQ, assert_same_batches, check_resume_mid_stream, default_loader, take
from titanlike.data import (
    DEFAULT_CORPUS_PATH,
    DEFAULT_TOKENIZER_PATH,
    build_dataloader,
    build_dataloader_from_source,
    build_tokenizer,
)
from titanlike.data.text_datasets import (
    IterableDocuments,
    PackedStream,
    PackedTokens,
    iter_documents,
    pack_documents,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def docs():
    return list(itertools.islice(iter_documents(DEFAULT_CORPUS_PATH), 40))


def stream_loader(tok, docs, *, rank=0, dp=1, local=G):
    stream = PackedStream(IterableDocuments(lambda: docs), tok, SEQ)
    return build_dataloader_from_source(
        stream, seq_len=SEQ, local_batch_size=local, global_batch_size=G, dp_rank=rank, dp_degree=dp,
    )


def global_steps(make, *, dp, local, steps):
    """Per step, all ranks' microbatches concatenated in rank order: (inputs, labels) of (G, SEQ)."""
    per_step = G // (dp * local)
    ranks = [take(make(rank=r, dp=dp, local=local), steps * per_step) for r in range(dp)]
    out = []
    for k in range(steps):
        mbs = [mb for r in range(dp) for mb in ranks[r][k * per_step : (k + 1) * per_step]]
        out.append((torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])))
    return out


# --------------------------------------------------------------------------- packing


def test_pack_documents_bos_eos(tok):
    docs = ["first document", "second\n\nparagraph", "😀"]
    tokens = pack_documents(docs, tok)
    expected = [i for d in docs for i in [tok.bos_id, *tok.encode(d, bos=False, eos=False), tok.eos_id]]
    assert tokens.tolist() == expected
    assert tokens.tolist().count(tok.eos_id) == 3
    # Every EOS but the last is followed by the next document's BOS.
    eos_at = np.flatnonzero(tokens == tok.eos_id)
    assert all(tokens[i + 1] == tok.bos_id for i in eos_at[:-1])


def test_packed_windows_and_shifted_labels(tok, docs):
    tokens = pack_documents(docs, tok)
    source = PackedTokens(tokens, SEQ)
    assert len(source) == len(tokens) // (SEQ + 1)
    assert source[3].tolist() == tokens[3 * (SEQ + 1) : 4 * (SEQ + 1)].tolist()
    loader = build_dataloader_from_source(
        source, seq_len=SEQ, local_batch_size=4, global_batch_size=4, dp_rank=0, dp_degree=1
    )
    (x0, y0), (x1, y1) = take(loader, 2)
    assert x0.dtype == y0.dtype == torch.int64 and x0.shape == y0.shape == (4, SEQ)
    # Non-overlapping windows of SEQ+1 tokens, in order (no shuffle), labels one ahead.
    window = torch.from_numpy(tokens[: 8 * (SEQ + 1)].astype(np.int64)).view(8, SEQ + 1)
    assert torch.equal(torch.cat([x0, x1]), window[:, :-1])
    assert torch.equal(torch.cat([y0, y1]), window[:, 1:])
    assert x0[0, 0].item() == tok.bos_id


def test_stream_matches_map_packing_and_wraps(tok, docs):
    tokens = pack_documents(docs[:5], tok)
    stream = PackedStream(IterableDocuments(lambda: docs[:5]), tok, SEQ)
    n = len(tokens) // (SEQ + 1)
    assert [stream.sample(i).tolist() for i in range(n)] == [PackedTokens(tokens, SEQ)[i].tolist() for i in range(n)]
    # The stream carries the epoch's tail into the next epoch instead of dropping it.
    looped = np.concatenate([tokens] * 3)
    for i in range(n, 2 * n + 1):
        assert stream.sample(i).tolist() == looped[i * (SEQ + 1) : (i + 1) * (SEQ + 1)].tolist()


def test_map_epochs_reshuffle_reproducibly():
    tokens = np.arange(5 * (SEQ + 1) + 3, dtype=np.int32)  # 5 windows + a dropped tail
    source = PackedTokens(tokens, SEQ)

    def epochs(seed, shuffle):
        loader = build_dataloader_from_source(
            source, seq_len=SEQ, local_batch_size=5, global_batch_size=5, dp_rank=0, dp_degree=1,
            seed=seed, shuffle=shuffle,
        )
        return [x[:, 0].tolist() for x, _ in take(loader, 3)]

    firsts = [i * (SEQ + 1) for i in range(5)]
    assert epochs(0, False) == [firsts] * 3
    shuffled = epochs(1, True)
    assert all(sorted(e) == firsts for e in shuffled)
    assert len({tuple(e) for e in shuffled}) > 1, "every epoch came out in the same order"
    assert epochs(1, True) == shuffled
    assert epochs(2, True) != shuffled


# --------------------------------------------------------------------------- rank slicing


@pytest.mark.parametrize("kind", ["default", "stream"])
def test_rank_union_is_layout_independent(tok, docs, kind):
    def make(**kw):
        return default_loader(tok, **kw) if kind == "default" else stream_loader(tok, docs, **kw)

    reference = global_steps(make, dp=1, local=G, steps=4)
    for dp, local in [(1, 2), (2, 4), (2, 2), (4, 2), (4, 1)]:
        got = global_steps(make, dp=dp, local=local, steps=4)
        for k in range(4):
            assert torch.equal(got[k][0], reference[k][0]), (dp, local, k)
            assert torch.equal(got[k][1], reference[k][1]), (dp, local, k)
    # Steps really advance through new data.
    assert not torch.equal(reference[0][0], reference[1][0])


def test_rank_block_formula():
    # Global sample i is filled with i, so each row names the sample it came from.
    source = [np.full(SEQ + 1, i, dtype=np.int64) for i in range(1000)]

    class Source:
        def __len__(self):
            return len(source)

        def __getitem__(self, i):
            return source[i]

    loader = build_dataloader_from_source(
        Source(), seq_len=SEQ, local_batch_size=2, global_batch_size=G, dp_rank=1, dp_degree=2
    )
    rows = [x[:, 0].tolist() for x, _ in take(loader, 4)]
    # G/D = 4 samples per rank per step, as 2 microbatches of 2; rank 1 starts at k*8 + 4.
    assert rows == [[4, 5], [6, 7], [12, 13], [14, 15]]


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("kind", ["default", "stream"])
def test_resume_mid_stream(tok, docs, kind):
    def make():
        if kind == "stream":
            return stream_loader(tok, docs[:3], rank=1, dp=2, local=2)
        return default_loader(tok, rank=1, dp=2, local=2)

    check_resume_mid_stream(make)


@pytest.mark.parametrize("kind", ["default", "stream"])
def test_resume_under_another_dp_layout(tok, docs, kind):
    def make(**kw):
        return default_loader(tok, **kw) if kind == "default" else stream_loader(tok, docs, **kw)

    reference = global_steps(make, dp=1, local=4, steps=3)
    states = []
    for r in range(2):
        loader = make(rank=r, dp=2, local=2)
        take_it = iter(loader)
        for _ in range(4):  # two whole steps
            next(take_it)
        states.append(loader.state_dict())
    for saved in states:  # any old rank's state gives the new layout the same position
        single = make(rank=0, dp=1, local=4)
        single.load_state_dict(saved)
        step2 = take(single, 2)
        assert torch.equal(torch.cat([x for x, _ in step2]), reference[2][0])

    loader = make(rank=0, dp=2, local=2)
    next(iter(loader))
    mid_step = loader.state_dict()
    single = make(rank=0, dp=1, local=4)
    single.load_state_dict(mid_step)
    with pytest.raises(ValueError, match="middle of a step"):
        iter(single)


def test_resume_rejects_other_seq_len(tok):
    loader = default_loader(tok)
    take(loader, 1)
    other = default_loader(tok, seq_len=SEQ * 2)
    with pytest.raises(ValueError, match="saved with training.seq_len 16 but this run's is 32"):
        other.load_state_dict(loader.state_dict())  # refused as it is loaded, not at the next iter()


# --------------------------------------------------------------------------- local files


def test_jsonl_bad_lines_counted_and_skipped(tmp_path, tok, caplog):
    path = tmp_path / "data.jsonl.gz"
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"content": "wrong key"}),
        "",
        json.dumps({"text": 7}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"text": "good two", "meta": 1}),
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        assert list(iter_documents(path)) == ["good one", "good two"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 4 of 6 lines" in warnings[0] and "line 2" in warnings[0]

    loader = build_dataloader(
        dataset="text", dataset_path=str(path), tokenizer=tok, seq_len=4, local_batch_size=1,
        global_batch_size=1, dp_rank=0, dp_degree=1, seed=0,
    )
    packed = PackedTokens(pack_documents(["good one", "good two"], tok), 4)
    epoch = sorted(torch.cat([x, y[:, -1:]], 1)[0].tolist() for x, y in take(loader, len(packed)))
    assert epoch == sorted(packed[i].tolist() for i in range(len(packed)))


def test_text_directory_one_document_per_txt_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("book b\n\nstill book b")
    with gzip.open(tmp_path / "sub" / "a.txt.gz", "wt") as f:
        f.write("book a")
    (tmp_path / "c.jsonl").write_text('{"text": "c1"}\n{"text": "c2"}\n')
    (tmp_path / "notes.md").write_text("ignored")
    assert list(iter_documents(tmp_path)) == ["book b\n\nstill book b", "c1", "c2", "book a"]


# --------------------------------------------------------------------------- bad input


def _build(tok, **overrides):
    kw = dict(dataset="default", dataset_path=None, tokenizer=tok, seq_len=SEQ, local_batch_size=2,
              global_batch_size=G, dp_rank=0, dp_degree=2, seed=0)
    kw.update(overrides)
    return build_dataloader(**kw)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(global_batch_size=6), ValueError, r"global_batch_size \(6\) must be divisible by local_batch_size \* dp_degree \(2 \* 2 = 4\)"),
    (dict(dp_rank=2), ValueError, r"dp_rank must be in \[0, dp_degree=2\), got 2"),
    (dict(seq_len=0), ValueError, "seq_len must be an integer >= 1"),
    (dict(local_batch_size=True), ValueError, "local_batch_size must be an integer"),
    (dict(num_workers=-1), ValueError, "num_workers must be"),
    (dict(dataset="defualt"), ValueError, r"unknown dataset 'defualt' \(did you mean 'default'\?\)"),
    (dict(dataset="text"), ValueError, "dataset 'text' needs dataset_path"),
    (dict(dataset_path="x.txt"), ValueError, "takes no dataset_path"),
    (dict(dataset="text", dataset_path="/nonexistent/corpus"), FileNotFoundError, "does not exist"),
    (dict(tokenizer="path/to/tokenizer"), TypeError, "build_tokenizer"),
    (dict(dataset="huggingface", dataset_path="allenai/c4", num_workers=2), ValueError, "num_workers=0 only"),
])
def test_clear_errors(tok, overrides, error, match):
    with pytest.raises(error, match=match):
        _build(tok, **overrides)


def test_file_errors(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt, .txt.gz, .jsonl, .jsonl.gz files under"):
        _build(tok, dataset="text", dataset_path=str(tmp_path / "empty"))
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ValueError, match="not a text dataset file"):
        _build(tok, dataset="text", dataset_path=str(tmp_path / "data.csv"))
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="fewer than one sample of seq_len \\+ 1 = 17"):
        _build(tok, dataset="text", dataset_path=str(tmp_path / "short.txt"))


def test_bad_sources(tok):
    wrong = build_dataloader_from_source(
        [np.zeros(SEQ, dtype=np.int64)] * 4, seq_len=SEQ, local_batch_size=1, global_batch_size=1,
        dp_rank=0, dp_degree=1,
    )
    with pytest.raises(ValueError, match=r"expected 17 \(seq_len \+ 1\) integer token ids"):
        take(wrong, 1)
    empty = stream_loader(tok, [])
    with pytest.raises(ValueError, match="yielded no documents"):
        take(empty, 1)


def test_huggingface_needs_datasets(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        _build(tok, dataset="huggingface", dataset_path="allenai/c4:en")


# --------------------------------------------------------------------------- Hugging Face


def test_huggingface_streaming_local(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("datasets")
    texts = [f"document number {i}: " + "word " * (i % 7) for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def hf_loader():
        return _build(tok, dataset="huggingface", dataset_path=str(tmp_path), dp_degree=1, local_batch_size=2)

    # Same packing as the stand-in stream over the same documents, through several epochs.
    expected = take(stream_loader(tok, texts, local=2), 24)
    got = take(hf_loader(), 24)
    assert_same_batches(got, expected)

    original = hf_loader()
    it = iter(original)
    for _ in range(7):
        next(it)
    state = pickle.loads(pickle.dumps(original.state_dict()))
    assert "source" in state["dataset_state"]["samples"], "resume should use the HF dataset's own state"
    resumed = hf_loader()
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 10), expected[7:17])


def test_packed_split_parts_are_disjoint_and_cover_the_source():
    tokens = np.arange(200 * (SEQ + 1), dtype=np.int32)
    source = PackedTokens(tokens, SEQ)
    train, valid = source.split("99,1", "train"), source.split("99,1", "valid")
    assert (len(train), len(valid)) == (198, 2)
    starts = [int(part[i][0]) for part in (train, valid) for i in range(len(part))]
    assert starts == [i * (SEQ + 1) for i in range(200)]
    with pytest.raises(IndexError):
        valid[2]
    with pytest.raises(ValueError, match="holds no sample"):
        PackedTokens(tokens[: 10 * (SEQ + 1)], SEQ).split("99,1", "valid")


def test_default_corpus_holds_out_its_validation_split(tok):
    def source(split_name):
        return build_dataloader(dataset="default", dataset_path=None, tokenizer=tok, seq_len=SEQ, local_batch_size=1,
                                global_batch_size=1, dp_rank=0, dp_degree=1, seed=0,
                                split_name=split_name).dataset.samples.source

    train, valid = source("train"), source("valid")
    assert len(valid) == round(0.01 * (len(train) + len(valid)))
    train_windows = {train[i].tobytes() for i in range(len(train))}
    assert not any(valid[i].tobytes() in train_windows for i in range(len(valid)))
    with pytest.raises(ValueError, match="no held-out 'valid' split"):
        build_dataloader(dataset="text", dataset_path=DEFAULT_CORPUS_PATH, tokenizer=tok, seq_len=SEQ, local_batch_size=1,
                         global_batch_size=1, dp_rank=0, dp_degree=1, seed=0, split_name="valid")


# --------------------------------------------------------------------------- DataError: one sentence


def test_text_without_usable_document_is_a_data_error_at_construction(tmp_path, tok):
    from titanlike.data import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "wrong key"}\n{not json\n{"text": ""}\n')
    with pytest.raises(DataError) as err:
        _build(tok, dataset="text", dataset_path=str(bad), dp_rank=0, dp_degree=1, local_batch_size=G)
    assert str(err.value) == (
        f"{bad} holds no usable document: 2 of its 3 lines are not JSON objects with a string 'text' field "
        f"(first: {bad} line 1: missing key 'text'), the other 1 have an empty 'text'")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(DataError, match="empty holds no usable document: its 1 text file"):
        list(iter_documents(tmp_path / "empty"))


def test_ensure_document_reads_no_further_than_the_first(tmp_path, monkeypatch, caplog):
    import titanlike.data.text_datasets as td

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "first"}\n{not json\n')
    td.ensure_document(path)
    (tmp_path / "a.txt").write_text("x" * 10_000)
    reads = []
    real_open = td._open_binary
    monkeypatch.setattr(td, "_open_binary", lambda p: reads.append(p) or real_open(p))
    td.ensure_document(tmp_path)  # a.txt comes first and answers: d.jsonl is never opened
    assert reads == [str(tmp_path / "a.txt")]
    path.write_text('{"x": 1}\n')
    with caplog.at_level(logging.WARNING), pytest.raises(td.DataError, match="1 of its 1 lines are not JSON"):
        td.ensure_document(path)
    assert not caplog.records  # the one sentence, not a warning before it


def test_loader_errors_are_data_errors(tmp_path, tok):
    from titanlike.data import DataError

    (tmp_path / "empty").mkdir()
    (tmp_path / "short.txt").write_text("too short")
    for overrides in (dict(dataset="text", dataset_path=str(tmp_path / "empty")),
                      dict(dataset="text", dataset_path=str(tmp_path / "short.txt")),
                      dict(dataset="text", dataset_path=str(tmp_path / "nope")),
                      dict(dataset_path="x.txt"), dict(dataset="defualt")):
        with pytest.raises(DataError):
            _build(tok, **overrides)
    with pytest.raises(FileNotFoundError):  # still one, for callers that catch that
        _build(tok, dataset="text", dataset_path=str(tmp_path / "nope"))


@pytest.mark.parametrize("dataset, path, message", [
    ("default", "corpus.txt", "training.dataset_path is only read by the text, huggingface and megatron datasets; "
                              "the default dataset is the embedded corpus"),
    ("text", "{tmp}/empty", "training.dataset_path: no .txt, .txt.gz, .jsonl, .jsonl.gz files under directory"),
    ("text", "{tmp}/bad.jsonl", "training.dataset_path: {tmp}/bad.jsonl holds no usable document: 1 of its 1 lines"),
    ("megatron", "{tmp}/neg", "training.dataset_path: {tmp}/neg.idx: damaged index: sequence 1 (document 1) has "
                              "a negative size of -2 tokens"),
])
def test_validate_dataset_refuses_unusable_paths(tmp_path, dataset, path, message):
    from titanlike.data import DataError
    from titanlike.data.indexed import write_indexed_dataset
    from titanlike.data.loader import validate_dataset

    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    write_indexed_dataset(str(tmp_path / "neg"), [[1, 2], [3, 4]], np.uint16)
    raw = bytearray((tmp_path / "neg.idx").read_bytes())
    raw[34 + 4: 34 + 8] = np.array([-2], "<i4").tobytes()
    (tmp_path / "neg.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError) as err:
        validate_dataset(dataset, path.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(err.value) and "\n" not in str(err.value)
