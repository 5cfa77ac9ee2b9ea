"""Where a vision-language model's images go in its token sequence: shared by the model, which
splices image features at the placeholders (models/llava/model.py), and by its training objective,
which computes the same index for a batch (objectives/image_caption.py)."""

from __future__ import annotations

import torch


def image_index(tokens: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """(batch, seq) int64: which of its sample's image-feature rows each `<image>` placeholder takes
    (the sample's placeholders in order: image i's features are rows i * tokens_per_image, ...), -1
    for a text token. Relative to the sample, so that a pipeline's cut into microbatches of rows
    keeps it right; computed on whole sequences, since a context-parallel slice cannot count the
    placeholders before it."""
    is_image = tokens == image_token_id
    return torch.where(is_image, is_image.cumsum(1) - 1, -1)
