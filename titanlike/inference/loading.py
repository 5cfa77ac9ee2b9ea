"""A checkpoint and its tokenizer, loaded for inference: what titanlike-generate, titanlike-serve
and the lm-evaluation-harness model (inference/harness.py, titanlike-eval) share, from the options
that name them (add_model_arguments and load_model_arguments for the two command lines; the harness
reads the same names as lm-eval model_args through model_dtype and choose_device).

The checkpoint is a DCP step folder (full or model-only), a checkpoint folder of step-N folders (the
latest is taken) or a Hugging Face folder; the tokenizer is the one named, else the checkpoint
folder's own tokenizer.json, else titanlike's debug tokenizer. A tokenizer whose vocabulary is not
the model's is refused: every id it produces must be one the model was trained on. What turns
requests into the loaded model's inputs is the Processor (processor.py: Processor.for_model).

The engine imports nothing from here (no cycle): this module imports GenerationError and scores_only
from it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn as nn

from titanlike.inference.arguments import DTYPE_NAMES, add_model_arguments  # noqa: F401 (importable from here)
from titanlike.inference.engine import GenerationError, scores_only


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


def model_spec(model: nn.Module):
    """The ModelSpec of the family `model` is of: its class's, else the one it derives from (FSDP's
    wrapper of a model is a subclass of the model's class); None for a class no family registered."""
    from titanlike.models.registry import get_model_spec, model_names

    specs = [get_model_spec(name) for name in model_names()]
    exact = next((spec for spec in specs if spec.model_cls is type(model)), None)
    return exact or next((spec for spec in specs if isinstance(model, spec.model_cls)), None)


def training_objective(model):
    """The objective the model's family trains with (its ModelSpec's, for these args)."""
    from titanlike.config import JobConfig
    from titanlike.objectives.registry import family_objective

    return family_objective(JobConfig(), model_spec(model), model.model_args)


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


def pad_start_id(tokenizer) -> int | None:
    """The tokenizer's pad token, which span-corruption samples start the decoder inputs with
    (data/special_tokens.py), None when it has none."""
    from titanlike.data.errors import DataError
    from titanlike.data.special_tokens import special_token_ids

    try:
        return special_token_ids(tokenizer, ["pad"])["pad"]
    except (DataError, TypeError):
        return None


def decoder_start_id(checkpoint: str, tokenizer, model: nn.Module) -> int | None:
    """The token an encoder-decoder's decoder starts from (T5: the pad id its samples start the
    decoder inputs with): a Hugging Face folder's config.json `decoder_start_token_id`, a titanlike
    checkpoint's recorded pad id, else the tokenizer's pad token (data/special_tokens.py, as the
    samples find it); None leaves the model's default. An id outside the vocabulary is a
    GenerationError, one sentence."""
    import json

    from titanlike.checkpoint import CheckpointError
    from titanlike.checkpoint.format import HF_CONFIG, is_hf_folder, read_sidecar, resolve_checkpoint_folder

    value, where = None, None
    try:
        folder = resolve_checkpoint_folder(checkpoint)
        if is_hf_folder(folder):
            where = os.path.join(folder, HF_CONFIG)
            with open(where) as f:
                value = json.load(f).get("decoder_start_token_id")
        else:
            where = f"{folder}'s tokenizer record"
            value = ((read_sidecar(folder) or {}).get("tokenizer") or {}).get("pad_id")
    except (CheckpointError, OSError, ValueError, AttributeError):
        value = None  # load_for_inference has read this checkpoint: what it lacks, it does not need
    if value is None and tokenizer is not None:
        value, where = pad_start_id(tokenizer), "the tokenizer's pad token"
    if value is None:
        return None
    vocab = vocab_size(model)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise GenerationError(f"{where} gives the decoder start token {json.dumps(value)[:40]}, which is not an id "
                              f"of the model's {vocab}-token vocabulary")
    return value


def generation_eos_ids(checkpoint: str, model: nn.Module) -> frozenset[int] | None:
    """The ids a Hugging Face folder's generation_config.json ends an answer with (`eos_token_id`, an
    id or a list: Llama 3 Instruct's EOS and end of turn, what checkpoint/hf.py writes), as
    transformers' generate and `transformers serve` stop; None for a titanlike checkpoint or a folder
    without one. GenerationError, one sentence, for a value that is not ids of the vocabulary."""
    import json

    from titanlike.checkpoint import CheckpointError
    from titanlike.checkpoint.format import is_hf_folder, resolve_checkpoint_folder

    try:
        folder = resolve_checkpoint_folder(checkpoint)
    except (CheckpointError, OSError, ValueError):
        return None
    where = os.path.join(folder, "generation_config.json")
    if not is_hf_folder(folder) or not os.path.isfile(where):
        return None
    try:
        with open(where) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        raise GenerationError(f"{where} is not a JSON object") from None
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    vocab = vocab_size(model)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise GenerationError(f"{where} gives eos_token_id {json.dumps(value)[:40]}, which is not an id or a list of "
                              f"ids of the model's {vocab}-token vocabulary")
    return frozenset(ids)


# The dtypes weights may be cast to for inference, by name (arguments.py's --dtype choices).
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def model_dtype(name: str | None, *, option: str = "--dtype") -> torch.dtype | None:
    """The torch dtype a DTYPES name means (None: as stored); GenerationError, one sentence, else."""
    if name is None:
        return None
    if name not in DTYPES:
        raise GenerationError(f"{option} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def choose_device(name: str | None, *, option: str = "--device") -> torch.device:
    """The device a name means (None: cuda when there is a GPU, else cpu); a bare `cuda` is this
    rank's GPU (LOCAL_RANK), made current, since NCCL binds each rank to its device.
    GenerationError, one sentence, for a name that is no device or a GPU this machine lacks."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise GenerationError(f"{option} {name!r} is not a torch device (cpu, cuda, cuda:0, ...)") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise GenerationError(f"{option} {name} was asked for but this machine has no CUDA GPU; use cpu")
        if chosen.index is None:
            chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(chosen)
    return chosen


def refuse_encoders(model: nn.Module) -> None:
    """GenerationError, one sentence, for a model with no decoder (BERT): the accept of
    load_model_arguments unless the tool gives its own."""
    from titanlike.models import protocol

    if protocol.generation_hooks(model) is None:
        objective = training_objective(model)
        raise GenerationError(f"{type(model).__name__} cannot generate text: it is an encoder trained on "
                              f"{objective.name} samples, and generation continues prompts with decoder-only or "
                              "encoder-decoder models (load it with titanlike.load_model and call it, or export it "
                              "to Hugging Face)")


def load_model_arguments(args: argparse.Namespace, *, accept: Callable[[nn.Module], None] = refuse_encoders):
    """(model, tokenizer) as add_model_arguments' options name them (load_for_inference), on the
    device --device means; GenerationError, one sentence, when they cannot be loaded."""
    return load_for_inference(args.checkpoint, tokenizer=args.tokenizer, device=choose_device(args.device),
                              dtype=model_dtype(args.dtype), accept=accept)


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


__all__ = ["DTYPES", "PIPELINE_REFUSAL", "add_model_arguments", "checkpoint_tokenizer", "choose_device",
           "decoder_start_id", "load_for_inference", "load_model_arguments", "model_dtype", "model_spec",
           "one_process", "pad_start_id", "refuse_encoders", "scores_only", "training_objective", "vocab_size"]
