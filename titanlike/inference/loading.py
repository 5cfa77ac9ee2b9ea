"""A checkpoint and its tokenizer, loaded for inference: what scripts/generate.py and the
lm-evaluation-harness model (inference/harness.py) share.

The checkpoint is a DCP step folder (full or model-only), a checkpoint folder of step-N folders (the
latest is taken) or a Hugging Face folder; the tokenizer is the one named, else the checkpoint
folder's own tokenizer.json, else titanlike's debug tokenizer. A tokenizer whose vocabulary is not
the model's is refused: every id it produces must be one the model was trained on."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn as nn

from titanlike.inference.engine import GenerationError


def _logits(output) -> torch.Tensor:
    """The logits of a forward (a family may return them beside auxiliary losses)."""
    from titanlike.models.outputs import logits_of

    return logits_of(output)


@torch.no_grad()
def vocab_size(model) -> int:
    """The model's vocabulary: the size of its output projection's logits for one token."""
    from titanlike.models import protocol

    device = next(model.parameters()).device
    hooks = protocol.generation_hooks(model)
    if hooks is None:  # an encoder: its own forward
        return _logits(model(torch.zeros(1, 1, dtype=torch.long, device=device))).shape[-1]
    init_cache, prefill, _ = hooks
    cache = init_cache(1, 1, device=device, dtype=next(model.parameters()).dtype)
    return prefill(torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long,
                   device=device), cache).shape[-1]


def scores_only(model) -> str | None:
    """The sentence for a decoder whose head scores instead of predicting tokens (a reward model:
    models/protocol.py no_text_reason), None otherwise (an encoder is its caller's to name)."""
    from titanlike.models import protocol

    if protocol.generation_hooks(model) is None:
        return None
    reason = protocol.no_text_reason(model, model.model_args)
    if reason is None:
        return None
    return (f"{type(model).__name__} cannot generate text: it {reason}; score text with titanlike.load_model, or "
            "export it to Hugging Face")


def training_objective(model):
    """The objective the model's family trains with (its ModelSpec's, for these args)."""
    from titanlike.config import JobConfig
    from titanlike.models.registry import get_model_spec, model_names

    spec = next(get_model_spec(name) for name in model_names() if get_model_spec(name).model_cls is type(model))
    return spec.objective(JobConfig(), model.model_args)


# Why no pipeline parallelism in generation, serving or evaluation: a decode step carries one token
# per row through every stage in turn (the other stages idle unless several batches are kept in
# flight), each stage keeps the cache of its own layers, and the last stage must send the sampled
# tokens back to the first: a scheduler of its own, unlike training's schedules. The models these
# tools run fit tensor parallelism within a node, which titanlike-eval does under torchrun.
PIPELINE_REFUSAL = ("is not split over pipeline stages (a decode step would pass one token through the stages "
                    "in turn and send it back to the first): run it in one process, or with tensor parallelism "
                    "(titanlike-eval under torchrun: its ranks are one tensor-parallel group)")


def one_process(tool: str) -> None:
    """GenerationError, one sentence, when `tool` (generate, serve: one process, one device) was
    launched as several ranks (torchrun), which would only run it several times over."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise GenerationError(f"{tool} runs in one process but was launched as {world} ranks: generation "
                              f"{PIPELINE_REFUSAL}")


def checkpoint_tokenizer(checkpoint: str, tokenizer: str | None = None):
    """The tokenizer named (a tiktoken file or a folder with tokenizer.json), else the checkpoint
    folder's own tokenizer.json, else the debug tokenizer. GenerationError, one sentence, when it
    cannot be read."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.tokenizer_json import is_tokenizer_folder

    own = checkpoint if os.path.isdir(checkpoint) and is_tokenizer_folder(checkpoint) else None
    path = tokenizer or own or DEFAULT_TOKENIZER_PATH
    if not os.path.exists(path):
        raise GenerationError(f"the tokenizer {path} does not exist (give a tiktoken file or a folder with "
                              "tokenizer.json)")
    try:
        return build_tokenizer(path)
    except (ImportError, OSError, ValueError) as e:
        raise GenerationError(f"the tokenizer {path} cannot be read: {e}") from None


def load_for_inference(checkpoint: str, *, tokenizer: str | None = None, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, accept: Callable[[nn.Module], None] | None = None):
    """(model, tokenizer): the unsharded model in eval mode on `device` (weights cast to `dtype`
    when given) and the tokenizer (checkpoint_tokenizer). accept(model) raises GenerationError for a
    model the caller cannot use (before the tokenizer is compared: that refusal says more).
    GenerationError, one sentence, for a checkpoint that cannot be loaded or a tokenizer of another
    vocabulary."""
    from titanlike.checkpoint import CheckpointError, load_model

    tok = checkpoint_tokenizer(checkpoint, tokenizer)
    try:
        model = load_model(checkpoint, device, dtype=dtype)
    except CheckpointError as e:
        raise GenerationError(str(e)) from None
    if accept is not None:
        accept(model)
    problem = scores_only(model)
    if problem is not None:
        raise GenerationError(problem)
    vocab = vocab_size(model)
    if tok.vocab_size != vocab:
        raise GenerationError(f"the tokenizer has {tok.vocab_size} tokens but the model {vocab}; pass the tokenizer "
                              "it was trained with (--tokenizer)")
    return model, tok


__all__ = ["PIPELINE_REFUSAL", "checkpoint_tokenizer", "load_for_inference", "one_process", "scores_only",
           "training_objective", "vocab_size"]
