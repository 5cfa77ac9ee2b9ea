"""Megatron's tokenizer types for ``scripts/preprocess_data.py --tokenizer-type``: the token ids
megatron-core 0.16.1's tokenizers give (the ones Megatron-LM's ``tools/preprocess_data.py`` builds by
default), from files the user brings, and how titanlike then trains on the data they wrote.

=================================  ============================================  =====================================
``--tokenizer-type``               files                                         titanlike trains on the data with
=================================  ============================================  =====================================
(none: titanlike's own)            ``--tokenizer-model`` tiktoken ranks file or  ``--model.tokenizer_path FILE`` (or
                                   tokenizer.json folder (default: the debug     ``--model.hf_assets_path FOLDER``;
                                   tokenizer)                                    nothing for the debug tokenizer)
``GPT2BPETokenizer``               ``--vocab-file`` vocab.json, ``--merge-file``  ``--model.hf_assets_path`` the
                                   merges.txt (byte-level BPE, ``tokenizers``)    tokenizer.json folder written beside
                                                                                 the data (``{prefix}_tokenizer``)
``HuggingFaceTokenizer``           ``--tokenizer-model`` a local folder with     ``--model.hf_assets_path FOLDER``
                                   tokenizer.json
``SentencePieceTokenizer``,        ``--tokenizer-model`` a ``.model`` file       not directly (one sentence says so
``GPTSentencePieceTokenizer``,     (the ``sentencepiece`` package)               when preprocessing starts)
``Llama2Tokenizer``
``TikTokenizer``                   ``--tokenizer-model`` a tiktoken ranks file   ``--model.tokenizer_path FILE``;
                                   (titanlike's format, Llama 3's layout), or    Megatron's .json: not directly
                                   Megatron's vocabulary ``.json``
                                   (``--tiktoken-pattern``, ``--vocab-size``,
                                   ``--tiktoken-num-special-tokens``)
``NullTokenizer``                  ``--vocab-size V``; each text is space-       not directly
                                   separated ids, end of document V
=================================  ============================================  =====================================

As in megatron-core, a special token's text inside a document (``<|endoftext|>``, ``</s>``) is that
special token with the Megatron types; titanlike's own tokenizer keeps it plain text (a document
cannot forge an EOS). Nothing is downloaded: a tokenizer named by a Hub id instead of local files is
refused in one sentence (``scripts/download_hf_assets.py`` fetches the files).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["MEGATRON_TYPES", "TokenizerChoice", "TokenizerChoiceError", "build_choice"]

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
MEGATRON_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES, "TikTokenizer", "NullTokenizer")
# Megatron's other types, and why they are not here.
UNSUPPORTED_TYPES = {
    "BertWordPieceLowerCase": "use --tokenizer-type HuggingFaceTokenizer with a BERT tokenizer folder (tokenizer.json)",
    "BertWordPieceCase": "use --tokenizer-type HuggingFaceTokenizer with a BERT tokenizer folder (tokenizer.json)",
    "MultimodalTokenizer": "titanlike trains text models only",
    "NullMultimodalTokenizer": "titanlike trains text models only",
    "SFTTokenizer": "titanlike has no supervised fine-tuning data format",
}

GPT2_EOD = "<|endoftext|>"
# Megatron's TikTokenizer: its regexes (megatron-core tokenizers/text/libraries/tiktoken_tokenizer.py) and
# the special tokens it requires at ids 0..6, "</s>" being the end of document.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2**17
SENTENCEPIECE_INSTALL = "pip install sentencepiece (or pip install 'titanlike[sentencepiece]')"


class TokenizerChoiceError(ValueError):
    """A tokenizer choice that cannot work: one sentence, preprocess_data.py exits 2."""


@dataclass(frozen=True)
class TokenizerChoice:
    """What preprocess_data.py's tokenizer flags chose; picklable, so each worker builds its own."""

    type: str | None = None  # Megatron's --tokenizer-type; None: titanlike's build_tokenizer(model)
    model: str | None = None  # --tokenizer-model
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    hf_include_special_tokens: bool = False  # megatron-core 0.16.1's default: no BOS/EOS added
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    special_tokens: tuple[str, ...] | None = None

    def check(self) -> None:
        """TokenizerChoiceError (one sentence) for flags that do not fit the type or files that are not there."""
        t = self.type
        if t in UNSUPPORTED_TYPES:
            raise TokenizerChoiceError(f"--tokenizer-type {t} is not supported here: {UNSUPPORTED_TYPES[t]}")
        if t is not None and t not in MEGATRON_TYPES:
            raise TokenizerChoiceError(f"unknown --tokenizer-type {t}; supported: {', '.join(MEGATRON_TYPES)}")
        reads = {None: {"model"}, "GPT2BPETokenizer": {"vocab_file", "merge_file"},
                 "HuggingFaceTokenizer": {"model", "hf_include_special_tokens"},
                 "TikTokenizer": {"model", "vocab_size", "tiktoken_pattern", "tiktoken_num_special_tokens",
                                  "special_tokens"},
                 "NullTokenizer": {"vocab_size"}}.get(t, {"model"})
        flags = {"model": "--tokenizer-model", "vocab_file": "--vocab-file", "merge_file": "--merge-file",
                 "vocab_size": "--vocab-size", "hf_include_special_tokens": "--tokenizer-hf-include-special-tokens",
                 "tiktoken_pattern": "--tiktoken-pattern", "special_tokens": "--tokenizer-special-tokens",
                 "tiktoken_num_special_tokens": "--tiktoken-num-special-tokens"}
        defaults = TokenizerChoice()
        for field, flag in flags.items():
            if field not in reads and getattr(self, field) != getattr(defaults, field):
                raise TokenizerChoiceError(f"{flag} is not used with --tokenizer-type {t or '(none: titanlike tokenizer)'}"
                                           f" here; it reads {', '.join(flags[f] for f in sorted(reads))}")
        if t == "GPT2BPETokenizer":
            if not self.vocab_file or not self.merge_file:
                raise TokenizerChoiceError("--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json) and "
                                           "--merge-file (merges.txt); nothing is downloaded")
            _must_exist(self.vocab_file, "--vocab-file")
            _must_exist(self.merge_file, "--merge-file")
        elif t == "NullTokenizer":
            if not self.vocab_size or self.vocab_size < 1:
                raise TokenizerChoiceError("--tokenizer-type NullTokenizer needs --vocab-size (ids 0..V-1, end of "
                                           "document V)")
        elif t is not None:
            if not self.model:
                raise TokenizerChoiceError(f"--tokenizer-type {t} needs --tokenizer-model ({_MODEL_IS[t]})")
            if t == "HuggingFaceTokenizer":
                _hf_folder(self.model)
            else:
                _must_exist(self.model, "--tokenizer-model", file=True)
            if t in SENTENCEPIECE_TYPES:
                try:
                    import sentencepiece  # noqa: F401
                except ImportError:
                    raise TokenizerChoiceError(f"--tokenizer-type {t} reads {self.model} with the sentencepiece "
                                               f"package, which is not installed: {SENTENCEPIECE_INSTALL}") from None
            if t == "TikTokenizer" and not self.megatron_tiktoken and (
                    self.tiktoken_pattern or self.vocab_size or self.special_tokens
                    or self.tiktoken_num_special_tokens != 1000):
                raise TokenizerChoiceError(
                    f"--tiktoken-pattern, --vocab-size, --tiktoken-num-special-tokens and --tokenizer-special-tokens "
                    f"describe Megatron's TikTokenizer vocabulary (a .json file), but {self.model} is a tiktoken ranks "
                    "file, read in titanlike's (Llama 3's) layout")
        elif self.model:
            _must_exist(self.model, "--tokenizer-model")

    @property
    def megatron_tiktoken(self) -> bool:
        return self.type == "TikTokenizer" and bool(self.model) and self.model.endswith(".json")

    def build(self):
        """The tokenizer: ``encode(text, *, bos, eos)``, ``eos_id`` (the end of document), ``vocab_size``."""
        t = self.type
        if t is None:
            from titanlike.data import DEFAULT_TOKENIZER_PATH
            from titanlike.data.tokenizer import build_tokenizer

            return build_tokenizer(self.model or DEFAULT_TOKENIZER_PATH)
        if t == "GPT2BPETokenizer":
            return GPT2BPE(self.vocab_file, self.merge_file)
        if t == "HuggingFaceTokenizer":
            return HFFolder(self.model, include_special_tokens=self.hf_include_special_tokens)
        if t in SENTENCEPIECE_TYPES:
            return SentencePiece(self.model)
        if t == "TikTokenizer":
            if self.megatron_tiktoken:
                return MegatronTikToken(self.model, pattern=self.tiktoken_pattern or "v2",
                                        vocab_size=self.vocab_size or TIKTOKEN_DEFAULT_VOCAB,
                                        num_special_tokens=self.tiktoken_num_special_tokens,
                                        special_tokens=self.special_tokens)
            from titanlike.data.tokenizer import Tokenizer

            return Tokenizer(self.model)
        assert t == "NullTokenizer", t
        return Null(self.vocab_size)

    def training_flags(self, written_folder: str | None = None) -> str | None:
        """The train.py flags that give training this data's vocabulary; None where titanlike cannot."""
        t = self.type
        if t is None:
            if not self.model:
                return ""  # the debug tokenizer: train.py's default
            return f"--model.hf_assets_path {self.model}" if os.path.isdir(self.model) else \
                f"--model.tokenizer_path {self.model}"
        if t == "GPT2BPETokenizer":
            return f"--model.hf_assets_path {written_folder}"
        if t == "HuggingFaceTokenizer":
            return f"--model.hf_assets_path {self.model}"
        if t == "TikTokenizer" and not self.megatron_tiktoken:
            return f"--model.tokenizer_path {self.model}"
        return None

    def cannot_train(self) -> str | None:
        """One sentence when titanlike cannot train on the data this tokenizer writes; None when it can."""
        t = self.type
        if t in SENTENCEPIECE_TYPES:
            return (f"titanlike trains with a tiktoken ranks file or a tokenizer.json folder, not a SentencePiece .model: "
                    f"to train on this data, save {self.model} as tokenizer.json (transformers: "
                    f"LlamaTokenizerFast(vocab_file={self.model!r}).save_pretrained(FOLDER)) and pass "
                    "--model.hf_assets_path FOLDER")
        if self.megatron_tiktoken:
            return ("titanlike cannot train with Megatron's TikTokenizer vocabulary (its special tokens come before the "
                    "ranks, titanlike's tokenizer puts Llama 3's after them), so this data can be read but not trained "
                    "on here")
        if t == "NullTokenizer":
            return ("titanlike has no NullTokenizer (it sizes the model and finds the end of document from a tokenizer "
                    "file), so this data can be read but not trained on here")
        return None

    @property
    def writes_folder(self) -> bool:
        """Whether preprocessing writes a tokenizer.json folder beside the data (the vocabulary for training)."""
        return self.type == "GPT2BPETokenizer"


def build_choice(choice: TokenizerChoice):
    """preprocess_data's worker loader: the tokenizer of a choice."""
    return choice.build()


_MODEL_IS = {"HuggingFaceTokenizer": "a local folder holding tokenizer.json",
             "TikTokenizer": "a tiktoken ranks file, or Megatron's vocabulary .json",
             **{t: "a SentencePiece .model file" for t in SENTENCEPIECE_TYPES}}


def _must_exist(path: str, flag: str, *, file: bool = False) -> None:
    if not os.path.exists(path):
        raise TokenizerChoiceError(f"{flag} {path} does not exist")
    if file and not os.path.isfile(path):
        raise TokenizerChoiceError(f"{flag} {path} is not a file")


def _hf_folder(path: str) -> None:
    from titanlike.data.tokenizer_json import TOKENIZER_JSON

    if not os.path.exists(path):
        hub = path.count("/") == 1 and not path.startswith((".", "/"))
        raise TokenizerChoiceError(
            f"--tokenizer-model {path} does not exist" + (
                f"; it looks like a Hugging Face Hub id, and nothing is downloaded here: fetch it first with "
                f"python scripts/download_hf_assets.py --repo_id {path} --assets tokenizer" if hub else ""))
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
        raise TokenizerChoiceError(
            f"--tokenizer-model {path} is not a folder holding {TOKENIZER_JSON}; save one with transformers "
            f"(AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER))")


# -- the tokenizers ------------------------------------------------------------------------------


class GPT2BPE:
    """GPT-2's byte-level BPE from vocab.json + merges.txt (Megatron's GPT2BPETokenizer); the end of
    document is ``<|endoftext|>`` (appended to the vocabulary if the file lacks it, as transformers does)."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust reader's error: one line
            raise TokenizerChoiceError(f"--vocab-file {vocab_file} / --merge-file {merge_file} are not GPT-2 BPE files "
                                       f"(vocab.json, merges.txt): {' '.join(str(e).split())[:200]}") from None
        self.backend = Tokenizer(bpe)
        self.backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.backend.decoder = decoders.ByteLevel()
        self.backend.add_special_tokens([GPT2_EOD])
        self.eos_id = self.bos_id = self.backend.token_to_id(GPT2_EOD)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def save_folder(self, folder: str) -> None:
        """tokenizer.json + tokenizer_config.json: what train.py reads as --model.hf_assets_path."""
        os.makedirs(folder, exist_ok=True)
        self.backend.save(os.path.join(folder, "tokenizer.json"))
        config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
                  "unk_token": GPT2_EOD, "add_prefix_space": False, "clean_up_tokenization_spaces": False}
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")


class HFFolder:
    """A Hugging Face tokenizer.json folder (Megatron's HuggingFaceTokenizer on a local folder): special
    tokens in the text are recognized; the file's post-processor (BOS, ...) only with
    ``include_special_tokens`` (--tokenizer-hf-include-special-tokens); the end of document is its EOS."""

    def __init__(self, folder: str, *, include_special_tokens: bool = False):
        from titanlike.data.tokenizer_json import HuggingFaceTokenizer

        try:
            inner = HuggingFaceTokenizer(folder)
        except (ImportError, OSError, ValueError) as e:
            raise TokenizerChoiceError(f"--tokenizer-model: {e}") from None
        self.model = inner.model
        self.model.encode_special_tokens = False
        self.include_special_tokens = include_special_tokens
        self.eos_id, self.bos_id, self.vocab_size = inner.eos_id, inner.bos_id, inner.vocab_size

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.model.encode(text, add_special_tokens=self.include_special_tokens).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])


class SentencePiece:
    """A SentencePiece ``.model`` (Megatron's SentencePieceTokenizer / Llama2Tokenizer, not legacy): the
    end of document is the model's EOS."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerChoiceError(f"reading {path} needs the sentencepiece package: {SENTENCEPIECE_INSTALL}") from None
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerChoiceError(f"--tokenizer-model {path} is not a SentencePiece model: "
                                       f"{' '.join(str(e).split())[:200]}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.sp.encode_as_ids(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])


class MegatronTikToken:
    """Megatron's TikTokenizer: a vocabulary .json (a list of {"rank", "token_bytes", "token_str"}),
    ``num_special_tokens`` special tokens first (the 7 required ones, then ``<SPECIAL_i>``), the ranks
    after them, cut to ``vocab_size`` ids in all; the end of document is ``</s>``."""

    def __init__(self, path: str, *, pattern: str, vocab_size: int, num_special_tokens: int,
                 special_tokens: tuple[str, ...] | None):
        import base64

        import tiktoken

        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerChoiceError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        specials = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in specials]
        if missing or len(set(specials)) != len(specials):
            raise TokenizerChoiceError(f"--tokenizer-special-tokens must hold {', '.join(TIKTOKEN_SPECIAL_TOKENS)} "
                                       "once each" + (f" (missing {', '.join(missing)})" if missing else ""))
        if not len(specials) <= num_special_tokens < vocab_size:
            raise TokenizerChoiceError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                                       f"{len(specials)} special tokens and below --vocab-size {vocab_size}")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        try:
            with open(path) as f:
                vocab = json.load(f)
            entries = vocab[:vocab_size - num_special_tokens]
            ranks = {}
            for i, x in enumerate(entries):
                if x["rank"] != i:
                    raise ValueError(f"entry {i} has rank {x['rank']}")
                ranks[base64.b64decode(x["token_bytes"])] = i + num_special_tokens
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerChoiceError(f"--tokenizer-model {path} is not Megatron's TikTokenizer vocabulary (a JSON "
                                       f"list of rank, token_bytes, token_str): {e}") from None
        if len(ranks) != vocab_size - num_special_tokens:
            raise TokenizerChoiceError(f"--tokenizer-model {path} holds {len(ranks)} ranks, fewer than --vocab-size "
                                       f"{vocab_size} minus {num_special_tokens} special tokens (Megatron's default "
                                       f"vocab size is {TIKTOKEN_DEFAULT_VOCAB}: pass --vocab-size)")
        self.encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
                                          mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(specials)})
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = specials.index("<s>"), specials.index("</s>")

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.encoding.encode(text, allowed_special="all")
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])


class Null:
    """Megatron's NullTokenizer (megatron-core 0.16.1): a text is its ids separated by single spaces;
    ``vocab_size`` V + 1 ids, the end of document is V."""

    def __init__(self, vocab_size: int):
        self.eos_id = self.bos_id = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        try:
            ids = [int(x) for x in text.split(" ")]
        except ValueError:
            raise ValueError(f"NullTokenizer text must be token ids separated by single spaces, got {text[:60]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer id {bad[0]} is outside 0..{self.vocab_size - 1} (--vocab-size "
                             f"{self.vocab_size - 1} plus the end of document)")
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])
