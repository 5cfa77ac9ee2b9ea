"""Validation runs: loss, perplexity and accuracy of the model being trained on held-out data.

The validation data go through the same loader as training (same data-parallel slicing,
same microbatch preparation: document masks, context-parallel cut), from the start of the
split at every run, so successive runs measure the same tokens. The loss is summed
cross-entropy over all target tokens of the run divided by their count, exactly as the
training loss, so it is the same number for every parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlike.config.schema import JobConfig
from titanlike.data import build_dataloader
from titanlike.data.tokenizer import Tokenizer
from titanlike.objectives.base import Objective


@dataclass
class ValidationData:
    loader: object  # a StatefulDataLoader, restarted (iter) at every run
    num_batches: int  # batches per data-parallel rank in one run


def build_validation_data(cfg: JobConfig, tokenizer: Tokenizer, *, dp_rank: int, dp_degree: int,
                          seed: int, objective: Objective | None = None) -> ValidationData:
    """objective: the job's (its samples; None: the dataset kind's token windows)."""
    v, t = cfg.validation, cfg.training
    local_batch_size = v.local_batch_size if v.local_batch_size != -1 else t.local_batch_size
    global_batch_size = local_batch_size * dp_degree
    if v.dataset is None:
        # No dataset of its own: the held-out split of the training data.
        dataset, dataset_path, split, part = t.dataset, t.dataset_path, t.split, "valid"
    elif v.dataset == "default":
        dataset, dataset_path, split, part = "default", None, None, "valid"  # the embedded corpus's held-out 1%
    else:
        # A dataset given for validation is used whole ("1": one part holding everything).
        dataset, dataset_path, split, part = v.dataset, v.dataset_path, "1", "train"
    loader = build_dataloader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=v.seq_len if v.seq_len != -1 else t.seq_len,
        local_batch_size=local_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=seed,
        num_samples=None if v.steps == -1 else v.steps * global_batch_size,
        split=split,
        split_name=part,
        objective=objective,
    )
    if v.steps != -1:
        num_batches = v.steps
    else:
        # The whole split, in full global batches (validation refuses -1 for streaming sources).
        num_samples = len(loader.dataset.samples.source)
        num_batches = num_samples // global_batch_size
        if num_batches == 0:
            raise ValueError(f"the validation split holds {num_samples} samples, fewer than one global "
                             f"batch of {global_batch_size}; use a smaller validation.local_batch_size")
    return ValidationData(loader, num_batches)
