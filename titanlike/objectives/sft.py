"""Supervised fine-tuning on conversations: next-token prediction on the assistant's turns.

Chosen by `training.objective sft` for any family whose own objective predicts the next token
(objectives/registry in objectives/__init__.py). Samples are conversations rendered with a chat
template and packed (titanlike/data/conversations.py, data/chat_template.py): each sample carries
its document ids, so every conversation attends only within itself and its RoPE positions start at
0, with the attention kernel's document mask (the pre-training document-masking machinery, which
context parallelism reads from the same ids). The loss is the causal LM's: summed over the trained
targets, divided once by the step's global count.

Padding (sft.padding): every sample holds training.seq_len positions, the rest of a sample being
padding (a document of its own with no targets); with `longest`, `prepare` cuts each microbatch
after the last position that any of its samples trains on (rounded up to sft.pad_to_multiple_of),
so that unpacked conversations cost the longest of their microbatch rather than seq_len. Exact for
a causal model: nothing after a sample's last target changes its loss.

Options, [sft]: format, chat_template, assistant_only_loss, packing, padding, pad_to_multiple_of,
overlong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.data.tokenizer import pad_id
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.objectives.base import (BatchContext, FieldShapes, Microbatch, Objective, compile_options,
                                       cut_sequence, refuse_pretraining_options, target_count)
from titanlike.objectives.causal_lm import lookahead_targets
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class SFTOptions:
    format: str = opt("auto", "conversation form of each row: messages (a list of role/content turns), "
                      "prompt_completion (prompt and completion), instruction (instruction, input, output: "
                      "Alpaca's), text (TRL's language-modeling rows: plain text, every token trained), or auto "
                      "(from each row's keys)", choices=("auto", "messages", "prompt_completion", "instruction", "text"))
    chat_template: str = opt(
        "auto", "auto: the tokenizer folder's chat_template (tokenizer_config.json or chat_template.jinja), else "
        "titanlike's llama3 template; tokenizer: the folder's, required; llama3 or chatml: titanlike's own; a "
        "published template by name (those of titanlike/data/assets/chat_templates: gemma3, gptoss, qwen3, ...); or "
        "a path to a Jinja file")
    assistant_only_loss: bool = opt(True, "train on the assistant's tokens only (end-of-turn tokens included as "
                                    "the template places them); off trains on every token of the conversation")
    packing: bool = opt(True, "pack several conversations into each sample (best-fit decreasing), each attending "
                        "only within itself; off: one conversation per sample, padded (sft.padding)")
    padding: str = opt("seq_len", "seq_len: every microbatch holds training.seq_len positions; longest: each "
                       "microbatch is cut after the last position any of its samples trains on (rounded up to "
                       "sft.pad_to_multiple_of), its shape then varying from one microbatch to the next; not with "
                       "pipeline or context parallelism", choices=("seq_len", "longest"))
    pad_to_multiple_of: int = opt(16, "with sft.padding longest, the microbatch length is a multiple of this (fewer "
                                  "distinct shapes for torch.compile; under tensor parallelism a multiple of its "
                                  "degree, as sequence parallelism splits the sequence)")
    overlong: str = opt("truncate", "a conversation longer than training.seq_len + 1 tokens is truncated to it, or "
                        "dropped; both are counted in the log", choices=("truncate", "drop"))


register_section("sft", SFTOptions)


class SFT(Objective):
    name = "sft"
    attention_mask = "a document mask"
    generation = "chat"

    def __init__(self, options: SFTOptions | None = None, *, holds_out: bool = True, **loss_options):
        """holds_out: leave training.split's held-out parts out of training (validation reads them:
        data/conversations.py held_out_for_validation; for_job turns it off when validation does not
        read them, so that every conversation is trained on)."""
        super().__init__(**loss_options)
        self.options = options or SFTOptions()
        self.holds_out = holds_out

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> SFT:
        """training.objective sft: only for a family whose own objective predicts the next token."""
        if family_objective is not None and family_objective.generation is None:
            raise ValueError(f"training.objective sft fine-tunes models that predict the next token; {model} trains "
                             f"with {family_objective.name}")
        from titanlike.data.conversations import held_out_for_validation

        return cls(cfg.sft, holds_out=held_out_for_validation(cfg), **compile_options(cfg))

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        refuse_pretraining_options(cfg, "sft")
        super()._validate_job(cfg, dims, model=model)
        o = self.options
        if o.pad_to_multiple_of < 1:
            raise ValueError(f"sft.pad_to_multiple_of must be at least 1, got {o.pad_to_multiple_of}")
        if o.padding == "longest":
            # A pipeline schedule and context parallelism's position split are built for one length.
            for degree, name in ((dims.pp, "pipeline_parallel_degree"), (dims.cp, "context_parallel_degree")):
                if degree > 1:
                    raise ValueError(f"sft.padding longest gives microbatches of varying length, which "
                                     f"parallelism.{name} {degree} cannot take: use sft.padding seq_len (or packing)")
            if o.pad_to_multiple_of % dims.tp:
                raise ValueError(f"sft.pad_to_multiple_of {o.pad_to_multiple_of} must be a multiple of "
                                 f"parallelism.tensor_parallel_degree {dims.tp}: sequence parallelism splits each "
                                 "microbatch's sequence over its ranks")

    def _check_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import check_row_dataset

        check_row_dataset(dataset, dataset_path, option=option, objective="sft", files="conversation files",
                          contents="the conversations")

    def _check_held_out(self, dataset: str) -> None:
        """Conversations are held out by training.split (its 'valid' part), whatever the files."""

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        return {"inputs": tokens, "labels": tokens, "document_ids": tokens}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.chat_template import load_chat_template
        from titanlike.data.conversations import ConversationSamples, split_rows, tokenize_conversations
        from titanlike.data.loader import GlobalSamples

        self._check_dataset(dataset, dataset_path)
        o = self.options
        rows = split_rows(dataset_path, split, split_name, holds_out=self.holds_out)
        template = load_chat_template(o.chat_template, tokenizer)
        conversations = tokenize_conversations(rows, template, tokenizer, seq_len=seq_len, fmt=o.format,
                                               assistant_only_loss=o.assistant_only_loss, overlong=o.overlong)
        source = ConversationSamples(conversations, seq_len=seq_len, packing=o.packing, pad_id=pad_id(tokenizer))
        return GlobalSamples(source, shuffle=True, fields=source.fields)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        if self.options.padding == "longest":
            batch = cut_to_longest(batch, self.options.pad_to_multiple_of)
        inputs, labels = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        # Every cp rank keeps the ids of the whole sequence: its attention picks its rows.
        mask = DocumentMask.from_document_ids(batch["document_ids"].to(ctx.device), ctx.mask_kernel)
        mb = Microbatch(inputs, {"labels": labels}, target_count(labels), positions=mask.positions, mask=mask)
        if ctx.lookahead_tokens:
            # The tokens after each position (the next input; the labels hide untrained ones): a
            # prediction never reaches past its conversation (the document ids stop it).
            following = torch.cat([inputs[:, 1:], inputs[:, -1:]], dim=1)
            mb.lookahead = lookahead_targets(following, labels, ctx.lookahead_tokens, mask.document_ids)
        if ctx.cp_positions is not None:
            labels = cut_sequence(labels, ctx)
            mb.inputs, mb.targets, mb.units = cut_sequence(inputs, ctx), {"labels": labels}, target_count(labels)
            mb.positions = cut_sequence(mask.positions, ctx)
            if mb.lookahead is not None:
                mb.lookahead = cut_sequence(mb.lookahead, ctx)
        return mb


register_objective("sft", SFT.for_job, section="sft")


def cut_to_longest(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The microbatch's positions up to its last trained target, rounded up to `multiple` (at most
    the samples' length). Reads the loader's labels on the host, before they go to the device."""
    labels = batch["labels"]
    seq = labels.shape[1]
    trained = (labels != IGNORE_INDEX).any(0).nonzero()
    last = int(trained[-1]) + 1 if len(trained) else 1
    length = min(seq, -(-last // multiple) * multiple)
    if length == seq:
        return batch
    return {name: value[:, :length] for name, value in batch.items()}


__all__ = ["SFT", "SFTOptions", "cut_to_longest", "pad_id"]
