"""The tokenizer of a Hugging Face assets folder (``tokenizer.json``), with our Tokenizer's interface.

torchtitan points ``model.hf_assets_path`` at a folder downloaded from the Hugging Face Hub; its
``tokenizer.json`` is the tokenizer and its ``tokenizer_config.json`` names the BOS and EOS tokens.
The ``tokenizers`` package (Rust; a dependency of titanlike and of transformers) reads it.
A folder without tokenizer.json but with a sentencepiece ``tokenizer.model`` (Llama 2, Mistral v1-v3,
Gemma) or Mistral's ``tekken.json`` is converted to one in memory by transformers, as
``AutoTokenizer.from_pretrained`` converts it (its sentencepiece converter, which needs the
``sentencepiece`` and ``protobuf`` packages; its tekken converter), so the ids are transformers'.

Ids are the folder's own: BOS and EOS are added here (never by the file's post-processor, so a
document gets exactly one of each), and special-token strings inside training text are encoded as
plain text, as with the tiktoken tokenizer: a document cannot forge an EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import AbstractSet, Literal, NamedTuple

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TEKKEN_JSON = "tekken.json"
# The files a folder's tokenizer is read from, in order of preference.
TOKENIZER_FILES = (TOKENIZER_JSON, SENTENCEPIECE_MODEL, TEKKEN_JSON)

# Names of BOS / EOS tokens tried, in order, when tokenizer_config.json does not name them.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


class Framing(NamedTuple):
    """The special ids a tokenizer puts around one text given to a model (transformers'
    `tokenizer(text)`): Llama 3 BOS before, T5 EOS after, GPT-2 nothing."""

    before: tuple[int, ...]
    after: tuple[int, ...]


def is_tokenizer_folder(path: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def _converted(folder: str, name: str) -> tuple[str, dict]:
    """(tokenizer.json text, the BOS / EOS names) of a folder's sentencepiece or tekken file, converted
    by transformers; ValueError, one sentence, when it cannot be."""
    path = os.path.join(folder, name)
    if name == SENTENCEPIECE_MODEL and not os.path.isfile(os.path.join(folder, TOKENIZER_CONFIG)):
        raise ValueError(f"{folder} has a sentencepiece {name} but no {TOKENIZER_CONFIG} naming its tokenizer_class "
                         "(LlamaTokenizer, GemmaTokenizer), which transformers needs to convert it")
    try:
        if name == TEKKEN_JSON:
            from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

            fast = convert_tekken_tokenizer(path, chat_template="")
        else:
            from transformers import AutoTokenizer

            fast = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        backend = fast.backend_tokenizer
    except ImportError as e:
        raise ValueError(f"reading {path} needs transformers with sentencepiece and protobuf installed ({e})") from None
    except Exception as e:  # transformers' and sentencepiece's own errors, one line
        tiktoken = (" (a tiktoken tokenizer.model, Llama 3's, goes in model.tokenizer_path)"
                    if name == SENTENCEPIECE_MODEL else "")
        raise ValueError(f"{path} could not be converted by transformers: {' '.join(str(e).split())[:200]}"
                         f"{tiktoken}") from None
    names = {key: getattr(fast, key) for key in ("bos_token", "eos_token") if isinstance(getattr(fast, key), str)}
    return backend.to_str(), names


def _config_token(config: dict, key: str) -> str | None:
    # tokenizer_config.json writes a token as a string or as {"content": "<s>", ...}.
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HuggingFaceTokenizer:
    """``tokenizer.json`` of a Hugging Face folder, answering like titanlike's Tokenizer."""

    def __init__(self, folder: str | os.PathLike):
        self.path = os.fspath(folder)
        name = next((n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, n))), None)
        if name is None:
            raise FileNotFoundError(f"{self.path} has no {' or '.join(TOKENIZER_FILES)}, so it is not a Hugging Face "
                                    "tokenizer folder")
        file = os.path.join(self.path, name)
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError as e:
            raise ImportError(f"reading {file} needs the `tokenizers` package, a dependency of titanlike "
                              "(pip install tokenizers)") from e
        converted: dict = {}
        if name == TOKENIZER_JSON:
            with open(file, "rb") as f:
                raw = f.read()
        else:
            text, converted = _converted(self.path, name)
            raw = text.encode("utf-8")
        try:
            self.model = Backend.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust parser's error: one line
            raise ValueError(f"{file} is not a tokenizer.json the `tokenizers` package reads: "
                             f"{' '.join(str(e).split())[:200]}") from None
        self.model.encode_special_tokens = True  # special-token strings in text stay plain text
        config: dict = {}
        config_file = os.path.join(self.path, TOKENIZER_CONFIG)
        if os.path.isfile(config_file):
            try:
                with open(config_file) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        config = {**converted, **config}  # a converted file's BOS and EOS, unless the config names them
        self.eos_id = self._special_id(config, "eos_token", _EOS_NAMES)
        if self.eos_id is None:
            raise ValueError(f"{self.path}: no EOS token (tokenizer_config.json names no eos_token and none of "
                             f"{', '.join(_EOS_NAMES)} is in the vocabulary); documents need one to be separated")
        bos = self._special_id(config, "bos_token", _BOS_NAMES)
        # Tokenizers without a BOS (GPT-2's) separate documents with EOS alone: BOS is EOS.
        self.bos_id = self.eos_id if bos is None else bos
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(raw)
        digest.update(f"{self.bos_id},{self.eos_id}".encode())
        self.fingerprint = digest.hexdigest()
        self.framing = self._framing()

    def _framing(self) -> Framing:
        """How tokenizer.json's post-processor frames a text (what transformers' `tokenizer(text)` adds
        with this folder), read off a probe text."""
        framed = self.model.encode("a", add_special_tokens=True).ids
        plain = self.model.encode("a", add_special_tokens=False).ids
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), None)
        if at is None:  # a post-processor that rewrites the text's own ids: frame nothing
            return Framing((), ())
        return Framing(tuple(framed[:at]), tuple(framed[at + len(plain):]))

    @property
    def special_tokens(self) -> dict[str, int]:
        """The added tokens the file marks special, text -> id, as Tokenizer.special_tokens has them
        (a LLaVA export's image token among them: data/image_text.py image_token_text)."""
        return {token.content: i for i, token in self.model.get_added_tokens_decoder().items() if token.special}

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens the file marks special (what generated text leaves out, as
        transformers' decode with skip_special_tokens)."""
        return frozenset(self.special_tokens.values())

    def _special_id(self, config: dict, key: str, names: Sequence[str]) -> int | None:
        named = _config_token(config, key)
        for token in (named,) if named else names:
            token_id = self.model.token_to_id(token)
            if token_id is not None:
                return token_id
        if named:
            raise ValueError(f"{self.path}: tokenizer_config.json names {key} {named!r}, which is not in the vocabulary")
        return None

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode(self, text: str, *, bos: bool, eos: bool,
               allowed_special: Literal["all"] | AbstractSet[str] = frozenset()) -> list[int]:
        """Token ids of ``text``; special-token strings in it are plain text unless ``allowed_special``
        is given (the backend cannot allow only some: any non-empty set allows them all)."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}")
        if allowed_special:
            self.model.encode_special_tokens = False
            try:
                ids = self.model.encode(text, add_special_tokens=False).ids
            finally:
                self.model.encode_special_tokens = True
        else:
            ids = self.model.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Iterable[str], *, bos: bool, eos: bool) -> list[list[int]]:
        encoded = self.model.encode_batch(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, bos, eos) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size})"
