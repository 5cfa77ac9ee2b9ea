"""scripts/preprocess_data.py: JSONL -> MMIDIDX, Megatron's bytes, robust to bad lines. With worker
processes and as a program: tests/integration/test_preprocess_workers.py."""

import os
import struct

import pytest

from preprocess_checks import GOOD, LINES, StandIn, pp, read_pair, run, write_jsonl
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.indexed import IndexedDataset


def reference_bytes(docs, token_format="<H", code=8, itemsize=2):
    """MMIDIDX bytes built from the format description: docs = [[sequence, ...], ...]."""
    lengths, pointers, doc_idx, tokens, ptr = [], [], [0], b"", 0
    for doc in docs:
        for seq in doc:
            tokens += b"".join(struct.pack(token_format, t) for t in seq)
            lengths.append(len(seq))
            pointers.append(ptr)
            ptr += len(seq) * itemsize
        doc_idx.append(len(lengths))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return tokens, idx


def expected_docs(tok, key="text", eod=True):
    docs = []
    for i in GOOD:
        value = LINES[i][key]
        sentences = value if isinstance(value, list) else [value]
        seqs = [tok.encode(s, bos=False, eos=False) for s in sentences]
        seqs = [s for s in seqs if s]  # Megatron drops empty sentences
        if seqs and eod:
            seqs[-1] = seqs[-1] + [tok.eos_id]
        docs.append(seqs)
    return docs


def test_output_is_megatron_bytes_and_bad_lines_are_counted(tmp_path):
    summary = run(tmp_path, append_eod=True)
    assert summary["documents"] == len(GOOD)
    assert summary["malformed"] == 4
    assert summary["malformed_by_kind"] == {"bad_json": 1, "not_an_object": 1,
                                            "missing_key": 1, "not_text": 1}
    assert [n for n, _ in summary["malformed_examples"]] == [2, 3, 4, 7]  # 1-based lines
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    assert tok.vocab_size < 65500 and summary["dtype"] == "uint16"
    prefix = str(tmp_path / "out_text_document")
    assert read_pair(prefix) == reference_bytes(expected_docs(tok))
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(GOOD)
    text = tok.decode(ds.get(int(ds.document_indices[4]))[:-1].tolist())
    assert text == LINES[8]["text"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


def test_without_append_eod(tmp_path):
    run(tmp_path)
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    assert read_pair(str(tmp_path / "out_text_document")) == reference_bytes(
        expected_docs(tok, eod=False))


def test_several_json_keys(tmp_path):
    summary = run(tmp_path, json_keys=["text", "title"], append_eod=True)
    assert summary["documents"] == len(GOOD)
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    assert read_pair(str(tmp_path / "out_title_document")) == reference_bytes(
        expected_docs(tok, key="title"))
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == len(GOOD)


def test_large_vocab_writes_int32(tmp_path):
    summary = run(tmp_path, tokenizer_path="unused", tokenizer_loader=StandIn, append_eod=True)
    assert summary["dtype"] == "int32"
    tok = StandIn(None)
    assert read_pair(str(tmp_path / "out_text_document")) == reference_bytes(
        expected_docs(tok), token_format="<i", code=4, itemsize=4)
    assert IndexedDataset(str(tmp_path / "out_text_document"))[0][-1] == 69_999


def test_split_sentences_writes_one_sequence_per_sentence(tmp_path, capsys):
    # Megatron's --split-sentences layout: one sequence per sentence, the document index groups
    # a document's sentences, outputs under the "sentence" level name; a list value's strings are
    # split too, empty texts stay documents with no sequence.
    lines = [
        {"text": "In the beginning God created the heaven. And the earth was void! Was it? Yes."},
        {"text": ["Mr. Smith came. He left.", "", "One more."]},
        {"text": ""},
        {"text": "No terminal punctuation at all"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    rc = pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--split-sentences",
                  "--sentence-splitter", "regex", "--append-eod"])
    assert rc == 0, capsys.readouterr().err
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    sentences = [["In the beginning God created the heaven.", "And the earth was void!", "Was it?", "Yes."],
                 ["Mr. Smith came.", "He left.", "One more."], [], ["No terminal punctuation at all"]]
    docs = [[tok.encode(x, bos=False, eos=False) for x in doc] for doc in sentences]
    for doc in docs:
        if doc:
            doc[-1] = doc[-1] + [tok.eos_id]
    prefix = str(tmp_path / "o_text_sentence")
    assert read_pair(prefix) == reference_bytes(docs)
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 4 and list(ds.document_indices) == [0, 4, 7, 7, 8]
    assert not os.path.exists(str(tmp_path / "o_text_document.bin"))


def test_split_sentences_nltk_without_nltk_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from titanlike.data import sentences

    monkeypatch.setattr(sentences, "_nltk_punkt", lambda: None)
    src = write_jsonl(tmp_path / "in.jsonl", LINES)
    rc = pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--split-sentences",
                  "--sentence-splitter", "nltk"])
    assert rc == 1 and "punkt" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
    # auto falls back to the regex splitter when punkt is not there
    assert sentences.sentence_splitter("auto")[0] == "regex"


@pytest.mark.parametrize("text, expected", [
    ("Mr. Smith went to Washington. He said \"Hi!\" Then he left.",
     ["Mr. Smith went to Washington.", 'He said "Hi!"', "Then he left."]),
    ("J. R. R. Tolkien wrote e.g. books, etc. and more. The end?! Yes...  Right.",
     ["J. R. R. Tolkien wrote e.g. books, etc. and more.", "The end?!", "Yes...", "Right."]),
    ("first paragraph without a stop\n\n  second one. 3 follows.", ["first paragraph without a stop",
                                                                     "second one.", "3 follows."]),
    ("lower case after a stop. does not split", ["lower case after a stop. does not split"]),
    ("", []),
    ("   \n\n  ", []),
])
def test_regex_sentence_splitter(text, expected):
    from titanlike.data.sentences import regex_split_sentences

    assert regex_split_sentences(text) == expected


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    rc = pp.main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                  str(tmp_path / "o")])
    assert rc == 1 and "input not found" in capsys.readouterr().err


# -- an input that gives an empty dataset is an error and publishes nothing ------------------------


def test_unusable_input_leaves_an_earlier_output_alone(tmp_path):
    run(tmp_path, append_eod=True)
    before = read_pair(str(tmp_path / "out_text_document"))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        run(tmp_path, src=empty)
    assert read_pair(str(tmp_path / "out_text_document")) == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
