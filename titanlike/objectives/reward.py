"""Reward models: a scalar head on a decoder, trained with the Bradley-Terry loss on preference pairs.

Chosen by `training.objective reward` for any family whose own objective predicts the next token
and whose args can take a scalar head (BaseModelArgs.with_score_head: the output projection gives
one score per position instead of the vocabulary's logits). Samples are the preference pairs of
DPO (titanlike/data/preferences.py: chosen = document 2k, rejected = 2k + 1 of one sample, so a pair
is always whole in one microbatch on one rank), each side rendered whole: a reward model scores a
sequence at its last token, as transformers' `...ForSequenceClassification` does (the score at the
last token that is not padding), so every rendered token is an input (tokenize_pairs' end_id).

Per pair, with r_c and r_r the scores at the last token of the chosen and the rejected side (TRL's
RewardTrainer, trl 1.16, tests/unit/test_reward_model.py compares):
  loss = -log s(r_c - r_r - m) + c (r_c + r_r)^2    (c: reward.center_rewards_coefficient; m: the
                                                    row's `margin`, 0 without one, as TRL reads it)
summed over pairs; the step divides once by the global pair count (Microbatch.units). Reported per
pair: the chosen and rejected scores, the margin and the accuracy (r_c > r_r), as DPO reports its
rewards; validation's accuracy is the same preference accuracy.

Its targets, each (batch, seq): `document_ids` (int64), `scored` (bool, a side's last token) and
`pair_start` (bool, the first position of each pair: the pair count is a sum) and, when the rows have
a `margin` column, `margins` (float32, each pair's margin at its chosen side's first position, 0
elsewhere: the sample field of data/preferences.py). The score of a side is
one scatter_add over the document ids. Exported to Hugging Face (checkpoint/format.py write_hf) as the family's
sequence-classification class with num_labels 1 and the tokenizer's pad id (models/common/hf.py
HFAdapter.score_model).

Options, [reward]: center_rewards_coefficient, chat_template, packing, overlong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import BatchContext, LossTerms, Objective, compile_options
from titanlike.objectives.companion import Targets
from titanlike.objectives.preference import PairObjective, document_sums, pair_reports, pair_starts
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class RewardOptions:
    center_rewards_coefficient: float = opt(0.0, "weight of the mean squared sum of a pair's scores added to the "
                                            "loss, which centers the rewards on 0 (TRL's; 0: off)")
    chat_template: str = opt("auto", "as sft.chat_template: auto, tokenizer, llama3, chatml, a published "
                             "template's name (gemma3, ...), or a Jinja file")
    packing: bool = opt(True, "pack several pairs into each sample (best-fit decreasing over whole pairs); off: one "
                        "pair per sample")
    overlong: str = opt("truncate", "a pair longer than training.seq_len positions has both answers shortened to fit "
                        "(the prompt is kept), or is dropped; both are counted in the log", choices=("truncate", "drop"))


register_section("reward", RewardOptions)


def reward_targets(labels: torch.Tensor, documents: torch.Tensor) -> Targets:
    """The targets of pair-structured samples whose sides are whole (module docstring)."""
    has_answer = document_sums((labels != IGNORE_INDEX).float(), documents).gather(1, documents) > 0
    last = torch.ones_like(documents, dtype=torch.bool)
    last[:, :-1] = documents[:, 1:] != documents[:, :-1]
    return {"document_ids": documents, "scored": last & has_answer,
            "pair_start": pair_starts(labels != IGNORE_INDEX, documents)}


def pair_scores(output, targets: Targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, valid), each (batch, slots / 2): the scores of every pair slot's sides."""
    scores = logits_of(output)[..., 0].float()
    documents = targets["document_ids"]
    sides = document_sums(scores * targets["scored"], documents)
    with torch.no_grad():
        valid = document_sums(targets["pair_start"].float(), documents)[:, 0::2] > 0
    return sides[:, 0::2], sides[:, 1::2], valid


class RewardModel(PairObjective):
    name = "reward"
    # The head's output is one score, not logits over a vocabulary: the plan gathers nothing else.
    vocab_parallel_loss = False

    def __init__(self, options: RewardOptions | None = None, **loss_options):
        super().__init__(options or RewardOptions(), **loss_options)

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> RewardModel:
        from titanlike.data.conversations import held_out_for_validation

        cls.refuse(args, family_objective, model=model, what="puts a scalar head on a decoder")
        return cls(cfg.reward, holds_out=held_out_for_validation(cfg), **compile_options(cfg))

    def model_args(self, args, *, vocab_size: int, seq_len: int):
        return super().model_args(args, vocab_size=vocab_size, seq_len=seq_len).with_score_head()

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        if self.options.center_rewards_coefficient < 0:
            raise ValueError(f"reward.center_rewards_coefficient must be at least 0, got "
                             f"{self.options.center_rewards_coefficient}")
        super()._validate_job(cfg, dims, model=model)
        if dims.cp > 1:
            raise ValueError("training.objective reward scores each side at its last token, which context "
                             "parallelism would put on one rank only; set parallelism.context_parallel_degree 1")

    def samples(self, dataset: str, **source_args):
        from titanlike.objectives.sft import pad_id

        return super().samples(dataset, end_id=pad_id(source_args["tokenizer"]), margins=True, **source_args)

    def pair_targets(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Targets:
        targets = reward_targets(batch["labels"].to(ctx.device), batch["document_ids"].to(ctx.device))
        if "margins" in batch:
            targets["margins"] = batch["margins"].to(ctx.device, torch.float32)
        return targets

    def loss(self, output, targets: Targets, ctx: BatchContext, *, correct: bool = False) -> LossTerms:
        chosen, rejected, valid = pair_scores(output, targets)
        margin = chosen - rejected
        if "margins" in targets:  # TRL's RewardTrainer: the required margin inside the sigmoid
            margin = margin - document_sums(targets["margins"], targets["document_ids"])[:, 0::2]
        per_pair = -F.logsigmoid(margin)
        if self.options.center_rewards_coefficient:
            per_pair = per_pair + self.options.center_rewards_coefficient * (chosen + rejected) ** 2
        total = torch.where(valid, per_pair, torch.zeros((), device=per_pair.device)).sum()
        right = (valid & (chosen > rejected)).sum().float() if correct else None
        return LossTerms(total, pair_reports(chosen.detach(), rejected.detach(), valid), right)


register_objective("reward", RewardModel.for_job, section="reward")

__all__ = ["RewardModel", "RewardOptions", "pair_scores", "reward_targets"]
