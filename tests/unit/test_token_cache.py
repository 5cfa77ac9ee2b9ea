"""The disk cache of tokenized corpora (titanlike/data/token_cache.py): a hit gives the very tokens a
fresh tokenization gives; a changed file, tokenizer or option misses; a damaged, altered or foreign
entry is ignored and rewritten; an unwritable cache folder means no cache, not an error."""

from __future__ import annotations

import gzip
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from titanlike.data import DEFAULT_TOKENIZER_PATH, Tokenizer, sentence_samples, text_datasets, token_cache
from titanlike.data.sentence_samples import sentence_split_corpus
from titanlike.data.text_datasets import packed_text_corpus

TEXTS = ["In the beginning was the word. And the word was with God.",
         "Blessed are the meek: for they shall inherit the earth. Blessed are they that mourn.",
         "Ask, and it shall be given you; seek, and ye shall find. Knock, and it shall be opened."]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache folder, and no per-process memo: every call below goes to disk."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TITANLIKE_CACHE_DIR", str(folder))
    monkeypatch.setattr(text_datasets, "_PACK_CACHE", {})
    monkeypatch.setattr(sentence_samples, "_CORPUS_CACHE", {})
    return folder


def write_corpus(path: Path, texts: list[str]) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


def forget(monkeypatch):
    monkeypatch.setattr(text_datasets, "_PACK_CACHE", {})
    monkeypatch.setattr(sentence_samples, "_CORPUS_CACHE", {})


def tokenizing_forbidden(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized although the cache holds the corpus")

    monkeypatch.setattr(text_datasets, "pack_documents", refuse)
    monkeypatch.setattr(sentence_samples.InMemorySentences, "__init__", refuse)


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "tokens").glob("*.npz"))


def test_cache_folder_follows_the_override_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TITANLIKE_CACHE_DIR", str(tmp_path / "mine"))
    assert token_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TITANLIKE_CACHE_DIR")
    assert token_cache.cache_dir() == tmp_path / "xdg" / "titanlike"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert token_cache.cache_dir() == Path.home() / ".cache" / "titanlike"


def test_a_hit_gives_the_same_samples_without_tokenizing(cache, tmp_path, tokenizer, monkeypatch):
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS * 4)
    fresh = packed_text_corpus(corpus, tokenizer, 16)
    fresh_sentences = sentence_split_corpus(corpus, tokenizer)
    assert len(entries(cache)) == 2
    forget(monkeypatch)
    tokenizing_forbidden(monkeypatch)
    hit = packed_text_corpus(corpus, tokenizer, 16)
    assert hit.tokens.dtype == fresh.tokens.dtype and not hit.tokens.flags.writeable
    assert len(hit) == len(fresh) and all(np.array_equal(hit[i], fresh[i]) for i in range(len(fresh)))
    hit_sentences = sentence_split_corpus(corpus, tokenizer)
    for name in ("tokens", "sequence_lengths", "sequence_pointers", "document_indices"):
        assert np.array_equal(getattr(hit_sentences, name), getattr(fresh_sentences, name)), name
    assert [hit_sentences.get(i).tolist() for i in range(len(hit_sentences))] == \
        [fresh_sentences.get(i).tolist() for i in range(len(fresh_sentences))]


def test_a_changed_file_misses_even_with_its_size_and_mtime(cache, tmp_path, tokenizer, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Jesus wept. " * 20)
    first = packed_text_corpus(corpus, tokenizer, 8).tokens.copy()
    stat = corpus.stat()
    corpus.write_text("Moses spoke " * 20)  # as many bytes
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    forget(monkeypatch)
    second = packed_text_corpus(corpus, tokenizer, 8).tokens
    assert not np.array_equal(first, second)
    assert np.array_equal(second, text_datasets.pack_documents(text_datasets.iter_documents(corpus), tokenizer))
    assert len(entries(cache)) == 2


class ShiftedTokenizer:
    """A stand-in tokenizer: byte values plus an offset; a different offset is a different tokenizer."""

    def __init__(self, shift: int):
        self.shift, self.vocab_size, self.bos_id, self.eos_id = shift, 300, 298, 299
        self.fingerprint = f"shift-{shift}"

    def encode_batch(self, texts, *, bos, eos):
        return [[self.bos_id] * bos + [b + self.shift for b in t.encode()] + [self.eos_id] * eos for t in texts]


def test_a_changed_tokenizer_or_option_misses(cache, tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    one, two = ShiftedTokenizer(0), ShiftedTokenizer(1)
    tokens_one = packed_text_corpus(corpus, one, 8).tokens.copy()
    forget(monkeypatch)
    tokens_two = packed_text_corpus(corpus, two, 8).tokens
    assert np.array_equal(tokens_two[tokens_two < 298], tokens_one[tokens_one < 298] + 1)
    forget(monkeypatch)
    first_document = packed_text_corpus(corpus, one, 8, max_documents=1).tokens
    assert len(first_document) == len(TEXTS[0].encode()) + 2
    assert len(entries(cache)) == 3


def _damage_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _damage_flipped_token(path: Path) -> None:
    # A valid archive whose tokens differ from what its digest says.
    with np.load(path) as entry:
        arrays = {name: entry[name].copy() for name in entry.files}
    arrays["tokens"][5] ^= 1
    np.savez(path, **arrays)


def _damage_out_of_vocabulary(path: Path) -> None:
    # Hostile: consistent digest, but ids no embedding has; the read-back check must refuse it.
    with np.load(path) as entry:
        arrays = {name: entry[name].copy() for name in entry.files}
    arrays["tokens"][5] = 10**6
    meta = json.loads(arrays["__meta__"].tobytes())
    meta["sha256"] = token_cache._arrays_digest({"tokens": arrays["tokens"]})
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def _damage_pickled(path: Path) -> None:
    np.savez(path, tokens=np.array([object()], dtype=object), __meta__=np.zeros(3, np.uint8))


def _damage_plain_npy(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.arange(10))


def _damage_other_key(path: Path) -> None:
    # Another corpus's entry (valid ids, a matching digest) under this name: its recorded key differs.
    with np.load(path) as entry:
        arrays = {name: entry[name].copy() for name in entry.files}
    arrays["tokens"] = arrays["tokens"][::-1].copy()
    meta = json.loads(arrays["__meta__"].tobytes())
    meta["key"] = "0" * 64
    meta["sha256"] = token_cache._arrays_digest({"tokens": arrays["tokens"]})
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def _damage_float_tokens(path: Path) -> None:
    with np.load(path) as entry:
        arrays = {name: entry[name].copy() for name in entry.files}
    arrays["tokens"] = arrays["tokens"].astype(np.float32)
    np.savez(path, **arrays)


DAMAGES = [_damage_truncated, _damage_garbage, _damage_flipped_token, _damage_out_of_vocabulary, _damage_pickled,
           _damage_plain_npy, _damage_other_key, _damage_float_tokens]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__[len("_damage_"):] for d in DAMAGES])
def test_a_damaged_entry_is_ignored_and_rewritten(cache, tmp_path, tokenizer, monkeypatch, damage):
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS * 4)
    fresh = packed_text_corpus(corpus, tokenizer, 16).tokens.copy()
    (entry,) = entries(cache)
    damage(entry)
    forget(monkeypatch)
    assert np.array_equal(packed_text_corpus(corpus, tokenizer, 16).tokens, fresh)
    # Rewritten whole: the next process reads it without tokenizing.
    forget(monkeypatch)
    tokenizing_forbidden(monkeypatch)
    assert np.array_equal(packed_text_corpus(corpus, tokenizer, 16).tokens, fresh)


def test_inconsistent_sentence_arrays_are_rebuilt(cache, tmp_path, tokenizer, monkeypatch):
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    fresh = sentence_split_corpus(corpus, tokenizer)
    (entry,) = entries(cache)
    with np.load(entry) as stored:
        arrays = {name: stored[name].copy() for name in stored.files}
    arrays["sequence_lengths"][0] += 1  # lengths that no longer add up to the tokens
    meta = json.loads(arrays["__meta__"].tobytes())
    meta["sha256"] = token_cache._arrays_digest({k: v for k, v in arrays.items() if k != "__meta__"})
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(entry, **arrays)
    forget(monkeypatch)
    assert np.array_equal(sentence_split_corpus(corpus, tokenizer).sequence_lengths, fresh.sequence_lengths)


def test_an_unwritable_cache_folder_means_no_cache(tmp_path, tokenizer, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("TITANLIKE_CACHE_DIR", str(blocker))
    forget(monkeypatch)
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    expected = text_datasets.pack_documents(text_datasets.iter_documents(corpus), tokenizer)
    assert np.array_equal(packed_text_corpus(corpus, tokenizer, 8).tokens, expected)
    assert blocker.read_text() == ""


def test_writes_leave_no_temporary_files(cache, tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    packed_text_corpus(corpus, tokenizer, 8)
    assert [p.name for p in (cache / "tokens").iterdir()] == [entries(cache)[0].name]
    assert zipfile.is_zipfile(entries(cache)[0])


def test_the_entries_used_last_are_kept(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "_KEEP", 2)
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    abandoned = cache / "tokens" / ".abandoned.tmp"

    def run(shift):
        forget(monkeypatch)
        return packed_text_corpus(corpus, ShiftedTokenizer(shift), 8).tokens

    first = run(0)
    abandoned.write_bytes(b"half an entry")
    os.utime(abandoned, (0, 0))
    run(1)
    os.utime(entries(cache)[0], (1, 1))  # both entries old; reading one of them refreshes it
    os.utime(entries(cache)[1], (1, 1))
    forget(monkeypatch)
    with monkeypatch.context() as m:
        tokenizing_forbidden(m)
        assert np.array_equal(run(0), first)
    run(2)  # a third entry: the least recently used (shift 1) goes
    assert len(entries(cache)) == 2 and not abandoned.exists()
    with monkeypatch.context() as m:
        tokenizing_forbidden(m)
        run(0)
        run(2)


def test_a_corpus_too_large_for_memory_is_not_cached(cache, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(text_datasets, "_LARGE_CORPUS_BYTES", 10)
    corpus = write_corpus(tmp_path / "c.jsonl.gz", TEXTS)
    expected = text_datasets.pack_documents(text_datasets.iter_documents(corpus), tokenizer)
    assert np.array_equal(packed_text_corpus(corpus, tokenizer, 8).tokens, expected)
    assert not (cache / "tokens").exists()
