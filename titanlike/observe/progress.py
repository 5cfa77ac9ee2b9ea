"""Progress bars for work a user waits on (tokenizing conversations, converting or loading a
checkpoint, lm-eval's requests): tqdm on stderr, shown only where someone watches it.

A bar is drawn on rank 0 only, and only when stderr is a terminal: a log file, a pipe, torchrun's
tee of the ranks' output and pytest's capture get no bar (their lines stay what they were). Off, a
bar is tqdm's disabled one: it passes the iterable through and its update() does nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress_enabled() -> bool:
    """Whether a bar would be seen: rank 0 (RANK, as torchrun sets it) writing to a terminal."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        tty = False
    return tty and int(os.environ.get("RANK", 0) or 0) == 0


def progress(iterable: Iterable[T] | None = None, *, desc: str, total: int | float | None = None,
             unit: str = "it", unit_scale: bool = False, enabled: bool = True) -> tqdm:
    """A bar over `iterable` (or one to update() by hand), described by `desc`; disabled where
    progress_enabled() is false, or by the caller (enabled=False). total: defaults to len(iterable)
    when it has one. The bar goes when done (leave=False): the log line the caller writes afterwards
    says what was done."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, leave=False,
                disable=not (enabled and progress_enabled()), file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


__all__ = ["progress", "progress_enabled"]
