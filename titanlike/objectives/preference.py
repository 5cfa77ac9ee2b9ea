"""Preference optimization: DPO and its variants (IPO, hinge, robust DPO, reference-free SimPO).

Chosen by `training.objective dpo` for any family whose own objective predicts the next token.
Samples are preference pairs (titanlike/data/preferences.py): the chosen and the rejected answer of
a pair are two adjacent documents of one sample (document ids 2k and 2k + 1), so a pair is always
whole in one microbatch on one rank.

The loss of a pair needs the summed log-probability of each answer under the policy and under the
reference. Everything per token travels in the labels tensor, (batch, seq, 4) float32, because the
pipeline schedule hands the loss (output, labels) only and cuts both along the batch:
  0: the target token (IGNORE_INDEX where not an answer token; exact in float32 below 2**24),
  1: the document id (which pair, which side),
  2: the reference log-probability of the target (0 where not trained; filled before the step by
     the reference's forward, or left 0 for SimPO, which has no reference),
  3: 1 at the first position of each pair, which makes "count the pairs" a sum (count_units).
Per-token log-probabilities are -cross_entropy(reduction="none"), which torch's loss_parallel also
computes on logits split over the vocabulary; they are summed per document with one scatter_add over
the document ids, and the loss is a sum over pairs: the step divides it once by the global pair
count, like the token count of a language-model loss.

Per pair, with x_c = log pi(chosen) - log ref(chosen), x_r likewise and d = x_c - x_r (TRL's
DPOTrainer and CPOTrainer, trl 1.16, tests/unit/test_preference.py compares):
  sigmoid  -(1 - e) log s(b d) - e log s(-b d)    (e: label_smoothing; e = 0 is DPO)
  robust   (-(1 - e) log s(b d) + e log s(-b d)) / (1 - 2 e)
  hinge    relu(1 - b d)
  ipo      (x_c / n_c - x_r / n_r - 1 / (2 b))^2  (n: the answer's tokens)
  simpo    sigmoid on m = log pi(chosen) / n_c - log pi(rejected) / n_r - gamma / b: no reference
Rewards: b x (b x the mean log-probability for SimPO); reported per pair: chosen, rejected, margin
and accuracy (chosen rewarded more than rejected).

The reference (`dpo.reference`): `model`, a frozen copy of the policy as the run started (the same
plan and layout, parallelized like it; its weights copied from the policy before the first step, or,
in a resumed run, rebuilt from the initialization and checkpoint.initial_load_path); or `adapters`,
the policy itself with its LoRA adapters switched off (training LoRA: the base is the reference).
Its forward runs when a microbatch is prepared (`prepare`), before the step, so the step stays a
function of its microbatches; under pipeline parallelism it runs through a forward-only schedule of
its own stages, and its log-probabilities reach the labels on the last stage, where the loss runs.
Under context parallelism each rank holds some positions of every pair: the per-document sums are
completed over the cp ranks (an all-reduce whose backward passes the gradient through), every cp
rank computes every pair's loss, reports 1/cp of it and differentiates all of it. Or `precomputed`:
for a model too large to hold twice, the reference's log-probabilities computed in one pass before
training (scripts/precompute_reference.py: the model the job starts from, each side of each pair
alone, every answer token's log-probability written into the row as ref_chosen_logps /
ref_rejected_logps) travel with the samples (field reference_logps, along the positions) and fill
the labels' reference channel in `prepare`; no reference model is built. A summed value per side
(TRL's precomputed form) is accepted too, placed on the answer's first token, since the loss only
sums the channel per answer.

Options, [dpo]: beta, loss_type, label_smoothing, simpo_gamma, reference, chat_template, packing,
overlong.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import (BatchContext, FieldShapes, Microbatch, Objective, cut_sequence,
                                       refuse_pretraining_options)
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
TARGET, DOCUMENT, REFERENCE, PAIR_START = range(4)


@dataclass
class DPOOptions:
    beta: float = opt(0.1, "the strength of the KL penalty toward the reference (SimPO: the reward scale)")
    loss_type: str = opt("sigmoid", "sigmoid (DPO), ipo, hinge, robust (robust DPO, with label_smoothing), or simpo "
                         "(reference-free, length-normalized, with simpo_gamma)", choices=LOSS_TYPES)
    label_smoothing: float = opt(0.0, "the assumed probability that a pair's preference is flipped (conservative "
                                 "DPO for sigmoid and simpo, robust DPO for robust), in [0, 0.5)")
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin (loss_type simpo only)")
    reference: str = opt("model", "model: a frozen copy of the policy as training starts, sharded like it; adapters: "
                         "the policy with its LoRA adapters off (needs the lora converter); precomputed: the "
                         "ref_chosen_logps / ref_rejected_logps of each row (scripts/precompute_reference.py), no "
                         "reference forward; unused by simpo", choices=("model", "adapters", "precomputed"))
    chat_template: str = opt("auto", "as sft.chat_template: auto, tokenizer, llama3, chatml, or a Jinja file")
    packing: bool = opt(True, "pack several pairs into each sample (best-fit decreasing over whole pairs); off: one "
                        "pair per sample")
    overlong: str = opt("truncate", "a pair longer than training.seq_len positions has both answers shortened to fit "
                        "(the prompt is kept), or is dropped; both are counted in the log", choices=("truncate", "drop"))


register_section("dpo", DPOOptions)


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(batch, seq) log-probabilities of the targets under (batch, seq, vocab) logits, 0 where the
    target is IGNORE_INDEX. Logits split over the vocabulary (a DTensor, inside loss_parallel) need
    no gather: torch's vocabulary-parallel cross-entropy computes it, and the result is replicated."""
    logp = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="none",
                            ignore_index=IGNORE_INDEX)
    if isinstance(logp, DTensor):
        logp = logp.full_tensor()
    return logp.view(targets.shape)


def document_sums(values: torch.Tensor, documents: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    """(batch, slots) sums of per-token values over each document id; slots is even and above any id
    of a sample of seq_len positions (a document holds at least one; default: documents' length)."""
    s = documents.shape[1] if seq_len is None else seq_len
    slots = s + 2 - s % 2
    return torch.zeros(documents.shape[0], slots, dtype=values.dtype, device=values.device).scatter_add(
        1, documents, values)


@dataclass
class PairTerms:
    """Per pair slot (batch, slots / 2): the loss and the rewards, and which slots hold a pair."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    valid: torch.Tensor


def pair_terms(options: DPOOptions, logps: torch.Tensor, labels: torch.Tensor, *, cp_degree: int = 1,
               cp_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PairTerms:
    """The loss of every pair of the labels' structure (module docstring), from per-token policy
    log-probs. Under context parallelism (cp_sum) the labels hold this rank's positions: the
    per-document sums are completed over the cp ranks, and every cp rank computes every pair's terms."""
    o = options
    documents = labels[..., DOCUMENT].long()
    seq_len = documents.shape[1] * cp_degree
    trained = (labels[..., TARGET] != IGNORE_INDEX).float()
    policy = document_sums(logps, documents, seq_len)
    with torch.no_grad():
        sides = torch.stack([document_sums(labels[..., channel] if channel != TARGET else trained, documents, seq_len)
                             for channel in (TARGET, PAIR_START, REFERENCE)])
    if cp_sum is not None:
        policy, sides = cp_sum(policy), cp_sum(sides)
    tokens = sides[0].clamp(min=1.0)  # empty slots stay finite
    valid = sides[1][:, 0::2] > 0
    pc, pr, nc, nr = policy[:, 0::2], policy[:, 1::2], tokens[:, 0::2], tokens[:, 1::2]
    b, e = o.beta, o.label_smoothing
    if o.loss_type == "simpo":
        chosen, rejected = pc / nc, pr / nr
        z = b * (chosen - rejected - o.simpo_gamma / b)
        loss = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)
        return PairTerms(loss, b * chosen.detach(), b * rejected.detach(), valid)
    reference = sides[2]
    xc, xr = pc - reference[:, 0::2], pr - reference[:, 1::2]
    d = b * (xc - xr)
    if o.loss_type == "sigmoid":
        loss = -(1 - e) * F.logsigmoid(d) - e * F.logsigmoid(-d)
    elif o.loss_type == "robust":
        loss = (-(1 - e) * F.logsigmoid(d) + e * F.logsigmoid(-d)) / (1 - 2 * e)
    elif o.loss_type == "hinge":
        loss = torch.relu(1 - d)
    else:  # ipo: the log-ratios averaged over the answer's tokens (TRL's, confirmed by the IPO authors)
        loss = (xc / nc - xr / nr - 1 / (2 * b)) ** 2
    return PairTerms(loss, b * xc.detach(), b * xr.detach(), valid)


class DPO(Objective):
    name = "dpo"
    attention_mask = "a document mask"
    predicts_next_token = True
    reported_terms = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, options: DPOOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.options = options or DPOOptions()
        self.reference: Callable[[Microbatch], torch.Tensor] | None = None  # set by attach
        self._reports: torch.Tensor | None = None
        self._recording = True
        self._cp_sum, self._cp_degree = None, 1  # context parallelism (attach)

    @property
    def uses_reference(self) -> bool:
        return self.options.loss_type != "simpo"

    @property
    def frozen_copies(self) -> int:
        return int(self.uses_reference and self.options.reference == "model")

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> DPO:
        if family_objective is not None and not family_objective.predicts_next_token:
            raise ValueError(f"training.objective dpo trains models that predict the next token; {model} trains "
                             f"with {family_objective.name}")
        if args.moe_args() is not None or args.lookahead_tokens:
            what = "mixture-of-experts" if args.moe_args() is not None else "multi-token prediction"
            raise ValueError(f"training.objective dpo does not train {what} models yet ({model}): their auxiliary "
                             "losses are counted per token, dpo's per pair")
        if args.vocab_size >= 2 ** 24:
            raise ValueError(f"training.objective dpo carries target ids in float32 labels, exact below 2**24; "
                             f"{model} has vocab_size {args.vocab_size}")
        return cls(cfg.dpo, **cls.compile_options(cfg))

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        o = self.options
        if o.beta <= 0:
            raise ValueError(f"dpo.beta must be positive, got {o.beta}")
        if not 0 <= o.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must lie in [0, 0.5), got {o.label_smoothing}")
        if o.label_smoothing and o.loss_type in ("ipo", "hinge"):
            raise ValueError(f"dpo.label_smoothing applies to the sigmoid, robust and simpo losses, not dpo.loss_type "
                             f"{o.loss_type}; remove it")
        refuse_pretraining_options(cfg, "dpo")
        if self.uses_reference and not self.precomputed and dims.pp > 1:
            from titanlike.parallel.pipeline import V_SCHEDULES, schedule_name

            name = schedule_name(cfg.parallelism.pipeline_parallel_schedule)
            if name in V_SCHEDULES:
                raise ValueError(f"dpo.reference {o.reference} needs a forward-only pass, which the {name} pipeline "
                                 "schedule does not have (torch's V-shaped schedules); use another schedule")
        if self.uses_reference and o.reference == "adapters" and "lora" not in cfg.model.converters:
            raise ValueError("dpo.reference adapters is the policy without its LoRA adapters, so it needs "
                             "model.converters lora")

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import check_row_dataset

        check_row_dataset(dataset, dataset_path, option=option, objective="dpo", files="preference files",
                          contents="the preference pairs")

    def validate_held_out(self, dataset: str) -> None:
        """Pairs are held out by training.split, whatever the files."""

    # Samples ----------------------------------------------------------------------------------

    @property
    def precomputed(self) -> bool:
        """The reference's log-probabilities come with the data (sample field reference_logps)."""
        return self.uses_reference and self.options.reference == "precomputed"

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        fields = {"inputs": tokens, "labels": tokens, "document_ids": tokens}
        if self.precomputed:
            fields["reference_logps"] = ((seq_len,), "float32")
        return fields

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.preferences import preference_samples

        self.validate_dataset(dataset, dataset_path)
        return preference_samples(self.options, "dpo", dataset_path=dataset_path, tokenizer=tokenizer, seq_len=seq_len,
                                  split=split, split_name=split_name, reference=self.precomputed)

    # Batch ------------------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, targets = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        documents = batch["document_ids"].to(ctx.device)
        mask = DocumentMask.from_document_ids(documents, ctx.mask_kernel)
        labels = pair_labels(targets, documents)
        if self.precomputed:
            labels[..., REFERENCE] = batch["reference_logps"].to(ctx.device, torch.float32)
        mb = Microbatch(inputs, labels, positions=mask.positions, mask=mask)
        if ctx.cp_positions is not None:
            # Every cp rank keeps the ids of the whole sequence (its attention picks its rows) and cuts
            # the rest; the loss completes each pair's sums over the cp ranks.
            mb.inputs, mb.labels = cut_sequence(inputs, ctx), cut_sequence(labels, ctx)
            mb.positions = cut_sequence(mask.positions, ctx)
            labels = mb.labels
        if self.reference is not None and self.uses_reference:
            logps = self.reference(mb)
            if logps is not None:  # (None on pipeline ranks without the last stage, where no loss runs)
                labels[..., REFERENCE] = logps
        return mb

    def attach(self, models) -> None:
        """The reference's forward (ObjectiveModels, objectives/base.py): a frozen copy of the policy or
        the policy with its adapters off; None for SimPO."""
        self._cp_sum, self._cp_degree = models.cp_sum, models.cp_degree
        if not self.uses_reference or self.precomputed:
            return
        if self.options.reference == "adapters":
            parts = models.parts
            switch = lambda: models.converters_off(parts)  # noqa: E731
        else:
            parts = models.frozen_copy()
            switch = contextlib.nullcontext

        def logps(output, labels: torch.Tensor) -> torch.Tensor:
            return token_logps(logits_of(output), labels[..., TARGET].long())

        @torch.no_grad()
        def reference(mb: Microbatch) -> torch.Tensor | None:
            modes = [part.training for part in parts]
            for part in parts:
                part.eval()
            try:
                with switch():
                    return models.forward(parts, mb, logps)
            finally:
                for part, mode in zip(parts, modes):
                    part.train(mode)

        self.reference = reference

    # Loss -------------------------------------------------------------------------------------

    def count_units(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[..., PAIR_START].sum()

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        logps = token_logps(logits_of(output), labels[..., TARGET].long())
        terms = pair_terms(self.options, logps, labels, cp_degree=self._cp_degree, cp_sum=self._cp_sum)
        valid = terms.valid
        zero = torch.zeros((), device=logps.device)
        total = torch.where(valid, terms.loss, zero).sum()
        if self._cp_degree > 1:
            # Every cp rank holds every pair's loss: each reports 1/cp of it (the step's sum over the
            # world counts it once) and differentiates all of it (its own positions' share).
            total = total / self._cp_degree + (total - total.detach()) * (1 - 1 / self._cp_degree)
        if not self._recording:
            return total
        with torch.no_grad():
            margin = terms.chosen_rewards - terms.rejected_rewards
            reports = torch.stack([torch.where(valid, v, zero).sum() for v in (
                terms.chosen_rewards, terms.rejected_rewards, margin, (margin > 0).float())]) / self._cp_degree
            self._reports = reports if self._reports is None else self._reports + reports
        return total

    def count_correct(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Validation's accuracy: the pairs whose chosen answer gets the higher reward."""
        with torch.no_grad():
            logps = token_logps(logits_of(output).detach(), labels[..., TARGET].long())
            terms = pair_terms(self.options, logps, labels, cp_degree=self._cp_degree, cp_sum=self._cp_sum)
            right = (terms.valid & (terms.chosen_rewards > terms.rejected_rewards)).sum().float()
        return right / self._cp_degree  # every cp rank counts every pair

    @contextlib.contextmanager
    def reports_paused(self):
        self._recording = False
        try:
            yield
        finally:
            self._recording = True

    def collect_reports(self, device: torch.device) -> torch.Tensor:
        reports, self._reports = self._reports, None
        return torch.zeros(len(self.reported_terms), device=device) if reports is None else reports.to(device)


def pair_labels(targets: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """The (batch, seq, 4) labels of pair-structured samples (module docstring), the reference channel 0."""
    labels = torch.zeros(*targets.shape, 4, dtype=torch.float32, device=targets.device)
    labels[..., TARGET] = targets.float()
    labels[..., DOCUMENT] = documents.float()
    # A pair starts at the first position of a chosen (even) document that has answer tokens (the
    # padding document, also even, has none).
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    trained = document_sums((targets != IGNORE_INDEX).float(), documents)
    labels[..., PAIR_START] = (first & (documents % 2 == 0) & (trained.gather(1, documents) > 0)).float()
    return labels


register_objective("dpo", DPO.for_job, section="dpo")

__all__ = ["DPO", "DPOOptions", "LOSS_TYPES", "PairTerms", "document_sums", "pair_labels",
           "pair_terms", "token_logps"]
