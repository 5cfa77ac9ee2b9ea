"""Preference optimization: DPO and its variants (IPO, hinge, robust DPO, reference-free SimPO).

Chosen by `training.objective dpo` for any family whose own objective predicts the next token.
Samples are preference pairs (titanlike/data/preferences.py): the chosen and the rejected answer of
a pair are two adjacent documents of one sample (document ids 2k and 2k + 1), so a pair is always
whole in one microbatch on one rank.

The loss of a pair needs the summed log-probability of each answer under the policy and under the
reference. Its targets, each (batch, seq): `labels` (int64, the target token, IGNORE_INDEX where not
an answer token), `document_ids` (int64, which pair and which side), `pair_start` (bool, the first
position of each pair: "count the pairs" is a sum, Microbatch.units) and `ref_logps` (float32, the
reference log-probability of the target, 0 where not trained; added before the step by the reference
companion, or read from the data when precomputed; absent for SimPO, which has no reference).
Per-token log-probabilities are -cross_entropy(reduction="none"), which torch's loss_parallel also
computes on logits split over the vocabulary; they are summed per document with one scatter_add over
the document ids, and the loss is a sum over pairs: the step divides it once by the global pair
count, like the token count of a language-model loss.

Per pair, with x_c = log pi(chosen) - log ref(chosen), x_r likewise and d = x_c - x_r (TRL's
DPOTrainer and CPOTrainer, trl 1.16, tests/unit/test_preference.py compares):
  sigmoid  -(1 - e) log s(b d) - e log s(-b d)    (e: label_smoothing; e = 0 is DPO, e > 0 conservative
                                                   DPO, which TRL 1.16's DPOTrainer ignores e for)
  robust   (-(1 - e) log s(b d) + e log s(-b d)) / (1 - 2 e)
  hinge    relu(1 - b d)
  ipo      (x_c / n_c - x_r / n_r - 1 / (2 b))^2  (n: the answer's tokens)
  simpo    sigmoid on m = log pi(chosen) / n_c - log pi(rejected) / n_r - gamma / b: no reference
Rewards: b x (b x the mean log-probability for SimPO); reported per pair: chosen, rejected, margin
and accuracy (chosen rewarded more than rejected).

The reference (`dpo.reference`; `auto`, the default, chooses as TRL's DPOTrainer does on a PEFT
model: `adapters` for LoRA adapters that start fresh (no lora.modules_to_save), `model` for a
pretrained adapter, lora.adapter_path, whose frozen copy TRL keeps as its "ref" adapter; `model`
otherwise): `model`, a frozen copy of the policy as the run started (the same plan and layout,
parallelized like it; its weights copied from the policy before the first step, or, in a resumed run,
rebuilt from the initialization and checkpoint.initial_load_path); or `adapters`, the policy itself
with its LoRA adapters switched off (training LoRA: the base is the reference).
It is a companion (objectives/companion.py): its forward runs when a microbatch is prepared, before
the step, so the step stays a function of its microbatches; under pipeline parallelism it runs through
a forward-only schedule of its own stages, and its log-probabilities join the targets on the last
stage, where the loss runs.
Under context parallelism each rank holds some positions of every pair: the per-document sums are
completed over the cp ranks (an all-reduce whose backward passes the gradient through), every cp
rank computes every pair's loss, reports 1/cp of it and differentiates all of it. Or `precomputed`:
for a model too large to hold twice, the reference's log-probabilities computed in one pass before
training (scripts/precompute_reference.py: the model the job starts from, each side of each pair
alone, every answer token's log-probability written into the row as ref_chosen_logps /
ref_rejected_logps) travel with the samples (field reference_logps, along the positions) and become
the `ref_logps` target in `prepare`; no reference model is built. A summed value per side
(TRL's precomputed form) is accepted too, placed on the answer's first token, since the loss only
sums the channel per answer.

Options, [dpo]: beta, loss_type, label_smoothing, simpo_gamma, reference, chat_template, packing,
overlong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.dtensor import is_dtensor
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import (BatchContext, FieldShapes, LossTerms, Microbatch, Objective, compile_options,
                                       cut_sequence, refuse_pretraining_options)
from titanlike.objectives.companion import Companion, Source, Targets
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


@dataclass
class DPOOptions:
    beta: float = opt(0.1, "the strength of the KL penalty toward the reference (SimPO: the reward scale)")
    loss_type: str = opt("sigmoid", "sigmoid (DPO), ipo, hinge, robust (robust DPO, with label_smoothing), or simpo "
                         "(reference-free, length-normalized, with simpo_gamma)", choices=LOSS_TYPES)
    label_smoothing: float = opt(0.0, "the assumed probability that a pair's preference is flipped, in [0, 0.5): "
                                 "robust DPO for robust; conservative DPO for sigmoid and simpo, as TRL's CPOTrainer "
                                 "and DPOTrainer before 1.0, not TRL 1.16's DPOTrainer, which ignores it for sigmoid "
                                 "(leave it 0 to match that)")
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin (loss_type simpo only)")
    reference: str = opt("auto", "auto: TRL's choice, adapters when LoRA adapters start fresh (no "
                         "modules_to_save), model when lora.adapter_path loads a pretrained adapter (TRL's copy "
                         "of it), else model; model: a frozen copy of the policy as training starts (a "
                         "pretrained adapter included), sharded like it; adapters: the policy with its LoRA "
                         "adapters off, the base (needs the lora converter); "
                         "precomputed: the ref_chosen_logps / ref_rejected_logps of each row "
                         "(scripts/precompute_reference.py), no reference forward; unused by simpo",
                         choices=("auto", "model", "adapters", "precomputed"))
    chat_template: str = opt("auto", "as sft.chat_template: auto, tokenizer, llama3, chatml, a published "
                             "template's name (gemma3, ...), or a Jinja file")
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
    if is_dtensor(logp):
        logp = logp.full_tensor()
    return logp.view(targets.shape)


def document_sums(values: torch.Tensor, documents: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    """(batch, slots) sums of per-token values over each document id; slots is even and above any id
    of a sample of seq_len positions (a document holds at least one; default: documents' length)."""
    s = documents.shape[1] if seq_len is None else seq_len
    slots = s + 2 - s % 2
    return torch.zeros(documents.shape[0], slots, dtype=values.dtype, device=values.device).scatter_add(
        1, documents, values)


def pair_starts(trained: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: the first position of each pair, a chosen (even) document with trained tokens
    (the padding document, also even, has none). trained: (batch, seq) bool, the positions a side is
    trained or scored on."""
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    has = document_sums(trained.float(), documents).gather(1, documents) > 0
    return first & (documents % 2 == 0) & has


class PairObjective(Objective):
    """What DPO and reward models share: samples of preference pairs (chosen = document 2k, rejected =
    2k + 1 of one sample, so a pair is whole in one microbatch on one rank; titanlike/data/preferences.py),
    their rules, and the pair count as the loss's units. Subclasses build their targets (`pair_targets`)
    and their loss."""

    attention_mask = "a document mask"
    reported_terms = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, options, *, holds_out: bool = True, **loss_options):
        """holds_out: leave training.split's held-out pairs out of training (validation reads them:
        data/conversations.py held_out_for_validation; for_job turns it off when validation does not
        read them, so that every pair is trained on)."""
        super().__init__(**loss_options)
        self.options = options
        self.holds_out = holds_out

    @classmethod
    def refuse(cls, args: BaseModelArgs, family_objective: Objective | None, *, model: str, what: str) -> None:
        """ValueError (one sentence) for a family or model a pair objective cannot train: `what` says
        what the objective does to the model."""
        if family_objective is not None and family_objective.generation is None:
            raise ValueError(f"training.objective {cls.name} {what}; {model} trains with {family_objective.name}")
        if args.moe_args() is not None or args.lookahead_tokens:
            kind = "mixture-of-experts" if args.moe_args() is not None else "multi-token prediction"
            raise ValueError(f"training.objective {cls.name} does not train {kind} models yet ({model}): their "
                             f"auxiliary losses are counted per token, {cls.name}'s per pair")

    def _check_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import check_row_dataset

        check_row_dataset(dataset, dataset_path, option=option, objective=self.name, files="preference files",
                          contents="the preference pairs")

    def _check_held_out(self, dataset: str) -> None:
        """Pairs are held out by training.split, whatever the files."""

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        refuse_pretraining_options(cfg, self.name)
        super()._validate_job(cfg, dims, model=model)

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        return {"inputs": tokens, "labels": tokens, "document_ids": tokens}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train", **pair_options):
        from titanlike.data.preferences import preference_samples

        self._check_dataset(dataset, dataset_path)
        return preference_samples(self.options, self.name, dataset_path=dataset_path, tokenizer=tokenizer,
                                  seq_len=seq_len, split=split, split_name=split_name, holds_out=self.holds_out,
                                  **pair_options)

    def pair_targets(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Targets:
        """The loss's targets of a loader microbatch, over whole sequences (prepare cuts them)."""
        raise NotImplementedError

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs = batch["inputs"].to(ctx.device)
        documents = batch["document_ids"].to(ctx.device)
        mask = DocumentMask.from_document_ids(documents, ctx.mask_kernel)
        targets = self.pair_targets(batch, ctx)
        # Every cp rank keeps the ids of the whole sequence in its mask (its attention picks its rows)
        # and cuts the rest; the loss completes each pair's sums over the cp ranks.
        targets = {name: cut_sequence(value, ctx) for name, value in targets.items()}
        # After the cut: each pair's start lies on one cp rank, so the world's sum counts it once.
        units = targets["pair_start"].sum()
        return Microbatch(cut_sequence(inputs, ctx), targets, units, positions=cut_sequence(mask.positions, ctx),
                          mask=mask)


@dataclass
class PairTerms:
    """Per pair slot (batch, slots / 2): the loss and the rewards, and which slots hold a pair."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    valid: torch.Tensor


def pair_terms(options: DPOOptions, logps: torch.Tensor, targets: Targets, ctx: BatchContext) -> PairTerms:
    """The loss of every pair of the targets (module docstring), from per-token policy log-probs.
    Under context parallelism the targets hold this rank's positions: the per-document sums are
    completed over the cp ranks, and every cp rank computes every pair's terms."""
    o = options
    documents = targets["document_ids"]
    seq_len = documents.shape[1] * ctx.cp_degree
    trained = (targets["labels"] != IGNORE_INDEX).float()
    policy = document_sums(logps, documents, seq_len)
    reference = targets.get("ref_logps")
    with torch.no_grad():
        sides = torch.stack([document_sums(v, documents, seq_len) for v in (
            trained, targets["pair_start"].float(), torch.zeros_like(logps) if reference is None else reference)])
    policy, sides = ctx.cp_sum(policy), ctx.cp_sum(sides)
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


def pair_reports(chosen: torch.Tensor, rejected: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The reported terms of pair objectives (PairObjective.reported_terms), summed over the valid pairs."""
    with torch.no_grad():
        zero = torch.zeros((), device=chosen.device)
        margin = chosen - rejected
        return torch.stack([torch.where(valid, v, zero).sum() for v in (chosen, rejected, margin,
                                                                         (margin > 0).float())])


def reference_logps(output, targets: Targets) -> Targets:
    """What the reference companion adds: the log-probability of every target token."""
    return {"ref_logps": token_logps(logits_of(output), targets["labels"])}


class DPO(PairObjective):
    name = "dpo"
    generation = "chat"  # pairs are rendered with the chat template (titanlike/data/preferences.py)

    def __init__(self, options: DPOOptions | None = None, *, reference_source: str | None = None, **loss_options):
        """reference_source: the checkpoint the job starts from (its reference's model), which a precomputed
        reference must have been computed with (reference_fingerprint)."""
        super().__init__(options or DPOOptions(), **loss_options)
        self.reference_source = reference_source

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> DPO:
        from titanlike.checkpoint.manager import initial_load_path
        from titanlike.data.conversations import held_out_for_validation

        cls.refuse(args, family_objective, model=model, what="trains models that predict the next token")
        options = cfg.dpo
        if options.reference == "auto":
            # TRL's DPOTrainer on a PEFT model: a new adapter's reference is the base (adapters disabled), a
            # pretrained adapter's a frozen copy of it (its "ref" adapter).
            # Modules trained in full beside the adapters stay trained with the adapters off: a copy then.
            lora = "lora" in cfg.model.converters
            fresh = lora and not cfg.lora.adapter_path and not cfg.lora.modules_to_save
            options = dataclasses.replace(options, reference="adapters" if fresh else "model")
        return cls(options, reference_source=initial_load_path(cfg.checkpoint, cfg.model.hf_assets_path),
                   holds_out=held_out_for_validation(cfg), **compile_options(cfg))

    @property
    def uses_reference(self) -> bool:
        return self.options.loss_type != "simpo"

    @property
    def precomputed(self) -> bool:
        """The reference's log-probabilities come with the data (sample field reference_logps)."""
        return self.uses_reference and self.options.reference == "precomputed"

    @property
    def companions(self) -> tuple[Companion, ...]:
        if not self.uses_reference or self.precomputed:
            return ()
        adapters = self.options.reference == "adapters"
        return (Companion("reference", f"dpo.reference {self.options.reference}",
                          Source.POLICY if adapters else Source.FROZEN_COPY, reference_logps, converters_off=adapters),)

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        o = self.options
        if o.beta <= 0:
            raise ValueError(f"dpo.beta must be positive, got {o.beta}")
        if not 0 <= o.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must lie in [0, 0.5), got {o.label_smoothing}")
        if o.label_smoothing and o.loss_type in ("ipo", "hinge"):
            raise ValueError(f"dpo.label_smoothing applies to the sigmoid, robust and simpo losses, not dpo.loss_type "
                             f"{o.loss_type}; remove it")
        super()._validate_job(cfg, dims, model=model)
        if self.uses_reference and o.reference == "adapters" and "lora" not in cfg.model.converters:
            raise ValueError("dpo.reference adapters is the policy without its LoRA adapters, so it needs "
                             "model.converters lora")

    def sample_fields(self, seq_len: int) -> FieldShapes:
        fields = super().sample_fields(seq_len)
        if self.precomputed:
            fields["reference_logps"] = ((seq_len,), "float32")
        return fields

    def samples(self, dataset: str, **source_args):
        if not self.precomputed:
            return super().samples(dataset, reference=False, **source_args)
        fingerprint = reference_fingerprint(self.reference_source, source_args["tokenizer"])
        return super().samples(dataset, reference=True, fingerprint=fingerprint, **source_args)

    def pair_targets(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Targets:
        labels, documents = batch["labels"].to(ctx.device), batch["document_ids"].to(ctx.device)
        targets = {"labels": labels, "document_ids": documents,
                   "pair_start": pair_starts(labels != IGNORE_INDEX, documents)}
        if self.precomputed:
            targets["ref_logps"] = batch["reference_logps"].to(ctx.device, torch.float32)
        return targets

    def loss(self, output, targets: Targets, ctx: BatchContext, *, correct: bool = False) -> LossTerms:
        logps = token_logps(logits_of(output), targets["labels"])
        terms = pair_terms(self.options, logps, targets, ctx)
        valid = terms.valid
        total = torch.where(valid, terms.loss, torch.zeros((), device=logps.device)).sum()
        cp = ctx.cp_degree
        if cp > 1:
            # Every cp rank holds every pair's loss: each reports 1/cp of it (the step's sum over the
            # world counts it once) and differentiates all of it (its own positions' share).
            total = total / cp + (total - total.detach()) * (1 - 1 / cp)
        reports = pair_reports(terms.chosen_rewards, terms.rejected_rewards, valid) / cp
        right = (valid & (terms.chosen_rewards > terms.rejected_rewards)).sum().float() / cp if correct else None
        return LossTerms(total, reports, right)


def reference_fingerprint(source: str | None, tokenizer) -> str | None:
    """A digest of the reference's model (checkpoint `source`, format.model_fingerprint) and the
    tokenizer: scripts/precompute_reference.py records it in every row it writes, and a DPO job with
    dpo.reference precomputed refuses rows of another (None: the job starts from no checkpoint)."""
    import hashlib

    from titanlike.checkpoint.format import model_fingerprint

    if source is None:
        return None
    return hashlib.sha256(f"{model_fingerprint(source)}:{tokenizer.fingerprint}".encode()).hexdigest()[:16]


register_objective("dpo", DPO.for_job, section="dpo")

__all__ = ["DPO", "DPOOptions", "LOSS_TYPES", "PairObjective", "PairTerms", "document_sums", "pair_reports",
           "pair_starts", "pair_terms", "reference_fingerprint", "reference_logps", "token_logps"]
