"""The module-hook protocol: what generic code may read of a model and of its modules.

Generic code (parallel/, train/, checkpoint/, models/converters.py, models/outputs.py, the
estimator) knows a family only through its ModelSpec (models/registry.py), its args
(models/args.py) and what this file declares. Every attribute it reads of a model or of one of its
modules is declared here once, in HOOKS (what it is, who sets it, who reads it), and read through
the accessor functions below, never with `getattr(module, "name", default)` where it is used.
tests/unit/test_module_protocol.py checks every registered family against it, and that generic
code reads no undeclared attribute.

The model contract. A model class (spec.model_cls) is an nn.Module built from its args on the meta
device that provides:
  - `layers`: an nn.ModuleDict of blocks keyed "0", "1", ..., args.total_layers - 1: the unit of
    pipeline splitting, activation checkpointing, compile and FSDP wrapping;
  - `init_weights(seed=..., buffer_device=None)`: initialize whatever the module holds after
    parallelization and `to_empty`, as a function of (seed, parameter name, args) only;
  - `forward(tokens, positions=None, mask=None, **fields)`: tokens (or, on a later pipeline stage,
    hidden states) -> logits, or a ModelOutput with auxiliary losses (models/outputs.py); `fields`
    are the other fields of its objective's samples (the objective spec.objective names, titanlike/objectives/: BERT's
    token types, T5's decoder inputs), given to every pipeline stage; optionally a `logits_at`
    argument (selects_logits below): logits only at the positions it names;
  - the input-end and output-end modules named in its spec's `pipeline_ends`, settable to None;
  - optionally the `tied_weights` / `tie_weights` hooks below.
Modules may carry the other hooks; a hook a module does not carry has the default given here.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Hook:
    """One declared attribute: its name, what carries it, the type of its value, its default where
    a module does not carry it, and what it means, who sets it and who reads it."""

    name: str
    carrier: str       # "model" (the model or a pipeline stage of it) or "module" (any submodule)
    kind: Any          # the value's type, for isinstance (Callable: any callable)
    default: Any
    meaning: str


HOOKS: dict[str, Hook] = {hook.name: hook for hook in (
    # The model ----------------------------------------------------------------------------------
    Hook("tied_weights", "model", dict, {},
         "{alias name: owner name} of parameters that are one Parameter under two names (tied input "
         "and output embeddings), {} otherwise. Set by the model; read by the pipeline split and its "
         "tied-gradient sync (parallel/pipeline.py) and checkpoints."),
    Hook("extra_layers", "model", tuple, (),
         "ModuleDicts of blocks besides `layers` (a vision-language model's vision tower blocks) that "
         "activation checkpointing, compile and FSDP wrap block by block as they wrap `layers` (the "
         "pipeline split does not cut them); () on a pipeline stage without them. Set by the model; "
         "read through layer_stacks by parallel/activation_checkpoint.py, parallel/fsdp.py and the "
         "compile step of parallel/parallelize.py."),
    Hook("tie_weights", "model", Callable, None,
         "A method making every alias in tied_weights the same Parameter as its owner where both are "
         "held (a pipeline stage may hold one end). Required when tied_weights is not empty. Called "
         "after tensor parallelism replaced the parameters (parallel/tensor_parallel.py)."),
    # Generation -------------------------------------------------------------------------------------
    Hook("init_cache", "model", (Callable, type(None)), None,
         "A method init_cache(batch_size, capacity, *, device, dtype) -> the family's decoding state "
         "(models/common/kv_cache.ModelCache: per-row lengths and each layer's own cache: keys and "
         "values, MLA's compressed latent, Mamba-2 conv and SSM states, T5's decoder caches). Set by "
         "models that generate (common/decoder.py, t5/model.py); None (BERT sets it so): the model "
         "cannot generate (an encoder). Read by titanlike/inference/engine.py, with prefill and decode_step."),
    Hook("prefill", "model", (Callable, type(None)), None,
         "A method prefill(tokens, lengths, cache, *, start_id=None, **fields) -> logits (batch, vocab): "
         "right-padded prompts (batch, P) of `lengths` real tokens run in one pass, the cache filled, the "
         "logits of each row's next token returned (start_id: an encoder-decoder's decoder start "
         "token, its pad id; decoders ignore it; fields: other inputs of the prompts the family's "
         "prefill names, a vision-language model's pixel_values). Required with init_cache; read by "
         "titanlike/inference/engine.py."),
    Hook("decode_step", "model", (Callable, type(None)), None,
         "A method decode_step(tokens, cache) -> logits (batch, vocab): one new token per row "
         "(batch,) at its row's next position. Required with init_cache; read by "
         "titanlike/inference/engine.py."),
    # Context parallelism --------------------------------------------------------------------------
    Hook("core_attention", "module", Callable, None,
         "An instance attribute of an attention module: the kernel (q, k, v, mask, causal=..., and "
         "window=... for a sliding-window layer) it "
         "calls. Set by the module to models/common/attention.core_attention; context parallelism "
         "(parallel/context.py) replaces it by its ring/all-gather attention. A model without one "
         "cannot run context parallel."),
    Hook("sequence_carry", "module", object, None,
         "An instance attribute of a sequence mixer that carries state along the sequence (a "
         "Mamba-2 mixer): None, or the carry context parallelism sets (parallel/context.py "
         "ContextParallelCarry) to hand each rank the state at the start of its piece."),
    # Expert parallelism -> FSDP and compile ---------------------------------------------------------
    Hook("fsdp_mesh", "module", str, None,
         "The name of the mesh FSDP shards this module over as a unit of its own (\"expert_fsdp\" "
         "for routed experts, \"token_fsdp\" for an MoE layer). Set by parallel/expert_parallel.py; "
         "read by parallel/fsdp.py."),
    Hook("skip_compile", "module", bool, False,
         "True for a module that must stay eager inside a compiled block (an MoE layer: data-"
         "dependent token counts). Set by parallel/expert_parallel.py; read by the compile step of "
         "parallel/parallelize.py."),
    # Training statistics and reported losses ------------------------------------------------------
    Hook("record_statistics", "module", bool, None,
         "Carried by a module whose training forwards record statistics (MoE expert counts, a "
         "reported loss); the pipeline sets it False while it infers shapes on placeholder inputs "
         "(parallel/pipeline.py), True otherwise."),
    Hook("reported_loss", "module", str, None,
         "The name (one of its args' reported_losses()) of a loss term the module adds to the "
         "objective and that is logged apart; the module keeps the float32 scalar buffer "
         "`reported_loss_sum`, to which its training forwards add the term in summed units. Read and "
         "zeroed once per step by the training step (models/outputs.LossReports, built once)."),
    Hook("reported_loss_sum", "module", torch.Tensor, None,
         "The buffer of a module that declares reported_loss (see there)."),
    Hook("loss_weight", "module", (torch.Tensor, type(None)), None,
         "An instance attribute of a module whose forward adds a term to the objective with "
         "models/outputs.attach_loss (an MoE layer, a model with multi-token prediction or BERT's "
         "binary head): the objective's weight that term's backward uses, None for 1. The module sets "
         "it None; the training step (train/step.py) points every such module at its weight tensor "
         "once, at build time, and rewrites that tensor in place each step (float16 loss scaling)."),
    # Converters -------------------------------------------------------------------------------------
    Hook("keep_high_precision", "module", bool, False,
         "True on a linear that low-precision converters (float8, Transformer Engine) must leave "
         "alone (an MoE router, a per-sequence head). Set by the model; read by models/converters.py."),
    # Tensor parallelism -----------------------------------------------------------------------------
    Hook("sequence_inputs", "module", int, 1,
         "How many of a module's first positional inputs are sequence-sharded activations that "
         "sequence parallelism all-gathers on entry (cross-attention: its own stream and the encoder's "
         "output, 2). Set by the module's class; read by models/common/sharding.gather_layouts."),
    Hook("head_split_parameters", "module", tuple, None,
         "Names of a module's parameters laid out head by head on dim 0 (per-head vectors, per-channel "
         "conv filters, a relative-bias table), which tensor parallelism splits with the heads; the "
         "module reads them with to_local(). Names it lacks (an optional bias) are skipped. Set by the "
         "module's class; read by the head-split styles (models/common/sharding.py, mamba2.py)."),
    # Optimizer ----------------------------------------------------------------------------------------
    Hook("qk_clip_heads", "module", Callable, None,
         "A method of an attention module QK-clip can rescale (the shared attention, DeepSeek-V3's "
         "latent attention): the query heads over all tensor-parallel ranks, or None where its forward "
         "records no logits; such a module also carries `logit_max`, `has_qk_norm` and "
         "`scale_qk_heads_` (train/qk_clip.ClippedAttention). Read by train/qk_clip.py."),
)}


def _get(module: nn.Module, name: str) -> Any:
    return getattr(module, name, HOOKS[name].default)


# The model ------------------------------------------------------------------------------------------


def tied_weights(model: nn.Module) -> dict[str, str]:
    return dict(_get(model, "tied_weights") or {})


def layer_stacks(model: nn.Module) -> list[nn.ModuleDict]:
    """model.layers, then its extra_layers: every ModuleDict of blocks wrapped block by block."""
    return [model.layers, *_get(model, "extra_layers")]


def retie_weights(model: nn.Module) -> None:
    """Make tied parameters one Parameter again (parallelization replaces them one by one)."""
    tie = _get(model, "tie_weights")
    if tie is not None:
        tie()


# Generation -----------------------------------------------------------------------------------------


def generation_hooks(model: nn.Module) -> tuple[Callable, Callable, Callable] | None:
    """(init_cache, prefill, decode_step) of a model that generates, None for one that cannot."""
    hooks = tuple(_get(model, name) for name in ("init_cache", "prefill", "decode_step"))
    if hooks[0] is None:
        return None
    if None in hooks:
        raise ValueError(f"{type(model).__name__} has init_cache but not both prefill and decode_step")
    return hooks


def no_text_reason(model, args) -> str | None:
    """Why a model of this class (or instance) and args cannot continue a prompt, as a predicate
    ("is an encoder ..."), or None when it generates text: it has generation hooks and its output
    projection gives the vocabulary's logits (args.has_score_head: a reward model's gives one score)."""
    if generation_hooks(model) is None:
        return "is an encoder (it has no decoder to continue a prompt with)"
    if args.has_score_head:
        return "is a reward model (its head gives one score per position, not the vocabulary's logits)"
    return None


# Context parallelism ------------------------------------------------------------------------------


def core_attention_modules(root: nn.Module) -> list[nn.Module]:
    """Every module under root (root included) whose instance carries a `core_attention` hook."""
    return [m for m in root.modules() if "core_attention" in vars(m)]


def sequence_carry_modules(root: nn.Module) -> list[nn.Module]:
    """Every module under root (root included) whose instance carries a `sequence_carry` hook."""
    return [m for m in root.modules() if "sequence_carry" in vars(m)]


def set_core_attention(module: nn.Module, kernel: Callable) -> None:
    module.core_attention = kernel


def set_sequence_carry(module: nn.Module, carry: object) -> None:
    module.sequence_carry = carry


# Expert parallelism -> FSDP and compile ------------------------------------------------------------


def selects_logits(model: nn.Module) -> bool:
    """Whether the model's forward takes logits_at, computing logits only at the positions it names
    (models/common/decoder.py Decoder.forward)."""
    import inspect

    return "logits_at" in inspect.signature(model.forward).parameters


def fsdp_mesh(module: nn.Module) -> str | None:
    return _get(module, "fsdp_mesh")


def set_fsdp_mesh(module: nn.Module, mesh_name: str) -> None:
    module.fsdp_mesh = mesh_name


def skips_compile(module: nn.Module) -> bool:
    return bool(_get(module, "skip_compile"))


def set_skip_compile(module: nn.Module) -> None:
    module.skip_compile = True


# Training statistics and reported losses -----------------------------------------------------------


def statistics_recorders(root: nn.Module) -> list[nn.Module]:
    """Every module under root that carries `record_statistics`."""
    return [m for m in root.modules() if _get(m, "record_statistics") is not None]


def set_record_statistics(module: nn.Module, on: bool) -> None:
    module.record_statistics = on


def reported_loss(module: nn.Module) -> str | None:
    return _get(module, "reported_loss")


def reported_loss_sum(module: nn.Module) -> torch.Tensor:
    return module.reported_loss_sum


def loss_attaching_modules(root: nn.Module) -> list[nn.Module]:
    """Every module under root whose instance carries a `loss_weight` hook."""
    return [m for m in root.modules() if "loss_weight" in vars(m)]


def set_loss_weight(module: nn.Module, weight: torch.Tensor | None) -> None:
    module.loss_weight = weight


# Converters and tensor parallelism ------------------------------------------------------------------


def keeps_high_precision(module: nn.Module) -> bool:
    return bool(_get(module, "keep_high_precision"))


def sequence_inputs(module: nn.Module) -> int:
    return _get(module, "sequence_inputs")


def head_split_parameters(module: nn.Module) -> tuple[str, ...]:
    names = _get(module, "head_split_parameters")
    if names is None:
        raise ValueError(f"{type(module).__name__} is split by heads but declares no head_split_parameters")
    return tuple(names)


# Optimizer --------------------------------------------------------------------------------------------


def qk_clip_heads(module: nn.Module) -> int | None:
    """The query heads QK-clip rescales in this module (over all tensor-parallel ranks), None for a
    module it does not clip."""
    method = _get(module, "qk_clip_heads")
    return None if method is None else method()


__all__ = ["HOOKS", "Hook", "core_attention_modules", "fsdp_mesh", "generation_hooks", "head_split_parameters", "keeps_high_precision", "layer_stacks", "qk_clip_heads",
           "reported_loss", "selects_logits", "reported_loss_sum", "retie_weights", "sequence_carry_modules", "sequence_inputs",
           "set_core_attention", "set_fsdp_mesh", "set_record_statistics", "set_sequence_carry", "set_skip_compile",
           "skips_compile", "statistics_recorders", "tied_weights"]
