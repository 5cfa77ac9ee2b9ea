"""TRL's dataset forms read as TRL reads them (issue 45, item 8): preference rows whose prompt is implicit
in chosen and rejected (trl's extract_prompt), and SFT's language-modeling rows, {"text": ...} (its
SFTTrainer: the tokenizer's own encoding of the text with EOS appended, every token trained)."""

from __future__ import annotations

import numpy as np
import pytest

from sft_assets import TAGGED, tokenizer_folder
from titanlike.data import DataError, build_tokenizer
from titanlike.data.chat_template import load_chat_template
from titanlike.data.conversations import IGNORE_INDEX, text_ids, tokenize_conversations
from titanlike.data.preferences import implicit_prompt, row_pair, tokenize_pairs

USER = {"role": "user", "content": "What color is the sky?"}
EXPLICIT = [
    {"prompt": [USER], "chosen": [{"role": "assistant", "content": "It is blue."}],
     "rejected": [{"role": "assistant", "content": "It is green."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "And at night?"}],
     "chosen": [{"role": "assistant", "content": "Black."}], "rejected": [{"role": "assistant", "content": "Pink."}]},
]
# TRL's implicit form: each answer is the whole conversation; the prompt is what they share.
IMPLICIT = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in EXPLICIT]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    folder = tokenizer_folder(tmp_path_factory.mktemp("tok"), TAGGED["chatml"])
    tok = build_tokenizer(str(folder))
    return folder, tok, load_chat_template("auto", tok)


def _rows(rows):
    return [(f"pairs.jsonl line {i + 1}", r) for i, r in enumerate(rows)]


def test_an_implicit_prompt_is_the_shared_start_as_trl_extracts_it():
    trl = pytest.importorskip("trl")
    for row in IMPLICIT + [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # strings: the space stays with the answers
        {"prompt": "What color is the sky?", **IMPLICIT[0]},  # a string prompt beside conversations: TRL extracts
    ]:
        expected = trl.maybe_extract_prompt(dict(row))
        assert implicit_prompt(row["chosen"], row["rejected"]) == (
            expected["prompt"], expected["chosen"], expected["rejected"])
    prompt, chosen, rejected = row_pair(IMPLICIT[1], "line 1")
    assert (prompt, chosen, rejected) == (EXPLICIT[1]["prompt"], EXPLICIT[1]["chosen"], EXPLICIT[1]["rejected"])


def test_implicit_prompt_rows_train_as_the_explicit_ones(chatml):
    _, tok, template = chatml
    explicit = tokenize_pairs(_rows(EXPLICIT), template, tok, seq_len=256)
    implicit = tokenize_pairs(_rows(IMPLICIT), template, tok, seq_len=256)
    for field in ("inputs", "labels", "bounds"):
        assert np.array_equal(getattr(explicit, field), getattr(implicit, field))
    # The prompt is not trained: fewer targets than positions.
    assert 0 < (implicit.labels != IGNORE_INDEX).sum() < len(implicit.labels) / 2


def test_an_implicit_pair_with_nothing_shared_is_refused(chatml):
    _, tok, template = chatml
    row = {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}
    with pytest.raises(DataError, match="has no 'prompt', and its chosen and rejected answers share no start"):
        tokenize_pairs(_rows([row]), template, tok, seq_len=256)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Ends with its EOS already<|end_of_text|>", "x"]


def test_text_rows_are_tokenized_as_trl_does(chatml):
    """TRL's SFTTrainer on {"text": ...}: the text + the tokenizer's eos_token unless it ends with it, then
    the tokenizer called on it (its own special tokens); labels are every token."""
    transformers = pytest.importorskip("transformers")
    folder, tok, template = chatml
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        with_eos = text if text.endswith(hf.eos_token) else text + hf.eos_token
        assert text_ids(tok, text, "line 1") == hf(text=with_eos)["input_ids"]
    data = tokenize_conversations(_rows([{"text": t} for t in TEXTS]), template, tok, seq_len=256)
    assert (data.labels != IGNORE_INDEX).all()  # every token trained, assistant_only_loss or not
    first = hf(text=TEXTS[0] + hf.eos_token)["input_ids"]
    assert data.inputs[: len(first) - 1].tolist() == first[:-1] and data.labels[: len(first) - 1].tolist() == first[1:]


def test_text_rows_beside_conversations_and_a_bad_text(chatml):
    _, tok, template = chatml
    rows = [{"text": "plain"}, {"messages": [USER, {"role": "assistant", "content": "Blue."}], "text": "ignored"}]
    data = tokenize_conversations(_rows(rows), template, tok, seq_len=256)
    assert len(data) == 2 and (data.labels[data.bounds[1]:] == IGNORE_INDEX).any()  # the conversation: answers only
    with pytest.raises(DataError, match="line 1: 'text' is int, not a string"):
        tokenize_conversations(_rows([{"text": 3}]), template, tok, seq_len=256)
    with pytest.raises(DataError, match="has no 'text' \\(sft.format text\\)"):
        tokenize_conversations(_rows([{"messages": []}]), template, tok, seq_len=256, fmt="text")
