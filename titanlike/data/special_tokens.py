"""Special tokens of the masked-LM (BERT) and span-corruption (T5) objectives, found in a tokenizer.

Names: ``"cls"``, ``"sep"``, ``"mask"``, ``"pad"`` and the T5 sentinels ``"sentinel_0"``,
``"sentinel_1"``, ... The vocabulary is never grown (the model's vocab stays the tokenizer's
``vocab_size``), so each name maps onto a token the tokenizer already has:

* Llama-3-format tiktoken tokenizers (ours, the debug one included) have 256 special slots:
  cls = ``<|begin_of_text|>``, sep = ``<|end_of_text|>`` (the EOS), pad =
  ``<|finetune_right_pad_id|>``, mask = ``<|reserved_special_token_0|>``, and sentinel k =
  ``<|reserved_special_token_{k + 2}|>`` (244 sentinels: reserved tokens 2 to 245).
* ``tokenizer.json`` folders: the conventional strings, the first one the vocabulary holds:
  ``[CLS]``/``<s>``, ``[SEP]``/``</s>``, ``[MASK]``/``<mask>``, ``[PAD]``/``<pad>``, and
  ``<extra_id_k>`` (T5's sentinels); the Llama 3 names above are tried last, so a Llama 3
  ``tokenizer.json`` answers like the tiktoken file.

A name the tokenizer lacks is a :class:`~titanlike.data.errors.DataError` of one sentence.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from titanlike.data.errors import DataError

__all__ = ["SPECIAL_TOKEN_NAMES", "ordinary_token_ids", "sentinel_ids", "special_token_ids"]

SPECIAL_TOKEN_NAMES = ("cls", "sep", "mask", "pad")

# Llama 3's 256 slots: reserved_special_token_0 and _1 are named slots nobody uses, then 2..245.
_LLAMA3_MASK = "<|reserved_special_token_0|>"
_LLAMA3_FIRST_SENTINEL = 2
_LLAMA3_CANDIDATES = {
    "cls": ("<|begin_of_text|>",),
    "sep": ("<|end_of_text|>",),
    "pad": ("<|finetune_right_pad_id|>",),
    "mask": (_LLAMA3_MASK,),
}
# tokenizer.json folders: BERT's and T5's / RoBERTa's spellings, then Llama 3's.
_JSON_CANDIDATES = {
    "cls": ("[CLS]", "<s>", "<|begin_of_text|>"),
    "sep": ("[SEP]", "</s>", "<|end_of_text|>"),
    "mask": ("[MASK]", "<mask>", _LLAMA3_MASK),
    "pad": ("[PAD]", "<pad>", "<|finetune_right_pad_id|>"),
}


def _is_tiktoken(tokenizer) -> bool:
    # titanlike.data.tokenizer.Tokenizer: its special tokens are a dict of the 256 Llama 3 slots.
    return isinstance(getattr(tokenizer, "special_tokens", None), dict) and hasattr(tokenizer, "num_bpe_tokens")


def _candidates(tokenizer, name: str) -> tuple[str, ...]:
    tiktoken = _is_tiktoken(tokenizer)
    if name.startswith("sentinel_"):
        k = name[len("sentinel_"):]
        if not k.isdigit():
            raise ValueError(f"special token name {name!r}: a sentinel is named sentinel_<number>")
        if tiktoken:
            return (f"<|reserved_special_token_{int(k) + _LLAMA3_FIRST_SENTINEL}|>",)
        return (f"<extra_id_{int(k)}>", f"<|reserved_special_token_{int(k) + _LLAMA3_FIRST_SENTINEL}|>")
    table = _LLAMA3_CANDIDATES if tiktoken else _JSON_CANDIDATES
    if name not in table:
        raise ValueError(f"unknown special token name {name!r}; known: {', '.join(SPECIAL_TOKEN_NAMES)}, sentinel_<k>")
    return table[name]


def _token_id(tokenizer, token: str) -> int | None:
    if _is_tiktoken(tokenizer):
        return tokenizer.special_tokens.get(token)
    model = getattr(tokenizer, "model", None)
    if model is not None and hasattr(model, "token_to_id"):  # the `tokenizers` backend
        return model.token_to_id(token)
    raise TypeError(f"cannot look special tokens up in a {type(tokenizer).__name__}: expected a titanlike "
                    "Tokenizer or HuggingFaceTokenizer (titanlike.data.build_tokenizer)")


def special_token_ids(tokenizer, names: Iterable[str]) -> dict[str, int]:
    """``{name: id}`` for each name (``"cls"``, ``"sep"``, ``"mask"``, ``"pad"``, ``"sentinel_<k>"``);
    DataError naming the first token the tokenizer does not have."""
    out: dict[str, int] = {}
    for name in names:
        candidates = _candidates(tokenizer, name)
        for token in candidates:
            token_id = _token_id(tokenizer, token)
            if token_id is not None:
                out[name] = int(token_id)
                break
        else:
            where = getattr(tokenizer, "path", type(tokenizer).__name__)
            raise DataError(f"tokenizer {where} has no {name} token (looked for {' or '.join(candidates)}); "
                            "masked-LM and span-corruption data need it")
    return out


def sentinel_ids(tokenizer, n: int) -> list[int]:
    """Ids of the sentinels ``sentinel_0 .. sentinel_{n-1}``, in that order."""
    names = [f"sentinel_{k}" for k in range(n)]
    found = special_token_ids(tokenizer, names)
    return [found[name] for name in names]


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids a masked-LM "random token" replacement draws from: every id that is not a special token
    (tiktoken: the BPE ranks; tokenizer.json: every id but the added special tokens)."""
    ids = np.arange(int(tokenizer.vocab_size), dtype=np.int64)
    return np.setdiff1d(ids, np.fromiter(tokenizer.special_ids, dtype=np.int64))
