"""Tokenizer, datasets and the stateful, data-parallel-aware data loader."""

from importlib import import_module
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
# The King James Bible, one JSONL document per chapter (see assets/README.md).
DEFAULT_CORPUS_PATH = str(ASSETS_DIR / "kjv_chapters.jsonl.gz")
# 1792 byte-level BPE ranks trained on that corpus; + 256 Llama 3 specials = vocab 2048.
DEFAULT_TOKENIZER_PATH = str(ASSETS_DIR / "debug_tokenizer.tiktoken")

from titanlike.data.errors import DataError  # noqa: E402
from titanlike.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

# The loader and the text datasets import torch (~2.5 s); data-preparation scripts that only
# need the tokenizer or the indexed format should not pay for it, so these load on first use.
_LAZY = {
    "GlobalSamples": "loader",
    "RankBatches": "loader",
    "build_dataloader": "loader",
    "build_dataloader_from_source": "loader",
    "dataset_kinds": "loader",
    "register_dataset_kind": "loader",
    "IterableDocuments": "text_datasets",
    "PackedStream": "text_datasets",
    "PackedTokens": "text_datasets",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"titanlike.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'titanlike.data' has no attribute {name!r}")


__all__ = ["ASSETS_DIR", "DEFAULT_CORPUS_PATH", "DEFAULT_TOKENIZER_PATH", "DataError", "Tokenizer", "build_tokenizer",
           *_LAZY]
