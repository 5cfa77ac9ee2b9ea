"""Cross-entropy summed over target tokens.

The trainer divides by the global count of target tokens of the whole step (all
microbatches, all data-parallel ranks), so gradient accumulation and the
data-parallel degree leave the math unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
