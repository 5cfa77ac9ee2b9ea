"""Validation runs: loss, perplexity and accuracy of the model being trained, on held-out data.

The validation data go through the same loader and microbatch preparation as training (the same
data-parallel slicing, document masks, context-parallel cut) and through the step's own forward
(the pipeline schedule's forward-only mode under pipeline parallelism), from the start of the
split at every run, so successive runs measure the same tokens. The loss is the objective's
summed loss over all its units of the run (target tokens; pairs for preference objectives) divided
by their count, exactly as the training loss, so it is the same number for every parallel layout.

Accuracy is counted by the objective's loss (LossTerms.correct, asked for by the step's loss in
validation: StepLoss.counting_correct): by default the fraction of targets (next tokens, masked tokens,
decoder targets) whose most likely token is right (vocabulary-parallel logits gathered for it, in
validation only); for preference pairs, the pairs whose chosen answer gets the higher reward.

Samples (validation.sample_prompts): greedy continuations of fixed prompts every sample_freq
steps, with the KV-cache engine, where every rank computes whole layers (one process, DP, FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from titanlike.config.schema import JobConfig
from titanlike.data import build_dataloader
from titanlike.data.loader import find_dataset_kind
from titanlike.data.tokenizer import Tokenizer
from titanlike.inference import Engine, Processor, SamplingParams
from titanlike.objectives.base import Objective
from titanlike.parallel.utils import sum_over_world
from titanlike.train.step import TrainStep


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
    kind = find_dataset_kind(v.dataset)
    if v.dataset is None:
        # No dataset of its own: the held-out split of the training data.
        dataset, dataset_path, split, part = t.dataset, t.dataset_path, t.split, "valid"
    elif kind is not None and kind.validates_on_held_out:  # the embedded corpus's held-out 1%
        dataset, dataset_path, split, part = v.dataset, None, None, "valid"
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



def validate_validation_layout(v, t, dims) -> None:
    """The [validation] rules that depend on the layout: ValueError, one sentence. v: the
    validation section, t: the training section, dims: ParallelDims. (Its dataset is the
    objective's to check: Objective.validate.)"""
    if v.seq_len not in (-1, t.seq_len):
        if dims.cp_enabled or dims.pp_enabled:
            raise ValueError(f"validation.seq_len {v.seq_len} must be -1 or training.seq_len {t.seq_len} under "
                             f"{'context' if dims.cp_enabled else 'pipeline'} parallelism, which is set up for "
                             "training's sequence length")
        if v.seq_len % dims.tp:
            raise ValueError(f"validation.seq_len {v.seq_len} must be divisible by tensor_parallel_degree {dims.tp} "
                             "(sequence parallelism cuts it)")

def validate_samples_layout(v, dims, *, no_text: str | None, compile_blocks: bool, model: str, tokenizer=None,
                            context_len: int | None = None) -> None:
    """The rules of validation.sample_prompts (Samples, below): ValueError, one sentence. no_text:
    why the model generates no text (models/protocol.py no_text_reason), None when it does."""
    if not v.sample_prompts:
        return
    if no_text is not None:
        raise ValueError(f"validation.sample_prompts needs a model that generates text, and {model} {no_text}")
    # Samples run the KV-cache engine on each rank's model as it is: whole layers, plain forwards.
    split = [name for name, on in (("pipeline", dims.pp_enabled), ("tensor", dims.tp_enabled),
                                   ("context", dims.cp_enabled), ("expert", dims.ep_enabled),
                                   ("expert tensor", dims.etp_enabled)) if on]
    if split:
        raise ValueError(f"validation.sample_prompts cannot run under {split[0]} parallelism, where a rank does not "
                         "compute whole layers for a batch of its own (data parallelism and FSDP can); sample from a "
                         "checkpoint with scripts/generate.py instead")
    if compile_blocks:
        raise ValueError("validation.sample_prompts cannot run with compile.enable on the model's blocks (compiled "
                         "for training's shapes, not a decode step's); sample from a checkpoint with "
                         "scripts/generate.py instead")
    if tokenizer is not None and context_len is not None:
        processor = Processor(tokenizer)
        for i, prompt in enumerate(v.sample_prompts):
            n = len(processor.encode(prompt))
            if n >= context_len:
                raise ValueError(f"validation.sample_prompts[{i}] has {n} tokens, which leaves no room in the "
                                 f"model's context of {context_len} tokens")


class Samples:
    """Greedy continuations of fixed prompts with the KV cache (titanlike/inference), taken during
    training: every rank runs the same steps on its model (FSDP all-gathers the weights of each
    layer, so every rank must), rank 0 reports them. Greedy and the same weights: every rank draws
    the same tokens, so they stop together."""

    def __init__(self, model, tokenizer, prompts: list[str], max_tokens: int):
        # The processor: the prompts' tokens, their stop ids, an encoder-decoder's decoder start (the
        # pad token, as span-corruption samples start theirs), the answers' text.
        self.model, self.prompts = model, list(prompts)
        self.processor = Processor.for_model(model, tokenizer)
        batch = self.processor(self.prompts)
        self.ids = batch.ids
        self.params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=batch.stop_ids)

    @torch.no_grad()
    def run(self) -> list[tuple[str, str]]:
        """(prompt, continuation) of each prompt; every rank calls it."""
        stops = self.params.stop_token_ids
        try:
            engine = Engine(self.model, start_id=self.processor.start_id)
            completions, _ = engine.generate(self.ids, self.params,
                                             detokenize=lambda t: self.processor.decode(t, stop_ids=stops))
        finally:
            self.model.train()
        return [(prompt, c.text) for prompt, c in zip(self.prompts, completions)]


class Evaluator:
    def __init__(self, step: TrainStep, data, prepare: Callable):
        """data: a ValidationData (loader + batches per run, above); prepare: the
        trainer's loader microbatch -> Microbatch."""
        self.step, self.data, self.prepare = step, data, prepare

    @torch.no_grad()
    def run(self) -> tuple[float, int, float]:
        """(mean loss per target token, target tokens, accuracy); every rank calls it."""
        step = self.step
        device = step.device
        for part in step.model_parts:
            part.eval()
        loss_sum = torch.zeros((), device=device)
        tokens = torch.zeros((), device=device)
        data = iter(self.data.loader)
        try:
            # The loss counts correct units too, and records no reported terms (those are the training steps').
            with step.step_loss.counting_correct() as correct:
                for _ in range(self.data.num_batches):
                    mb = self.prepare(next(data))
                    tokens += mb.units
                    loss_sum += step.forward_backward(mb, backward=False)
                right = correct()
        finally:
            for part in step.model_parts:
                part.train()
        right = torch.zeros((), device=device) if right is None else right
        # Tokens are seen by every tp rank and stage, the loss and correct counts by the last stage's.
        sums = sum_over_world(torch.stack([tokens * step.token_share, loss_sum * step.loss_share,
                                           right.float() * step.loss_share]))
        tokens, loss_sum, right = sums.tolist()
        return loss_sum / tokens, int(tokens), right / tokens


__all__ = ["Evaluator", "Samples", "ValidationData", "build_validation_data", "validate_samples_layout"]
