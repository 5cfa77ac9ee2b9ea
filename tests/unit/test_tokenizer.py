"""Tokenizer: Llama 3 format, special tokens, long inputs, and the BPE trainer script."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from titanlike.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_PATH, Tokenizer, build_tokenizer
from titanlike.data import tokenizer as tokmod
from titanlike.data.text_datasets import iter_documents
from titanlike.data.tokenizer import LLAMA3_SPECIAL_TOKENS, load_bpe_ranks, save_bpe_ranks

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


TEXTS = {
    "ascii": "In the beginning God created the heaven and the earth. 1234567 don't!",
    "unicode": "Héllo wörld, naïve café. Ελληνικά, русский, 中文测试, العربية, हिन्दी",
    "emoji": "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨",
    "whitespace": "a  b   c\t\td\n\n\n e \r\n\r\n   \u00a0\u3000 trailing   ",
    "empty": "",
    "special_text": "<|begin_of_text|> <|eot_id|> looks special but is text",
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.num_bpe_tokens for i in ids), "plain text must never produce special ids"


def test_bos_eos_flags(tok):
    body = tok.encode("hello", bos=False, eos=False)
    assert tok.encode("hello", bos=True, eos=False) == [tok.bos_id, *body]
    assert tok.encode("hello", bos=False, eos=True) == [*body, tok.eos_id]
    assert tok.encode("hello", bos=True, eos=True) == [tok.bos_id, *body, tok.eos_id]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_special_token_ids(tok):
    n = tok.num_bpe_tokens
    assert n == 1792 and tok.vocab_size == 2048
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert tok.bos_id == n and tok.eos_id == n + 1
    assert tok.special_tokens["<|start_header_id|>"] == n + 6
    assert tok.special_tokens["<|end_header_id|>"] == n + 7
    assert tok.eot_id == tok.special_tokens["<|eot_id|>"] == n + 9
    assert tok.special_tokens["<|reserved_special_token_245|>"] == tok.vocab_size - 1
    # Specials inside text stay text unless allowed (training data cannot forge an EOS).
    assert tok.eot_id not in tok.encode("x<|eot_id|>", bos=False, eos=False)
    assert tok.encode("x<|eot_id|>", bos=False, eos=False, allowed_special="all")[-1] == tok.eot_id


def test_single_bytes_are_ranks_0_to_255():
    ranks = load_bpe_ranks(DEFAULT_TOKENIZER_PATH)
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert sorted(ranks.values()) == list(range(len(ranks)))


def test_encode_batch_matches_encode(tok):
    texts = list(TEXTS.values())
    assert tok.encode_batch(texts, bos=True, eos=True) == [tok.encode(t, bos=True, eos=True) for t in texts]


def test_long_inputs(tok):
    pieces = list(tokmod._split_long_runs("ab " * 200_000 + "x" * 60_001 + " " * 30_000 + "tail"))
    assert "".join(pieces) == "ab " * 200_000 + "x" * 60_001 + " " * 30_000 + "tail"
    assert max(len(p) for p in pieces) <= tokmod.TIKTOKEN_MAX_ENCODE_CHARS
    assert not any(tokmod._LONG_RUN.search(p) for p in pieces)

    t0 = time.perf_counter()
    for text in ("a" * 1_000_000, " " * 300_000, "😀" * 100_000, TEXTS["unicode"] * 20_000):
        ids = tok.encode(text, bos=True, eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids[1:-1]) == text
    # Older tiktoken releases were quadratic in the length of one regex piece.
    assert time.perf_counter() - t0 < 30


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\nthis is not base64 at all\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2"):
        Tokenizer(bad)
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 300  # gap: specials would start at 257 and collide with nothing sensible
    gap = tmp_path / "gap.tiktoken"
    save_bpe_ranks(ranks, gap)
    with pytest.raises(ValueError, match="ranks must be exactly 0..256"):
        Tokenizer(gap)
    few = tmp_path / "few.tiktoken"
    save_bpe_ranks({b"a": 0, b"b": 1}, few)
    with pytest.raises(ValueError, match="single bytes have no rank"):
        Tokenizer(few)


def test_train_bpe_round_trips(tmp_path):
    corpus = [TEXTS["ascii"] * 3, TEXTS["unicode"], "the quick brown fox jumps over the lazy dog " * 20]
    ranks = train_tokenizer.train_bpe(corpus, 300, min_frequency=2)
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert 256 < len(ranks) <= 300 and sorted(ranks.values()) == list(range(len(ranks)))
    path = tmp_path / "small.tiktoken"
    save_bpe_ranks(ranks, path)
    small = Tokenizer(path)
    assert small.vocab_size == len(ranks) + 256
    for text in [*corpus, *TEXTS.values()]:
        assert small.decode(small.encode(text, bos=False, eos=False)) == text
    fox = "the quick brown fox jumps over the lazy dog"
    assert len(small.encode(fox, bos=False, eos=False)) < len(fox.encode()) / 2, "no merges were learned"


def test_train_script_reproduces_shipped_tokenizer(tmp_path):
    out = tmp_path / "debug.tiktoken"
    assert train_tokenizer.main(["--input", DEFAULT_CORPUS_PATH, "--vocab-size", "1792", "--output", str(out)]) == 0
    assert out.read_bytes() == Path(DEFAULT_TOKENIZER_PATH).read_bytes()


def test_trained_ranks_match_hf_tokenization():
    """tiktoken applying our converted ranks splits text exactly as the HF BPE it came from."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, models, pre_tokenizers, trainers

    docs = list(iter_documents(DEFAULT_CORPUS_PATH))[:60]
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokmod.LLAMA3_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ranks = train_tokenizer.train_bpe(docs, 600)
    enc = tokmod.tiktoken.Encoding("t", pat_str=tokmod.LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    to_byte = train_tokenizer._byte_level_alphabet()
    for doc in docs[:20] + [TEXTS["unicode"], TEXTS["whitespace"]]:
        ours = [enc.decode_single_token_bytes(i) for i in enc.encode_ordinary(doc)]
        theirs = [bytes(to_byte[c] for c in t) for t in hf.encode(doc).tokens]
        assert ours == theirs


def _llama3_tokenizer_path() -> str | None:
    env = os.environ.get("TITANLIKE_LLAMA3_TOKENIZER")
    if env:
        return env
    spec = importlib.util.find_spec("llama_models")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"
        if candidate.is_file():
            return str(candidate)
    return None


LLAMA3 = _llama3_tokenizer_path()


@pytest.mark.skipif(LLAMA3 is None, reason="Llama 3 tokenizer.model not available "
                    "(set TITANLIKE_LLAMA3_TOKENIZER; `pip download --no-deps llama-models` holds it)")
def test_real_llama3_tokenizer():
    t = build_tokenizer(LLAMA3)
    assert t.num_bpe_tokens == 128_000 and t.vocab_size == 128_256
    assert (t.bos_id, t.eos_id, t.eot_id) == (128_000, 128_001, 128_009)
    assert t.special_tokens["<|start_header_id|>"] == 128_006
    assert t.special_tokens["<|end_header_id|>"] == 128_007
    # Ids Meta's tokenizer gives (and every Llama 3 model card example shows).
    assert t.encode("Hello, world!", bos=True, eos=True) == [128_000, 9906, 11, 1917, 0, 128_001]
    text = "".join(TEXTS.values()) + " 12345 I'LL <|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = t.encode(text, bos=False, eos=False, allowed_special="all")
    assert t.decode(ids) == text
    converter = pytest.importorskip("transformers.convert_slow_tokenizer")
    hf = converter.TikTokenConverter(
        vocab_file=LLAMA3, pattern=tokmod.LLAMA3_PAT_STR, extra_special_tokens=list(LLAMA3_SPECIAL_TOKENS)
    ).converted()
    assert ids == hf.encode(text, add_special_tokens=False).ids
