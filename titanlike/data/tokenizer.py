"""Byte-level BPE tokenizer in Llama 3's format, backed by ``tiktoken``.

The ranks file is tiktoken's plain format (one ``base64(token_bytes) rank`` per line), the
format of Llama 3's ``tokenizer.model``. The pre-tokenization regex and the 256 special tokens
are Llama 3's, with special ids placed right after the BPE ranks, so Meta's real file loads
unchanged and gives Meta's ids, and the small tokenizers trained by
``scripts/train_tokenizer.py`` behave the same way at a size tiny test models can afford.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import AbstractSet, Literal

import tiktoken

__all__ = [
    "LLAMA3_PAT_STR",
    "LLAMA3_SPECIAL_TOKENS",
    "Tokenizer",
    "build_tokenizer",
    "job_tokenizer",
    "load_bpe_ranks",
    "pad_id",
    "save_bpe_ranks",
]

LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
# Llama 3.1+ naming of the 256 slots; ids 0, 1, 6, 7 and 9 past the ranks are the same in the
# original Llama 3 release, which called the other named slots reserved tokens.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{i}|>"
    for i in range(2, 2 + _NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)

# tiktoken panics on very large inputs and its BPE merge is superlinear in the length of one
# regex piece, which a long run without whitespace (or of whitespace) becomes. Same bounds as
# Meta's reference tokenizer.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1))


def load_bpe_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken ranks file.

    Parsed here rather than with ``tiktoken.load.load_tiktoken_bpe`` because that caches file
    contents in a temp directory keyed by the path string: a tokenizer retrained to the same
    path would silently load the stale copy.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path!r}")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_b64, rank_str = line.split()
                token = base64.b64decode(token_b64, validate=True)
                rank = int(rank_str)
            except Exception as e:
                raise ValueError(
                    f"{path}:{lineno}: not a tiktoken ranks line (expected 'base64token rank'): "
                    f"{line[:80]!r}"
                ) from e
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} appears twice")
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"tokenizer file {path!r} holds no ranks")
    return ranks


def save_bpe_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """Write ranks in tiktoken's format, in rank order (the order Meta's file uses)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    os.replace(tmp, path)


def _check_ranks(ranks: dict[bytes, int], path: str) -> None:
    # Special ids are assigned from len(ranks) up, so gaps or duplicates in the ranks would make
    # them collide with (or skip past) BPE ids.
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise ValueError(f"tokenizer {path!r}: ranks must be exactly 0..{n - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"tokenizer {path!r}: {len(missing)} single bytes have no rank (e.g. {missing[:5]}); "
            "a byte-level BPE needs all 256 so that any text can be encoded"
        )


def _split_long_runs(text: str) -> Iterator[str]:
    for start in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        part = text[start : start + TIKTOKEN_MAX_ENCODE_CHARS]
        pos = 0
        for m in _LONG_RUN.finditer(part):
            for cut in range(m.start() + MAX_NO_WHITESPACES_CHARS, m.end(), MAX_NO_WHITESPACES_CHARS):
                yield part[pos:cut]
                pos = cut
        yield part[pos:]


class Tokenizer:
    """Llama 3 style tokenizer: tiktoken BPE ranks + Llama 3 regex + 256 special tokens.

    What every tokenizer build_tokenizer returns answers (this class and HuggingFaceTokenizer), and
    all that generic code reads of one: path, bos_id, eos_id, vocab_size, special_tokens, special_ids,
    fingerprint, framing, encode, encode_batch, decode."""

    pat_str = LLAMA3_PAT_STR
    # How a text given to a model is framed (data/tokenizer_json.py Framing): a ranks file does not
    # say, so the model's family does (inference/processor.py prompt_framing).
    framing = None

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        ranks = load_bpe_ranks(self.path)
        _check_ranks(ranks, self.path)
        self.num_bpe_tokens = len(ranks)
        self.special_tokens: dict[str, int] = {
            tok: self.num_bpe_tokens + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)
        }
        self.model = tiktoken.Encoding(
            name=os.path.basename(self.path),
            pat_str=self.pat_str,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]
        # Identifies the ranks (not the path) so caches of tokenized corpora can be keyed on it.
        digest = hashlib.sha256()
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            digest.update(len(token).to_bytes(2, "little") + token)
        self.fingerprint = digest.hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.num_bpe_tokens + len(self.special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids (Llama 3's 256 slots after the BPE ranks): what generated text
        leaves out, as transformers' decode with skip_special_tokens."""
        return frozenset(self.special_tokens.values())

    def encode(
        self,
        text: str,
        *,
        bos: bool,
        eos: bool,
        allowed_special: Literal["all"] | AbstractSet[str] = frozenset(),
    ) -> list[int]:
        """Token ids of ``text``.

        Special-token strings inside ``text`` are encoded as plain text unless named in
        ``allowed_special`` (or ``"all"``): training text must not be able to forge an EOS.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}")
        ids: list[int] = [self.bos_id] if bos else []
        for chunk in _split_long_runs(text):
            if allowed_special:
                ids.extend(self.model.encode(chunk, allowed_special=allowed_special, disallowed_special=()))
            else:
                ids.extend(self.model.encode_ordinary(chunk))
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Iterable[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """``encode`` for many plain texts, using tiktoken's threaded batch encoder."""
        owners: list[int] = []
        chunks: list[str] = []
        n = 0
        for n, text in enumerate(texts, 1):
            for chunk in _split_long_runs(text):
                owners.append(n - 1)
                chunks.append(chunk)
        out: list[list[int]] = [[self.bos_id] if bos else [] for _ in range(n)]
        for owner, ids in zip(owners, self.model.encode_ordinary_batch(chunks)):
            out[owner].extend(ids)
        if eos:
            for ids in out:
                ids.append(self.eos_id)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(path: str | os.PathLike):
    """A tiktoken ranks file (Tokenizer), or a Hugging Face folder holding tokenizer.json, a
    sentencepiece tokenizer.model or Mistral's tekken.json (HuggingFaceTokenizer, torchtitan's
    model.hf_assets_path); both answer alike."""
    if os.path.isdir(path):
        from titanlike.data.tokenizer_json import HuggingFaceTokenizer

        return HuggingFaceTokenizer(path)
    return Tokenizer(path)


def job_tokenizer(tokenizer_path: str | None, hf_assets_path: str | None, default: str):
    """The tokenizer a job names (model.hf_assets_path, a folder with tokenizer.json, a sentencepiece
    tokenizer.model or tekken.json, or
    model.tokenizer_path, a tiktoken ranks file; else `default`), built once. ValueError, one
    sentence, when what is named is not there or cannot be read."""
    if hf_assets_path:
        from titanlike.config.compat import hub_id_hint
        from titanlike.data.tokenizer_json import TOKENIZER_JSON, is_tokenizer_folder

        if not os.path.isdir(hf_assets_path):
            raise ValueError(f"model.hf_assets_path {hf_assets_path} does not exist or is not a folder"
                             + hub_id_hint(hf_assets_path, "model.hf_assets_path"))
        if not is_tokenizer_folder(hf_assets_path):
            raise ValueError(f"model.hf_assets_path {hf_assets_path} has no {TOKENIZER_JSON} (torchtitan's "
                             "scripts/download_hf_assets.py --assets tokenizer fetches it; a sentencepiece "
                             "tokenizer.model or Mistral's tekken.json in its place also loads; a tiktoken "
                             "tokenizer.model goes in model.tokenizer_path)")
        try:
            return build_tokenizer(hf_assets_path)
        except (ImportError, OSError, ValueError) as e:
            raise ValueError(f"model.hf_assets_path: {e}") from None
    if tokenizer_path and not os.path.isfile(tokenizer_path):
        raise ValueError(f"model.tokenizer_path {tokenizer_path} does not exist or is not a file")
    try:
        return build_tokenizer(tokenizer_path or default)
    except OSError as e:  # a file that exists but cannot be read (permissions, /proc)
        raise ValueError(f"model.tokenizer_path {tokenizer_path or default} cannot be read "
                         f"({os.strerror(e.errno) if e.errno else e})") from None


def pad_id(tokenizer) -> int:
    """The token that fills padding (never trained on, masked out of attention): the tokenizer's pad
    token where it has one, else EOS."""
    pad = getattr(tokenizer, "pad_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else tokenizer.eos_id
