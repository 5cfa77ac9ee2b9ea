"""Assets of the preference tests, generated on the spot: a synthetic preference task."""

from __future__ import annotations

import random

from sft_assets import TASK_WORDS


# Words the rejected answers bring in and no prompt holds.
INTRUDERS = ["king", "stone"]


def reverse_preferences(n: int, seed: int, words: int = 2) -> list[dict]:
    """Pairs asking for `words` words in reverse order: the reversed words are chosen; rejected is the
    same answer with its last word replaced by an intruder (a word of no prompt), so the preference
    is a property of the answer's words; prompts and answers as strings (a user turn, the
    assistant's reply)."""
    rng = random.Random(seed)
    pool = [w for w in TASK_WORDS if w not in INTRUDERS]
    rows = []
    for _ in range(n):
        ws = [rng.choice(pool) for _ in range(words)]
        answer = list(reversed(ws))
        rows.append({"prompt": "reverse: " + " ".join(ws), "chosen": " ".join(answer),
                     "rejected": " ".join(answer[:-1] + [rng.choice(INTRUDERS)])})
    return rows
