"""Chat templates: a conversation rendered to token ids, with the mask of the assistant's tokens.

Rendering follows `transformers`' `apply_chat_template` so that a model fine-tuned here sees at
inference exactly the tokens it was trained on: the template (Jinja, from the tokenizer folder's
`tokenizer_config.json` `chat_template` or `chat_template.jinja`) runs in a sandboxed environment
with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, transformers' `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace`, and the tokenizer's special-token
strings (`bos_token`, `eos_token`, ...) as variables. The rendered text is tokenized whole, with the
special-token strings the template wrote read as special tokens (`add_special_tokens=False`: the
template places BOS itself).

The assistant mask: a template may wrap what the model must learn to write in
`{% generation %}...{% endgeneration %}`; a token is the assistant's when its characters overlap
such a span (transformers' `return_assistant_tokens_mask=True`). A template without generation
tags (most published ones) is re-rendered on prefixes instead: for each assistant turn k, the
conversation up to k with the generation prompt, and up to k included; the characters between the
two ends are that turn's (what TRL and torchtitan do for prompt/completion pairs). That needs each
prefix's rendering to be a prefix of the whole one; a template that rewrites earlier turns (Qwen3
drops old reasoning) cannot be split so: SFT swaps in TRL's training variant of the published ones
it knows (`training_variant`, as TRL's SFTTrainer does) and refuses the others in one sentence,
naming generation tags.

Templates of our own serve tokenizers without one (`BUILTIN_TEMPLATES`): Llama 3's format (whose
header and end-of-turn tokens every Llama-3-format tokenizer, the debug one included, has) and
ChatML, both with generation tags. Published templates shipped in `assets/chat_templates/`
(`published_template_names`: Gemma 3's, gpt-oss', Qwen3's, ...) are chosen by name too, for a
tokenizer that has the model's special tokens but not its template.

A template is data a downloaded folder or a server's operator supplies, so rendering is bounded
(issue 46): Jinja's immutable sandbox (no attribute walks to Python internals, no mutating
methods), a time limit (`ChatTemplate.time_limit`, checked at every call, attribute, operator and
`range` item), and a size limit on the text (`max_chars`, checked before a string or list is
multiplied or joined and on every piece rendered). A template that breaks a rule stops with a
DataError naming the template and the rule (`TemplateLimitError`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import threading
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

from titanlike.data.errors import DataError

# Llama 3.x's published format, trimmed of tools and dates, with generation tags around what the
# assistant writes (its text and its end-of-turn token).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN_TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}

# The tokenizer_config.json entries a template may read as variables (transformers passes its
# special_tokens_map).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


RENDER_SECONDS = 10.0  # one rendering; a conversation of 10^5 turns renders in about a second
MAX_RENDER_CHARS = 1 << 26  # 64 Mi characters of text, or items of a list a template builds
MAX_RANGE = 100_000  # items of one range(), Jinja's sandbox's own cap


class TemplateLimitError(DataError):
    """A chat template broke one of the rendering rules (the module docstring's limits)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source, where it came from (for messages), the variables it renders with, and
    the limits of one rendering (seconds, characters)."""

    source: str
    origin: str  # "tokenizer_config.json of FOLDER", "titanlike's llama3 template", a file path
    variables: dict[str, str]
    time_limit: float = RENDER_SECONDS
    max_chars: int = MAX_RENDER_CHARS

    @property
    def has_generation_tags(self) -> bool:
        import re

        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None


def _config_token(value: Any) -> str | None:
    # tokenizer_config.json writes a token as a string or as {"content": "<s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def folder_chat_template(folder: str) -> str | None:
    """The chat template a Hugging Face tokenizer folder holds (`chat_template.jinja`, or
    tokenizer_config.json's `chat_template`, a string or a list of named templates whose "default"
    is taken), or None."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    config = _tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def _token_string(tokenizer, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    return tokenizer.decode([token_id])


def load_chat_template(choice: str, tokenizer, *, option: str = "sft.chat_template") -> ChatTemplate:
    """The template `choice` names for `tokenizer`: "auto" (the tokenizer folder's, else titanlike's
    llama3), "tokenizer" (the folder's, required), "llama3" / "chatml" (ours), a published template's
    name (published_template_names), or a path to a Jinja file. DataError (one sentence) when it
    cannot be had or does not compile."""
    folder = getattr(tokenizer, "path", None)
    folder = folder if folder and os.path.isdir(folder) else None
    variables: dict[str, str] = {}
    if folder is not None:
        config = _tokenizer_config(folder)
        variables = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _config_token(config.get(k))) is not None}
    # BOS / EOS as the tokenizer itself resolves them, where tokenizer_config.json is silent.
    variables.setdefault("bos_token", _token_string(tokenizer, getattr(tokenizer, "bos_id", None)) or "")
    variables.setdefault("eos_token", _token_string(tokenizer, getattr(tokenizer, "eos_id", None)) or "")
    if choice in BUILTIN_TEMPLATES:
        source, origin = BUILTIN_TEMPLATES[choice], f"titanlike's {choice} template"
    elif choice in published_template_names():
        with open(os.path.join(_VARIANTS_DIR, f"{choice}.jinja"), encoding="utf-8") as f:
            source, origin = f.read(), f"the published {choice} template"
    elif choice in ("auto", "tokenizer"):
        source = folder_chat_template(folder) if folder is not None else None
        origin = f"the chat_template of {folder}"
        if source is None:
            if choice == "tokenizer":
                where = folder if folder is not None else f"the tokenizer {getattr(tokenizer, 'path', tokenizer)}"
                raise DataError(f"{option} tokenizer: {where} has no chat_template (tokenizer_config.json or "
                                "chat_template.jinja); name one of titanlike's (llama3, chatml) or a Jinja file")
            source, origin = LLAMA3_TEMPLATE, "titanlike's llama3 template (the tokenizer has none)"
    else:
        if not os.path.isfile(choice):
            names = ", ".join([*BUILTIN_TEMPLATES, *published_template_names()])
            raise DataError(f"{option} {choice!r} is neither auto, tokenizer, a template's name ({names}) nor an "
                            "existing Jinja file")
        with open(choice, encoding="utf-8") as f:
            source, origin = f.read(), choice
    try:
        _compile(source)
    except Exception as e:  # jinja2.TemplateSyntaxError and the sandbox's refusals
        raise DataError(f"{option}: {origin} does not compile: {_one_line(e)}") from None
    return ChatTemplate(source, origin, variables)


# TRL 1.16's training variants of published templates (titanlike/data/assets/chat_templates/README.md):
# each name's NAME.jinja is the published template, NAME_training.jinja its variant.
TRAINING_VARIANTS = ("deepseek_r1_distill", "gptoss", "phi3", "phi3_5", "qwen3")
_VARIANTS_DIR = os.path.join(os.path.dirname(__file__), "assets", "chat_templates")


def training_variant(template: ChatTemplate) -> ChatTemplate | None:
    """TRL's training variant of `template` when it is a published template TRL has one for
    (TRAINING_VARIANTS, compared byte for byte as TRL's get_training_chat_template does) and has no
    generation tags, else None. The variant renders each turn as it stays once later turns follow and
    tags what the assistant writes, so the assistant's tokens can be found (the published Qwen3 and
    DeepSeek-R1 drop old reasoning, which re-rendering prefixes cannot split); TRL's SFTTrainer swaps
    it in under assistant-only loss the same way. Exports keep the published template, to chat with."""
    if template.has_generation_tags:
        return None
    name = _published_templates().get(template.source)
    if name is None:
        return None
    with open(os.path.join(_VARIANTS_DIR, f"{name}_training.jinja"), encoding="utf-8") as f:
        source = f.read()
    return dataclasses.replace(template, source=source, origin=f"TRL's {name}_training variant of {template.origin}")


@lru_cache(maxsize=1)
def published_template_names() -> tuple[str, ...]:
    """The published templates shipped in assets/chat_templates/ (its README says whose), by file name."""
    names = (f[: -len(".jinja")] for f in os.listdir(_VARIANTS_DIR) if f.endswith(".jinja"))
    return tuple(sorted(n for n in names if not n.endswith("_training")))


@lru_cache(maxsize=1)
def _published_templates() -> dict[str, str]:
    published = {}
    for name in TRAINING_VARIANTS:
        with open(os.path.join(_VARIANTS_DIR, f"{name}.jinja"), encoding="utf-8") as f:
            published[f.read()] = name
    return published


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


# ---------------------------------------------------------------------------------------------
# The Jinja environment (transformers' settings), compiled once per template.


class _Limit(Exception):
    """Raised inside a rendering that broke a rule; render() names the template (TemplateLimitError)."""


class _Render(threading.local):
    """The rendering under way in this thread (server threads render one template concurrently): the
    characters yielded so far, the spans of `{% generation %}` blocks, the deadline and the size cap."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.spans: list[tuple[int, int]] | None = None  # (blocks yielded before it, its length)
        self.deadline = float("inf")
        self.time_limit = 0.0
        self.max_chars = MAX_RENDER_CHARS
        self.ticks = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Limit(f"it ran past the time limit of {self.time_limit:g} s (a loop too long?)")

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 255:
            self.check_time()

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _Limit(f"{what} would hold {size} items or characters, more than the limit of {self.max_chars}")


class _Range(SequenceABC):
    """range() for templates: at most MAX_RANGE items, and each item a tick of the time limit (a loop
    over it may have no other hook: `{% for i in range(n) %}{% endfor %}`)."""

    def __init__(self, state: _Render, *args) -> None:
        self._range, self._state = range(*args), state
        if len(self._range) > MAX_RANGE:
            raise _Limit(f"range() of {len(self._range)} items is more than the limit of {MAX_RANGE}")

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        return self._range[index]

    def __iter__(self):
        for item in self._range:
            self._state.tick()
            yield item


def _sized(value) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


@lru_cache(maxsize=32)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    state = _Render()

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if state.spans is not None:
                # Everything rendered before this block has been yielded already (see render()): its
                # start is the length of those blocks, summed once at the end (summing them here,
                # at every block, was quadratic in the turns).
                state.spans.append((len(state.blocks), len(text)))
            return text

    class Limited(ImmutableSandboxedEnvironment):
        """The immutable sandbox with the time and size rules at each hook it offers."""

        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "+" and type(left) is str and type(right) is str:  # text joined: the common case, fast
                if len(left) + len(right) > state.max_chars:
                    state.check_size(len(left) + len(right), "a string joined")
                return left + right
            state.tick()
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if _sized(seq) is not None and isinstance(times, int):
                        state.check_size(_sized(seq) * max(times, 0), "a string or list multiplied")
            elif operator == "+" and _sized(left) is not None and _sized(right) is not None:
                state.check_size(_sized(left) + _sized(right), "a string or list joined")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right > 4096:
                raise _Limit(f"{left} ** {right} is a number of more than 1,000 digits")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, r"%[^a-zA-Z%]*?")
                _check_args(right if isinstance(right, tuple) else (right,), "a %-format's value")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's spelling)
            state.tick()
            if getattr(__obj, "__name__", None) in ("format", "format_map"):
                method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
                if isinstance(getattr(method, "__self__", None), str):
                    _check_format(method.__self__, r"[:!][^{}]*?")
            if args:
                _check_args(args, "a call's argument")
            if kwargs:
                _check_args(kwargs.values(), "a call's argument")
            return _checked(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            state.ticks += 1
            if not state.ticks & 255:
                state.check_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            state.ticks += 1
            if not state.ticks & 255:
                state.check_time()
            return super().getitem(obj, argument)

    def _check_args(values, what: str) -> None:
        # A width, a count or a repeat beyond the size limit asks for text beyond it (center, indent,
        # ljust, wordwrap, '%*d', '{:>N}'.format...): refused before it is built.
        # A string or list argument past the limit (a macro doubling its argument) is refused too.
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > state.max_chars:
                raise _Limit(f"{what} {value} is beyond the size limit of {state.max_chars}")
            if _sized(value) is not None:
                state.check_size(len(value), what)

    def _check_format(text: str, spec: str) -> None:
        # A width or precision of as many digits as the size limit has asks for text beyond it.
        if re.search(spec + r"\d{%d,}" % len(str(state.max_chars)), text):
            raise _Limit(f"a format's width or precision is beyond the size limit of {state.max_chars}")

    def _checked(result):
        if _sized(result) is not None:
            state.check_size(len(result), "a value")
        return result

    def limited_filter(f):
        offset = 2 if hasattr(f, "jinja_pass_arg") else 1  # (context,) value, then the filter's arguments

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            state.tick()
            if len(args) > offset:
                _check_args(args[offset:], "a filter's argument")
            if kwargs:
                _check_args(kwargs.values(), "a filter's argument")
            return _checked(f(*args, **kwargs))

        return wrapper

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not Jinja's own filter, which escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Limited(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: limited_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    env.globals["range"] = lambda *args: _Range(state, *args)
    return env.from_string(source), state


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    # transformers' names for an answer's reasoning: whichever the row uses, the template finds it
    # under `thinking` (gpt-oss reads that) and `reasoning_content` (Qwen3, DeepSeek-R1).
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(template: ChatTemplate, messages: Sequence[dict], *, add_generation_prompt: bool = False,
           tools: list | None = None, kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans of its generation blocks). As transformers'
    apply_chat_template: messages' keys whose value is None are dropped, reasoning is found under
    each of its names, `tools` (JSON schemas) is a variable (None without), and `kwargs` (its
    **kwargs: a row's chat_template_kwargs, e.g. enable_thinking) are variables over the special
    tokens'. A rule broken (time, size) or an operation the sandbox refuses is a TemplateLimitError
    naming the template; the template's other exceptions (its raise_exception) propagate."""
    from jinja2.exceptions import SecurityError

    compiled, state = _compile(template.source)
    messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
    variables = {**template.variables, "tools": tools, "documents": None, **(kwargs or {})}
    blocks: list[str] = []
    state.blocks, state.spans, state.ticks = blocks, [], 0
    state.time_limit, state.max_chars = template.time_limit, template.max_chars
    state.deadline = time.monotonic() + template.time_limit
    length, max_chars = 0, template.max_chars
    try:
        for block in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            blocks.append(block)
            length += len(block)
            if length > max_chars:
                state.check_size(length, "the rendered text")
            if not len(blocks) & 63:
                state.check_time()
        spans, done, total = [], 0, 0
        for index, size in state.spans:
            while done < index:
                total, done = total + len(blocks[done]), done + 1
            spans.append((total, total + size))
        return "".join(blocks), spans
    except _Limit as e:
        raise TemplateLimitError(f"the chat template ({template.origin}) was stopped: {e}") from None
    except SecurityError as e:
        raise TemplateLimitError(f"the chat template ({template.origin}) was stopped: the sandbox refuses "
                                 f"{_one_line(e)}") from None
    except (RecursionError, MemoryError) as e:
        rule = "it recursed too deeply" if isinstance(e, RecursionError) else "it ran out of memory"
        raise TemplateLimitError(f"the chat template ({template.origin}) was stopped: {rule}") from None
    finally:
        state.blocks, state.spans, state.deadline = [], None, float("inf")


# ---------------------------------------------------------------------------------------------
# Tokens and their characters.


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` with the special-token strings in it read as special tokens (what a chat
    template writes), and each token's [start, end) characters."""
    model = tokenizer.model
    if hasattr(model, "encode_special_tokens"):  # the `tokenizers` backend (HuggingFaceTokenizer)
        model.encode_special_tokens = False
        try:
            encoding = model.encode(text, add_special_tokens=False)
        finally:
            model.encode_special_tokens = True
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]
    ids = tokenizer.encode(text, bos=False, eos=False, allowed_special="all")  # tiktoken
    _, starts = model.decode_with_offsets(ids)
    ends = starts[1:] + [len(text)]
    return ids, list(zip(starts, ends))


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for each token whose characters overlap one of `spans` (sorted), transformers' rule."""
    mask = [False] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


def assistant_spans(template: ChatTemplate, messages: Sequence[dict], *, tools: list | None = None,
                    kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of the assistant's turns): the template's
    generation blocks, or the spans found by re-rendering prefixes (module docstring). DataError
    when a template without generation tags rewrites earlier turns. tools, kwargs: render's."""
    text, spans = render(template, messages, tools=tools, kwargs=kwargs)
    if template.has_generation_tags:
        return text, spans
    return text, _prefix_spans(template, messages, text, tools=tools, kwargs=kwargs)


def _prefix_spans(template: ChatTemplate, messages: Sequence[dict], text: str, char_limit: int | None = None, *,
                  tools: list | None = None, kwargs: dict | None = None) -> list[tuple[int, int]]:
    """The assistant turns' spans in `text` by re-rendering prefixes. char_limit: the text past this
    character is cut anyway (truncation), so turns starting there are not re-rendered: each
    re-rendering costs the turns before it, and 10^5 turns would cost 10^10."""
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt, _ = render(template, messages[:k], add_generation_prompt=True, tools=tools, kwargs=kwargs)
        if char_limit is not None and len(prompt) >= char_limit and text.startswith(prompt):
            break
        upto, _ = render(template, messages[: k + 1], tools=tools, kwargs=kwargs)
        if not (text.startswith(prompt) and text.startswith(upto) and len(upto) >= len(prompt)):
            raise DataError(f"{template.origin} renders the turns before assistant turn {k} differently once later "
                            "turns follow, so its assistant tokens cannot be found by re-rendering; use a template "
                            "with {% generation %} tags (sft.chat_template)")
        spans.append((len(prompt), len(upto)))
    return spans


def tokenize_conversation(template: ChatTemplate, tokenizer, messages: Sequence[dict], *,
                          max_tokens: int | None = None, tools: list | None = None, kwargs: dict | None = None
                          ) -> tuple[list[int], list[bool]]:
    """A conversation's token ids and, per token, whether it is the assistant's. max_tokens: the
    caller keeps at most this many (it truncates): the mask of the tokens past them may be left
    unfound (False), which spares re-rendering the turns that lie there (_prefix_spans). tools,
    kwargs: render's (a row's tool schemas and chat_template_kwargs)."""
    text, spans = render(template, messages, tools=tools, kwargs=kwargs)
    ids, offsets = encode_with_offsets(tokenizer, text)
    if not template.has_generation_tags:
        char_limit = offsets[max_tokens - 1][1] if max_tokens is not None and 0 < max_tokens < len(ids) else None
        spans = _prefix_spans(template, messages, text, char_limit, tools=tools, kwargs=kwargs)
    return ids, overlap_mask(offsets, spans)


def end_of_turn_ids(template: ChatTemplate, tokenizer) -> set[int]:
    """The tokens that end an assistant turn in this template (where sampling stops): the first
    token the template writes after the assistant's text (Llama 3's <|eot_id|>, ChatML's
    <|im_end|>, Gemma's <end_of_turn>, DeepSeek-R1's <｜end▁of▁sentence｜>, Mistral's EOS), and the
    tokenizer's EOS.

    The answer's end is found by rendering the conversation with two answers and keeping what both
    renderings end with, not by rendering the prompt first: a generation prompt may write what the
    rendered turn does not (DeepSeek-R1's opens a `<think>` block), and a template may render earlier
    turns differently once an answer follows, so the prompt's tokens need not start the conversation's."""
    texts = []
    for answer in ("ok", "no"):  # no character in common at either end
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
        try:
            texts.append(render(template, probe)[0])
        except Exception as e:  # its raise_exception, an undefined name...: one sentence where it is loaded
            raise DataError(f"the chat template ({template.origin}) cannot render a user turn and an assistant "
                            f"answer: {_one_line(e)}") from None
    text, other = texts
    tail = len(os.path.commonprefix([text[::-1], other[::-1]]))  # what the template writes after the answer
    end = len(text) - tail
    ids, offsets = encode_with_offsets(tokenizer, text)
    stops = {tokenizer.eos_id}
    # The first token after the answer, where the answer ends on a token boundary.
    after = next((i for i, (start, _) in enumerate(offsets) if start >= end), None)
    if tail and after is not None and after > 0 and offsets[after - 1][1] <= end:
        stops.add(ids[after])
    return stops


def chat_prompt_ids(template: ChatTemplate, tokenizer, messages: Sequence[dict], *, tools: list | None = None,
                    kwargs: dict | None = None) -> list[int]:
    """The ids of `messages` followed by the template's generation prompt (what a model answers).
    tools, kwargs: render's (a data row's tool schemas and chat_template_kwargs)."""
    text, _ = render(template, messages, add_generation_prompt=True, tools=tools, kwargs=kwargs)
    return encode_with_offsets(tokenizer, text)[0]


__all__ = ["BUILTIN_TEMPLATES", "CHATML_TEMPLATE", "ChatTemplate", "LLAMA3_TEMPLATE", "TemplateLimitError",
           "assistant_spans", "chat_prompt_ids", "encode_with_offsets", "end_of_turn_ids", "folder_chat_template",
           "load_chat_template", "overlap_mask", "published_template_names", "render", "tokenize_conversation",
           "TRAINING_VARIANTS", "training_variant"]
