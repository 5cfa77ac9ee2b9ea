"""Preference pairs for DPO and its variants: read, rendered with a chat template, packed by pairs.

Files as for conversations (titanlike/data/conversations.py: JSONL, Parquet, a saved `datasets`
folder, or a folder of them). A row is one pair: `prompt`, `chosen`, `rejected`, each a string or a
list of messages. A string prompt is the user's turn and a string answer the assistant's; a list
prompt is the conversation so far and a list answer the assistant's reply (its turns). A row without
a prompt (or with a string prompt beside conversations) holds it implicitly, as TRL reads it: the
prompt is the longest common prefix of chosen and rejected (whole turns of conversations), the
answers what follows (implicit_prompt). A row's `tools` and `chat_template_kwargs` go to the template
as for conversations (data/conversations.py row_template_inputs), for the prompt and both sides alike,
as TRL's DPOTrainer and RewardTrainer pass them to apply_chat_template.

Each side of a pair is rendered as one conversation, prompt then answer (data/chat_template.py),
and becomes a document of n - 1 training positions (input t_j, target t_{j+1}); a target is trained
when it is the answer's: an assistant token past the prompt (the tokens of
`chat_prompt_ids(prompt)`, the prompt with the template's generation prompt). The rest is
IGNORE_INDEX, so the prompt never counts in a log-probability.

A pair is two adjacent documents of one sample: the chosen one with document id 2k, the rejected
one 2k + 1 (the k-th pair of the sample); the padding after the last pair is document 2K. A pair
therefore never straddles samples, microbatches or ranks, and the loss finds its halves from the
ids alone. Samples are packed by best-fit decreasing over whole pairs (packing off: one pair per
sample). A pair longer than `seq_len` positions is cut (`overlong truncate`: both answers shortened
alike, the prompt kept whole) or left out (`drop`); both are counted in the log. A prompt so long
that not even one answer token of each side fits is left out under drop and refused under truncate.
A pair whose cut leaves chosen and rejected identical (answers that differ only past the cut) would
train on nothing (a loss of log 2 and no gradient): it is left out and counted, and a run where that
is over half of the pairs is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from titanlike.data.conversations import IGNORE_INDEX, ConversationSamples, check_turns, render_row, row_template_inputs
from titanlike.data.errors import DataError

logger = logging.getLogger("titanlike")

PAIR_KEYS = ("prompt", "chosen", "rejected")


def _messages(value, where: str, key: str, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in value):
        return list(value)
    raise DataError(f"{where}: {key!r} is {type(value).__name__ if not isinstance(value, list) else 'a list'}, not "
                    "a string or a non-empty list of messages with a 'role'")


def _conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) of a pair whose prompt is the shared start of both answers: TRL's
    extract_prompt, its rules included: turns of conversations or characters of
    strings, the space before a string's first difference left to the answers."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def row_pair(row: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one row; DataError (one sentence) for a row that is not a pair."""
    has = {k for k in PAIR_KEYS if row.get(k) is not None}
    if {"chosen", "rejected"} <= has and row.get("chosen") != row.get("rejected") and (
            "prompt" not in has or _conversational(row["prompt"]) != _conversational(row["chosen"])):
        # TRL's maybe_extract_prompt: no prompt, or one of another form than the answers (a string beside
        # whole conversations, which then hold it).
        prompt, chosen, rejected = implicit_prompt(row["chosen"], row["rejected"])
        if not prompt:
            raise DataError(f"{where} has no 'prompt', and its chosen and rejected answers share no start to take "
                            "it from (TRL's implicit prompt)")
        row = {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    missing = [k for k in PAIR_KEYS if k not in row or row[k] is None]
    if missing:
        raise DataError(f"{where} has no {missing[0]!r}: a preference pair needs prompt, chosen and rejected "
                        f"(its keys: {', '.join(sorted(row)) or 'none'})")
    if row["chosen"] == row["rejected"]:
        raise DataError(f"{where}: 'chosen' equals 'rejected', so the pair prefers nothing")
    return (_messages(row["prompt"], where, "prompt", "user"), _messages(row["chosen"], where, "chosen", "assistant"),
            _messages(row["rejected"], where, "rejected", "assistant"))


def answer_mask(ids: list[int], assistant: list[bool], prompt_ids: list[int]) -> np.ndarray:
    """Per token of a rendered prompt + answer, whether it is the answer's: an assistant token past
    the prompt (past the longest common prefix with the prompt's own rendering, for templates that
    render the last turn differently once it has an answer)."""
    shared = 0
    for a, b in zip(ids, prompt_ids):
        if a != b:
            break
        shared += 1
    mask = np.asarray(assistant, dtype=bool).copy()
    mask[:shared] = False
    return mask


@dataclass
class TokenizedPairs:
    """Every pair's two documents, concatenated: inputs, targets (IGNORE_INDEX where not trained),
    bounds of documents 2k (chosen) and 2k + 1 (rejected) of pair k."""

    inputs: np.ndarray
    labels: np.ndarray
    bounds: np.ndarray  # (2 n + 1,) int64
    # Precomputed reference log-probabilities along the labels (0 where not trained), or None.
    reference: np.ndarray | None = None
    # Each pair's margin (TRL's reward-model `margin` column) at its chosen document's first position
    # (0 elsewhere: the loss sums it per document), along the labels; None when the rows have none.
    margin: np.ndarray | None = None

    def __len__(self) -> int:
        return (len(self.bounds) - 1) // 2

    def lengths(self) -> np.ndarray:
        """Positions of each pair (both documents)."""
        return self.bounds[2::2] - self.bounds[:-1:2]


def _fit(chosen: tuple[list[int], np.ndarray], rejected: tuple[list[int], np.ndarray],
         seq_len: int) -> tuple[tuple, tuple] | None:
    """Both sides cut to the longest common token budget that fits seq_len positions with at least
    one answer target each; None when even that does not fit."""
    (c_ids, c_mask), (r_ids, r_mask) = chosen, rejected
    # A side needs its tokens up to its first answer target (token 1 or later).
    need = [int(np.argmax(m[1:])) + 2 for m in (c_mask, r_mask)]
    if (need[0] - 1) + (need[1] - 1) > seq_len:
        return None
    cap = max(len(c_ids), len(r_ids))
    while cap > 1 and (min(len(c_ids), cap) - 1) + (min(len(r_ids), cap) - 1) > seq_len:
        cap -= 1
    cap_c, cap_r = max(min(len(c_ids), cap), need[0]), max(min(len(r_ids), cap), need[1])
    # The side with the longer prompt may need more than the common cap: take it from the other.
    while (cap_c - 1) + (cap_r - 1) > seq_len:
        if cap_c > need[0] and cap_c >= cap_r:
            cap_c -= 1
        else:
            cap_r -= 1
    return (c_ids[:cap_c], c_mask[:cap_c]), (r_ids[:cap_r], r_mask[:cap_r])


def pack_pairs(pairs, *, seq_len: int, overlong: str = "truncate", section: str = "dpo") -> TokenizedPairs:
    """pairs: (where, (chosen ids, chosen answer mask), (rejected ids, rejected answer mask)) per pair,
    ids lists of token ids and masks per token (True: an answer token). Over-long pairs are cut or
    dropped by `overlong` (counted in the log). DataError (one sentence) for a side with no answer
    token or a prompt that leaves no room for an answer (under truncate). section: the objective's
    config section (dpo, reward), which the log and the messages name."""
    inputs, labels, bounds, references, margins = [], [], [0], [], []
    truncated = dropped = identical = total = 0
    for where, *sides in pairs:
        total += 1
        # What a row brings beside its sides: precomputed reference values of both, its margin.
        extra = sides.pop() if len(sides) == 3 else {}
        refs, margin = extra.get("reference"), extra.get("margin")
        cut = False
        sides = [(list(ids), np.asarray(mask, dtype=bool)) for ids, mask in sides]
        for (ids, mask), side in zip(sides, ("chosen", "rejected")):
            if not mask[1:].any():
                raise DataError(f"{where}: the {side} answer renders to no answer token, so there is nothing to compare")
        if (len(sides[0][0]) - 1) + (len(sides[1][0]) - 1) > seq_len:
            fitted = _fit(sides[0], sides[1], seq_len)
            if overlong == "drop" or fitted is None:
                if overlong != "drop":
                    raise DataError(f"{where}: the prompt fills training.seq_len {seq_len} (a pair's two documents "
                                    "need room for the prompt twice and an answer token each); raise "
                                    f"training.seq_len, shorten the prompt, or set {section}.overlong drop")
                dropped += 1
                continue
            sides, cut = fitted, True
            if sides[0][0] == sides[1][0]:  # the same prompt, so the same answer tokens too
                identical += 1
                continue
            truncated += 1
        for i, (ids, mask) in enumerate(sides):
            target = np.asarray(ids[1:], dtype=np.int64)
            inputs.append(np.asarray(ids[:-1], dtype=np.int64))
            labels.append(np.where(mask[1:], target, IGNORE_INDEX))
            bounds.append(bounds[-1] + len(target))
            if refs is not None:
                references.append(_reference_values(refs[i], mask[1:], where, ("chosen", "rejected")[i], cut=cut))
            if margin is not None:
                margins.append(np.zeros(len(target), dtype=np.float32))
                margins[-1][0] = margin if i == 0 else 0.0
    if 2 * identical > total:
        raise DataError(f"{identical} of {total} preference pairs have identical chosen and rejected answers once cut "
                        f"to training.seq_len {seq_len} (their answers differ only past the cut), so they would train "
                        f"nothing; raise training.seq_len or set {section}.overlong drop")
    if truncated or dropped or identical:
        same = f", {identical} dropped as identical once cut (chosen equals rejected)" if identical else ""
        logger.info(f"{section}: {truncated} pairs longer than training.seq_len = {seq_len} positions truncated "
                    f"(answers shortened), {dropped} dropped ({section}.overlong {overlong}){same}")
    if len(bounds) == 1:
        raise DataError("no preference pair is left to train on" + (
            f" (every one is too long for training.seq_len; {section}.overlong truncate keeps them)"
            if dropped else ""))
    if references and len(references) != len(labels):
        raise DataError("some preference pairs have precomputed reference log-probabilities and some do not")
    if margins and len(margins) != len(labels):
        raise DataError("some preference rows have a 'margin' and some do not; give every row one or none")
    return TokenizedPairs(np.concatenate(inputs), np.concatenate(labels), np.asarray(bounds, dtype=np.int64),
                          np.concatenate(references) if references else None,
                          np.concatenate(margins) if margins else None)


def _margin(row: dict, where: str) -> float | None:
    """A row's `margin` (TRL's reward-model column: how much more the chosen side is preferred), None
    without one; DataError, one sentence, for one that is not a finite number."""
    value = row.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise DataError(f"{where}: its margin {value!r:.40} is not a finite number")
    return float(value)


REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
# The model and tokenizer the reference was computed with (scripts/precompute_reference.py writes it,
# objectives/preference.py reference_fingerprint): a row computed with another is refused.
FINGERPRINT_KEY = "ref_fingerprint"
# A log-probability is at most 0; log_softmax's rounding may leave the largest a hair above.
_LOGP_SLACK = 1e-4


def _reference_values(value, trained: np.ndarray, where: str, side: str, *, cut: bool) -> np.ndarray:
    """One side's precomputed reference along its positions: `value` is the log-probability of every
    answer token in order (scripts/precompute_reference.py writes these; a pair cut to fit seq_len
    keeps the first ones, as its answer keeps its first tokens), or their sum (TRL's precomputed
    form), placed on the first answer token: the loss only sums them per answer."""
    key = REFERENCE_KEYS[side == "rejected"]
    out = np.zeros(len(trained), dtype=np.float32)
    at = np.flatnonzero(trained)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if cut:
            raise DataError(f"{where}: the pair is cut to fit training.seq_len, so the summed {key} no longer "
                            "matches its answer; store per-token values (scripts/precompute_reference.py), raise "
                            "training.seq_len, or set dpo.overlong drop")
        if not np.isfinite(value):
            raise DataError(f"{where}: its {key} is not a finite number")
        if value > _LOGP_SLACK:
            raise DataError(f"{where}: its {key} is {value:g}, but a log-probability is at most 0")
        out[at[0]] = value
        return out
    if not (isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise DataError(f"{where}: {key} is neither a number nor a list of numbers")
    if len(value) < len(at) or (len(value) != len(at) and not cut):
        raise DataError(f"{where}: {key} holds {len(value)} log-probabilities but the {side} answer renders to "
                        f"{len(at)} answer tokens: they were computed with another chat template or tokenizer; "
                        "precompute them again for this job")
    values = np.asarray(value[:len(at)], dtype=np.float64)
    if not np.isfinite(values).all():
        raise DataError(f"{where}: {key} holds a value that is not finite")
    if (values > _LOGP_SLACK).any():
        raise DataError(f"{where}: {key} holds {values.max():g}, but a log-probability is at most 0")
    out[at] = values
    return out


def render_pair(row: dict, where: str, template, tokenizer, *, end_id: int | None = None, seq_len: int | None = None
                ) -> tuple[tuple[list[int], np.ndarray], ...]:
    """((chosen ids, answer mask), (rejected ids, answer mask)) of one preference row, whole. end_id: a
    token appended to every rendered side as its last target, so that the side's last real token is an
    input too (a reward model scores each whole sequence at its last token). seq_len: the job's, which
    bounds the turns of each side (conversations.check_turns)."""
    from titanlike.data.chat_template import chat_prompt_ids

    def render(messages: list[dict], prompt_ids: list[int]):
        ids, assistant = render_row(template, tokenizer, messages, where, "pair", tools=tools, kwargs=kwargs)
        mask = answer_mask(ids, assistant, prompt_ids)
        if end_id is not None:
            ids, mask = [*ids, end_id], np.append(mask, True)
        return ids, mask

    prompt, chosen, rejected = row_pair(row, where)
    tools, kwargs = row_template_inputs(row, where)
    if seq_len is not None:
        check_turns(len(prompt) + max(len(chosen), len(rejected)), seq_len, where)
    try:
        prompt_ids = chat_prompt_ids(template, tokenizer, prompt, tools=tools, kwargs=kwargs)
    except Exception as e:
        raise DataError(f"{where}: {template.origin} refused the prompt: "
                        f"{' '.join(str(e).split())[:200] or type(e).__name__}") from None
    return render(prompt + chosen, prompt_ids), render(prompt + rejected, prompt_ids)


def tokenize_pairs(rows, template, tokenizer, *, seq_len: int, overlong: str = "truncate",
                   end_id: int | None = None, reference: bool = False, fingerprint: str | None = None,
                   section: str = "dpo", margins: bool = False) -> TokenizedPairs:
    """rows: (where, row) of preference rows; template: a chat_template.ChatTemplate; end_id:
    render_pair's. reference: read each row's precomputed reference log-probabilities (REFERENCE_KEYS)
    into TokenizedPairs.reference; fingerprint: the job's model and tokenizer (None: it starts from no
    checkpoint), which a row's FINGERPRINT_KEY must equal. section: pack_pairs'. margins: read each
    row's `margin` (a reward model's, as TRL's RewardTrainer does) into TokenizedPairs.margin."""
    unchecked = 0

    from titanlike.observe.progress import progress

    def pairs():
        nonlocal unchecked
        for where, row in progress(rows, desc=f"{section}: tokenizing pairs", unit=" pairs"):
            sides = render_pair(row, where, template, tokenizer, end_id=end_id, seq_len=seq_len)
            if not reference:
                margin = _margin(row, where) if margins else None
                yield (where, *sides) if margin is None else (where, *sides, {"margin": margin})
                continue
            missing = [k for k in REFERENCE_KEYS if row.get(k) is None]
            if missing:
                raise DataError(f"{where} has no {missing[0]!r}, which dpo.reference precomputed reads; write the "
                                "reference log-probabilities with scripts/precompute_reference.py")
            theirs = row.get(FINGERPRINT_KEY)
            if theirs is None:
                unchecked += 1
            elif theirs != fingerprint:
                mine = f"this job's is {fingerprint}" if fingerprint else "this job starts from no checkpoint"
                raise DataError(f"{where}: its reference log-probabilities were computed with another model or "
                                f"tokenizer ({FINGERPRINT_KEY} {str(theirs)[:40]!r}; {mine}: "
                                "checkpoint.initial_load_path and the tokenizer); compute them again for this job "
                                "with scripts/precompute_reference.py")
            yield where, *sides, {"reference": tuple(row[k] for k in REFERENCE_KEYS)}

    packed = pack_pairs(pairs(), seq_len=seq_len, overlong=overlong, section=section)
    if unchecked:
        logger.warning(f"{section}: {unchecked} preference rows carry no {FINGERPRINT_KEY} (not written by "
                       "scripts/precompute_reference.py), so whether their reference log-probabilities come from this "
                       "job's model cannot be checked")
    return packed


class PreferenceSamples(ConversationSamples):
    """Samples of whole pairs (module docstring: chosen 2k, rejected 2k + 1, the padding 2K), packed
    as conversations are, two documents per item."""

    documents_per_item = 2

    def __init__(self, data: TokenizedPairs, *, section: str = "dpo", **packing):
        self.section = section  # the objective's config section, which the log line names
        super().__init__(data, **packing)

    def summary(self, items: int, trained: int) -> str:
        return f"{self.section}: {items} pairs ({trained:,} answer tokens)"

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        fields = super().fields
        for name, values in (("reference_logps", self.data.reference), ("margins", self.data.margin)):
            if values is not None:
                fields[name] = ((self.seq_len,), "float32")
        return fields

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = super().__getitem__(index)
        for name, values in (("reference_logps", self.data.reference), ("margins", self.data.margin)):
            if values is None:
                continue
            # Laid out as the labels are (ConversationSamples.__getitem__): the bin's documents in order.
            out = np.zeros(self.seq_len, dtype=np.float32)
            at, b = 0, self.data.bounds
            for item in self.bins[index]:
                for d in range(2 * item, 2 * item + 2):
                    n = int(b[d + 1] - b[d])
                    out[at: at + n] = values[b[d]: b[d + 1]]
                    at += n
            sample[name] = out
        return sample


def preference_samples(options, section: str, *, dataset_path, tokenizer, seq_len, split, split_name,
                       end_id: int | None = None, reference: bool = False, fingerprint: str | None = None,
                       holds_out: bool = True, margins: bool = False):
    """The global sample source of preference rows for an objective whose options have chat_template,
    overlong and packing (section: its config section, named in messages); end_id, reference, margins:
    tokenize_pairs'; holds_out: data/conversations.py split_rows'."""
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.conversations import split_rows
    from titanlike.data.loader import GlobalSamples
    from titanlike.data.tokenizer import pad_id

    rows = split_rows(dataset_path, split, split_name, holds_out=holds_out, what="pairs", section=section)
    template = load_chat_template(options.chat_template, tokenizer, option=f"{section}.chat_template")
    pairs = tokenize_pairs(rows, template, tokenizer, seq_len=seq_len, overlong=options.overlong,
                           end_id=end_id, reference=reference, fingerprint=fingerprint, section=section,
                           margins=margins)
    source = PreferenceSamples(pairs, section=section, seq_len=seq_len, packing=options.packing,
                               pad_id=pad_id(tokenizer))
    return GlobalSamples(source, shuffle=True, fields=source.fields)


__all__ = ["FINGERPRINT_KEY", "PAIR_KEYS", "PreferenceSamples", "REFERENCE_KEYS", "TokenizedPairs", "answer_mask",
           "implicit_prompt",
           "pack_pairs", "preference_samples", "render_pair", "row_pair", "tokenize_pairs"]
