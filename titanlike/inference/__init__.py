"""Text generation on titanlike models: a KV-cache engine (engine.py), continuous batching on it
(continuous.py: a finished row's slot refilled at once; the server's, server.py), sampling
(sampling.py) and the prompt processor (processor.py: prompts, chat and images -> the engine's
inputs, completions -> text).

The cache itself belongs to each family (models/common/kv_cache.py and the families' modules); the
engine reads a model only through the generation hooks of models/protocol.py."""

from titanlike.inference.continuous import ContinuousBatch, Sequence
from titanlike.inference.engine import Completion, Engine, GenerationError, GenerationStats, uncached_logits
from titanlike.inference.processor import Processor, PromptBatch
from titanlike.inference.sampling import SamplingParams

__all__ = ["Completion", "ContinuousBatch", "Sequence", "Engine", "GenerationError", "GenerationStats", "Processor",
           "PromptBatch", "SamplingParams", "uncached_logits"]
