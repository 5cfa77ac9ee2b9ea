"""Conversation and preference rows a file controls (issue 46, item 5): a row of 10^6 turns, bytes that
are not UTF-8, a lone-surrogate escape, JSON nested 100,000 deep: each one sentence naming the file and
line, in SFT and in DPO, never a traceback or an hour of rendering."""

from __future__ import annotations

import json
import time

import pytest

from sft_assets import TAGGED, tokenizer_folder
from titanlike.data import DataError, build_tokenizer
from titanlike.data.chat_template import load_chat_template
from titanlike.data.conversations import iter_rows, tokenize_conversations
from titanlike.data.preferences import tokenize_pairs

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "prompt": "hi", "chosen": "hello", "rejected": "go away"}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    tok = build_tokenizer(str(tokenizer_folder(tmp_path_factory.mktemp("tok"), TAGGED["chatml"])))
    return tok, load_chat_template("auto", tok)


def _turns(n: int) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(n)]


HOSTILE = {
    "turns": (json.dumps({"messages": _turns(10**6), "prompt": _turns(10**6 - 1),
                          "chosen": [{"role": "assistant", "content": "a"}],
                          "rejected": [{"role": "assistant", "content": "b"}]}).encode(), "holds 1,000,000 turns, more than the training.seq_len + 1 = 65"),
    "not_utf8": (b'{"messages": [{"role": "user", "content": "h\xff\xfei"}], "prompt": "h\xff", "chosen": "a", '
                 b'"rejected": "b"}', "is not UTF-8 text (byte 0xff at column"),
    "surrogate": (b'{"messages": [{"role": "user", "content": "h\\udcffi"}], "prompt": "h\\udcff", "chosen": "a", '
                  b'"rejected": "b"}', "holds a \\u escape of a lone surrogate ('\\udcff'), which is not text"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "is JSON nested too deeply to read (past Python's recursion limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_hostile_row_is_one_sentence_naming_file_and_line(chatml, tmp_path, case, objective):
    tok, template = chatml
    raw, words = HOSTILE[case]
    data = tmp_path / "rows.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + raw + b"\n")
    begin = time.monotonic()
    with pytest.raises(DataError) as e:
        rows = list(iter_rows(str(data)))
        if objective == "sft":
            tokenize_conversations(rows, template, tok, seq_len=64)
        else:
            tokenize_pairs(rows, template, tok, seq_len=64)
    assert time.monotonic() - begin < 60
    message = str(e.value)
    assert words in message and f"{data} line 2" in message and "\n" not in message, message
