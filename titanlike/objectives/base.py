"""What every training objective provides, and the microbatch it hands the training step.

An objective (causal LM, masked LM, span corruption) owns, for the model family that trains with it
(ModelSpec.objective names it; objectives/registry.py builds it from the job and the flavor's args):
  - its options: a config section registered with the loader (titanlike/config/sections.py);
  - its rules (`validate`): one sentence, before any process group;
  - its samples (`samples`): the global sample source the data loader slices by rank and step;
  - its batch (`prepare`): the loader's dict of named tensors -> a Microbatch on the device, masked
    and cut to this rank's context-parallel positions, as the model and the loss take it;
  - its loss (`loss`): summed over its units (target tokens by default, pairs for preference
    objectives: `count_units`), the model's auxiliary losses added;
  - optionally, models beside the one it trains (`attach`: a frozen reference) and loss terms it
    reports apart (`reported_terms`, `collect_reports`).
Generic code (data/, train/, checkpoint/, estimation/) calls these and never asks which objective
it has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX, ModelOutput, cross_entropy_sum

if TYPE_CHECKING:
    import torch.nn as nn

    from titanlike.config.schema import JobConfig
    from titanlike.models.args import LayoutDegrees

# Field name -> (shape of one sample, "int64" | "float32").
FieldShapes = dict[str, tuple[tuple[int, ...], str]]


@dataclasses.dataclass(frozen=True)
class BatchContext:
    """What `prepare` needs beyond the loader's batch: where the tensors go and how this rank cuts them."""

    device: torch.device
    # Context parallel: the global positions of the tokens this rank keeps of every sequence.
    cp_positions: torch.Tensor | None = None
    # The kernel a document or padding mask is built for ("sdpa", "flex"), None under context
    # parallelism (its attention builds its own masks from the document ids).
    mask_kernel: str | None = None
    eos_id: int | None = None  # the tokenizer's end-of-document token
    # The depth of multi-token prediction (the model args' lookahead_tokens); 0: none.
    lookahead_tokens: int = 0


@dataclasses.dataclass
class Microbatch:
    """What the model and the loss of one microbatch get, on this rank's device and slice."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # RoPE positions when not 0..seq-1
    mask: DocumentMask | None = None  # attend within documents (training.document_masking, or a padding mask)
    # Multi-token prediction's inputs and targets (objectives/causal_lm.py lookahead_targets), for
    # models whose args have lookahead_tokens > 0.
    lookahead: torch.Tensor | None = None
    # The sample's other fields (BERT's token types, T5's decoder inputs, ...), passed to the model's
    # forward under their names.
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def forward_kwargs(self) -> dict:
        kwargs = {"positions": self.positions, "mask": self.mask, **self.fields}
        if self.lookahead is not None:
            kwargs["lookahead"] = self.lookahead
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


@dataclasses.dataclass(frozen=True)
class ObjectiveModels:
    """What the trainer lends an objective that needs models beside the one it trains (`attach`),
    once the model is built and loaded, before the first step."""

    parts: list[nn.Module]  # this rank's parts of the model being trained
    # A frozen copy of them (requires_grad off): the same plan and layout, the weights of the model as
    # the run started (the parts' own before the first step; rebuilt from the initial load on resume).
    frozen_copy: Callable[[], list[nn.Module]]
    # forward(parts, mb, fn): a forward-only pass of `parts` (the model's or a frozen copy's) over the
    # microbatch, as the step runs it (autocast, loss parallelism, the pipeline schedule), returning
    # fn(output, labels) of its samples concatenated along the batch, (batch, ...), on the ranks that
    # hold the last pipeline stage, and None on the others (where the loss never runs).
    forward: Callable[[list[nn.Module], Microbatch, Callable], torch.Tensor | None]
    # Context parallelism: each rank holds some positions of every sample. cp_sum(x) sums a tensor
    # over the cp ranks (its backward passes the gradient through: parallel/utils.py
    # sum_over_for_replicated_loss); None without it. cp_degree: the number of cp ranks.
    cp_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    cp_degree: int = 1
    # other_model(path): this rank's parts of the model of another checkpoint (a DCP checkpoint or a
    # Hugging Face folder; a distillation teacher), frozen, built with the job's layout (its own
    # pipeline split over the same stages) and loaded; `forward` runs it like the frozen copy.
    other_model: Callable[[str], list[nn.Module]] | None = None


def cut_sequence(x: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
    """This rank's tokens of a per-token tensor (batch, seq, ...) under context parallelism."""
    if ctx.cp_positions is None:
        return x
    from titanlike.parallel.context import shard_sequence

    return shard_sequence(x, ctx.cp_positions)


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
    """Base of every objective: the loss they share (cross-entropy summed over the targets, plus the
    model's auxiliary losses). Subclasses implement the rest (see the module docstring)."""

    # Name shown in messages ("masked_lm"); nothing dispatches on it.
    name: ClassVar[str] = ""
    # Fields of a sample laid out along the sequence of `inputs` (cut with it under context
    # parallelism), besides inputs and labels.
    token_fields: ClassVar[tuple[str, ...]] = ()
    # What the attention mask of its samples is, for the start-up log: "a document mask", "a padding
    # mask", or None (plain causal or bidirectional attention).
    attention_mask: str | None = None
    # Whether `loss` works on logits split over the vocabulary (a DTensor, Shard(-1)) inside torch's
    # loss_parallel(): cross-entropy does. Under tensor parallelism the plan then keeps the logits
    # sharded (parallelism.disable_loss_parallel off); an objective whose loss needs whole logits says
    # False, and the output projection gathers them.
    vocab_parallel_loss: ClassVar[bool] = True
    # Whether the model it trains predicts the next token from the tokens before it, so it can be
    # sampled from left to right (scripts/generate.py asks; the later inference issue builds on it).
    predicts_next_token: ClassVar[bool] = False

    @property
    def frozen_copies(self) -> int:
        """How many frozen copies of the model (same plan, sharded like it: parameters only, no
        gradients or optimizer state) the objective holds beside it; the memory estimator counts them."""
        return 0

    @property
    def frozen_models(self) -> tuple[str, ...]:
        """Checkpoints of other models the objective runs frozen beside the one it trains (what `attach`
        asks ObjectiveModels.other_model for: a distillation teacher). The memory estimator counts their
        parameter shards (no gradients, no optimizer state) and their forward without gradients."""
        return ()

    def __init__(self, *, compile_loss: bool = False, compile_backend: str = "inductor"):
        # compile.components "loss": the cross-entropy compiled with compile.backend (on first use, so
        # that building an objective to check a job's rules compiles nothing).
        self.compile_backend = compile_backend if compile_loss else None

    @functools.cached_property
    def _cross_entropy(self):
        if self.compile_backend is None:
            return cross_entropy_sum
        return torch.compile(cross_entropy_sum, backend=self.compile_backend)

    @staticmethod
    def compile_options(cfg: JobConfig) -> dict[str, Any]:
        """The loss's compile settings from the job's [compile] section (for subclasses' for_job)."""
        c = cfg.compile
        return {"compile_loss": c.enable and "loss" in c.components, "compile_backend": c.backend}

    # Loss terms the objective reports apart (logged as their sums divided by the step's units, like
    # the loss): collect_reports gives their sums since the last call, in this order.
    reported_terms: ClassVar[tuple[str, ...]] = ()

    # Rules ------------------------------------------------------------------------------------

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        """Raise ValueError (one sentence naming the option) when this job cannot train with this
        objective; `model` names the model in messages. Called before any process group exists."""

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        """Raise ValueError (one sentence) when `dataset` at `dataset_path` cannot give this objective's
        samples; option: the section named in messages ("training", "validation"). The dataset
        kind's own rules by default."""
        from titanlike.data.loader import validate_dataset

        validate_dataset(dataset, dataset_path, option=option)

    def validate_held_out(self, dataset: str) -> None:
        """Validation without a dataset of its own reads the training data's held-out split: raise
        ValueError (one sentence) when `dataset` has none for this objective's samples. Only the
        embedded corpus and Megatron datasets hold one out by default (DatasetKind.held_out)."""
        from titanlike.data.loader import find_dataset_kind

        kind = find_dataset_kind(dataset)
        if kind is None or not kind.held_out:
            raise ValueError(f"validation needs validation.dataset and validation.dataset_path: a {dataset} training "
                             "dataset has no held-out split (only the embedded corpus and megatron datasets do)")

    def model_args(self, args):
        """The model args this objective trains, from the job's (sized) ones: unchanged by default; a
        reward model's have a scalar head (BaseModelArgs.with_score_head). ValueError, one sentence."""
        return args

    def model_lengths(self) -> dict[str, int]:
        """Lengths the objective adds to the model's sizing (update_from_config's keywords beyond
        vocab_size and seq_len), e.g. an encoder-decoder's decoder tokens."""
        return {}

    # Samples ----------------------------------------------------------------------------------

    def sample_fields(self, seq_len: int) -> FieldShapes:
        """Each field of one sample as the loader yields it: name -> (shape, dtype)."""
        raise NotImplementedError

    def samples(self, dataset: str, **source_args):
        """The global sample source (titanlike.data.loader.GlobalSamples) of `dataset` for this
        objective; source_args: dataset_path, tokenizer, seq_len, seed, num_samples, split, split_name."""
        raise NotImplementedError

    # Batch ------------------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        """A loader microbatch (a dict of named tensors) as the model and the loss take it."""
        raise NotImplementedError

    def attach(self, models: ObjectiveModels) -> None:
        """Called once by the trainer before the first step (of a fresh or a resumed run): an objective
        that needs a model beside the one it trains (a frozen reference) takes it here. Nothing by default."""

    # Generation -------------------------------------------------------------------------------

    def prompt(self, tokenizer, text: str, images: Sequence = ()) -> tuple[list[int], dict[str, torch.Tensor]]:
        """A generation prompt for the model this objective trains: its token ids (BOS, then the text)
        and the other inputs its prefill takes, one row (Engine.generate's fields). ValueError, one
        sentence, for images a text model cannot take."""
        if images:
            raise ValueError(f"a model trained on {self.name} samples takes no images")
        return tokenizer.encode(text, bos=True, eos=False), {}

    def chat_prompt(self, tokenizer, template, messages: Sequence[dict],
                    images: Sequence = ()) -> tuple[list[int], dict[str, torch.Tensor]]:
        """prompt() for a conversation: `messages` rendered with the chat template, then its generation
        prompt (what the model answers), and the prefill's other inputs."""
        from titanlike.data.chat_template import chat_prompt_ids

        if images:
            raise ValueError(f"a model trained on {self.name} samples takes no images")
        return chat_prompt_ids(template, tokenizer, messages), {}

    # Loss -------------------------------------------------------------------------------------

    def count_units(self, labels: torch.Tensor) -> torch.Tensor:
        """The units a microbatch's summed loss is over (the step divides by their global count): its
        target tokens by default."""
        return (labels != IGNORE_INDEX).sum()

    def count_correct(self, output: torch.Tensor | ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """Validation's accuracy count over this microbatch's units (divided by their global count):
        by default the targets whose most likely token is right (vocabulary-parallel logits are
        gathered for it, in validation only)."""
        from torch.distributed.tensor import DTensor

        logits = output.logits if isinstance(output, ModelOutput) else output
        logits = logits.detach()
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        targets = labels != IGNORE_INDEX
        return (logits.argmax(-1) == labels)[targets].sum()

    def collect_reports(self, device: torch.device) -> torch.Tensor:
        """(len(reported_terms),) the reported terms' sums since the last call, then zeroed; device
        work only."""
        return torch.zeros(len(self.reported_terms), device=device)

    def reports_paused(self) -> contextlib.AbstractContextManager:
        """A context in which `loss` records no reported terms (a pipeline's metadata inference)."""
        return contextlib.nullcontext()

    def loss(self, output: torch.Tensor | ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """The microbatch's loss summed over its target tokens, with the output's auxiliary losses (in
        the same summed units). The trainer divides the step's total once by its global target count."""
        if isinstance(output, ModelOutput):
            loss = self._cross_entropy(output.logits, labels)
            for aux in output.aux_losses.values():
                loss = loss + aux
            return loss
        return self._cross_entropy(output, labels)


__all__ = ["BatchContext", "FieldShapes", "Microbatch", "Objective", "ObjectiveModels", "cut_sequence",
           "refuse_pretraining_options"]
