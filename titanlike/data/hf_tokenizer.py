"""A titanlike tokenizer as Hugging Face tokenizer files, so that an exported model folder
works with ``transformers.AutoTokenizer.from_pretrained(folder)``.

The tiktoken ranks become a byte-level BPE through transformers' own ``TikTokenConverter``;
the pre-tokenization regex, the special tokens (ids right after the ranks) and the BOS that
``encode(bos=True)`` adds are set as our Tokenizer has them. The result is checked against
tiktoken on probe texts before anything is written. A tokenizer that cannot be converted
(transformers missing, a file that is not a tiktoken ranks file, a check that fails) is copied
as is next to a note saying how to load it: the export of the weights never fails for it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

# Not "tokenizer.model" nor "tiktoken.model": transformers converts a file of those names by
# itself, with its own special tokens, which would give other ids than the model was trained on.
TOKENIZER_COPY = "tokenizer.tiktoken"
TOKENIZER_NOTE = "TOKENIZER.md"
# A Hugging Face tokenizer folder's files (data/tokenizer_json.py reads a sentencepiece tokenizer.model
# or a tekken.json where there is no tokenizer.json).
_HF_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "tokenizer_config.json", "special_tokens_map.json")

# Text the converted tokenizer must encode as tiktoken does: regex edge cases (contractions,
# digit runs, whitespace runs, CR/LF), multi-byte UTF-8, and special-token strings.
_PROBES = (
    "In the beginning God created the heaven and the earth. 1234567 don't I'LL",
    "Héllo wörld, naïve café. Ελληνικά, русский, 中文测试 😀👍🏽 👨‍👩‍👧‍👦",
    "a  b   c\t\td\n\n\n e \r\n\r\n   \u00a0\u3000 trailing   ",
    "<|begin_of_text|>hi<|end_of_text|> <|eot_id|>x<|reserved_special_token_7|>",
)


class TokenizerExport(NamedTuple):
    converted: bool  # tokenizer.json and tokenizer_config.json were written
    message: str  # one line for the export's log


def tokenizer_record(tokenizer, chat_template=None) -> dict:
    """What a checkpoint records about its job's tokenizer (the sidecar's "tokenizer" entry).

    Besides the special ids, where the tokenizer file is and a fingerprint of its ranks: the
    checkpoint writer stores those files inside the checkpoint (store_tokenizer), so that an export
    made later (convert_dcp_to_hf) can add the tokenizer files, and can tell when they no longer
    hold the ranks the model was trained with. chat_template (a data/chat_template.py ChatTemplate):
    the template the job rendered conversations with, recorded with its end-of-turn ids (EOS left
    out), which the exports write as tokenizer_config.json's chat_template and generation stops.
    """
    record = {"bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id)}
    pad_id = _pad_id(tokenizer)
    if pad_id is not None:  # what masked-LM and span-corruption samples are padded with
        record["pad_id"] = pad_id
    if getattr(tokenizer, "path", None):
        record["path"] = os.path.abspath(tokenizer.path)
    if getattr(tokenizer, "fingerprint", None):
        record["fingerprint"] = tokenizer.fingerprint
    if chat_template is not None:
        from titanlike.data.chat_template import end_of_turn_ids

        record["chat_template"] = chat_template.source
        try:
            record["end_of_turn_ids"] = sorted(end_of_turn_ids(chat_template, tokenizer) - {tokenizer.eos_id})
        except Exception:  # a template refusing the probe conversation: its exports stop at EOS only
            pass
    return record


def store_tokenizer(folder: str, record: dict) -> dict:
    """A checkpoint keeps its tokenizer inside itself: the files of the record's "path" (a tiktoken
    ranks file, copied as TOKENIZER_COPY, or a Hugging Face tokenizer folder's files) are copied into
    checkpoint `folder`, and the record the sidecar keeps names them ("files") instead of the path.
    Nothing a checkpoint records points outside it, so an export made from a crafted sidecar reads
    no file of the machine (stored_tokenizer)."""
    record = dict(record)
    source = record.pop("path", None)
    if not source:
        return record
    if os.path.isdir(source):
        names = [name for name in _HF_FILES if os.path.isfile(os.path.join(source, name))]
        for name in names:
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
    else:
        names = [TOKENIZER_COPY]
        shutil.copyfile(source, os.path.join(folder, TOKENIZER_COPY))
    record["files"] = names
    return record


def stored_tokenizer(folder: str, record: dict) -> tuple[str | None, str | None]:
    """(the tokenizer a checkpoint stored inside itself: its file, or `folder` for Hugging Face
    tokenizer files; None when there is none, and then why in one sentence, or None when the
    checkpoint simply names no tokenizer). Only plain files of the folder itself are read: a record
    naming a path (older titanlike wrote the tokenizer's absolute path) or a file that leads outside
    the folder (a symlink, '..') is not followed."""
    if not isinstance(record, dict):
        return None, None
    files = record.get("files")
    if files is None:
        if record.get("path"):
            return None, (f"the checkpoint names its tokenizer by a path outside itself ({record['path']!s:.200}), "
                          "which is not read (an older titanlike wrote it, or it was edited): pass the tokenizer "
                          "file explicitly")
        return None, None
    if not (isinstance(files, list) and files and all(isinstance(n, str) for n in files)):
        return None, "the checkpoint's tokenizer entry is damaged (its files are not a list of names)"
    for name in files:
        if not _plain_file(folder, name):
            return None, (f"the checkpoint's tokenizer file {name!r:.200} is not a plain file inside {folder} "
                          "(a path, a link or missing), so it is not read")
    if {"tokenizer.json", "tokenizer.model", "tekken.json"} & set(files):
        extra = [n for n in _HF_FILES if os.path.lexists(os.path.join(folder, n)) and not _plain_file(folder, n)]
        if extra:
            return None, f"the checkpoint's tokenizer file {extra[0]} is a link or not a plain file, so it is not read"
        return folder, None
    if files != [TOKENIZER_COPY]:
        return None, f"the checkpoint's tokenizer entry names {files!r:.200}, not {TOKENIZER_COPY} or tokenizer.json"
    return os.path.join(folder, TOKENIZER_COPY), None


def _plain_file(folder: str, name: str) -> bool:
    """Whether `name` is a plain file name (no path) of a regular file in folder, not a link."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        return False
    path = os.path.join(folder, name)
    return os.path.isfile(path) and not os.path.islink(path)


def _pad_id(tokenizer) -> int | None:
    from titanlike.data.errors import DataError
    from titanlike.data.special_tokens import special_token_ids

    try:
        return special_token_ids(tokenizer, ["pad"])["pad"]
    except DataError:
        return None


# Llama 3's framing (BOS first) and the roles its tokenizer_config.json names.
DEFAULT_TEMPLATE = ("bos $A", "bos $A bos $B")
DEFAULT_ROLES = ("bos", "eos", "pad")


def write_hf_tokenizer(out: str, path: str | None, *, fingerprint: str | None = None,
                       vocab_size: int | None = None, model_max_length: int | None = None,
                       template: tuple[str, str] = DEFAULT_TEMPLATE,
                       roles: tuple[str, ...] = DEFAULT_ROLES) -> TokenizerExport:
    """Write the tokenizer at ``path`` into the Hugging Face folder ``out``.

    fingerprint: the ranks' fingerprint the checkpoint recorded (None: not checked);
    vocab_size: the model's vocabulary, which every token id must fit in;
    model_max_length: the model's context, for tokenizer_config.json;
    template, roles: the model family's convention (HFAdapter.tokenizer_template / tokenizer_roles):
    how its tokenizers frame a text and which special tokens they name.
    Returns what was done; raises only for errors writing into ``out``.
    """
    from titanlike.data.tokenizer import build_tokenizer

    # A folder exported into before may hold another tokenizer's files, or the note of one that
    # could not be converted; left there, they would describe the wrong tokenizer.
    for name in (*_HF_FILES, TOKENIZER_COPY, TOKENIZER_NOTE):
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    if not path:
        return TokenizerExport(False, "no tokenizer files written: the checkpoint names no tokenizer")
    if os.path.isdir(path):
        return _copy_hf_folder(out, path, fingerprint=fingerprint, vocab_size=vocab_size)
    if not os.path.isfile(path):
        return TokenizerExport(False, f"no tokenizer files written: tokenizer {path} not found")
    try:
        tokenizer = build_tokenizer(path)
    except (OSError, ValueError) as e:
        return _copy_with_note(out, path, None, f"it is not a tiktoken ranks file titanlike reads ({e})")
    if fingerprint and tokenizer.fingerprint != fingerprint:
        return TokenizerExport(False, f"no tokenizer files written: {path} no longer holds the ranks the model "
                                      "was trained with (its fingerprint differs from the checkpoint's)")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        return TokenizerExport(False, f"no tokenizer files written: {path} has {tokenizer.vocab_size} ids but "
                                      f"the model only {vocab_size}")
    try:
        fast = _convert(tokenizer, model_max_length, template, roles)
    except Exception as e:  # any failure of an optional library: fall back to the copy
        return _copy_with_note(out, path, tokenizer, f"{type(e).__name__}: {e}")
    fast.save_pretrained(out)
    _name_generic_class(out)
    return TokenizerExport(True, f"tokenizer.json and tokenizer_config.json from {path} "
                                 f"({tokenizer.vocab_size} ids, same ids as titanlike's tokenizer)")


def _copy_hf_folder(out: str, folder: str, *, fingerprint: str | None, vocab_size: int | None) -> TokenizerExport:
    """A job trained with a Hugging Face tokenizer folder (model.hf_assets_path): its files, as they are."""
    from titanlike.data.tokenizer_json import HuggingFaceTokenizer

    try:
        tokenizer = HuggingFaceTokenizer(folder)
    except (ImportError, OSError, ValueError) as e:
        return TokenizerExport(False, f"no tokenizer files written: {e}")
    if fingerprint and tokenizer.fingerprint != fingerprint:
        return TokenizerExport(False, f"no tokenizer files written: {folder} no longer holds the tokenizer the model "
                                      "was trained with (its fingerprint differs from the checkpoint's)")
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        return TokenizerExport(False, f"no tokenizer files written: {folder} has {tokenizer.vocab_size} ids but "
                                      f"the model only {vocab_size}")
    copied = [name for name in _HF_FILES if os.path.isfile(os.path.join(folder, name))]
    for name in copied:
        shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    return TokenizerExport(True, f"{', '.join(copied)} copied from {folder} (the tokenizer the model was trained with)")


def _role_ids(tokenizer, roles) -> dict[str, int]:
    """The id of each role (bos, eos: the tokenizer's own; cls, sep, mask, pad: the objectives' special
    tokens, data/special_tokens.py); DataError (a ValueError) for one the tokenizer lacks."""
    from titanlike.data.special_tokens import special_token_ids

    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    return {role: ids[role] if role in ids else special_token_ids(tokenizer, [role])[role] for role in roles}


def template_framing(tokenizer, template: str):
    """A family's single-text template (HFAdapter.tokenizer_template[0], e.g. "bos $A") as the ids it
    puts around a text with `tokenizer` (data/tokenizer_json.py Framing): how the family's exported
    tokenizer frames it. DataError (a ValueError) for a role the tokenizer lacks."""
    from titanlike.data.tokenizer_json import Framing

    pieces = template.split()
    at = pieces.index("$A")
    role_ids = _role_ids(tokenizer, {p for p in pieces if p != "$A"})
    return Framing(tuple(role_ids[p] for p in pieces[:at]), tuple(role_ids[p] for p in pieces[at + 1:]))


def _framed(template: str, role_ids: dict[str, int], ids: list[int]) -> list[int]:
    """A single-text template applied to a text's ids (what the converted tokenizer must give)."""
    return [i for piece in template.split() for i in (ids if piece == "$A" else [role_ids[piece]])]


def _convert(tokenizer, model_max_length: int | None, template: tuple[str, str] = DEFAULT_TEMPLATE,
             roles: tuple[str, ...] = DEFAULT_ROLES):
    """transformers' fast tokenizer giving our ids, framed as the family's tokenizers frame a text;
    ValueError if the probes say otherwise."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from titanlike.data.tokenizer import load_bpe_ranks

    class _Converter(TikTokenConverter):
        # TikTokenConverter reads the file through tiktoken's loader, which caches contents by
        # path: a tokenizer retrained to the same path would be converted from the stale copy.
        # (transformers 4.x calls tiktoken directly; the probes below catch a stale copy there.)
        @staticmethod
        def load_tiktoken_bpe(_):
            return load_bpe_ranks(tokenizer.path)

    # In id order, so each lands on the id after the last: our special ids. transformers 5 names
    # the argument extra_special_tokens, 4.x additional_special_tokens; each ignores the other.
    specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    names = [t for t, _ in specials]
    backend = _Converter(vocab_file=tokenizer.path, pattern=tokenizer.pat_str, extra_special_tokens=names,
                         additional_special_tokens=names).converted()
    # The family's framing (Llama 3: BOS first, as its tokenizer.json and our training encode; GPT-2
    # nothing; BERT [CLS] ... [SEP]; T5 ... EOS), with our special tokens in those roles.
    framing = [piece.split(":")[0] for t in template for piece in t.split() if not piece.startswith("$")]
    role_ids = _role_ids(tokenizer, {*roles, *framing})
    tokens = {role: _token(tokenizer, id_) for role, id_ in role_ids.items()}

    def spelled(t: str) -> str:
        return " ".join(tokens[p.split(":")[0]] + p[len(p.split(":")[0]):] if not p.startswith("$") else p
                        for p in t.split())

    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=spelled(template[0]), pair=spelled(template[1]),
                                      special_tokens=sorted({(tokens[r], role_ids[r]) for r in framing})),
    ])

    for token, id_ in specials:
        if backend.token_to_id(token) != id_:
            raise ValueError(f"special token {token} got id {backend.token_to_id(token)}, not {id_}")
    for text in _PROBES:
        want = _framed(template[0], role_ids, tokenizer.encode(text, bos=False, eos=False, allowed_special="all"))
        got = backend.encode(text).ids
        if got != want:
            raise ValueError(f"the converted tokenizer encodes {text[:30]!r} as {got[:8]}..., "
                             f"tiktoken as {want[:8]}...")
        if backend.decode(got, skip_special_tokens=False) != tokenizer.decode(want):
            raise ValueError(f"the converted tokenizer decodes {text[:30]!r} differently")

    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{f"{role}_token": tokens[role] for role in roles},
        # Otherwise transformers 4.x drops spaces before punctuation when decoding ("a ." -> "a.").
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def _token(tokenizer, id_: int) -> str:
    return next(t for t, i in tokenizer.special_tokens.items() if i == id_)


def _name_generic_class(out: str) -> None:
    """tokenizer_config.json names PreTrainedTokenizerFast, as Meta's Llama 3 folders do.

    transformers 5 saves its new class name (TokenizersBackend), which transformers 4.x and the
    tools pinned to it (vLLM, TGI) do not know; 5.x reads the old name as the same class.
    """
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)  # 5.x's default, and unknown to 4.x
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _copy_with_note(out: str, path: str, tokenizer, reason: str) -> TokenizerExport:
    from titanlike.data.tokenizer import Tokenizer

    os.makedirs(out, exist_ok=True)
    shutil.copyfile(path, os.path.join(out, TOKENIZER_COPY))
    if isinstance(tokenizer, Tokenizer):
        layout = (
            f"- tiktoken BPE ranks ({tokenizer.num_bpe_tokens} of them, one `base64(token) rank` per line), "
            "split by Llama 3's pre-tokenization regex:\n\n"
            f"      {tokenizer.pat_str}\n\n"
            f"- {len(tokenizer.special_tokens)} special tokens (Llama 3's) at ids {tokenizer.num_bpe_tokens}.."
            f"{tokenizer.vocab_size - 1}: BOS `{_token(tokenizer, tokenizer.bos_id)}` = {tokenizer.bos_id}, "
            f"EOS `{_token(tokenizer, tokenizer.eos_id)}` = {tokenizer.eos_id}; "
            "training text starts with BOS and ends with EOS.\n"
        )
    else:
        layout = "- the file the model was trained with, copied unchanged.\n"
    note = (
        "# Tokenizer\n\n"
        f"`{TOKENIZER_COPY}` is the tokenizer this model was trained with, copied from `{path}`. "
        "It could not be converted to Hugging Face's `tokenizer.json`, so "
        "`transformers.AutoTokenizer.from_pretrained` does not load it from this folder.\n\n"
        f"Reason: {reason}\n\n"
        f"{layout}\n"
        "Load it with titanlike (the same ids as in training):\n\n"
        "```python\n"
        "from titanlike.data import build_tokenizer\n"
        f'tokenizer = build_tokenizer("{TOKENIZER_COPY}")\n'
        "ids = tokenizer.encode(text, bos=True, eos=False)\n"
        "```\n"
    )
    with open(os.path.join(out, TOKENIZER_NOTE), "w") as f:
        f.write(note)
    return TokenizerExport(False, f"tokenizer {path} could not be converted to tokenizer.json ({reason}); "
                                  f"copied it as {TOKENIZER_COPY}, {TOKENIZER_NOTE} says how to load it")


__all__ = ["TOKENIZER_COPY", "TOKENIZER_NOTE", "TokenizerExport", "store_tokenizer", "stored_tokenizer",
           "template_framing", "tokenizer_record", "write_hf_tokenizer"]
