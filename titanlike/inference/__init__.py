"""Text generation on titanlike models: a KV-cache engine (engine.py) and sampling (sampling.py).

The cache itself belongs to each family (models/common/kv_cache.py and the families' modules); the
engine reads a model only through the generation hooks of models/protocol.py."""

from titanlike.inference.engine import Completion, Engine, GenerationError, GenerationStats, uncached_logits
from titanlike.inference.sampling import SamplingParams

__all__ = ["Completion", "Engine", "GenerationError", "GenerationStats", "SamplingParams", "uncached_logits"]
