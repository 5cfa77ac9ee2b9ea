"""scripts/preprocess_data.py: JSONL -> MMIDIDX, Megatron's bytes, robust to bad lines."""

import gzip
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.indexed import IndexedDataset

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "preprocess_data.py"

# One module object per session (other tests load the script too): the worker pool pickles its
# task function by module name.
pp = sys.modules.get("preprocess_data")
if pp is None:
    _spec = importlib.util.spec_from_file_location("preprocess_data", SCRIPT)
    pp = importlib.util.module_from_spec(_spec)
    sys.modules["preprocess_data"] = pp
    _spec.loader.exec_module(pp)

LINES = [
    {"text": "In the beginning God created the heaven and the earth.", "title": "Genesis 1"},
    "{not json",
    {"title": "no text key"},
    {"text": 42, "title": "a number"},
    {"text": ["First sentence.", "", "Second one."], "title": "pre-split"},
    {"text": "", "title": "empty"},
    [1, 2, 3],
    {"text": "Caf\u00e9 na\u00efve \u2014 \u00fcber \U0001f600", "title": "unicode"},
    {"text": "And God said, Let there be light: and there was light." * 20, "title": "long"},
]
GOOD = [0, 4, 5, 7, 8]


def write_jsonl(path, lines, extra=()):
    raw = [json.dumps(x) if not isinstance(x, str) else x for x in lines] + list(extra)
    data = ("\n".join(raw) + "\n").encode()
    if str(path).endswith(".gz"):
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(data)
    else:
        Path(path).write_bytes(data)
    return path


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


def run(tmp_path, name="out", workers=1, **kw):
    kw.setdefault("stream", open(os.devnull, "w"))
    src = kw.pop("src", None) or write_jsonl(tmp_path / "in.jsonl", LINES)
    return pp.preprocess(str(src), str(tmp_path / name), workers=workers, **kw)


def read_pair(prefix):
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


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


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
def test_two_workers_and_gzip_give_identical_bytes(tmp_path):
    many = LINES * 40  # several chunks per worker, malformed lines spread across them
    plain = write_jsonl(tmp_path / "many.jsonl", many)
    gz = write_jsonl(tmp_path / "many.jsonl.gz", many)
    one = run(tmp_path, "w1", workers=1, src=plain, append_eod=True, chunk_lines=7)
    two = run(tmp_path, "w2", workers=2, src=plain, append_eod=True, chunk_lines=7)
    two_gz = run(tmp_path, "w2gz", workers=2, src=gz, append_eod=True, chunk_lines=5)
    assert one["malformed"] == two["malformed"] == two_gz["malformed"] == 4 * 40
    ref = read_pair(str(tmp_path / "w1_text_document"))
    assert read_pair(str(tmp_path / "w2_text_document")) == ref
    assert read_pair(str(tmp_path / "w2gz_text_document")) == ref


def test_several_json_keys(tmp_path):
    summary = run(tmp_path, json_keys=["text", "title"], append_eod=True)
    assert summary["documents"] == len(GOOD)
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    assert read_pair(str(tmp_path / "out_title_document")) == reference_bytes(
        expected_docs(tok, key="title"))
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == len(GOOD)


class StandIn:
    """Byte-level stand-in tokenizer; `vocab_size` is what picks the token dtype."""

    def __init__(self, path):
        self.vocab_size = 70_000
        self.eos_id = 69_999
        self.bos_id = 69_998

    def encode(self, text, *, bos, eos):
        if "BOOM" in text:
            raise RuntimeError("tokenizer exploded")
        return list(text.encode("utf-8"))


def test_large_vocab_writes_int32(tmp_path):
    summary = run(tmp_path, tokenizer_path="unused", tokenizer_loader=StandIn, append_eod=True)
    assert summary["dtype"] == "int32"
    tok = StandIn(None)
    assert read_pair(str(tmp_path / "out_text_document")) == reference_bytes(
        expected_docs(tok), token_format="<i", code=4, itemsize=4)
    assert IndexedDataset(str(tmp_path / "out_text_document"))[0][-1] == 69_999


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
def test_failure_leaves_no_output(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", LINES * 10, extra=[json.dumps({"text": "BOOM"})])
    with pytest.raises(RuntimeError, match="exploded"):
        run(tmp_path, workers=2, src=src, tokenizer_path="unused", tokenizer_loader=StandIn,
            chunk_lines=4)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


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


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
def test_split_sentences_two_workers_give_identical_bytes(tmp_path):
    lines = [{"text": f"Verse {i}. And it was so! Is it? It is. Mr. Jones agreed."} for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    one = run(tmp_path, "one", workers=1, src=src, split_sentences=True, sentence_splitter="regex", chunk_lines=8)
    two = run(tmp_path, "two", workers=2, src=src, split_sentences=True, sentence_splitter="regex", chunk_lines=8)
    assert one["outputs"]["text"].endswith("one_text_sentence")
    assert read_pair(one["outputs"]["text"]) == read_pair(two["outputs"]["text"])
    assert len(IndexedDataset(one["outputs"]["text"])) == 40 * 5


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


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
def test_cli_with_megatron_flags(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl.gz", LINES)
    cmd = [sys.executable, str(SCRIPT), "--input", str(src), "--output-prefix",
           str(tmp_path / "cli"), "--json-keys", "text", "--append-eod", "--workers", "2",
           "--partitions", "1", "--log-interval", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "docs/s" in proc.stderr and "tokens/s" in proc.stderr
    assert "skipped 4 malformed line(s)" in proc.stderr
    ref = run(tmp_path, "api", append_eod=True)
    assert ref["documents"] == len(GOOD)
    assert read_pair(str(tmp_path / "cli_text_document")) == read_pair(
        str(tmp_path / "api_text_document"))


# -- an input that gives an empty dataset is an error and publishes nothing ------------------------


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
@pytest.mark.parametrize("content, message", [
    (b"", "input {src} is empty: no line to tokenize, nothing written"),
    (b"{not json\n" + json.dumps({"title": "no text"}).encode() + b"\n[1, 2]\n",
     "no valid line in {src}: all 3 lines are malformed (bad_json=1, not_an_object=1, missing_key=1; first: "
     "line 1: bad_json, line 2: missing_key, line 3: not_an_object), nothing written; each line must be a JSON "
     "object with the key(s) 'text' (--json-keys) holding text"),
    (json.dumps({"text": ""}).encode() + b"\n" + json.dumps({"text": ["", ""]}).encode() + b"\n",
     "the 2 valid lines of {src} hold no token under 'text' (every document is empty), nothing written"),
])
def test_unusable_input_fails_and_writes_nothing(tmp_path, content, message):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    cmd = [sys.executable, str(SCRIPT), "--input", str(src), "--output-prefix", str(tmp_path / "out"),
           "--workers", "2", "--chunk-lines", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message.format(src=src)}"], proc.stderr
    assert "wrote" not in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no .bin/.idx, no temporaries


def test_unusable_input_leaves_an_earlier_output_alone(tmp_path):
    run(tmp_path, append_eod=True)
    before = read_pair(str(tmp_path / "out_text_document"))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        run(tmp_path, src=empty)
    assert read_pair(str(tmp_path / "out_text_document")) == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
