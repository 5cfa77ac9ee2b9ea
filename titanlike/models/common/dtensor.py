"""This rank's part of a tensor that tensor or expert parallelism may have made a DTensor, for model
code that runs with and without parallelism. torch.distributed.tensor is imported at the first call,
not with the model code: it costs about 0.6 s of CPU at every start, `train.py --help` included
(docs/performance.md), and only a parallelized model holds DTensors."""

from __future__ import annotations

import torch


def is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """t's shard on this rank when t is a DTensor, else t itself (None stays None)."""
    return t.to_local() if is_dtensor(t) else t


__all__ = ["is_dtensor", "local_part"]
