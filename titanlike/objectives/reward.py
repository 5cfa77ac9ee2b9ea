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
  loss = -log s(r_c - r_r) + c (r_c + r_r)^2        (c: reward.center_rewards_coefficient)
summed over pairs; the step divides once by the global pair count (count_units). Reported per
pair: the chosen and rejected scores, the margin and the accuracy (r_c > r_r), as DPO reports its
rewards; validation's accuracy is the same preference accuracy.

The labels, (batch, seq, 3) float32: the document id, 1 where a side is scored (its last token),
1 at the first position of each pair (count_units is a sum). The score of a side is one scatter_add
over the document ids. Exported to Hugging Face (checkpoint/hf.py write_hf) as the family's
sequence-classification class with num_labels 1 and the tokenizer's pad id (models/common/hf.py
HFAdapter.score_model).

Options, [reward]: center_rewards_coefficient, chat_template, packing, overlong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titanlike.checkpoint.hooks import LoadHook
from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import BatchContext, Microbatch, Objective, refuse_pretraining_options
from titanlike.objectives.preference import DPO, document_sums
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees

DOCUMENT, SCORED, PAIR_START = range(3)


@dataclass
class RewardOptions:
    center_rewards_coefficient: float = opt(0.0, "weight of the mean squared sum of a pair's scores added to the "
                                            "loss, which centers the rewards on 0 (TRL's; 0: off)")
    chat_template: str = opt("auto", "as sft.chat_template: auto, tokenizer, llama3, chatml, or a Jinja file")
    packing: bool = opt(True, "pack several pairs into each sample (best-fit decreasing over whole pairs); off: one "
                        "pair per sample")
    overlong: str = opt("truncate", "a pair longer than training.seq_len positions has both answers shortened to fit "
                        "(the prompt is kept), or is dropped; both are counted in the log", choices=("truncate", "drop"))


register_section("reward", RewardOptions)


def reward_labels(targets: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """The (batch, seq, 3) labels of pair-structured samples whose sides are whole (module docstring)."""
    labels = torch.zeros(*targets.shape, 3, dtype=torch.float32, device=targets.device)
    labels[..., DOCUMENT] = documents.float()
    has_answer = document_sums((targets != IGNORE_INDEX).float(), documents).gather(1, documents) > 0
    last = torch.ones_like(documents, dtype=torch.bool)
    last[:, :-1] = documents[:, 1:] != documents[:, :-1]
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    labels[..., SCORED] = (last & has_answer).float()
    # The padding document (even, like a chosen side) has no answer tokens.
    labels[..., PAIR_START] = (first & (documents % 2 == 0) & has_answer).float()
    return labels


def pair_scores(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, valid), each (batch, slots / 2): the scores of every pair slot's sides."""
    scores = logits_of(output)[..., 0].float()
    documents = labels[..., DOCUMENT].long()
    sides = document_sums(scores * labels[..., SCORED], documents)
    with torch.no_grad():
        valid = document_sums(labels[..., PAIR_START], documents)[:, 0::2] > 0
    return sides[:, 0::2], sides[:, 1::2], valid


class RewardModel(Objective):
    name = "reward"
    attention_mask = "a document mask"
    # The head's output is one score, not logits over a vocabulary: the plan gathers nothing else.
    vocab_parallel_loss = False
    reported_terms = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, options: RewardOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.options = options or RewardOptions()
        self._reports: torch.Tensor | None = None
        self._recording = True

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> RewardModel:
        if family_objective is not None and not family_objective.predicts_next_token:
            raise ValueError(f"training.objective reward puts a scalar head on a decoder; {model} trains with "
                             f"{family_objective.name}")
        if args.moe_args() is not None or args.lookahead_tokens:
            what = "mixture-of-experts" if args.moe_args() is not None else "multi-token prediction"
            raise ValueError(f"training.objective reward does not train {what} models ({model}): their auxiliary "
                             "losses are counted per token, a reward model's per pair")
        return cls(cfg.reward, **cls.compile_options(cfg))

    def model_args(self, args):
        return args.with_score_head()

    def load_hooks(self) -> tuple[NewScoreHead]:
        return (NewScoreHead(),)

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        if self.options.center_rewards_coefficient < 0:
            raise ValueError(f"reward.center_rewards_coefficient must be at least 0, got "
                             f"{self.options.center_rewards_coefficient}")
        refuse_pretraining_options(cfg, "reward")
        if dims.cp > 1:
            raise ValueError("training.objective reward scores each side at its last token, which context "
                             "parallelism would put on one rank only; set parallelism.context_parallel_degree 1")

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import check_row_dataset

        check_row_dataset(dataset, dataset_path, option=option, objective="reward", files="preference files",
                          contents="the preference pairs")

    def validate_held_out(self, dataset: str) -> None:
        """Pairs are held out by training.split, whatever the files."""

    # Samples ----------------------------------------------------------------------------------

    sample_fields = DPO.sample_fields

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.preferences import preference_samples
        from titanlike.objectives.sft import pad_id

        self.validate_dataset(dataset, dataset_path)
        return preference_samples(self.options, "reward", dataset_path=dataset_path, tokenizer=tokenizer, seq_len=seq_len,
                                  split=split, split_name=split_name, end_id=pad_id(tokenizer))

    # Batch ------------------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, targets = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        documents = batch["document_ids"].to(ctx.device)
        mask = DocumentMask.from_document_ids(documents, ctx.mask_kernel)
        return Microbatch(inputs, reward_labels(targets, documents), positions=mask.positions, mask=mask)

    # Loss -------------------------------------------------------------------------------------

    def count_units(self, labels: torch.Tensor) -> torch.Tensor:
        return labels[..., PAIR_START].sum()

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        chosen, rejected, valid = pair_scores(output, labels)
        margin = chosen - rejected
        per_pair = -F.logsigmoid(margin)
        if self.options.center_rewards_coefficient:
            per_pair = per_pair + self.options.center_rewards_coefficient * (chosen + rejected) ** 2
        zero = torch.zeros((), device=per_pair.device)
        total = torch.where(valid, per_pair, zero).sum()
        if self._recording:
            with torch.no_grad():
                reports = torch.stack([torch.where(valid, v, zero).sum() for v in (
                    chosen, rejected, margin, (margin > 0).float())])
                self._reports = reports if self._reports is None else self._reports + reports
        return total

    def count_correct(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Validation's accuracy: the pairs whose chosen side scores higher."""
        with torch.no_grad():
            chosen, rejected, valid = pair_scores(logits_of(output).detach(), labels)
            return (valid & (chosen > rejected)).sum().float()

    reports_paused = DPO.reports_paused
    collect_reports = DPO.collect_reports


class NewScoreHead(LoadHook):
    """A reward model started from a language model (an SFT run's checkpoint or export): every tensor
    but the output projection, whose one-score head (another shape) starts from its initialization."""

    def fresh(self, key: str, saved_args) -> bool:
        return saved_args is not None and not saved_args.has_score_head

    def saved_args(self, job_args, saved_args):
        return saved_args if saved_args.has_score_head else saved_args.with_score_head()


register_objective("reward", RewardModel.for_job, section="reward")

__all__ = ["RewardModel", "RewardOptions", "pair_scores", "reward_labels"]
