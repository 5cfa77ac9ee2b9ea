#!/usr/bin/env python
"""Train a byte-level BPE and write it as a tiktoken ranks file that ``titanlike`` loads.

Trainer: Hugging Face ``tokenizers`` (Rust, multi-threaded, widely used and maintained, and
already pulled in by ``transformers``). ``rustbpe`` trains tiktoken ranks directly but is a
young 0.1 package with few users; tiktoken's own trainer is an educational pure-Python one,
far too slow for a corpus of megabytes.

To get ranks that tiktoken applies the same way:

* pre-tokenization is a ``Split`` on Llama 3's regex (the one ``tiktoken`` uses at encode
  time) followed by ``ByteLevel`` with its own GPT-2 regex disabled, so training sees exactly
  the pieces tiktoken will see;
* the 256 single bytes are the initial alphabet and get ranks 0..255 in byte order, so every
  byte sequence stays encodable; merged tokens follow in the order the trainer created them,
  which is the merge priority tiktoken's rank-ordered merging needs;
* ``ByteLevel``'s printable stand-in characters are mapped back to raw bytes.

Usage::

    python scripts/train_tokenizer.py --input corpus.jsonl.gz more/*.txt \
        --vocab-size 1792 --output my.tiktoken

``--vocab-size`` counts BPE ranks (including the 256 bytes); the model's vocabulary is that
plus Llama 3's 256 special tokens. Inputs are read like the loader's ``text`` dataset
(``.txt`` = one document, ``.jsonl[.gz]`` = one ``{"text": ...}`` per line, or directories).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable

try:
    import titanlike  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.data.text_datasets import iter_documents
from titanlike.data.tokenizer import LLAMA3_PAT_STR, save_bpe_ranks

logger = logging.getLogger("train_tokenizer")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character table, inverted (char -> byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> dict[bytes, int]:
    """Byte-level BPE ranks (``token bytes -> rank``) with ranks 0..255 = the single bytes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the single bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    to_byte = _byte_level_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        raw = bytes(to_byte[c] for c in token)
        if raw not in ranks:
            ranks[raw] = len(ranks)
    if len(ranks) < vocab_size:
        logger.warning("corpus only supports %d ranks (asked for %d)", len(ranks), vocab_size)
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/.jsonl.gz files or directories")
    parser.add_argument("--vocab-size", type=int, required=True, help="BPE ranks, including the 256 bytes")
    parser.add_argument("--output", required=True, help="tiktoken ranks file to write")
    parser.add_argument("--min-frequency", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def texts():
        for path in args.input:
            yield from iter_documents(path)

    ranks = train_bpe(texts(), args.vocab_size, min_frequency=args.min_frequency)
    save_bpe_ranks(ranks, args.output)
    logger.info("wrote %d ranks to %s (model vocab with specials: %d)", len(ranks), args.output, len(ranks) + 256)
    return 0


if __name__ == "__main__":
    sys.exit(main())
