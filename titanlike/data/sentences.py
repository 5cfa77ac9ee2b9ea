"""Sentence splitting for masked-LM / span-corruption data (``preprocess_data.py --split-sentences``).

Megatron splits with NLTK's punkt model, which needs a data download. NLTK is used here only
when it is importable *and* its punkt data is already on the machine (``splitter="auto"``);
otherwise, and always with ``splitter="regex"``, a small rule-based splitter does the work:

* a sentence ends at ``.``, ``!`` or ``?`` (a run of them, e.g. ``?!`` or ``...``), optionally
  followed by closing quotes or brackets, when whitespace follows and the next text starts with
  an upper-case letter, a digit or an opening quote/bracket;
* not after a common abbreviation (``Mr.``, ``Dr.``, ``e.g.``, ``etc.`` ..., see ``ABBREVIATIONS``)
  nor after a single capital initial (``J. Smith``);
* a blank line (paragraph break) always ends a sentence.

Sentences come back stripped of surrounding whitespace, empty ones dropped. The rules are
deterministic and machine-independent, which is why the embedded corpus always uses them.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["ABBREVIATIONS", "regex_split_sentences", "sentence_splitter"]

ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al fig figs no nos vol vols ed eds p pp ch "
    "jan feb mar apr jun jul aug sep sept oct nov dec inc ltd co corp gen col lt sgt capt rev".split()
)

# A candidate end: terminal punctuation, closing quotes/brackets, whitespace, then a sentence opener.
_END = re.compile(r"""([.!?]+["'\u201d\u2019)\]]*)(\s+)(?=["'\u201c\u2018(\[]?[A-Z0-9\u00C0-\u00DE])""")
_PARAGRAPH = re.compile(r"\n\s*\n")
# The word right before a period: letters and inner periods ("e.g", "U.S").
_LAST_WORD = re.compile(r"([A-Za-z][A-Za-z.]*)$")


def _is_abbreviation(before: str) -> bool:
    m = _LAST_WORD.search(before)
    if m is None:
        return False
    word = m.group(1)
    return word.lower() in ABBREVIATIONS or (len(word) == 1 and word.isupper())


def regex_split_sentences(text: str) -> list[str]:
    """The rule-based splitter (see the module docstring)."""
    sentences: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        start = 0
        for m in _END.finditer(paragraph):
            # Only a lone "." can end an abbreviation; "?" and "!" always end the sentence.
            if m.group(1).startswith(".") and m.group(1).rstrip("\"'\u201d\u2019)]") == "." \
                    and _is_abbreviation(paragraph[start:m.start(1)]):
                continue
            sentences.append(paragraph[start:m.end(1)])
            start = m.end(2)
        sentences.append(paragraph[start:])
    return [s.strip() for s in sentences if s.strip()]


def _nltk_punkt() -> Callable[[str], list[str]] | None:
    """NLTK's punkt splitter when NLTK is installed and its data already present (never downloads)."""
    try:
        import nltk
    except ImportError:
        return None
    for resource in ("tokenizers/punkt_tab/english/", "tokenizers/punkt/english.pickle"):
        try:
            nltk.data.find(resource)
        except LookupError:
            continue
        return lambda text: [s for s in (p.strip() for p in nltk.tokenize.sent_tokenize(text)) if s]
    return None


def sentence_splitter(kind: str = "auto") -> tuple[str, Callable[[str], list[str]]]:
    """``(name, split)`` for ``kind`` ``"auto"`` (NLTK punkt if present, else the regex),
    ``"nltk"`` (ValueError without it) or ``"regex"``."""
    if kind not in ("auto", "nltk", "regex"):
        raise ValueError(f"sentence splitter must be auto, nltk or regex, got {kind!r}")
    if kind != "regex":
        punkt = _nltk_punkt()
        if punkt is not None:
            return "nltk", punkt
        if kind == "nltk":
            raise ValueError("the nltk sentence splitter needs NLTK with its punkt data already downloaded "
                             "(pip install nltk; python -m nltk.downloader punkt_tab); use --sentence-splitter regex")
    return "regex", regex_split_sentences
