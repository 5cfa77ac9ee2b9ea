"""Next-token prediction on packed token windows: the objective of every decoder (GPT, Llama, ...).

Samples are windows of seq_len + 1 tokens of the dataset kind's packed documents (inputs =
window[:-1], labels = window[1:]). Its options are the [training] section's document_masking
(attend within documents, positions restart at each) and eod_mask_loss (no target after an end of
document), and its own [fim] section: Fill-in-the-Middle rearranging of the samples (data/fim.py); a model
that predicts several tokens ahead (args.lookahead_tokens > 0) also gets the lookahead targets of
multi-token prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import (BatchContext, FieldShapes, Microbatch, Objective, compile_options,
                                       cut_sequence, target_count)
from titanlike.objectives.padded import check_fraction
from titanlike.objectives.registry import register_family_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class FimOptions:
    """Megatron-LM's --fim-* options (its GPTFIMDataset); the special tokens by their text."""

    rate: float = opt(0.0, "the probability that a pre-training sample is rearranged for Fill-in-the-Middle "
                      "(Megatron's --fim-rate); 0 turns FIM off")
    spm_rate: float = opt(0.5, "the probability that a rearranged sample is SPM (<PRE> <SUF> suffix <MID> prefix "
                          "middle) rather than PSM (<PRE> prefix <SUF> suffix <MID> middle) (Megatron's --fim-spm-rate)")
    prefix_token: str = opt("<fim_prefix>", "the token before the prefix, by its text")
    middle_token: str = opt("<fim_middle>", "the token before the middle, by its text")
    suffix_token: str = opt("<fim_suffix>", "the token before the suffix, by its text")
    pad_token: str = opt("<fim_pad>", "the token that pads a rearranged sample back to its length, by its text")
    eod_token: str = opt("", "the end-of-document token samples are cut at, by its text; empty: the tokenizer's "
                         "EOS (what preprocess_data.py --append-eod appends)")
    split_sample: str = opt("", "a token, by its text, at which a sample is split into fragments each rearranged "
                            "alone (with fim.fragment_rate), e.g. a file separator in samples of whole repositories")
    fragment_rate: float | None = opt(None, "the probability that each fragment is rearranged, with "
                                      "fim.split_sample (Megatron's --fim-fragment-rate)")
    no_prefix: str = opt("", "leave a piece whose text starts with this string as it is; empty: none (Megatron's "
                         "--fim-no-prefix)")

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def check(self) -> None:
        check_fraction("fim.rate", self.rate, exclusive=False)
        check_fraction("fim.spm_rate", self.spm_rate, exclusive=False)
        if self.fragment_rate is not None:
            check_fraction("fim.fragment_rate", self.fragment_rate, exclusive=False)
        if self.split_sample and self.fragment_rate is None:
            raise ValueError("fim.split_sample needs fim.fragment_rate, the probability that each fragment is rearranged")
        if self.fragment_rate is not None and not self.split_sample:
            raise ValueError("fim.fragment_rate is read only with fim.split_sample; set both or neither")


register_section("fim", FimOptions)


class CausalLM(Objective):
    name = "causal_lm"
    generation = "text"

    def __init__(self, *, document_masking: bool = False, eod_mask_loss: bool = False, fim: FimOptions | None = None,
                 **loss_options):
        super().__init__(**loss_options)
        self.document_masking = document_masking
        self.eod_mask_loss = eod_mask_loss
        self.attention_mask = "a document mask" if document_masking else None
        self.fim = fim if fim is not None and fim.enabled else None

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs) -> CausalLM:
        t = cfg.training
        return cls(document_masking=t.document_masking, eod_mask_loss=t.eod_mask_loss, fim=cfg.fim,
                   **compile_options(cfg))

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        if self.fim is None:
            return
        from titanlike.config.sections import dataset_kind_rules

        # Sample i draws from its own random stream (data/fim.py), which a stream without indices has not.
        rules = dataset_kind_rules()
        v = cfg.validation
        for option, dataset in (("training", cfg.training.dataset), ("validation", v.dataset if v.enable else None)):
            rule = rules.get(dataset) if dataset is not None else None
            if rule is not None and rule.streaming:
                raise ValueError(f"fim.rate is set, but {option}.dataset {dataset} is a stream; FIM draws each sample's "
                                 "cuts from its index, so it needs indexed data: megatron (as Megatron-LM's "
                                 "GPTFIMDataset), text or the embedded corpus")

    def _check_tokenizer(self, tokenizer) -> None:
        if self.fim is not None:
            self._fim_tokens(tokenizer)

    def _fim_tokens(self, tokenizer):
        from titanlike.data.fim import fim_token_ids

        f = self.fim
        return fim_token_ids(tokenizer, prefix=f.prefix_token, middle=f.middle_token, suffix=f.suffix_token,
                             pad=f.pad_token, eod=f.eod_token, split=f.split_sample)

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        return {"inputs": tokens, "labels": tokens}

    def samples(self, dataset: str, **source_args):
        from titanlike.data.loader import GlobalSamples, window_samples

        samples = window_samples(dataset, **source_args)
        if self.fim is None:
            return samples
        from titanlike.data.fim import FimSamples, FimTransform

        f, tokenizer = self.fim, source_args["tokenizer"]
        transform = FimTransform(tokenizer, self._fim_tokens(tokenizer), rate=f.rate, spm_rate=f.spm_rate,
                                 fragment_rate=f.fragment_rate, no_prefix=f.no_prefix)
        # Megatron's seed: the one its GPT dataset shuffles with (training's and validation's alike).
        return GlobalSamples(FimSamples(samples.source, transform, source_args["seed"]), shuffle=samples.shuffle)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, labels = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        raw_labels = labels
        if self.eod_mask_loss:
            labels = labels.masked_fill(inputs == ctx.eos_id, IGNORE_INDEX)
        mb = Microbatch(inputs, {"labels": labels}, target_count(labels), positions=ctx.cp_positions)
        if self.document_masking:
            mb.mask = DocumentMask.from_tokens(inputs, ctx.eos_id, ctx.mask_kernel)
            mb.positions = mb.mask.positions
        if ctx.lookahead_tokens:
            mb.lookahead = lookahead_targets(raw_labels, labels, ctx.lookahead_tokens,
                                             mb.mask.document_ids if mb.mask is not None else None)
        if ctx.cp_positions is not None:
            # Every cp rank of a data-parallel group got the same samples; each keeps its slice
            # before counting, so the token count summed over the loss mesh (which includes cp) is exact.
            labels = cut_sequence(labels, ctx)
            mb.inputs, mb.targets, mb.units = cut_sequence(inputs, ctx), {"labels": labels}, target_count(labels)
            if self.document_masking:
                mb.positions = cut_sequence(mb.positions, ctx)
            if mb.lookahead is not None:
                mb.lookahead = cut_sequence(mb.lookahead, ctx)
        return mb


def lookahead_targets(raw_labels: torch.Tensor, labels: torch.Tensor, depth: int,
                      document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """What multi-token prediction reads, (batch, seq, depth, 2) int64, from a microbatch's labels
    over the whole sequence (before any context-parallel cut: later tokens may live on another rank).

    For depth k (1-based) at position i: [..., k-1, 0] is the token t(i+k) the k-th prediction module
    embeds (raw_labels[i+k-1]: the labels before eod_mask_loss, which hides targets but not tokens;
    0 past the window), and [..., k-1, 1] the token it predicts, t(i+k+1) = labels[i+k], or
    IGNORE_INDEX past the window, where labels hides it, and (with document_ids, the documents of the
    input tokens under document masking) where t(i+k) belongs to another document than position i:
    a prediction never reaches into the next packed document.
    """
    batch, seq = labels.shape
    inputs = torch.zeros(batch, seq, depth, dtype=torch.long, device=labels.device)
    targets = torch.full((batch, seq, depth), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    for k in range(1, depth + 1):
        if k - 1 < seq:
            inputs[:, : seq - k + 1, k - 1] = raw_labels[:, k - 1:]
        if k < seq:
            target = labels[:, k:]
            if document_ids is not None:
                target = target.masked_fill(document_ids[:, k:] != document_ids[:, :-k], IGNORE_INDEX)
            targets[:, : seq - k, k - 1] = target
    return torch.stack([inputs, targets], dim=-1)


register_family_objective(CausalLM.name, CausalLM.for_job, section="fim")

__all__ = ["CausalLM", "FimOptions", "lookahead_targets"]
