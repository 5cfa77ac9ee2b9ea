"""Tokenizer, datasets and the stateful, data-parallel-aware data loader."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
# The King James Bible, one JSONL document per chapter (see assets/README.md).
DEFAULT_CORPUS_PATH = str(ASSETS_DIR / "kjv_chapters.jsonl.gz")
# 1792 byte-level BPE ranks trained on that corpus; + 256 Llama 3 specials = vocab 2048.
DEFAULT_TOKENIZER_PATH = str(ASSETS_DIR / "debug_tokenizer.tiktoken")

from titanlike.data.loader import (  # noqa: E402
    RankBatches,
    build_dataloader,
    build_dataloader_from_source,
    dataset_kinds,
    register_dataset_kind,
)
from titanlike.data.text_datasets import IterableDocuments, PackedStream, PackedTokens  # noqa: E402
from titanlike.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

__all__ = [
    "ASSETS_DIR",
    "DEFAULT_CORPUS_PATH",
    "DEFAULT_TOKENIZER_PATH",
    "IterableDocuments",
    "PackedStream",
    "PackedTokens",
    "RankBatches",
    "Tokenizer",
    "build_dataloader",
    "build_dataloader_from_source",
    "build_tokenizer",
    "dataset_kinds",
    "register_dataset_kind",
]
