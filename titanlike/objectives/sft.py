"""Supervised fine-tuning on conversations: next-token prediction on the assistant's turns.

Chosen by `training.objective sft` for any family whose own objective predicts the next token
(objectives/registry in objectives/__init__.py). Samples are conversations rendered with a chat
template and packed (titanlike/data/conversations.py, data/chat_template.py): each sample carries
its document ids, so every conversation attends only within itself and its RoPE positions start at
0, with the attention kernel's document mask (the pre-training document-masking machinery, which
context parallelism reads from the same ids). The loss is the causal LM's: summed over the trained
targets, divided once by the step's global count.

Options, [sft]: format, chat_template, assistant_only_loss, packing, overlong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titanlike.config.schema import opt
from titanlike.config.sections import register_section
from titanlike.models.common.attention import DocumentMask
from titanlike.objectives.base import BatchContext, FieldShapes, Microbatch, Objective, cut_sequence
from titanlike.objectives.causal_lm import lookahead_targets
from titanlike.objectives.registry import register_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees


@dataclass
class SFTOptions:
    format: str = opt("auto", "conversation form of each row: messages (a list of role/content turns), "
                      "prompt_completion (prompt and completion), instruction (instruction, input, output: "
                      "Alpaca's), or auto (from each row's keys)",
                      choices=("auto", "messages", "prompt_completion", "instruction"))
    chat_template: str = opt(
        "auto", "auto: the tokenizer folder's chat_template (tokenizer_config.json or chat_template.jinja), else "
        "titanlike's llama3 template; tokenizer: the folder's, required; llama3 or chatml: titanlike's own; or a "
        "path to a Jinja file")
    assistant_only_loss: bool = opt(True, "train on the assistant's tokens only (end-of-turn tokens included as "
                                    "the template places them); off trains on every token of the conversation")
    packing: bool = opt(True, "pack several conversations into each sample (best-fit decreasing), each attending "
                        "only within itself; off: one conversation per sample, padded to training.seq_len")
    overlong: str = opt("truncate", "a conversation longer than training.seq_len + 1 tokens is truncated to it, or "
                        "dropped; both are counted in the log", choices=("truncate", "drop"))


register_section("sft", SFTOptions)


class SFT(Objective):
    name = "sft"
    attention_mask = "a document mask"
    predicts_next_token = True

    def __init__(self, options: SFTOptions | None = None, **loss_options):
        super().__init__(**loss_options)
        self.options = options or SFTOptions()

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, *, family_objective: Objective | None = None,
                model: str = "the model") -> SFT:
        """training.objective sft: only for a family whose own objective predicts the next token."""
        if family_objective is not None and not family_objective.predicts_next_token:
            raise ValueError(f"training.objective sft fine-tunes models that predict the next token; {model} trains "
                             f"with {family_objective.name}")
        return cls(cfg.sft, **cls.compile_options(cfg))

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        t = cfg.training
        for option in ("document_masking", "eod_mask_loss"):
            if getattr(t, option):
                raise ValueError(f"training.{option} applies to packed pre-training text; sft samples carry their "
                                 f"own document masks: remove training.{option}")
        if t.rampup_batch_size:
            raise ValueError("training.rampup_batch_size is for pre-training; remove it with training.objective sft")

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        from titanlike.data.conversations import conversation_files
        from titanlike.data.errors import DataError

        if dataset != "text":
            raise DataError(f"{option}.dataset {dataset!r} cannot give sft samples, which read conversation files: "
                            f"set {option}.dataset text and {option}.dataset_path to JSONL or Parquet files or a "
                            "saved datasets folder")
        if not dataset_path:
            raise DataError(f"{option}.dataset text needs {option}.dataset_path (the conversations)")
        try:
            conversation_files(dataset_path)
        except DataError as e:
            raise DataError(f"{option}.dataset_path: {e}") from None

    def validate_held_out(self, dataset: str) -> None:
        """Conversations are held out by training.split (its 'valid' part), whatever the files."""

    def sample_fields(self, seq_len: int) -> FieldShapes:
        tokens = ((seq_len,), "int64")
        return {"inputs": tokens, "labels": tokens, "document_ids": tokens}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.chat_template import load_chat_template
        from titanlike.data.conversations import ConversationSamples, iter_rows, tokenize_conversations
        from titanlike.data.loader import GlobalSamples
        from titanlike.data.sentence_samples import split_documents

        self.validate_dataset(dataset, dataset_path)
        o = self.options
        rows = list(iter_rows(dataset_path))
        if split is not None:
            begin, end = split_documents(len(rows), split, split_name, name=dataset_path)
            rows = rows[begin:end]
        template = load_chat_template(o.chat_template, tokenizer)
        conversations = tokenize_conversations(rows, template, tokenizer, seq_len=seq_len, fmt=o.format,
                                               assistant_only_loss=o.assistant_only_loss, overlong=o.overlong)
        source = ConversationSamples(conversations, seq_len=seq_len, packing=o.packing, pad_id=pad_id(tokenizer))
        return GlobalSamples(source, shuffle=True, fields=source.fields)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, labels = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        # Every cp rank keeps the ids of the whole sequence: its attention picks its rows.
        mask = DocumentMask.from_document_ids(batch["document_ids"].to(ctx.device), ctx.mask_kernel)
        mb = Microbatch(inputs, labels, positions=mask.positions, mask=mask)
        if ctx.lookahead_tokens:
            # The tokens after each position (the next input; the labels hide untrained ones): a
            # prediction never reaches past its conversation (the document ids stop it).
            following = torch.cat([inputs[:, 1:], inputs[:, -1:]], dim=1)
            mb.lookahead = lookahead_targets(following, labels, ctx.lookahead_tokens, mask.document_ids)
        if ctx.cp_positions is not None:
            mb.inputs, mb.labels = cut_sequence(inputs, ctx), cut_sequence(labels, ctx)
            mb.positions = cut_sequence(mask.positions, ctx)
            if mb.lookahead is not None:
                mb.lookahead = cut_sequence(mb.lookahead, ctx)
        return mb


register_objective("sft", SFT.for_job, section="sft")


def pad_id(tokenizer) -> int:
    """The token that fills padding (never trained on, masked out of attention): the tokenizer's pad
    token where it has one, else EOS."""
    pad = getattr(tokenizer, "pad_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else tokenizer.eos_id


__all__ = ["SFT", "SFTOptions", "pad_id"]
