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

__all__ = ["ABBREVIATIONS", "keep_newlines", "regex_sentence_spans", "regex_split_sentences", "sentence_splitter"]

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


def regex_sentence_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each sentence of ``text`` by the rule-based splitter (see the module
    docstring), surrounding whitespace excluded, empty ones dropped."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for paragraph in _PARAGRAPH.split(text):
        start = text.index(paragraph, offset)
        offset = start + len(paragraph)
        begin = 0
        for m in _END.finditer(paragraph):
            # Only a lone "." can end an abbreviation; "?" and "!" always end the sentence.
            if m.group(1).startswith(".") and m.group(1).rstrip("\"'\u201d\u2019)]") == "." \
                    and _is_abbreviation(paragraph[begin:m.start(1)]):
                continue
            spans.append((start + begin, start + m.end(1)))
            begin = m.end(2)
        spans.append((start + begin, start + len(paragraph)))
    return [_strip(text, a, b) for a, b in spans if text[a:b].strip()]


def _strip(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def keep_newlines(text: str, spans: list[tuple[int, int]]) -> list[str]:
    """Megatron's --keep-newlines: a sentence keeps the whitespace after it when that whitespace holds a
    newline (paragraph breaks included), so the newlines of the text survive splitting."""
    out = []
    for i, (a, b) in enumerate(spans):
        after = spans[i + 1][0] if i + 1 < len(spans) else len(text)
        gap = text[b:after]
        out.append(text[a:after] if "\n" in gap and not gap.strip() else text[a:b])
    return out


def regex_split_sentences(text: str, *, newlines: bool = False) -> list[str]:
    """The rule-based splitter (see the module docstring); ``newlines``: Megatron's --keep-newlines."""
    spans = regex_sentence_spans(text)
    return keep_newlines(text, spans) if newlines else [text[a:b] for a, b in spans]


def _nltk_punkt(lang: str = "english", newlines: bool = False) -> Callable[[str], list[str]] | None:
    """NLTK's punkt splitter for ``lang`` when NLTK is installed and its data already present (never
    downloads)."""
    try:
        import nltk
    except ImportError:
        return None
    for resource, load in ((f"tokenizers/punkt_tab/{lang}/", lambda: nltk.tokenize.PunktTokenizer(lang)),
                           (f"tokenizers/punkt/{lang}.pickle", lambda: nltk.data.load(f"tokenizers/punkt/{lang}.pickle"))):
        try:
            nltk.data.find(resource)
            punkt = load()
        except (LookupError, AttributeError, OSError):
            continue

        def split(text: str, punkt=punkt) -> list[str]:
            spans = [_strip(text, a, b) for a, b in punkt.span_tokenize(text) if text[a:b].strip()]
            return keep_newlines(text, spans) if newlines else [text[a:b] for a, b in spans]

        return split
    return None


def sentence_splitter(kind: str = "auto", *, lang: str = "english",
                      newlines: bool = False) -> tuple[str, Callable[[str], list[str]]]:
    """``(name, split)`` for ``kind`` ``"auto"`` (NLTK punkt if present, else the regex),
    ``"nltk"`` (ValueError without it) or ``"regex"``; ``lang``: punkt's language (Megatron's --lang;
    the regex splitter is English only); ``newlines``: Megatron's --keep-newlines (see keep_newlines)."""
    if kind not in ("auto", "nltk", "regex"):
        raise ValueError(f"sentence splitter must be auto, nltk or regex, got {kind!r}")
    if kind != "regex":
        punkt = _nltk_punkt() if (lang, newlines) == ("english", False) else _nltk_punkt(lang, newlines)
        if punkt is not None:
            return "nltk", punkt
        if kind == "nltk" or lang != "english":
            raise ValueError(f"the nltk sentence splitter needs NLTK with its punkt data for {lang} already "
                             "downloaded (pip install nltk; python -m nltk.downloader punkt_tab)"
                             + ("; use --sentence-splitter regex" if lang == "english" else
                                f"; the rule-based splitter is English only, so --lang {lang} needs it"))
    if lang != "english":
        raise ValueError(f"--lang {lang}: the rule-based sentence splitter is English only; NLTK's punkt splits "
                         f"{lang} (--sentence-splitter nltk, with NLTK and its punkt data installed)")
    return "regex", (lambda text: regex_split_sentences(text, newlines=True)) if newlines else regex_split_sentences
