"""The data layer's error: what train.py reports as one sentence (``data error: ...``, exit 2).

Kept in its own module without imports so the numpy-only parts (``indexed.py``, the
preprocessing script) can raise it without pulling in torch.
"""

from __future__ import annotations


class DataError(ValueError):
    """Data that exists but cannot be trained on: a bad path, no usable document, a damaged
    index, too few tokens for one sample. The message is one sentence naming the file."""


class DataPathError(DataError, FileNotFoundError):
    """A data path that does not exist (also a FileNotFoundError, for callers that catch that)."""


__all__ = ["DataError", "DataPathError"]
