"""Conversations for supervised fine-tuning: read, rendered with a chat template, packed into samples.

Files (`training.dataset text`, `training.dataset_path` a file or a folder): JSONL (`.jsonl`,
`.jsonl.gz`, `.json` lines), Parquet (`.parquet`, needs pyarrow), or a folder a Hugging Face
`datasets` object was saved into (`save_to_disk`; needs `datasets`), or a folder of the files. A
row is one conversation, in one of four forms (`sft.format`, or "auto" from each row's keys):

- `messages`: a list of {"role", "content", ...} (system / user / assistant / tool turns; any
  other keys, such as tool calls, go to the template as they are);
  beside any conversation form, TRL's `tools` (a list of JSON schemas, or its JSON string) and
  `chat_template_kwargs` (e.g. {"enable_thinking": false}) columns go to the template as
  transformers' apply_chat_template(tools=..., **kwargs) passes them (row_template_inputs);
- `prompt` / `completion`: strings (a user turn and the assistant's answer) or lists of messages;
- `instruction` / `input` / `output` (Alpaca's): the instruction and the input, joined by a blank
  line when there is one, as the user turn, the output as the assistant's;
- `text` (TRL's language-modeling rows, its default dataset_text_field): a string, no chat template,
  read as TRL's SFTTrainer does: the tokenizer's own encoding (the BOS a Hugging Face tokenizer's
  post-processor adds, a tiktoken file's Llama 3 BOS) with EOS appended unless the text ends with it,
  every token trained (text_ids).

Each conversation becomes tokens t_0..t_{n-1} (titanlike/data/chat_template.py) and n - 1 training
positions: input t_j, target t_{j+1}, the target kept when t_{j+1} is the assistant's (or always,
sft.assistant_only_loss off). Samples hold `seq_len` positions: with packing, conversations are
placed by best-fit decreasing (the longest first, each into the fullest sample it still fits),
each a document of its own (its own positions, attention within it); without, one conversation per
sample. The rest of a sample is padding, a document of its own with no targets. A conversation
longer than seq_len + 1 tokens is cut to its first seq_len + 1 (sft.overlong truncate) or left out
(drop); the counts are logged.
"""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from titanlike.data.errors import DataError, DataPathError

logger = logging.getLogger("titanlike")

IGNORE_INDEX = -100  # models/outputs.py's, restated: data/ does not import the models
CONVERSATION_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
FORMATS = ("auto", "messages", "prompt_completion", "instruction", "text")
# In the order "auto" tries them: a row with messages and text is a conversation (TRL's order too).
_FORM_KEYS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
              "instruction": ("instruction", "output"), "text": ("text",)}


# ---------------------------------------------------------------------------------------------
# Rows.


def _is_saved_dataset(path: str) -> bool:
    """A folder `datasets`' save_to_disk wrote (a Dataset, or a DatasetDict of them)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def conversation_files(path: str) -> list[str]:
    """The files `path` names: itself, or those under it with a supported suffix (a saved dataset
    folder is one entry). DataError (one sentence) when there are none."""
    if _is_saved_dataset(path):
        return [path]
    if os.path.isfile(path):
        if not path.endswith(CONVERSATION_SUFFIXES):
            raise DataError(f"{path} is not a conversation file: expected {', '.join(CONVERSATION_SUFFIXES)} or a "
                            "folder saved by datasets' save_to_disk")
        return [path]
    if not os.path.isdir(path):
        raise DataPathError(f"dataset_path {path} does not exist")
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                   if name.endswith(CONVERSATION_SUFFIXES))
    if not files:
        raise DataError(f"no {', '.join(CONVERSATION_SUFFIXES)} files under {path}")
    return files


def _jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                # A \u escape of a lone surrogate parses, but is no text a tokenizer can encode.
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except RecursionError:
                raise DataError(f"{path} line {lineno} is JSON nested too deeply to read (past Python's recursion "
                                f"limit of {sys.getrecursionlimit()} levels)") from None
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1})") from None
            except UnicodeEncodeError as e:
                raise DataError(f"{path} line {lineno} holds a \\u escape of a lone surrogate "
                                f"({e.object[e.start]!r}), which is not text") from None
            except ValueError as e:
                raise DataError(f"{path} line {lineno} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno} is a JSON {type(row).__name__}, not an object")
            yield f"{path} line {lineno}", row


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path} is not a Parquet file pyarrow reads: {' '.join(str(e).split())[:200]}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _saved_dataset_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading the saved dataset {path} needs the datasets package "
                        "(pip install datasets, or pip install -e '.[hf]')") from None
    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data and len(data) != 1:
            raise DataError(f"the saved dataset {path} has the splits {', '.join(data)} and no 'train'; save the "
                            "split to train on")
        data = data["train"] if "train" in data else next(iter(data.values()))
    for i, row in enumerate(data):
        yield f"{path} row {i}", row


def iter_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of every conversation row under `path`, in a fixed order."""
    for file in conversation_files(path):
        if _is_saved_dataset(file):
            yield from _saved_dataset_rows(file)
        elif file.endswith(".parquet"):
            yield from _parquet_rows(file)
        else:
            yield from _jsonl_rows(file)


def _as_messages(value, where: str, key: str, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return list(value)
    raise DataError(f"{where}: {key!r} is {type(value).__name__}, not a string or a list of messages")


def row_format(row: dict, fmt: str, where: str) -> str:
    """The form of one row: `fmt` (FORMATS), or for "auto" the first whose keys the row has."""
    if fmt == "auto":
        fmt = next((f for f, keys in _FORM_KEYS.items() if all(k in row for k in keys)), "")
        if not fmt:
            raise DataError(f"{where} has the keys {', '.join(sorted(row)) or 'none'}, none of the conversation "
                            "forms: messages; prompt and completion; instruction (input) and output; text")
    missing = [k for k in _FORM_KEYS[fmt] if k not in row]
    if missing:
        raise DataError(f"{where} has no {missing[0]!r} (sft.format {fmt})")
    return fmt


def row_messages(row: dict, fmt: str, where: str) -> list[dict]:
    """The messages of one row in form `fmt` (FORMATS; "auto" looks at the row's keys); a text row
    has none (text_ids reads it)."""
    fmt = row_format(row, fmt, where)
    if fmt == "text":
        raise ValueError("a text row has no messages: text_ids reads it")  # a caller's mistake, not the data's
    if fmt == "messages":
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError(f"{where}: 'messages' is not a list of message objects")
    elif fmt == "prompt_completion":
        messages = (_as_messages(row["prompt"], where, "prompt", "user")
                    + _as_messages(row["completion"], where, "completion", "assistant"))
    else:
        instruction, extra, output = row["instruction"], row.get("input") or "", row["output"]
        if not all(isinstance(v, str) for v in (instruction, extra, output)):
            raise DataError(f"{where}: instruction, input and output must be strings")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    for m in messages:
        if not isinstance(m.get("role"), str):
            raise DataError(f"{where}: a message has no string 'role'")
    return messages


_RESERVED_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents")


def row_template_inputs(row: dict, where: str) -> tuple[list | None, dict | None]:
    """(tools, chat_template_kwargs) of one row, as TRL's SFTTrainer reads them: `tools` a list of
    tool schemas (objects) or its JSON text, `chat_template_kwargs` an object of template variables.
    DataError (one sentence) for another type or a variable the renderer sets itself."""
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise DataError(f"{where}: 'tools' is a string but not JSON: {e}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' is {type(tools).__name__}, not a list of tool schemas (JSON objects)")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise DataError(f"{where}: 'chat_template_kwargs' is {type(kwargs).__name__}, not an object of template "
                            "variables")
        taken = [k for k in kwargs if k in _RESERVED_VARIABLES]
        if taken:
            raise DataError(f"{where}: 'chat_template_kwargs' sets {taken[0]!r}, which the renderer sets itself")
    return tools, kwargs


def text_ids(tokenizer, text, where: str) -> list[int]:
    """A text row's token ids as TRL's SFTTrainer makes them (its add_eos, then the tokenizer
    called on the text): the tokenizer's own special tokens around the text (a Hugging
    Face tokenizer's post-processor, Llama 3's BOS for a tiktoken file) and EOS at the end, written
    once whether or not the text ends with EOS's string. One difference: a special token's string
    inside the text stays text (the tokenizers' rule here: data cannot forge a special token), where
    TRL's tokenizer call would read it as the token."""
    from titanlike.data.tokenizer_json import HuggingFaceTokenizer

    if not isinstance(text, str):
        raise DataError(f"{where}: 'text' is {type(text).__name__}, not a string")
    eos = tokenizer.decode([tokenizer.eos_id])
    if eos and text.endswith(eos):
        text = text[: -len(eos)]
    if isinstance(tokenizer, HuggingFaceTokenizer):
        ids = tokenizer.model.encode(text, add_special_tokens=True).ids
        return [*ids, tokenizer.eos_id]
    return tokenizer.encode(text, bos=True, eos=True)


# ---------------------------------------------------------------------------------------------
# Tokens and samples.


@dataclass
class TokenizedConversations:
    """Every conversation's training positions, concatenated: inputs, targets (IGNORE_INDEX where
    not trained), and the [start, end) of each conversation."""

    inputs: np.ndarray
    labels: np.ndarray
    bounds: np.ndarray  # (n + 1,) int64

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)


def render_row(template, tokenizer, messages: list[dict], where: str, what: str, *, max_tokens: int | None = None,
               tools: list | None = None, kwargs: dict | None = None, assistant_mask: bool = True):
    """tokenize_conversation's (ids, assistant mask) of one row; an error raised inside the template
    (its own raise_exception included, or a rendering rule it broke) is one DataError naming the row;
    what: "conversation", "pair"; max_tokens: tokenize_conversation's (the caller truncates there);
    tools, kwargs: row_template_inputs'. assistant_mask off: every token is marked, nothing is
    re-rendered (a loss on every token needs no turns, so a template that rewrites them serves)."""
    from titanlike.data.chat_template import (TemplateLimitError, encode_with_offsets, render,
                                              tokenize_conversation)

    try:
        if not assistant_mask:
            ids = encode_with_offsets(tokenizer, render(template, messages, tools=tools, kwargs=kwargs)[0])[0]
            return ids, [True] * len(ids)
        return tokenize_conversation(template, tokenizer, messages, max_tokens=max_tokens, tools=tools, kwargs=kwargs)
    except TemplateLimitError as e:
        raise DataError(f"{where}: {e}") from None
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{where}: {template.origin} refused the {what}: "
                        f"{' '.join(str(e).split())[:200] or type(e).__name__}") from None


def check_turns(turns: int, seq_len: int, where: str) -> None:
    """DataError (one sentence) for a conversation of more turns than training.seq_len + 1 tokens could
    hold: every turn renders to at least one token, so those past it would never be trained on, and
    rendering them (a template re-renders the turns before each assistant turn) could take hours."""
    if turns > seq_len + 1:
        raise DataError(f"{where} holds {turns:,} turns, more than the training.seq_len + 1 = {seq_len + 1:,} tokens "
                        "a sample holds (each turn is at least one token); split the conversation")


def tokenize_conversations(rows, template, tokenizer, *, seq_len: int, fmt: str = "auto",
                           assistant_only_loss: bool = True, overlong: str = "truncate") -> TokenizedConversations:
    """rows: (where, row) pairs; template: a chat_template.ChatTemplate. DataError (one sentence)
    for a row that is not a conversation, one without an assistant turn (under assistant-only loss),
    or one the template refuses. Under assistant-only loss a published template TRL has a training
    variant of is rendered with that variant (chat_template.training_variant), which the log says."""
    from titanlike.data.chat_template import training_variant
    from titanlike.observe.progress import progress

    variant = training_variant(template) if assistant_only_loss else None
    if variant is not None:
        logger.info(f"sft: {template.origin} rewrites earlier turns or tags no assistant text, so conversations are "
                    f"rendered with {variant.origin.split(' variant of ')[0]} variant (what TRL's SFTTrainer "
                    "does under assistant-only loss); exports keep the published template")
        template = variant

    inputs, labels, bounds = [], [], [0]
    truncated = dropped = 0
    for where, row in progress(rows, desc="sft: tokenizing conversations", unit=" conversations"):
        if row_format(row, fmt, where) == "text":
            # TRL trains every token of a text row (it has no turns to pick the assistant's from).
            ids = text_ids(tokenizer, row["text"], where)
            mask = [True] * len(ids)
        else:
            messages = row_messages(row, fmt, where)
            check_turns(len(messages), seq_len, where)
            if assistant_only_loss and not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{where} has no assistant turn, so nothing of it would be trained on")
            tools, kwargs = row_template_inputs(row, where)
            ids, mask = render_row(template, tokenizer, messages, where, "conversation", max_tokens=seq_len + 1,
                                   tools=tools, kwargs=kwargs, assistant_mask=assistant_only_loss)
        if len(ids) > seq_len + 1:
            if overlong == "drop":
                dropped += 1
                continue
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            truncated += 1
        if len(ids) < 2:
            continue
        target = np.asarray(ids[1:], dtype=np.int64)
        if assistant_only_loss:
            target = np.where(np.asarray(mask[1:], dtype=bool), target, IGNORE_INDEX)
        inputs.append(np.asarray(ids[:-1], dtype=np.int64))
        labels.append(target)
        bounds.append(bounds[-1] + len(target))
    if truncated or dropped:
        logger.info(f"sft: {truncated} conversations longer than seq_len + 1 = {seq_len + 1} tokens truncated, "
                    f"{dropped} dropped (sft.overlong {overlong})")
    if len(bounds) == 1:
        raise DataError("no conversation is left to train on" + (" (every one is too long for training.seq_len; "
                                                                 "sft.overlong truncate keeps them)" if dropped else ""))
    empty = np.zeros(0, dtype=np.int64)
    return TokenizedConversations(np.concatenate(inputs) if inputs else empty,
                                  np.concatenate(labels) if labels else empty, np.asarray(bounds, dtype=np.int64))


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most `capacity`: the longest item first, each into
    the bin with the least room that still holds it (a new bin when none does). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    # Sorted (room left, bin index) of the open bins.
    room: list[tuple[int, int]] = []
    for i in order:
        size = int(lengths[i])
        k = bisect.bisect_left(room, (size, -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - size, len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - size, b))
    return bins


def check_row_dataset(dataset: str, dataset_path: str | None, *, option: str, objective: str, files: str,
                      contents: str) -> None:
    """DataError (one sentence) unless `dataset` at `dataset_path` is rows an objective reads
    (`training.dataset text` naming JSONL or Parquet files or a saved datasets folder): sft's
    conversations, dpo's preference pairs. files: "conversation files"; contents: "the conversations"."""
    from titanlike.data.kinds import find_dataset_kind

    kind = find_dataset_kind(dataset)
    if kind is None or not kind.gives("rows"):
        raise DataError(f"{option}.dataset {dataset!r} cannot give {objective} samples, which read {files}: set "
                        f"{option}.dataset text and {option}.dataset_path to JSONL or Parquet files or a saved datasets "
                        f"folder of {contents}")
    kind.readers["rows"](dataset, dataset_path, option=option, contents=contents)


def check_row_files(dataset: str, dataset_path: str | None, *, option: str, contents: str) -> None:
    """The text kind's rows (data/loader.py): DataError, one sentence, unless dataset_path names JSONL or
    Parquet files or a saved datasets folder."""
    if not dataset_path:
        raise DataError(f"{option}.dataset {dataset} needs {option}.dataset_path ({contents})")
    try:
        conversation_files(dataset_path)
    except DataError as e:
        raise DataError(f"{option}.dataset_path: {e}") from None


def held_out_for_validation(cfg) -> bool:
    """Whether validation reads the training rows' held-out part (training.split's 'valid'): it is on
    and has no dataset of its own. Only then does training leave that part out (split_rows)."""
    return cfg.validation.enable and cfg.validation.dataset is None


def split_rows(dataset_path: str, split, split_name: str, *, holds_out: bool = True,
               what: str = "conversations", section: str = "sft") -> list:
    """The rows of `dataset_path` in training.split's part `split_name` (all of them without a split).
    holds_out: whether training leaves the other parts out (held_out_for_validation); with it off the
    'train' part is every row. The training part's log line says what was held out (what: "conversations",
    "pairs"; section: the objective's, which the line names)."""
    from titanlike.data.sentence_samples import split_documents

    rows = list(iter_rows(dataset_path))
    if split is None or (split_name == "train" and not holds_out):
        return rows
    begin, end = split_documents(len(rows), split, split_name, name=dataset_path)
    if split_name == "train" and end - begin < len(rows):
        logger.info(f"{section}: training.split {split} holds {len(rows) - (end - begin)} of the {len(rows)} {what} "
                    f"out of training ({_part_sizes(split, len(rows))}), for validation's 'valid' part")
    return rows[begin:end]


def _part_sizes(split: str, count: int) -> str:
    from titanlike.data.gpt_dataset import split_bookends

    parts = zip(("train", "valid", "test"), split_bookends(split))
    return ", ".join(f"{name} {round(b[1] * count) - round(b[0] * count)}" for name, b in parts if b is not None)


def choose_chat_template(choice: str, tokenizer, *, option: str):
    """(the template `choice` names, data/chat_template.py load_chat_template's, a warning when "auto"
    found none in the tokenizer folder and fell back to titanlike's llama3 template, else None)."""
    from titanlike.data.chat_template import folder_chat_template, load_chat_template

    template = load_chat_template(choice, tokenizer, option=option)
    if choice != "auto":
        return template, None
    folder = getattr(tokenizer, "path", None)
    if folder and os.path.isdir(folder) and folder_chat_template(folder) is not None:
        return template, None
    where = f"the tokenizer folder {folder}" if folder and os.path.isdir(folder) else "the tokenizer"
    return template, (f"{option} auto: {where} has no chat template, so conversations are rendered with titanlike's "
                      f"llama3 template (written into Hugging Face exports); name one with {option} to choose")


class ConversationSamples:
    """Map-style samples of `seq_len` positions: dicts of inputs, labels and document_ids (one id per
    document in the sample, then one for the padding, non-decreasing as the document mask needs).
    An item (a conversation here; a preference pair's two answers in data/preferences.py) is
    `documents_per_item` consecutive documents of the data, packed whole. `pad_id` fills the
    padding's inputs."""

    documents_per_item = 1

    def __init__(self, data: TokenizedConversations, *, seq_len: int, packing: bool, pad_id: int):
        self.data, self.seq_len, self.pad_id = data, seq_len, pad_id
        lengths = data.lengths()  # per item
        self.bins = best_fit_decreasing(lengths, seq_len) if packing else [[i] for i in range(len(lengths))]
        used, trained = int(lengths.sum()), int((data.labels != IGNORE_INDEX).sum())
        logger.info(f"{self.summary(len(data), trained)}, {used:,} positions in {len(self.bins)} samples of {seq_len} "
                    f"({used / (len(self.bins) * seq_len):.0%} filled)")

    def summary(self, items: int, trained: int) -> str:
        return f"sft: {items} conversations ({trained:,} trained tokens)"

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        shape = (self.seq_len,)
        return {"inputs": (shape, "int64"), "labels": (shape, "int64"), "document_ids": (shape, "int64")}

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        documents = np.zeros(self.seq_len, dtype=np.int64)
        at, doc, k = 0, 0, self.documents_per_item
        b = self.data.bounds
        for item in self.bins[index]:
            for d in range(k * item, k * item + k):
                n = int(b[d + 1] - b[d])
                inputs[at: at + n] = self.data.inputs[b[d]: b[d + 1]]
                labels[at: at + n] = self.data.labels[b[d]: b[d + 1]]
                documents[at: at + n] = doc
                at, doc = at + n, doc + 1
        documents[at:] = doc  # the padding: a document of its own
        return {"inputs": inputs, "labels": labels, "document_ids": documents}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} samples of {self.seq_len})"


__all__ = ["CONVERSATION_SUFFIXES", "ConversationSamples", "FORMATS", "TokenizedConversations", "best_fit_decreasing",
           "check_row_dataset", "check_row_files", "check_turns", "choose_chat_template", "held_out_for_validation",
           "split_rows", "conversation_files", "iter_rows", "row_format", "row_messages", "row_template_inputs",
           "text_ids", "tokenize_conversations"]
