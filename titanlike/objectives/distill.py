"""Knowledge distillation: a student learns a frozen teacher's next-token distribution.

Chosen by `training.objective distill` for any family whose own objective predicts the next token
(the student); its samples, batch and masks are that objective's (pre-training text, the family's
causal LM), only the loss changes. The teacher (`distill.teacher`) is another checkpoint: a DCP
checkpoint with its sidecar or a Hugging Face folder, of any next-token family or size whose
vocabulary is the student's (the same tokenizer). It is built with the job's layout (FSDP, TP, its
own pipeline split over the same stages: train/model_parts.py build_frozen_model, lent by the
trainer as ObjectiveModels.other_model), frozen, and run forward-only when a microbatch is prepared,
as DPO's reference is (objectives/preference.py); what the loss needs of it travels in the labels,
which the pipeline schedule cuts along the batch like the inputs.

Per target token, with p = softmax(teacher logits / T) and q = softmax(student logits / T):
  forward  KL(p || q) = sum_v p_v (log p_v - log q_v)
  reverse  KL(q || p) = sum_v q_v (log q_v - log p_v)
as TRL's generalized_jsd_loss at beta 0 and 1 (no T^2 factor), and the loss is
  kl_weight x KL + (1 - kl_weight) x cross-entropy(student logits, target)
summed over the target tokens (the step divides once by their global count).

Top-k distillation (distill.top_k k > 0, forward KL): only the teacher's k most likely tokens of each
position are kept, with p renormalized over them, and the student's full log q at those tokens:
sum_{v in top k} p_v (log p_v - log q_v) (>= 0). The labels then hold 2k numbers per token instead
of the vocabulary, which bounds the memory the teacher's output takes.

The labels, (batch, seq, 1 + n) float32: the target (IGNORE_INDEX where not trained; exact below
2**24), then the teacher's log p: the whole vocabulary's (n = this rank's vocabulary shard under
tensor parallelism), or top-k's k log-probabilities then their k token ids.

Tensor parallelism: the logits stay split over the vocabulary (loss parallel) and are never
gathered. Softmaxes are held per shard (ShardSoftmax): the max and the sum of exponentials are
all-reduced; each rank keeps its shard of the teacher's log p in its labels; the student's KL is a
partial sum per shard completed by an all-reduce whose backward passes the gradient through, with
the normalizer's term added after it (a pass-through is exact only for what every rank reads
alike). Top-k: each rank's k best, all-gathered (k x tp candidates), then the best k; the student's
log q at those ids is read on the rank that holds each and summed over the ranks.

Context parallelism: the teacher is built with the job's context-parallel attention, so it runs on
this rank's positions of the microbatch as the student does; the KL is per position, summed like the
hard loss (tests/integration/test_post_training.py: CP2 equals one process).

Options, [distill]: teacher, loss, temperature, kl_weight, top_k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.outputs import IGNORE_INDEX, ModelOutput, logits_of
from titanlike.objectives.base import BatchContext, Microbatch, Objective
from titanlike.objectives.preference import DPO
from titanlike.objectives.registry import family_objective, register_objective
from titanlike.parallel.utils import sum_over_for_replicated_loss

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class DistillOptions:
    teacher: str = opt("", "the teacher: a titanlike DCP checkpoint (or a folder of step-N checkpoints: the latest) "
                       "or a Hugging Face folder, of any next-token family or size with the student's vocabulary")
    loss: str = opt("forward_kl", "forward_kl: KL(teacher || student), mass-covering; reverse_kl: KL(student || "
                    "teacher), mode-seeking", choices=("forward_kl", "reverse_kl"))
    temperature: float = opt(1.0, "both distributions are softened by dividing the logits by it")
    kl_weight: float = opt(1.0, "the loss is kl_weight x KL + (1 - kl_weight) x the cross-entropy of the data's "
                           "next tokens (the hard labels), in [0, 1]")
    top_k: int = opt(0, "keep only the teacher's top_k tokens per position (renormalized), which bounds the memory of "
                     "its output to 2 x top_k numbers per token; 0: the whole vocabulary (forward_kl only)")


register_section("distill", DistillOptions)


def vocab_shard(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of a (..., vocab) tensor, the id of its first token): split over the
    vocabulary (a DTensor, Shard(-1): torch.chunk's sizes) or whole."""
    if not isinstance(t, DTensor):
        return t, 0
    rank = t.device_mesh.get_local_rank()
    return t.to_local(), rank * math.ceil(t.shape[-1] / t.device_mesh.size())


def over_vocab_shards(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of per-rank partial sums `local` when `like` is split over the vocabulary
    (its gradient passes through to each rank's part); `local` itself otherwise."""
    if not isinstance(like, DTensor):
        return local
    return sum_over_for_replicated_loss(local, like.device_mesh)


@dataclass
class ShardSoftmax:
    """softmax(logits / T) over the vocabulary, held as this rank's shard: x the scaled logits of its
    tokens (ids start..), e = exp(x - top), and the replicated normalizer: total = sum of e over
    every shard, log_z = top + log(total) (top: the all-reduced max, a constant shift). log p of
    its tokens is x - log_z. Sums over the vocabulary are partial sums of each shard completed
    with over_vocab_shards, whose backward passes the gradient through: exact when what reads the
    completed sum is the same on every rank, which is why log_z is kept apart from x."""

    x: torch.Tensor
    e: torch.Tensor
    total: torch.Tensor
    log_z: torch.Tensor
    start: int


def shard_softmax(logits: torch.Tensor, temperature: float) -> ShardSoftmax:
    local, start = vocab_shard(logits)
    x = local.float() / temperature
    top = x.detach().amax(-1)
    if isinstance(logits, DTensor):
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=logits.device_mesh.get_group())
    e = (x - top[..., None]).exp()
    total = over_vocab_shards(e.sum(-1), logits)
    return ShardSoftmax(x, e, total, top + total.log(), start)


def teacher_channels(output, top_k: int, temperature: float) -> torch.Tensor:
    """(batch, seq, n) the teacher's part of the labels (module docstring) from its output."""
    logits = logits_of(output)
    t = shard_softmax(logits, temperature)
    logp = t.x - t.log_z[..., None]
    if not top_k:
        return logp
    values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    ids = ids + t.start
    if isinstance(logits, DTensor):  # every rank's best k, then the best k of them
        mesh = logits.device_mesh
        values = DTensor.from_local(values, mesh, [Shard(-1)], run_check=False).full_tensor()
        ids = DTensor.from_local(ids, mesh, [Shard(-1)], run_check=False).full_tensor()
        values, best = values.topk(top_k, dim=-1)
        ids = ids.gather(-1, best)
    return torch.cat([values - values.logsumexp(-1, keepdim=True), ids.float()], dim=-1)


def kl_per_token(student_logits: torch.Tensor, teacher: torch.Tensor, *, loss: str, top_k: int,
                 temperature: float) -> torch.Tensor:
    """(batch, seq) the KL of every position, from the student's logits (whole or split over the
    vocabulary) and the teacher's channels of the labels (teacher_channels)."""
    q = shard_softmax(student_logits, temperature)
    if top_k:
        logp, ids = teacher[..., :top_k], teacher[..., top_k:].long()
        inside = (ids >= q.start) & (ids < q.start + q.x.shape[-1])
        picked = over_vocab_shards(q.x.gather(-1, torch.where(inside, ids - q.start, 0)) * inside, student_logits)
        return (logp.exp() * (logp - picked + q.log_z[..., None])).sum(-1)
    logp = teacher
    if loss == "forward_kl":  # sum p (log p - x) + (sum p) log_z
        p = logp.exp()
        mass = over_vocab_shards(p.sum(-1), student_logits)
        return over_vocab_shards((p * (logp - q.x)).sum(-1), student_logits) + mass * q.log_z
    # sum q (log q - log p) = sum e (x - log p) / total - log_z
    return over_vocab_shards((q.e * (q.x - logp)).sum(-1), student_logits) / q.total - q.log_z


class Distill(Objective):
    name = "distill"
    predicts_next_token = True
    reported_terms = ("distill_kl", "hard_loss")

    def __init__(self, family: Objective, options: DistillOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.family = family  # the student's own objective: its samples, batch and masks
        self.options = options or DistillOptions()
        self.attention_mask = None if family is None else family.attention_mask
        self.teacher = None  # set by attach
        self._vocab_split, self._channels = 1, 0  # set by validate and model_args
        self._reports: torch.Tensor | None = None
        self._recording = True

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> Distill:
        if family_objective is None or not family_objective.predicts_next_token:
            what = family_objective.name if family_objective is not None else "no next-token objective"
            raise ValueError(f"training.objective distill trains models that predict the next token; {model} trains "
                             f"with {what}")
        if args.lookahead_tokens:
            raise ValueError(f"training.objective distill does not train multi-token prediction models yet ({model})")
        return cls(family_objective, cfg.distill, **cls.compile_options(cfg))

    def teacher_model(self):
        """(folder, spec, args) of distill.teacher; ValueError (one sentence) if it holds no model."""
        from titanlike.checkpoint.format import CheckpointError
        from titanlike.checkpoint.hf import checkpoint_model

        try:
            return checkpoint_model(self.options.teacher)
        except CheckpointError as e:
            raise ValueError(f"distill.teacher: {e}") from None

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        o = self.options
        self.family.validate(cfg, dims, model=model)
        self._vocab_split = dims.tp if dims.tp > 1 and not cfg.parallelism.disable_loss_parallel else 1
        if not o.teacher:
            raise ValueError("training.objective distill needs distill.teacher: a DCP checkpoint or a Hugging Face folder "
                             "of the teacher")
        if not o.temperature > 0:
            raise ValueError(f"distill.temperature must be positive, got {o.temperature}")
        if not 0 <= o.kl_weight <= 1:
            raise ValueError(f"distill.kl_weight must lie in [0, 1], got {o.kl_weight}")
        if o.top_k < 0:
            raise ValueError(f"distill.top_k must be 0 (the whole vocabulary) or positive, got {o.top_k}")
        if o.top_k and o.loss != "forward_kl":
            raise ValueError("distill.top_k keeps the teacher's most likely tokens, which bounds forward_kl only; use "
                             "distill.loss forward_kl or distill.top_k 0")
        folder, spec, args = self.teacher_model()
        teacher = f"distill.teacher {folder}"
        family = family_objective(cfg, spec, args)
        if not family.predicts_next_token:
            raise ValueError(f"{teacher} is a {spec.name} model, which does not predict the next token: a teacher must")
        if args.lookahead_tokens:
            raise ValueError(f"{teacher} is a multi-token prediction model; such teachers are not supported yet")
        if dims.tp > 1 and spec.shard is None:
            raise ValueError(f"{teacher}: the {spec.name} family has no tensor parallelism, which this job's layout needs")
        if dims.pp > 1 and spec.pipeline_ends is None:
            raise ValueError(f"{teacher}: the {spec.name} family has no pipeline split, which this job's layout needs")
        try:
            args.validate(dims, seq_len=cfg.training.seq_len)
        except ValueError as e:
            raise ValueError(f"{teacher}: {e}") from None
        if dims.pp > 1:
            from titanlike.parallel.pipeline import V_SCHEDULES, schedule_name

            name = schedule_name(cfg.parallelism.pipeline_parallel_schedule)
            if name in V_SCHEDULES:
                raise ValueError(f"the distillation teacher needs a forward-only pass, which the {name} pipeline "
                                 "schedule does not have (torch's V-shaped schedules); use another schedule")

    def model_args(self, args):
        """The student's args, unchanged, once the teacher's vocabulary is known to be the student's."""
        # The teacher's channels of the labels per token (module docstring); under loss-parallel TP a
        # vocabulary shard's (torch.chunk's size: the first ranks' shards are the largest).
        self._channels = 2 * self.options.top_k or math.ceil(args.vocab_size / self._vocab_split)
        folder, _, teacher = self.teacher_model()
        if teacher.vocab_size != args.vocab_size:
            raise ValueError(f"distill.teacher {folder} has a vocabulary of {teacher.vocab_size} tokens and the student "
                             f"{args.vocab_size}: a teacher must use the student's tokenizer")
        if args.vocab_size >= 2 ** 24:
            raise ValueError(f"training.objective distill carries target ids in float32 labels, exact below 2**24; the "
                             f"vocabulary has {args.vocab_size}")
        return args

    # The student's samples ----------------------------------------------------------------------

    def validate_dataset(self, dataset, dataset_path, *, option="training"):
        self.family.validate_dataset(dataset, dataset_path, option=option)

    def validate_held_out(self, dataset: str) -> None:
        self.family.validate_held_out(dataset)

    def model_lengths(self) -> dict[str, int]:
        return self.family.model_lengths()

    def sample_fields(self, seq_len: int):
        return self.family.sample_fields(seq_len)

    def samples(self, dataset: str, **source_args):
        return self.family.samples(dataset, **source_args)

    # Batch ------------------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        mb = self.family.prepare(batch, ctx)
        targets = mb.labels.float()[..., None]
        channels = self.teacher(mb) if self.teacher is not None else None
        if channels is None:
            # Pipeline ranks without the last stage (no loss runs there), or no teacher attached (the
            # estimator's trace of the step): channels of the teacher's width, zero.
            channels = targets.new_zeros(*targets.shape[:-1], self._channels)
        mb.labels = torch.cat([targets, channels], dim=-1)
        return mb

    @property
    def frozen_models(self) -> tuple[str, ...]:
        return (self.options.teacher,)

    def attach(self, models) -> None:
        parts = models.other_model(self.options.teacher)
        o = self.options

        def channels(output, labels: torch.Tensor) -> torch.Tensor:
            return teacher_channels(output, o.top_k, o.temperature)

        @torch.no_grad()
        def teacher(mb: Microbatch) -> torch.Tensor | None:
            return models.forward(parts, mb, channels)

        self.teacher = teacher

    # Loss -------------------------------------------------------------------------------------

    def count_units(self, labels: torch.Tensor) -> torch.Tensor:
        return (labels[..., 0] != IGNORE_INDEX).sum()

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        o = self.options
        logits = logits_of(output)
        targets = labels[..., 0].long()
        trained = targets != IGNORE_INDEX
        kl = kl_per_token(logits, labels[..., 1:], loss=o.loss, top_k=o.top_k, temperature=o.temperature)
        kl = torch.where(trained, kl, torch.zeros((), device=kl.device)).sum()
        hard = self._cross_entropy(logits, targets)
        if isinstance(hard, DTensor):  # vocabulary-parallel cross-entropy: replicated
            hard = hard.full_tensor()
        total = o.kl_weight * kl + (1 - o.kl_weight) * hard if o.kl_weight < 1 else kl
        if isinstance(output, ModelOutput):
            for aux in output.aux_losses.values():
                total = total + aux
        if self._recording:
            reports = torch.stack([kl.detach(), hard.detach()])
            self._reports = reports if self._reports is None else self._reports + reports
        return total

    def count_correct(self, output, labels: torch.Tensor) -> torch.Tensor:
        return Objective.count_correct(self, output, labels[..., 0].long())

    reports_paused = DPO.reports_paused
    collect_reports = DPO.collect_reports


register_objective("distill", Distill.for_job, section="distill")

__all__ = ["Distill", "DistillOptions", "kl_per_token", "teacher_channels"]
