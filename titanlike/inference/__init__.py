"""Text generation on titanlike models: a KV-cache engine (engine.py), continuous batching on it
(continuous.py: a finished row's slot refilled at once; the server's, server.py), sampling
(sampling.py) and the prompt processor (processor.py: prompts, chat and images -> the engine's
inputs, completions -> text).

The cache itself belongs to each family (models/common/kv_cache.py and the families' modules); the
engine reads a model only through the generation hooks of models/protocol.py."""

from __future__ import annotations

import importlib

# Each name and the module that holds it, imported on first use: a tool's --help imports its argument
# module (arguments.py) without torch.
_HOME = {
    "ContinuousBatch": "continuous", "Sequence": "continuous",
    "Completion": "engine", "Engine": "engine", "GenerationError": "engine", "GenerationStats": "engine",
    "uncached_logits": "engine",
    "Processor": "processor", "PromptBatch": "processor",
    "SamplingParams": "sampling",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = ["Completion", "ContinuousBatch", "Sequence", "Engine", "GenerationError", "GenerationStats", "Processor",
           "PromptBatch", "SamplingParams", "uncached_logits"]
