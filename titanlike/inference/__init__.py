"""Text generation on titanlike models: a KV-cache engine (engine.py), continuous batching on it
(continuous.py: a finished row's slot refilled at once; the server's, server.py) and sampling (sampling.py).

The cache itself belongs to each family (models/common/kv_cache.py and the families' modules); the
engine reads a model only through the generation hooks of models/protocol.py."""

from titanlike.inference.continuous import ContinuousBatch, Sequence
from titanlike.inference.engine import Completion, Engine, GenerationError, GenerationStats, uncached_logits
from titanlike.inference.sampling import SamplingParams

__all__ = ["Completion", "ContinuousBatch", "Sequence", "Engine", "GenerationError", "GenerationStats", "SamplingParams", "uncached_logits"]
