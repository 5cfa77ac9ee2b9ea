"""Tokenizer folders without tokenizer.json (issue 45.19): a sentencepiece tokenizer.model with its
tokenizer_config.json (Llama 2 / Mistral / Gemma) and Mistral's tekken.json load through transformers'
own converters (data/tokenizer_json.py) and give transformers' ids, framing, BOS / EOS and text; a
checkpoint stores them and reads them back. The sentencepiece model is trained here in a fraction of a
second; the tekken file is the debug tokenizer's ranks in Mistral's layout."""

from __future__ import annotations

import base64
import json

import pytest

from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

transformers = pytest.importorskip("transformers")
TEXT = "In the beginning God created the heaven and the earth. Héllo wörld 1234 😀  two  spaces\n"


def _check_same(ours, theirs) -> None:
    want = theirs(TEXT)["input_ids"]
    plain = theirs(TEXT, add_special_tokens=False)["input_ids"]
    assert ours.encode(TEXT, bos=False, eos=False) == plain
    before, after = ours.framing
    assert list(before) + plain + list(after) == want
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.decode(plain) == theirs.decode(plain)


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed: the sentencepiece case needs "
                                                      "it to train a model and transformers to convert one")
    pytest.importorskip("google.protobuf", reason="protobuf is not installed: transformers' sentencepiece converter "
                                                  "reads the model with it")
    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["In the beginning God created the heaven and the earth."] * 40
                                + [f"number {i} and word{i} of the text" for i in range(200)]))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return folder


def test_a_sentencepiece_folder_gives_transformers_ids(sentencepiece_folder, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from titanlike.data.hf_tokenizer import store_tokenizer, stored_tokenizer
    from titanlike.data.tokenizer import job_tokenizer

    ours = build_tokenizer(str(sentencepiece_folder))
    theirs = AutoTokenizer.from_pretrained(sentencepiece_folder)
    _check_same(ours, theirs)
    assert ours.framing == ((1,), ())  # Llama 2's BOS, as its tokenizer_config.json asks
    # and sentencepiece's own ids, on text without runs of spaces (there transformers' conversion, which
    # we follow, differs from sentencepiece itself)
    processor = spm.SentencePieceProcessor(model_file=str(sentencepiece_folder / "tokenizer.model"))
    simple = TEXT.split("  ")[0]
    assert ours.encode(simple, bos=False, eos=False) == processor.encode(simple)
    assert job_tokenizer(None, str(sentencepiece_folder), DEFAULT_TOKENIZER_PATH).vocab_size == 400

    # A checkpoint keeps the folder's files and reads them back.
    record = store_tokenizer(str(tmp_path), {"path": str(sentencepiece_folder)})
    assert record["files"] == ["tokenizer.model", "tokenizer_config.json"]
    folder, why = stored_tokenizer(str(tmp_path), record)
    assert why is None and build_tokenizer(folder).encode(TEXT, bos=True, eos=False) == theirs(TEXT)["input_ids"]

    # Without its tokenizer_config.json, one sentence.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.model").write_bytes((sentencepiece_folder / "tokenizer.model").read_bytes())
    with pytest.raises(ValueError, match="has a sentencepiece tokenizer.model but no tokenizer_config.json"):
        build_tokenizer(str(bare))


def test_a_tekken_folder_gives_transformers_ids(tmp_path):
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    from titanlike.data.tokenizer import LLAMA3_PAT_STR, load_bpe_ranks

    ranks = load_bpe_ranks(DEFAULT_TOKENIZER_PATH)
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    tekken = {
        "config": {"pattern": LLAMA3_PAT_STR, "default_vocab_size": len(ranks) + len(specials),
                   "default_num_special_tokens": len(specials), "version": "v3"},
        "vocab": [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
                  for t, r in sorted(ranks.items(), key=lambda kv: kv[1])],
        "special_tokens": [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)],
    }
    (tmp_path / "tekken.json").write_text(json.dumps(tekken))
    ours = build_tokenizer(str(tmp_path))
    theirs = convert_tekken_tokenizer(str(tmp_path / "tekken.json"), chat_template="")
    _check_same(ours, theirs)
    # Mistral's layout: the special tokens first, then the ranks shifted past them.
    tiktoken = build_tokenizer(DEFAULT_TOKENIZER_PATH).encode(TEXT, bos=False, eos=False)
    assert ours.encode(TEXT, bos=False, eos=False) == [i + len(specials) for i in tiktoken]
    assert ours.special_tokens["[INST]"] == 3
