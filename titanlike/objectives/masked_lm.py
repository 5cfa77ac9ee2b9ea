"""Masked language modelling (BERT): Megatron's BERT samples from sentence-split documents, the loss
on the masked tokens; with sentence pairs, the model's sentence-order head learns from the samples'
binary labels too (its loss is the model's own, titanlike/models/bert).

Options, [masked_lm]: mask_prob and short_seq_prob (Megatron's --mask-prob, --short-seq-prob).
The samples are built by titanlike/data/masked_lm.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.objectives.base import FieldShapes, compile_options
from titanlike.objectives.padded import PaddedSamples, check_fraction
from titanlike.objectives.registry import register_family_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs


@dataclass
class MaskedLMOptions:
    mask_prob: float = opt(0.15, "the fraction of a sample's tokens that are masked (Megatron's --mask-prob)")
    short_seq_prob: float = opt(
        0.1, "the probability that a sample is built shorter than training.seq_len (and padded), so the model "
        "also sees short inputs (Megatron's --short-seq-prob)")

    def check(self) -> None:
        check_fraction("masked_lm.mask_prob", self.mask_prob, exclusive=True)
        check_fraction("masked_lm.short_seq_prob", self.short_seq_prob, exclusive=False)


register_section("masked_lm", MaskedLMOptions,
                 renamed={"training.mask_prob": "mask_prob", "training.short_seq_prob": "short_seq_prob"})


class MaskedLM(PaddedSamples):
    name = "masked_lm"
    token_fields = ("token_types",)

    def __init__(self, options: MaskedLMOptions | None = None, *, sentence_pairs: bool = False, **loss_options):
        """sentence_pairs: two segments per sample, swapped half of the time, with the binary label
        (BERT's binary head: Megatron's sentence-order prediction)."""
        super().__init__(**loss_options)
        self.options = options or MaskedLMOptions()
        self.sentence_pairs = sentence_pairs

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, sentence_pairs: bool = False) -> MaskedLM:
        return cls(cfg.masked_lm, sentence_pairs=sentence_pairs, **compile_options(cfg))

    def sample_fields(self, seq_len: int) -> FieldShapes:
        from titanlike.data.masked_lm import masked_lm_fields

        return masked_lm_fields(seq_len, self.sentence_pairs)

    def build_source(self, sentences, tokenizer, **options):
        from titanlike.data.masked_lm import MaskedLMSamples

        o = self.options
        return MaskedLMSamples(sentences, tokenizer, sentence_pairs=self.sentence_pairs, mask_prob=o.mask_prob,
                               short_seq_prob=o.short_seq_prob, **options)


register_family_objective(MaskedLM.name, MaskedLM.for_job)

__all__ = ["MaskedLM", "MaskedLMOptions"]
