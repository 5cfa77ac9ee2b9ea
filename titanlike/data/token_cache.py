"""A disk cache of tokenized in-memory corpora, so that a run does not re-tokenize the embedded
corpus (or a small local one) at every start.

An entry is one ``.npz`` file of named integer arrays under ``$TITANLIKE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/titanlike``, else ``~/.cache/titanlike``), in ``tokens/``. Its name is a
digest of everything the arrays depend on:

* the bytes of every corpus file, in reading order, with its path relative to the corpus root
  (its suffix decides how it is read), not its size and mtime, which a copy or a fast edit can
  keep while the text changes;
* the tokenizer: its class, its fingerprint (the vocabulary file's digest), its special ids and
  the version of its backend library;
* the source of the code that reads and encodes (the tokenizer's module and the reader modules the
  caller names), so that a changed rule never meets the tokens of the old one;
* the caller's options (which kind of corpus, how many documents).

Writes go to a temporary file in the same folder, renamed over the entry once complete: a reader
sees a whole entry or none, also when several ranks write the same entry at once. A read trusts
nothing in the file: it must load without pickles, carry the expected key, hold exactly the
expected arrays (names, integer dtypes, one dimension), match the SHA-256 recorded when it was
written, and pass the caller's own check (token ids within the vocabulary, consistent lengths).
Anything else is a miss, and the entry is rebuilt and rewritten. A cache folder that cannot be
created or written is no cache: the corpus is tokenized as before, without a word beyond a
debug log.

Since an edit of the reading code makes new entries, the folder keeps only the _KEEP entries used
last (a read refreshes an entry's mtime) and drops temporary files that writers left behind. The
callers do not cache corpora over 1 GiB of text (they belong in the preprocessed .bin/.idx format).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import numpy as np
from numpy.lib.npyio import NpzFile

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "cached_arrays", "corpus_cache_key", "ids_within_vocabulary"]

# Bump when the entry layout changes: old entries then miss instead of being misread.
_FORMAT = 1
_META = "__meta__"
_INTEGER_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_CHUNK = 1 << 20
# Entries kept (the ones used last): the embedded corpus takes two (packed, sentence-split) per
# version of the reading code.
_KEEP = 8
_ABANDONED_TMP_SECONDS = 3600


def cache_dir() -> Path:
    """The root of titanlike's caches: $TITANLIKE_CACHE_DIR, else $XDG_CACHE_HOME/titanlike, else
    ~/.cache/titanlike."""
    override = os.environ.get("TITANLIKE_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg if xdg else Path.home() / ".cache") / "titanlike"


def _module_source_digest(module: ModuleType) -> str:
    path = getattr(module, "__file__", None)
    if not path:
        return "no-source"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tokenizer_identity(tokenizer) -> dict:
    """What a tokenizer's output depends on, beyond the caller's code: its vocabulary (fingerprint),
    its class and module source, its special ids and its backend library's version."""
    cls = type(tokenizer)
    backend = type(getattr(tokenizer, "model", None)).__module__.split(".")[0]
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "source": _module_source_digest(sys.modules[cls.__module__]),
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": int(tokenizer.vocab_size),
        "special": [getattr(tokenizer, name, None) for name in ("bos_id", "eos_id")],
        "backend": f"{backend} {getattr(sys.modules.get(backend), '__version__', '')}",
    }


def corpus_cache_key(root: str | os.PathLike, files: Iterable[str], tokenizer, *,
                     readers: Iterable[ModuleType], **options) -> str:
    """The entry name of a corpus: a SHA-256 over the files' bytes (in order, with their paths
    relative to `root`), the tokenizer, the reader modules' source and the options (JSON values)."""
    digest = hashlib.sha256()
    header = {"format": _FORMAT, "tokenizer": _tokenizer_identity(tokenizer),
              "readers": {m.__name__: _module_source_digest(m) for m in readers}, "options": options}
    digest.update(json.dumps(header, sort_keys=True).encode())
    root = os.fspath(root)
    for file in files:
        relative = os.path.relpath(file, root) if os.path.isdir(root) else os.path.basename(file)
        digest.update(b"\0file\0" + relative.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _read(path: Path, key: str, names: set[str]) -> dict[str, np.ndarray] | None:
    """The entry's arrays if it is whole and what it claims to be, else None."""
    try:
        with open(path, "rb") as f:
            entry = np.load(f, allow_pickle=False)  # a .npy, not an archive, is a foreign file
            if not isinstance(entry, NpzFile):
                return None
            with entry:
                if set(entry.files) != names | {_META}:
                    return None
                meta = json.loads(entry[_META].tobytes().decode())
                arrays = {name: entry[name] for name in names}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, MemoryError,
            zipfile.BadZipFile) as e:  # what a truncated, altered or foreign file raises
        logger.debug("ignoring the damaged token cache entry %s: %s", path, e)
        return None
    if not isinstance(meta, dict) or meta.get("key") != key:
        return None
    if any(a.dtype not in _INTEGER_DTYPES or a.ndim != 1 for a in arrays.values()):
        return None
    if meta.get("sha256") != _arrays_digest(arrays):
        return None
    return arrays


def _write(path: Path, key: str, arrays: dict[str, np.ndarray]) -> None:
    """Write the entry atomically; give up quietly (the run goes on uncached) when it cannot."""
    meta = json.dumps({"key": key, "sha256": _arrays_digest(arrays)}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}-", suffix=".tmp")
    except OSError as e:
        logger.debug("token cache %s not writable (%s): not caching", path.parent, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{_META: np.frombuffer(meta, dtype=np.uint8)}, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not write the token cache entry %s (%s): not caching", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    _prune(path.parent)


def _prune(folder: Path) -> None:
    """Keep the _KEEP entries used last; remove temporary files abandoned by crashed writers."""
    entries, now = [], time.time()
    with contextlib.suppress(OSError):
        for item in os.scandir(folder):
            with contextlib.suppress(OSError):
                if item.name.endswith(".npz"):
                    entries.append((item.stat().st_mtime, item.path))
                elif item.name.endswith(".tmp") and now - item.stat().st_mtime > _ABANDONED_TMP_SECONDS:
                    os.unlink(item.path)
    for _, stale in sorted(entries, reverse=True)[_KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(stale)


def cached_arrays(key: str, names: Iterable[str], build: Callable[[], dict[str, np.ndarray]],
                  valid: Callable[[dict[str, np.ndarray]], bool]) -> dict[str, np.ndarray]:
    """The arrays `names` of entry `key`: read from the cache when a whole, unaltered entry is there
    and passes `valid`, else built with `build()` (1-D int32/int64 arrays) and written for next time."""
    path = cache_dir() / "tokens" / f"{key}.npz"
    arrays = _read(path, key, set(names))
    if arrays is not None and valid(arrays):
        logger.info("read the tokenized corpus from the cache: %s", path)
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the last to be pruned
        return arrays
    arrays = build()
    _write(path, key, arrays)
    return arrays


def ids_within_vocabulary(tokens: np.ndarray, vocab_size: int) -> bool:
    """Every id a valid index into an embedding of vocab_size rows (a check of a read entry)."""
    return tokens.size == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size)
