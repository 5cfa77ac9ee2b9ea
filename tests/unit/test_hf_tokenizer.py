"""Our tokenizer as Hugging Face tokenizer files (titanlike.data.hf_tokenizer): transformers'
AutoTokenizer on the written folder gives our ids and decodes back; a tokenizer that cannot be
converted is copied with a note instead of failing the export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import hf_warnings
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data import hf_tokenizer
from titanlike.data.hf_tokenizer import TOKENIZER_COPY, TOKENIZER_NOTE, tokenizer_record, write_hf_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "In the beginning God created the heaven and the earth. 1234567 don't I'LL",
    "Héllo wörld, naïve café. Ελληνικά, русский, 中文测试, العربية, हिन्दी",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨",
    "a  b   c\t\td\n\n\n e \r\n\r\n   \u00a0\u3000 trailing   ",
    "spaces before punctuation: a . b , c ? 's",
    "",
]
SPECIAL = "<|begin_of_text|>user<|eot_id|> text <|end_of_text|><|reserved_special_token_100|>"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tok) -> Path:
    out = tmp_path_factory.mktemp("hf_tok")
    result = write_hf_tokenizer(str(out), tok.path, fingerprint=tok.fingerprint, vocab_size=tok.vocab_size,
                                model_max_length=2048)
    assert result.converted, result.message
    return out


def test_auto_tokenizer_gives_our_ids(tok, hf_folder):
    with hf_warnings() as warned:
        hf = transformers.AutoTokenizer.from_pretrained(hf_folder)
    assert warned == []
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert len(hf) == tok.vocab_size and hf.model_max_length == 2048
    for text in TEXTS:
        # BOS first by default, as training text and generate.py prompts are encoded.
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text, bos=True, eos=False)
        plain = hf(text, add_special_tokens=False)["input_ids"]
        assert plain == tok.encode(text, bos=False, eos=False)
        assert hf.decode(plain) == text == hf.decode(ids, skip_special_tokens=True)
    # Special-token strings are special tokens in transformers, as with allowed_special="all".
    ids = hf(SPECIAL, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(SPECIAL, bos=False, eos=False, allowed_special="all")
    assert ids[0] == tok.bos_id and tok.eos_id in ids
    assert hf.decode(ids) == SPECIAL == tok.decode(ids)
    assert hf.decode(ids, skip_special_tokens=True) == "user text "


def test_tokenizer_config_is_readable_by_transformers_4(hf_folder):
    # transformers 5 would name its own class, which 4.x (and vLLM, TGI pinned to it) cannot load.
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in config
    assert config["clean_up_tokenization_spaces"] is False
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


def test_record_names_the_tokenizer(tok):
    record = tokenizer_record(tok)
    pad = tok.encode("<|finetune_right_pad_id|>", bos=False, eos=False, allowed_special="all")
    assert record == {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": pad[0],
                      "path": str(Path(tok.path).resolve()), "fingerprint": tok.fingerprint}


def test_a_tokenizer_that_cannot_be_converted_is_copied_with_a_note(tmp_path, tok, monkeypatch):
    # A file titanlike does not read as tiktoken ranks (e.g. another kind of tokenizer).
    other = tmp_path / "spm.model"
    other.write_bytes(b"\x0a\x0bnot tiktoken\n")
    result = write_hf_tokenizer(str(tmp_path / "a"), str(other))
    assert not result.converted and TOKENIZER_NOTE in result.message
    assert (tmp_path / "a" / TOKENIZER_COPY).read_bytes() == other.read_bytes()
    assert not (tmp_path / "a" / "tokenizer.json").exists()

    # Our tokenizer when the conversion itself fails (transformers not installed, ...): the note
    # says how to load the copy, and the copy loads to the same tokenizer.
    def no_transformers(*args, **kwargs):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(hf_tokenizer, "_convert", no_transformers)
    result = write_hf_tokenizer(str(tmp_path / "b"), tok.path)
    assert not result.converted and "No module named 'transformers'" in result.message
    note = (tmp_path / "b" / TOKENIZER_NOTE).read_text()
    assert "build_tokenizer" in note and f"= {tok.bos_id}" in note and f"= {tok.eos_id}" in note
    assert build_tokenizer(tmp_path / "b" / TOKENIZER_COPY).fingerprint == tok.fingerprint

    # Exported again into the same folder, once it converts: the stale copy and note are gone.
    monkeypatch.undo()
    assert write_hf_tokenizer(str(tmp_path / "b"), tok.path).converted
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_no_tokenizer_files_for_an_unknown_or_changed_tokenizer(tmp_path, tok):
    for path, kwargs, why in [
        (None, {}, "names no tokenizer"),
        (str(tmp_path / "gone.tiktoken"), {}, "not found"),
        (tok.path, {"fingerprint": "0" * 64}, "no longer holds the ranks"),
        (tok.path, {"vocab_size": 300}, "only 300"),
    ]:
        result = write_hf_tokenizer(str(tmp_path / "out"), path, **kwargs)
        assert not result.converted and why in result.message
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not os.environ.get("TITANLIKE_LLAMA3_TOKENIZER"),
                    reason="set TITANLIKE_LLAMA3_TOKENIZER to Meta's Llama 3 tokenizer.model")
def test_real_llama3_tokenizer(tmp_path):
    tok = build_tokenizer(os.environ["TITANLIKE_LLAMA3_TOKENIZER"])
    assert write_hf_tokenizer(str(tmp_path), tok.path, model_max_length=131072).converted
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # The ids Meta's own tokenizer.json gives (every Llama 3 model card shows them).
    assert hf("Hello, world!")["input_ids"] == [128_000, 9906, 11, 1917, 0]
    for text in [*TEXTS, SPECIAL]:
        assert hf(text)["input_ids"] == tok.encode(text, bos=True, eos=False, allowed_special="all")
