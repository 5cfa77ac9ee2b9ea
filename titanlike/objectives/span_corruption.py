"""Span corruption (T5): noise spans of the encoder's input replaced by sentinels, the decoder
predicting them; the loss on the decoder's targets.

Options, [span_corruption]: mask_prob (the noise density), short_seq_prob, mean_noise_span_length
and decoder_seq_len (the decoder's tokens per sample; training.seq_len is the encoder's). The
samples are built by titanlike/data/span_corruption.py.
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
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class SpanCorruptionOptions:
    mask_prob: float = opt(
        0.15, "the fraction of a sample's tokens replaced by noise spans, T5's noise density (Megatron's --mask-prob)")
    short_seq_prob: float = opt(
        0.1, "the probability that a sample is built shorter than training.seq_len (and padded), so the model "
        "also sees short inputs (Megatron's --short-seq-prob)")
    mean_noise_span_length: float = opt(3.0, "the mean length of a noise span")
    decoder_seq_len: int = opt(
        128, "decoder tokens per sample; training.seq_len is the encoder's (Megatron's --decoder-seq-length)")

    def check(self) -> None:
        check_fraction("span_corruption.mask_prob", self.mask_prob, exclusive=True)
        check_fraction("span_corruption.short_seq_prob", self.short_seq_prob, exclusive=False)
        if self.mean_noise_span_length < 1:
            raise ValueError(f"span_corruption.mean_noise_span_length must be at least 1, got "
                             f"{self.mean_noise_span_length}")
        if self.decoder_seq_len < 2:
            raise ValueError(f"span_corruption.decoder_seq_len must be at least 2, got {self.decoder_seq_len}")


register_section("span_corruption", SpanCorruptionOptions,
                 renamed={"training.mask_prob": "mask_prob", "training.short_seq_prob": "short_seq_prob",
                          "training.mean_noise_span_length": "mean_noise_span_length",
                          "training.decoder_seq_len": "decoder_seq_len"})


class SpanCorruption(PaddedSamples):
    name = "span_corruption"

    def __init__(self, options: SpanCorruptionOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.options = options or SpanCorruptionOptions()

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs) -> SpanCorruption:
        return cls(cfg.span_corruption, **compile_options(cfg))

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        self.validate_datasets(cfg)
        decoder = self.options.decoder_seq_len
        if decoder % dims.tp:
            raise ValueError(f"span_corruption.decoder_seq_len {decoder} must be divisible by tensor_parallel_degree "
                             f"{dims.tp} (sequence parallelism cuts the decoder's sequence too)")
        self.validate_packing(cfg, model=model)

    def model_args(self, args, *, vocab_size: int, seq_len: int):
        """Sized with the decoder's tokens per sample too."""
        return args.update_from_config(vocab_size=vocab_size, seq_len=seq_len,
                                       decoder_seq_len=self.options.decoder_seq_len)

    def sample_fields(self, seq_len: int) -> FieldShapes:
        from titanlike.data.span_corruption import span_corruption_fields

        return span_corruption_fields(seq_len, self.options.decoder_seq_len)

    def build_source(self, sentences, tokenizer, **options):
        from titanlike.data.span_corruption import SpanCorruptionSamples

        o = self.options
        return SpanCorruptionSamples(sentences, tokenizer, decoder_seq_len=o.decoder_seq_len, mask_prob=o.mask_prob,
                                     mean_noise_span_length=o.mean_noise_span_length,
                                     short_seq_prob=o.short_seq_prob, **options)


register_family_objective(SpanCorruption.name, SpanCorruption.for_job)

__all__ = ["SpanCorruption", "SpanCorruptionOptions"]
