"""Knowledge distillation: a student learns a frozen teacher's next-token distribution.

Chosen by `training.objective distill` for any family whose own objective predicts the next token
(the student); its samples, batch and masks are that objective's (pre-training text, the family's
causal LM), only the loss changes. The teacher (`distill.teacher`) is another checkpoint: a DCP
checkpoint with its sidecar or a Hugging Face folder, of any next-token family or size whose
vocabulary is the student's (the same tokenizer). It is a companion (objectives/companion.py): built
with the job's layout (FSDP, TP, its own pipeline split over the same stages: train/companions.py),
frozen, and run forward-only when a microbatch is prepared, as DPO's reference is; what the loss needs
of it joins the targets, which the pipeline schedule cuts along the batch like the inputs.

Per target token, with p = softmax(teacher logits / T) and q = softmax(student logits / T):
  forward  KL(p || q) = sum_v p_v (log p_v - log q_v)
  reverse  KL(q || p) = sum_v q_v (log q_v - log p_v)
as TRL's generalized_jsd_loss at beta 0 and 1 (no T^2 factor), and the loss is
  kl_weight x KL + (1 - kl_weight) x cross-entropy(student logits, target)
summed over the target tokens (the step divides once by their global count).

Top-k distillation (distill.top_k k > 0, forward KL): only the teacher's k most likely tokens of each
position are kept, with p renormalized over them, and the student's full log q at those tokens:
sum_{v in top k} p_v (log p_v - log q_v) (>= 0). The teacher then adds 2k numbers per token instead
of the vocabulary, which bounds the memory its output takes.

The targets: the family's (`labels`, int64, IGNORE_INDEX where not trained), and the teacher's:
`teacher_logps` (batch, seq, n) float32, the whole vocabulary's log p (n = this rank's vocabulary
shard under tensor parallelism) or top-k's k log-probabilities, with top-k's `teacher_ids` (batch,
seq, k) int64.

Tensor parallelism: the logits stay split over the vocabulary (loss parallel) and are never
gathered. Softmaxes are held per shard (ShardSoftmax): the max and the sum of exponentials are
all-reduced; each rank keeps its shard of the teacher's log p in its targets; the student's KL is a
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

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.dtensor import is_dtensor
from titanlike.models.outputs import IGNORE_INDEX, logits_of
from titanlike.objectives.base import (BatchContext, LossTerms, Microbatch, Objective, compile_options,
                                       next_token_correct, with_aux_losses)
from titanlike.objectives.companion import Companion, Source, Targets
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
    if not is_dtensor(t):
        return t, 0
    rank = t.device_mesh.get_local_rank()
    return t.to_local(), rank * math.ceil(t.shape[-1] / t.device_mesh.size())


def over_vocab_shards(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of per-rank partial sums `local` when `like` is split over the vocabulary
    (its gradient passes through to each rank's part); `local` itself otherwise."""
    if not is_dtensor(like):
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
    if is_dtensor(logits):
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=logits.device_mesh.get_group())
    e = (x - top[..., None]).exp()
    total = over_vocab_shards(e.sum(-1), logits)
    return ShardSoftmax(x, e, total, top + total.log(), start)


def teacher_targets(output, top_k: int, temperature: float) -> Targets:
    """The teacher's targets (module docstring) from its output."""
    logits = logits_of(output)
    t = shard_softmax(logits, temperature)
    logp = t.x - t.log_z[..., None]
    if not top_k:
        return {"teacher_logps": logp}
    values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    ids = ids + t.start
    if is_dtensor(logits):  # every rank's best k, then the best k of them
        from torch.distributed.tensor import DTensor, Shard

        mesh = logits.device_mesh
        values = DTensor.from_local(values, mesh, [Shard(-1)], run_check=False).full_tensor()
        ids = DTensor.from_local(ids, mesh, [Shard(-1)], run_check=False).full_tensor()
        values, best = values.topk(top_k, dim=-1)
        ids = ids.gather(-1, best)
    return {"teacher_logps": values - values.logsumexp(-1, keepdim=True), "teacher_ids": ids}


def kl_per_token(student_logits: torch.Tensor, teacher: Targets, *, loss: str, top_k: int,
                 temperature: float) -> torch.Tensor:
    """(batch, seq) the KL of every position, from the student's logits (whole or split over the
    vocabulary) and the teacher's targets (teacher_targets)."""
    q = shard_softmax(student_logits, temperature)
    if top_k:
        logp, ids = teacher["teacher_logps"], teacher["teacher_ids"]
        inside = (ids >= q.start) & (ids < q.start + q.x.shape[-1])
        picked = over_vocab_shards(q.x.gather(-1, torch.where(inside, ids - q.start, 0)) * inside, student_logits)
        return (logp.exp() * (logp - picked + q.log_z[..., None])).sum(-1)
    logp = teacher["teacher_logps"]
    if loss == "forward_kl":  # sum p (log p - x) + (sum p) log_z
        p = logp.exp()
        mass = over_vocab_shards(p.sum(-1), student_logits)
        return over_vocab_shards((p * (logp - q.x)).sum(-1), student_logits) + mass * q.log_z
    # sum q (log q - log p) = sum e (x - log p) / total - log_z
    return over_vocab_shards((q.e * (q.x - logp)).sum(-1), student_logits) / q.total - q.log_z


class Distill(Objective):
    name = "distill"
    generation = "text"
    reported_terms = ("distill_kl", "hard_loss")

    def __init__(self, family: Objective, options: DistillOptions | None = None, **loss_options):
        """family: the student's own objective: its samples, batch and masks."""
        super().__init__(**loss_options)
        self.family = family
        self.options = options or DistillOptions()
        self.attention_mask = None if family is None else family.attention_mask

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> Distill:
        if family_objective is None or family_objective.generation is None:
            what = family_objective.name if family_objective is not None else "no next-token objective"
            raise ValueError(f"training.objective distill trains models that predict the next token; {model} trains "
                             f"with {what}")
        if args.lookahead_tokens:
            raise ValueError(f"training.objective distill does not train multi-token prediction models yet ({model})")
        return cls(family_objective, cfg.distill, **compile_options(cfg))

    def teacher_model(self):
        """(folder, spec, args) of distill.teacher; ValueError (one sentence) if it holds no model."""
        from titanlike.checkpoint.format import CheckpointError
        from titanlike.checkpoint.hf import checkpoint_model

        try:
            return checkpoint_model(self.options.teacher)
        except CheckpointError as e:
            raise ValueError(f"distill.teacher: {e}") from None

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        o = self.options
        self.family._validate_job(cfg, dims, model=model)
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
        if family_objective(cfg, spec, args).generation is None:
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

    def model_args(self, args, *, vocab_size: int, seq_len: int):
        """The student's args, sized by its family's objective, once the teacher's vocabulary is known to
        be the student's."""
        args = self.family.model_args(args, vocab_size=vocab_size, seq_len=seq_len)
        folder, _, teacher = self.teacher_model()
        if teacher.vocab_size != args.vocab_size:
            raise ValueError(f"distill.teacher {folder} has a vocabulary of {teacher.vocab_size} tokens and the student "
                             f"{args.vocab_size}: a teacher must use the student's tokenizer")
        return args

    # The student's samples ----------------------------------------------------------------------

    def _check_dataset(self, dataset, dataset_path, *, option="training"):
        self.family._check_dataset(dataset, dataset_path, option=option)

    def _check_held_out(self, dataset: str) -> None:
        self.family._check_held_out(dataset)

    def sample_fields(self, seq_len: int):
        return self.family.sample_fields(seq_len)

    def samples(self, dataset: str, **source_args):
        return self.family.samples(dataset, **source_args)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        return self.family.prepare(batch, ctx)

    # The teacher ------------------------------------------------------------------------------

    @property
    def companions(self) -> tuple[Companion, ...]:
        o = self.options
        return (Companion("teacher", "distill.teacher", Source.CHECKPOINT, self._teacher_outputs, path=o.teacher),)

    def _teacher_outputs(self, output, targets: Targets) -> Targets:
        return teacher_targets(output, self.options.top_k, self.options.temperature)

    # Loss -------------------------------------------------------------------------------------

    def loss(self, output, targets: Targets, ctx: BatchContext, *, correct: bool = False) -> LossTerms:
        o = self.options
        logits = logits_of(output)
        labels = targets["labels"]
        trained = labels != IGNORE_INDEX
        kl = kl_per_token(logits, targets, loss=o.loss, top_k=o.top_k, temperature=o.temperature)
        kl = torch.where(trained, kl, torch.zeros((), device=kl.device)).sum()
        hard = self._cross_entropy(logits, labels)
        if is_dtensor(hard):  # vocabulary-parallel cross-entropy: replicated
            hard = hard.full_tensor()
        total = o.kl_weight * kl + (1 - o.kl_weight) * hard if o.kl_weight < 1 else kl
        reported = torch.stack([kl.detach(), hard.detach()])
        return LossTerms(with_aux_losses(total, output), reported,
                         next_token_correct(output, labels) if correct else None)


register_objective("distill", Distill.for_job, section="distill")

__all__ = ["Distill", "DistillOptions", "kl_per_token", "teacher_targets"]
