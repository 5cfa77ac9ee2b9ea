"""BERT masked-LM samples (titanlike.data.masked_lm) and their loader: determinism, data-parallel
independence, fields, 80/10/10 masking, sentence-order pairs, hostile documents, .bin/.idx round trip."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titanlike.data import DEFAULT_TOKENIZER_PATH, DataError, build_dataloader, build_tokenizer
from titanlike.data.indexed import IndexedDataset
from titanlike.data.loader import build_dataloader_from_source
from titanlike.data.masked_lm import IGNORE_INDEX, MaskedLMSamples
from titanlike.data.sentence_samples import InMemorySentences
from titanlike.data.special_tokens import special_token_ids
from titanlike.objectives import MaskedLM

SEQ = 48


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def ids(tok):
    return special_token_ids(tok, ("cls", "sep", "mask", "pad"))


def ordered_documents(num_docs=60, seed=0):
    """Documents whose tokens count up from 1 (sentence lengths 2..14): order is visible in the ids."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        lengths = rng.integers(2, 15, size=int(rng.integers(2, 9)))
        ends = np.cumsum(lengths)
        docs.append([np.arange(e - n, e) + 1 for n, e in zip(lengths, ends)])
    return docs


@pytest.fixture(scope="module")
def data():
    return InMemorySentences(ordered_documents(), name="ordered")


def build(data, tok, **kw):
    kw = {"seq_len": SEQ, "sentence_pairs": True, "seed": 7, **kw}
    return MaskedLMSamples(data, tok, **kw)


def originals(sample):
    return np.where(sample["labels"] != IGNORE_INDEX, sample["labels"], sample["inputs"])


def test_deterministic_per_seed_and_index(data, tok):
    a, b, other = build(data, tok), build(data, tok), build(data, tok, seed=8)
    assert len(a) == len(b) > 50
    for i in (0, 5, len(a) - 1):
        # any sample alone, in any order, is the same
        for key, value in a[i].items():
            np.testing.assert_array_equal(value, b[i][key])
    assert any(not np.array_equal(a[i]["inputs"], other[i]["inputs"]) for i in range(5))


def test_fields_padding_and_special_tokens(data, tok, ids):
    ds = build(data, tok, short_seq_prob=0.5)
    for i in range(len(ds)):
        s = ds[i]
        assert {k: (v.shape, v.dtype) for k, v in s.items()} == {
            "inputs": ((SEQ,), np.int64), "labels": ((SEQ,), np.int64), "token_types": ((SEQ,), np.int64),
            "document_ids": ((SEQ,), np.int64), "binary_labels": ((), np.int64), "binary_weights": ((), np.float32)}
        n = int((s["document_ids"] == 0).sum())
        assert (s["document_ids"][:n] == 0).all() and (s["document_ids"][n:] == 1).all()  # padding only at the end
        assert (s["inputs"][n:] == ids["pad"]).all() and (s["labels"][n:] == IGNORE_INDEX).all()
        assert (s["token_types"][n:] == 0).all()
        seps = np.flatnonzero(s["inputs"][:n] == ids["sep"])
        assert s["inputs"][0] == ids["cls"] and len(seps) == 2 and seps[1] == n - 1
        # [CLS] A [SEP] are type 0, B [SEP] type 1; special tokens are never masked
        assert (s["token_types"][:seps[0] + 1] == 0).all() and (s["token_types"][seps[0] + 1:n] == 1).all()
        assert (s["labels"][[0, seps[0], seps[1]]] == IGNORE_INDEX).all()
        maskable = n - 3
        assert (s["labels"] != IGNORE_INDEX).sum() == max(1, round(0.15 * maskable)) == s["binary_weights"]


def test_masking_proportions_and_sentence_order(data, tok, ids):
    ds = build(data, tok, num_samples=4000)  # several epochs: masks differ between epochs
    masked = replaced = kept = targets = tokens = swapped = 0
    for i in range(len(ds)):
        s = ds[i]
        at = s["labels"] != IGNORE_INDEX
        masked += int((s["inputs"][at] == ids["mask"]).sum())
        kept += int((s["inputs"][at] == s["labels"][at]).sum())
        replaced += int(((s["inputs"][at] != ids["mask"]) & (s["inputs"][at] != s["labels"][at])).sum())
        targets += int(at.sum())
        tokens += int((s["document_ids"] == 0).sum()) - 3
        # segment order: the ids count up through a document, so a swap shows
        orig = originals(s)
        sep = int(np.flatnonzero(s["inputs"] == ids["sep"])[0])
        n = int((s["document_ids"] == 0).sum())
        a, b = orig[1:sep], orig[sep + 1:n - 1]
        assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all()  # truncation trims ends only
        if s["binary_labels"] == 1:
            swapped += 1
            assert a.min() > b.max()
        else:
            assert a.max() < b.min()
    assert targets > 15_000
    assert abs(masked / targets - 0.8) < 0.015 and abs(kept / targets - 0.1) < 0.01
    assert abs(replaced / targets - 0.1) < 0.01
    assert abs(targets / tokens - 0.15) < 0.01
    assert abs(swapped / len(ds) - 0.5) < 0.03
    # the same packed sample gets other masks in another epoch
    rows = [ds.samples.packed_row(i) for i in range(len(ds))]
    i, j = [k for k, row in enumerate(rows) if row == rows[0]][:2]
    assert j >= ds.samples.per_epoch and not np.array_equal(ds[i]["inputs"], ds[j]["inputs"])


def test_random_replacements_are_ordinary_tokens(data, tok):
    ds = build(data, tok, mask_prob=0.5)
    pool = set(ds.random_pool.tolist())
    for i in range(len(ds)):
        s = ds[i]
        at = (s["labels"] != IGNORE_INDEX) & (s["inputs"] != ds.mask_id) & (s["inputs"] != s["labels"])
        assert set(s["inputs"][at].tolist()) <= pool
    assert not pool & set(ds.unmaskable.tolist()) and ds.random_pool.size == tok.num_bpe_tokens


def test_single_segment_without_sentence_pairs(data, tok, ids):
    ds = build(data, tok, sentence_pairs=False)
    s = ds[3]
    assert set(s) == {"inputs", "labels", "token_types", "document_ids"}
    n = int((s["document_ids"] == 0).sum())
    assert s["inputs"][0] == ids["cls"] and s["inputs"][n - 1] == ids["sep"] and (s["token_types"] == 0).all()
    assert (np.diff(originals(s)[1:n - 1]) == 1).all()


def test_hostile_documents(tok):
    docs = [[], [[]], [[5, 6, 7]], [np.arange(1, 200)], [[1, 2], [], [3]], [[9]] * 1, [[4], [5]]]
    data = InMemorySentences(docs, name="hostile")
    pairs = build(data, tok, seq_len=16, short_seq_prob=1.0)
    # only the documents with two non-empty sentences give pairs (Megatron skips the others)
    assert len(pairs) == 2
    for i in range(len(pairs)):
        s = pairs[i]
        assert (s["labels"] != IGNORE_INDEX).sum() >= 1 and s["inputs"].shape == (16,)
    single = build(data, tok, seq_len=16, sentence_pairs=False)
    assert len(single) == 5  # every document with a token; the long sentence is truncated
    assert all(single[i]["inputs"].shape == (16,) for i in range(len(single)))
    with pytest.raises(DataError, match="--split-sentences"):
        build(InMemorySentences([[[1, 2, 3]], [[4, 5]]], name="unsplit"), tok)
    with pytest.raises(DataError, match="leave no room"):
        build(data, tok, seq_len=4)


def rank_batches(loader, steps):
    out = []
    it = iter(loader)
    for _ in range(steps):
        out.append(next(it))
    return out


def test_same_samples_at_any_data_parallel_degree_and_resume(data, tok):
    source = build(data, tok)
    common = dict(seq_len=SEQ, global_batch_size=8, seed=0, sample_fields=source.fields)
    one = rank_batches(build_dataloader_from_source(source, local_batch_size=4, dp_rank=0, dp_degree=1, **common), 4)
    ranks = [rank_batches(build_dataloader_from_source(source, local_batch_size=2, dp_rank=r, dp_degree=2, **common), 4)
             for r in (0, 1)]
    for step in range(2):  # 2 microbatches of 4 per step on one rank; 2 of 2 on each of two ranks
        whole = {k: torch.cat([one[2 * step][k], one[2 * step + 1][k]]) for k in one[0]}
        split = {k: torch.cat([ranks[r][2 * step + m][k] for r in (0, 1) for m in (0, 1)]) for k in one[0]}
        for k in whole:
            assert torch.equal(whole[k], split[k]), k
    assert one[0]["binary_weights"].dtype == torch.float32 and one[0]["inputs"].dtype == torch.int64
    # resume: a loader restored from a state continues with the same microbatches
    loader = build_dataloader_from_source(source, local_batch_size=4, dp_rank=0, dp_degree=1, **common)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = build_dataloader_from_source(source, local_batch_size=4, dp_rank=0, dp_degree=1, **common)
    again.load_state_dict(state)
    assert torch.equal(next(iter(again))["inputs"], one[1]["inputs"])
    # a causal-LM loader's state does not resume a masked-LM one
    causal = build_dataloader_from_source(np.arange(8 * (SEQ + 1)).reshape(8, SEQ + 1), local_batch_size=4, dp_rank=0,
                                          dp_degree=1, seq_len=SEQ, global_batch_size=8)
    next(iter(causal))
    again = build_dataloader_from_source(source, local_batch_size=4, dp_rank=0, dp_degree=1, **common)
    with pytest.raises(ValueError, match="sample_fields"):
        again.load_state_dict(causal.state_dict())  # refused as it is loaded


class _BadSource:
    def __init__(self, sample):
        self.sample = sample

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.sample


def test_malformed_dict_samples_are_a_clear_error(data, tok):
    source = build(data, tok)
    good = source[0]
    for bad, message in ((dict(good, inputs=good["inputs"][:-1]), "field 'inputs' has shape"),
                         ({k: v for k, v in good.items() if k != "labels"}, "expected a dict of the fields"),
                         (dict(good, labels=good["labels"].astype(np.float32)), "field 'labels'")):
        loader = build_dataloader_from_source(_BadSource(bad), seq_len=SEQ, local_batch_size=2, global_batch_size=2,
                                              dp_rank=0, dp_degree=1, sample_fields=source.fields)
        with pytest.raises(DataError, match=message):
            next(iter(loader))


def find_run(row: np.ndarray, part: np.ndarray) -> int:
    starts = [k for k in range(row.size - part.size + 1) if np.array_equal(row[k:k + part.size], part)]
    assert starts, "segment is not a contiguous part of its sentences"
    return starts[0]


def _preprocess_module():
    script = Path(__file__).resolve().parents[2] / "scripts" / "preprocess_data.py"
    module = sys.modules.get("preprocess_data")
    if module is None:
        spec = importlib.util.spec_from_file_location("preprocess_data", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules["preprocess_data"] = module
        spec.loader.exec_module(module)
    return module


def test_split_sentences_round_trip_feeds_the_loader(tmp_path, tok, ids):
    lines = [{"text": " ".join(f"Sentence number {k} of document {d} is here." for k in range(2 + d % 5))}
             for d in range(40)] + [{"text": "Only one sentence."}, {"text": ""}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert _preprocess_module().main(["--input", str(src), "--output-prefix", str(tmp_path / "c"),
                                      "--split-sentences", "--sentence-splitter", "regex"]) == 0
    prefix = str(tmp_path / "c_text_sentence")
    indexed = IndexedDataset(prefix)
    assert indexed.num_documents == 42 and len(indexed) == sum(2 + d % 5 for d in range(40)) + 1
    ds = MaskedLMSamples(indexed, tok, seq_len=64, sentence_pairs=True, split="1", seed=1, short_seq_prob=0.0)
    for i in range(len(ds)):
        first, end, _ = ds.samples.packed_row(i)
        row = np.concatenate([indexed.get(k) for k in range(first, end)]).astype(np.int64)
        s = ds[i]
        sep = int(np.flatnonzero(s["inputs"] == ids["sep"])[0])
        n = int((s["document_ids"] == 0).sum())
        orig = originals(s)
        # each segment is a contiguous run of the packed sentences (truncation trims its ends), in
        # document order unless the pair was swapped
        a, b = find_run(row, orig[1:sep]), find_run(row, orig[sep + 1:n - 1])
        assert (a > b) == bool(s["binary_labels"]), (a, b)
    objective = MaskedLM(sentence_pairs=True)
    common = dict(tokenizer=tok, seq_len=64, local_batch_size=2, global_batch_size=4, dp_degree=1, seed=0,
                  objective=objective)
    train = build_dataloader(dataset="megatron", dataset_path=prefix, dp_rank=0, split="80,20", **common)
    valid = build_dataloader(dataset="megatron", dataset_path=prefix, dp_rank=0, split="80,20", split_name="valid",
                             **common)
    assert train.dataset.samples.source.samples.documents == range(0, 34)
    assert valid.dataset.samples.source.samples.documents == range(34, 42)
    assert next(iter(train))["inputs"].shape == (2, 64)
    with pytest.raises(DataError, match="use dataset 'megatron'"):
        build_dataloader(dataset="text", dataset_path=str(src), dp_rank=0, **common)
    with pytest.raises(DataError, match="not a blend"):
        build_dataloader(dataset="megatron", dataset_path=f"0.5 {prefix} 0.5 {prefix}", dp_rank=0, **common)


def test_embedded_corpus_default_kind(tok):
    from titanlike.config import load_job_config
    from titanlike.objectives import CausalLM
    from titanlike.train.plan import plan_job

    cfg = load_job_config(["--model.name", "bert", "--training.seq_len", "128", "--masked_lm.mask_prob", "0.2",
                           "--masked_lm.short_seq_prob", "0"])
    objective = plan_job(cfg, 1).objective
    assert isinstance(objective, MaskedLM) and objective.sentence_pairs  # the debug flavor's binary head
    assert (objective.options.mask_prob, objective.options.short_seq_prob) == (0.2, 0.0)
    assert isinstance(plan_job(load_job_config([]), 1).objective, CausalLM)  # the usual windows
    common = dict(dataset="default", dataset_path=None, tokenizer=tok, seq_len=SEQ, local_batch_size=2,
                  global_batch_size=2, dp_rank=0, dp_degree=1, seed=0, objective=objective)
    train, valid = build_dataloader(**common), build_dataloader(**common, split_name="valid")
    assert train.dataset.samples.source.mask_prob == 0.2 and train.dataset.samples.source.sentence_pairs
    train_docs = train.dataset.samples.source.samples.documents
    valid_docs = valid.dataset.samples.source.samples.documents
    assert train_docs.stop == valid_docs.start and valid_docs.stop == 1189  # 99,1 of the chapters
    batch = next(iter(train))
    assert batch["inputs"].shape == (2, SEQ) and batch["binary_labels"].shape == (2,)
    assert set(batch) == {"inputs", "labels", "token_types", "document_ids", "binary_labels", "binary_weights"}
