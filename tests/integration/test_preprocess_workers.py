"""scripts/preprocess_data.py with worker processes and as a program: two workers give the bytes of one,
a failing worker leaves no output, the command line takes Megatron's flags, and an input that gives an
empty dataset fails in one sentence. One process: tests/unit/test_preprocess.py."""

import json
import os
import subprocess
import sys

import pytest

from preprocess_checks import GOOD, LINES, SCRIPT, StandIn, read_pair, run, write_jsonl
from titanlike.data.indexed import IndexedDataset


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


def test_failure_leaves_no_output(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", LINES * 10, extra=[json.dumps({"text": "BOOM"})])
    with pytest.raises(RuntimeError, match="exploded"):
        run(tmp_path, workers=2, src=src, tokenizer_path="unused", tokenizer_loader=StandIn,
            chunk_lines=4)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_split_sentences_two_workers_give_identical_bytes(tmp_path):
    lines = [{"text": f"Verse {i}. And it was so! Is it? It is. Mr. Jones agreed."} for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    one = run(tmp_path, "one", workers=1, src=src, split_sentences=True, sentence_splitter="regex", chunk_lines=8)
    two = run(tmp_path, "two", workers=2, src=src, split_sentences=True, sentence_splitter="regex", chunk_lines=8)
    assert one["outputs"]["text"].endswith("one_text_sentence")
    assert read_pair(one["outputs"]["text"]) == read_pair(two["outputs"]["text"])
    assert len(IndexedDataset(one["outputs"]["text"])) == 40 * 5


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
