"""A preference pair whose cut to training.seq_len leaves chosen and rejected identical trains
nothing (a loss of log 2, no gradient): it is left out and counted, and a run where that is most
pairs is refused in one sentence (issue 45)."""

from __future__ import annotations

import pytest

from titanlike.data import DataError
from titanlike.data.preferences import pack_pairs

PROMPT = [1, 2, 3, 4]


def _pair(name: str, chosen: list[int], rejected: list[int]):
    def side(answer):
        return PROMPT + answer, [False] * len(PROMPT) + [True] * len(answer)

    return name, side(chosen), side(rejected)


SHORT = _pair("short", [5, 6], [7, 8])
# Answers that differ only in their last token: cut to 16 positions, both keep [5..9] and agree.
SAME_ONCE_CUT = _pair("same once cut", [5, 6, 7, 8, 9, 10, 20], [5, 6, 7, 8, 9, 10, 30])
# Long too, but they differ early: the cut keeps a difference.
DIFFERENT = _pair("different", [5, 6, 7, 8, 9, 10, 20], [11, 6, 7, 8, 9, 10, 30])


def test_a_pair_identical_once_cut_is_dropped_and_counted(caplog):
    with caplog.at_level("INFO", logger="titanlike"):
        kept = pack_pairs([SHORT, SAME_ONCE_CUT, DIFFERENT, SHORT], seq_len=16)
    assert len(kept) == 3
    b = kept.bounds
    for k in range(len(kept)):  # every pair kept still prefers something
        assert kept.labels[b[2 * k]: b[2 * k + 1]].tolist() != kept.labels[b[2 * k + 1]: b[2 * k + 2]].tolist()
    assert ("1 pairs longer than training.seq_len = 16 positions truncated (answers shortened), 0 dropped "
            "(dpo.overlong truncate), 1 dropped as identical once cut (chosen equals rejected)") in caplog.text


def test_most_pairs_identical_once_cut_is_refused_in_one_sentence():
    with pytest.raises(DataError) as e:
        pack_pairs([SAME_ONCE_CUT, SAME_ONCE_CUT, DIFFERENT], seq_len=16, section="reward")
    message = str(e.value)
    assert message.startswith("2 of 3 preference pairs have identical chosen and rejected answers once cut to "
                              "training.seq_len 16") and "reward.overlong drop" in message and "\n" not in message
    # Half is not most: trained, the one pair left out.
    assert len(pack_pairs([SAME_ONCE_CUT, DIFFERENT], seq_len=16)) == 1
