"""Training objectives: each owns its options, rules, samples, batch and loss (objectives/base.py).

A model family names its default objective in its ModelSpec (`objective`, a name of
objectives/registry.py); importing this package registers every objective, its config section and
the dataset kinds it brings.
"""

from titanlike.objectives.base import BatchContext, Microbatch, Objective
from titanlike.objectives.causal_lm import CausalLM, lookahead_targets
from titanlike.objectives.masked_lm import MaskedLM, MaskedLMOptions
from titanlike.objectives.distill import Distill, DistillOptions
from titanlike.objectives.grpo import GRPO, GRPOOptions
from titanlike.objectives.image_caption import ImageCaption
from titanlike.objectives.preference import DPO, DPOOptions
from titanlike.objectives.reward import RewardModel, RewardOptions
from titanlike.objectives.sft import SFT, SFTOptions
from titanlike.objectives.span_corruption import SpanCorruption, SpanCorruptionOptions

__all__ = ["BatchContext", "CausalLM", "DPO", "DPOOptions", "Distill", "DistillOptions", "GRPO", "GRPOOptions",
           "ImageCaption", "MaskedLM", "MaskedLMOptions", "Microbatch", "Objective", "RewardModel", "RewardOptions",
           "SFT", "SFTOptions", "SpanCorruption", "SpanCorruptionOptions", "lookahead_targets"]
