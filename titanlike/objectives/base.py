"""What every training objective provides, and the microbatch it hands the training step.

An objective (causal LM, masked LM, span corruption, SFT, DPO, reward model, distillation, image
captioning; a family names its own in ModelSpec.objective, objectives/registry.py builds it) is three
small things, built once at planning time and never changed after:
  - its samples: the job's rules (`validate`, one sentence before any process group, the datasets'
    included), the fields of a sample (`sample_fields`) and the global sample source (`samples`);
  - its batch (`prepare`): the loader's dict of named tensors -> a Microbatch on the device, cut to
    this rank's context-parallel positions: the model's inputs, and the named `targets` the loss
    reads, each with its own dtype (token ids and document indices stay int64), plus the count of
    the units its loss is summed over;
  - its loss (`loss`): a pure function of the model's output and the targets -> LossTerms (the
    summed value, and the terms it reports apart, named by `reported_terms`).
Models that run beside the one it trains (a frozen reference, a teacher) are `companions`: the
objective declares what each is and what it adds to the targets (objectives/companion.py); the
trainer builds and runs them (train/companions.py). Generic code (data/, train/, checkpoint/,
estimation/) calls these members and never asks which objective it has.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.dtensor import is_dtensor
from titanlike.models.outputs import IGNORE_INDEX, ModelOutput, cross_entropy_sum, logits_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees
    from titanlike.objectives.companion import Companion

# Field name -> (shape of one sample, "int64" | "float32").
FieldShapes = dict[str, tuple[tuple[int, ...], str]]


@dataclasses.dataclass(frozen=True)
class BatchContext:
    """Where a microbatch goes and how this rank cuts it: what `prepare` and `loss` need beyond the
    tensors themselves, built by the trainer once the meshes exist."""

    device: torch.device
    # Context parallel: the global positions of the tokens this rank keeps of every sequence.
    cp_positions: torch.Tensor | None = None
    # The kernel a document or padding mask is built for ("sdpa", "flex"), None under context
    # parallelism (its attention builds its own masks from the document ids).
    mask_kernel: str | None = None
    eos_id: int | None = None  # the tokenizer's end-of-document token
    # The depth of multi-token prediction (the model args' lookahead_tokens); 0: none.
    lookahead_tokens: int = 0
    # Context parallel's mesh, for a loss whose terms span positions held by several ranks (a
    # preference pair's summed log-probabilities); None without context parallelism.
    cp_mesh: DeviceMesh | None = None
    # The model computes logits only where a microbatch's logits_at says (Microbatch.logits_at): one
    # whole model on this rank (no tensor, context or pipeline split) whose forward takes logits_at.
    select_logits: bool = False

    @property
    def cp_degree(self) -> int:
        return 1 if self.cp_mesh is None else self.cp_mesh.size()

    def cp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the context-parallel ranks, its gradient passed through to each (parallel/utils.py
        sum_over_for_replicated_loss); itself without context parallelism."""
        if self.cp_mesh is None:
            return value
        from titanlike.parallel.utils import sum_over_for_replicated_loss

        return sum_over_for_replicated_loss(value, self.cp_mesh)


@dataclasses.dataclass
class Microbatch:
    """What the model and the loss of one microbatch get, on this rank's device and slice."""

    inputs: torch.Tensor
    # What the loss reads, by name, each (batch, ...) with its own dtype: cut along the batch with the
    # inputs by a pipeline schedule, extended by the companions (a reference's log-probabilities).
    targets: dict[str, torch.Tensor]
    # The units the microbatch's summed loss is over (target tokens, preference pairs), a 0-d tensor:
    # the step divides the gradients once by their global count.
    units: torch.Tensor
    positions: torch.Tensor | None = None  # RoPE positions when not 0..seq-1
    mask: DocumentMask | None = None  # attend within documents (training.document_masking, or a padding mask)
    # Multi-token prediction's inputs and targets (objectives/causal_lm.py lookahead_targets), for
    # models whose args have lookahead_tokens > 0.
    lookahead: torch.Tensor | None = None
    # The sample's other fields (BERT's token types, T5's decoder inputs, ...), passed to the model's
    # forward under their names.
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # (N,) indices into the flattened (batch x seq) positions whose logits the loss reads, when an
    # objective sets them (only where BatchContext.select_logits): the model's logits are then (N, vocab).
    logits_at: torch.Tensor | None = None

    def forward_kwargs(self) -> dict:
        kwargs = {"positions": self.positions, "mask": self.mask, **self.fields}
        if self.lookahead is not None:
            kwargs["lookahead"] = self.lookahead
        if self.logits_at is not None:
            kwargs["logits_at"] = self.logits_at
        return kwargs

    def rows(self, start: int, stop: int) -> dict:
        """forward_kwargs of samples start..stop-1 (a pipeline microbatch); per-sample tensors are cut,
        the positions shared by every sample (context parallel's, 1-D) are not."""
        positions = self.positions
        return {
            "positions": positions if positions is None or positions.ndim == 1 else positions[start:stop],
            "mask": None if self.mask is None else self.mask.rows(start, stop),
            **{name: value[start:stop] for name, value in self.fields.items()},
            **({} if self.lookahead is None else {"lookahead": self.lookahead[start:stop]}),
        }

    def target_rows(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """The targets of samples start..stop-1 (a pipeline microbatch's)."""
        return {name: value[start:stop] for name, value in self.targets.items()}


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """One microbatch's loss: `value`, summed over its units (what backward differentiates, with the
    model's auxiliary losses in the same units); `reported`, (len(reported_terms),) sums of the terms
    reported apart (detached), or None; `correct`, validation's count of correct units when asked."""

    value: torch.Tensor
    reported: torch.Tensor | None = None
    correct: torch.Tensor | None = None


def cut_sequence(x: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
    """This rank's tokens of a per-token tensor (batch, seq, ...) under context parallelism."""
    if ctx.cp_positions is None:
        return x
    from titanlike.parallel.context import shard_sequence

    return shard_sequence(x, ctx.cp_positions)


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """The target tokens of a (batch, seq) labels tensor: the units of a token-level loss."""
    return (labels != IGNORE_INDEX).sum()


def next_token_correct(output: torch.Tensor | ModelOutput, labels: torch.Tensor) -> torch.Tensor:
    """The targets whose most likely token is right (vocabulary-parallel logits are gathered for it:
    validation only)."""
    from torch.distributed.tensor import DTensor

    logits = logits_of(output).detach()
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return (logits.argmax(-1) == labels)[labels != IGNORE_INDEX].sum()


def with_aux_losses(loss: torch.Tensor, output) -> torch.Tensor:
    """The loss plus the output's auxiliary losses (MoE balancing, multi-token prediction), in the
    same summed units."""
    if isinstance(output, ModelOutput):
        for aux in output.aux_losses.values():
            loss = loss + aux
    return loss


def compile_options(cfg: JobConfig) -> dict[str, Any]:
    """The loss's compile settings from the job's [compile] section (for objectives' factories)."""
    from titanlike.parallel.pipeline import splits_backward

    c = cfg.compile
    # A schedule that splits the backward runs the last stage's loss backward twice (input, then weight
    # gradients), keeping its graph between, which a compiled loss refuses on torch 2.13 ('compiled with
    # non-empty donated buffers which requires ... retain_graph=False'): that loss stays eager.
    compile_loss = c.enable and "loss" in c.components and not splits_backward(cfg.parallelism)
    return {"compile_loss": compile_loss, "compile_backend": c.backend}


def refuse_pretraining_options(cfg: JobConfig, objective: str) -> None:
    """ValueError (one sentence) for the pre-training text options a job of `objective` (sft, dpo:
    samples that carry their own document masks, a fixed batch) cannot take."""
    t = cfg.training
    for option in ("document_masking", "eod_mask_loss"):
        if getattr(t, option):
            raise ValueError(f"training.{option} applies to packed pre-training text; {objective} samples carry their "
                             f"own document masks: remove training.{option}")
    if t.rampup_batch_size:
        raise ValueError(f"training.rampup_batch_size is for pre-training; remove it with training.objective "
                         f"{objective}")


class Objective:
    """Base of every objective: next-token cross-entropy over `targets["labels"]` summed over the
    targets, plus the model's auxiliary losses. Subclasses implement the rest (module docstring).

    Public members (what generic code may use): name, generation, vocab_parallel_loss,
    attention_mask, reported_terms, companions, validate, model_args, sample_fields, samples,
    prepare, loss. Subclasses add their rules in `_validate_job` and refine the data rules in
    `_check_dataset` and `_check_held_out`."""

    # Name shown in messages ("masked_lm"); nothing dispatches on it.
    name: ClassVar[str] = ""
    # How the model it trains is sampled from, left to right: None (it is not: an encoder, a score
    # head), "text" (it predicts the next token: a prompt is continued) or "chat" (it predicts the next
    # token and was trained on conversations rendered with a chat template: prompts are conversations,
    # and the run's summary suggests generate.py --chat). Objectives that fine-tune a family's model
    # ask whether the family's own generates.
    generation: ClassVar[str | None] = None
    # Whether `loss` works on logits split over the vocabulary (a DTensor, Shard(-1)) inside torch's
    # loss_parallel(): cross-entropy does. Under tensor parallelism the plan then keeps the logits
    # sharded (parallelism.disable_loss_parallel off); an objective whose loss needs whole logits says
    # False, and the output projection gathers them.
    vocab_parallel_loss: ClassVar[bool] = True
    # What the attention mask of its samples is, for the start-up log: "a document mask", "a padding
    # mask", or None (plain causal or bidirectional attention).
    attention_mask: str | None = None
    # Loss terms the objective reports apart (LossTerms.reported, logged as their sums divided by the
    # step's units, like the loss, and shown on the console line beside it: what a user watches to see
    # that the run learns).
    reported_terms: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, compile_loss: bool = False, compile_backend: str = "inductor"):
        # compile.components "loss": the cross-entropy compiled with compile.backend (on first use, so
        # that building an objective to check a job's rules compiles nothing).
        self._compile_backend = compile_backend if compile_loss else None

    @functools.cached_property
    def _cross_entropy(self):
        if self._compile_backend is None:
            return cross_entropy_sum
        compiled = torch.compile(cross_entropy_sum, backend=self._compile_backend)

        def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # Logits split over the vocabulary (loss parallelism) take the eager loss: loss_parallel()
            # reroutes cross-entropy through DTensor handlers that a compiled graph does not take, and
            # compiled, the loss came out wrong without an error (torch 2.13: 1.95 for 8.13 at TP 2).
            return cross_entropy_sum(logits, labels) if is_dtensor(logits) else compiled(logits, labels)

        return cross_entropy

    @property
    def companions(self) -> tuple[Companion, ...]:
        """The models that run beside the one it trains, and what each adds to the targets
        (objectives/companion.py); the trainer builds them, the estimator counts them."""
        return ()

    # Rules ------------------------------------------------------------------------------------

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str, data: bool = True,
                 tokenizer=None) -> None:
        """Raise ValueError (one sentence naming the option) when this job cannot train with this
        objective; `model` names the model in messages. Called before any process group exists: the
        objective's own rules (`_validate_job`), the tokens its samples need from `tokenizer` when given
        (`_check_tokenizer`), then the datasets': the validation data (its own, or the training data's
        held-out split) and, with `data`, the training data (the estimator plans layouts without them)."""
        t, v = cfg.training, cfg.validation
        self._validate_job(cfg, dims, model=model)
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        if v.enable:
            if v.dataset is None:
                self._check_held_out(t.dataset)
            elif v.dataset_path:
                from titanlike.data.loader import find_dataset_kind

                kind = find_dataset_kind(v.dataset)
                if not (kind is not None and kind.validates_on_held_out):  # the embedded corpus reads its own
                    self._check_dataset(v.dataset, v.dataset_path, option="validation")
        if data:
            self._check_dataset(t.dataset, t.dataset_path)

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        """The objective's own rules (its options against the job and the layout): ValueError."""

    def _check_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        """ValueError (one sentence) when `dataset` at `dataset_path` cannot give this objective's
        samples; option: the section named in messages. The dataset kind's own rules by default."""
        from titanlike.data.loader import validate_dataset

        validate_dataset(dataset, dataset_path, option=option)

    def _check_held_out(self, dataset: str) -> None:
        """Validation without a dataset of its own reads the training data's held-out split: ValueError
        (one sentence) when `dataset` has none for this objective's samples. Only the embedded corpus and
        Megatron datasets hold one out by default (DatasetKind.held_out)."""
        from titanlike.data.loader import find_dataset_kind

        kind = find_dataset_kind(dataset)
        if kind is None or not kind.held_out:
            raise ValueError(f"validation needs validation.dataset and validation.dataset_path: a {dataset} training "
                             "dataset has no held-out split (only the embedded corpus and megatron datasets do)")

    def _check_tokenizer(self, tokenizer) -> None:
        """ValueError (one sentence) when the job's tokenizer lacks a token this objective's samples need;
        called by validate, before any process group, with the tokenizer the job will train with."""

    def model_args(self, args: BaseModelArgs, *, vocab_size: int, seq_len: int) -> BaseModelArgs:
        """The model args this objective trains, sized for the job (the tokenizer's vocabulary, the
        training sequence length and any length of its own: an encoder-decoder's decoder tokens) from
        the flavor's; a reward model's also get a scalar head. ValueError, one sentence."""
        return args.update_from_config(vocab_size=vocab_size, seq_len=seq_len)

    # Samples ----------------------------------------------------------------------------------

    def sample_fields(self, seq_len: int) -> FieldShapes:
        """Each field of one sample as the loader yields it: name -> (shape, dtype)."""
        raise NotImplementedError

    def samples(self, dataset: str, **source_args):
        """The global sample source (titanlike.data.loader.GlobalSamples) of `dataset` for this
        objective; source_args: dataset_path, tokenizer, seq_len, seed, num_samples, split, split_name.
        Checks the dataset first (training's or validation's: `option`)."""
        raise NotImplementedError

    # Batch ------------------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        """A loader microbatch (a dict of named tensors) as the model and the loss take it."""
        raise NotImplementedError

    # Loss -------------------------------------------------------------------------------------

    def loss(self, output: torch.Tensor | ModelOutput, targets: dict[str, torch.Tensor], ctx: BatchContext, *,
             correct: bool = False) -> LossTerms:
        """The microbatch's loss summed over its target tokens, with the output's auxiliary losses (in
        the same summed units); correct: also count validation's correct units (LossTerms.correct). A
        pure function of its arguments: the step keeps the sums."""
        labels = targets["labels"]
        value = with_aux_losses(self._cross_entropy(logits_of(output), labels), output)
        return LossTerms(value, correct=next_token_correct(output, labels) if correct else None)


__all__ = ["BatchContext", "FieldShapes", "LossTerms", "Microbatch", "Objective", "compile_options", "cut_sequence",
           "next_token_correct", "refuse_pretraining_options", "target_count", "with_aux_losses"]
