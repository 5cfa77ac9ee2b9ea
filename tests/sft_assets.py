"""Assets of the fine-tuning tests, generated on the spot: a tokenizer folder with chat special
tokens and a chat template, the four template styles the issue names, and conversation files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_ASSET = REPO / "tests" / "assets" / "tokenizer"  # the debug tokenizer as tokenizer.json

# Added to the debug tokenizer so that every template's markers are special tokens, as in the real models.
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]"]

# Written for the tests in the style of the published templates (not copies): the same markers,
# system-prompt handling, role checks and end-of-turn placement.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if system %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unknown role ' + message['role']) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first %}{{- '[INST] ' + system + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
GEMMA = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set first_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set first_prefix = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def with_generation_tags(template: str, before: str, after: str) -> str:
    """`template` with {% generation %} around what the assistant writes: the text between `before`
    and `after` (two literal pieces of the template)."""
    assert template.count(before) == 1 and template.count(after) == 1, (before, after)
    return template.replace(before, before + "{% generation %}").replace(after, "{% endgeneration %}" + after)


TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL, "gemma": GEMMA}

# A generation-tagged version of each: the assistant's text and its end-of-turn token.
TAGGED = {
    "chatml": (
        "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    "gemma": (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{- '<start_of_turn>' + role + '\\n' }}"
        "{%- if role == 'model' %}{% generation %}{{- message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}"
        "{%- else %}{{- message['content'] | trim + '<end_of_turn>' }}{%- endif %}{{- '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two and two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three and three?"},
     {"role": "assistant", "content": " Six, of course.  "}],
    [{"role": "user", "content": "Say: in the beginning"}, {"role": "assistant", "content": "In the beginning God "
                                                                                           "created the heaven"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "and the earth."}],
]


def tokenizer_folder(folder: Path, chat_template: str | None = None) -> Path:
    """The debug tokenizer (tokenizer.json) with CHAT_TOKENS added as special tokens and, when given,
    `chat_template` in its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(TOKENIZER_ASSET / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((TOKENIZER_ASSET / "tokenizer_config.json").read_text())
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------- a task to learn

TASK_WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "king", "stone"]


def reverse_task(n: int, seed: int, words: int = 3) -> list[dict]:
    """Conversations asking for `words` words in reverse order, the answer exact (the issue's
    synthetic instruction task)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = [rng.choice(TASK_WORDS) for _ in range(words)]
        rows.append({"messages": [{"role": "user", "content": "reverse: " + " ".join(ws)},
                                  {"role": "assistant", "content": " ".join(reversed(ws))}]})
    return rows


def first_word_task(n: int, seed: int, words: int = 2) -> list[dict]:
    """Conversations asking for the first of `words` words (a second task, for adapters to learn on
    a model that answers the reverse task)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = [rng.choice(TASK_WORDS) for _ in range(words)]
        rows.append({"messages": [{"role": "user", "content": "first: " + " ".join(ws)},
                                  {"role": "assistant", "content": ws[0]}]})
    return rows


def exact_match(model, tokenizer, template, rows, *, max_new_tokens: int = 12) -> float:
    """The fraction of rows whose greedy answer (up to the end of the assistant's turn) is the
    row's assistant content exactly; no KV cache. The rows whose prompts have the same length in
    tokens are decoded together, one batch (no padding needed: a causal model's rows are independent)."""
    import torch

    from titanlike.data.chat_template import encode_with_offsets, render

    stop = {tokenizer.eos_id, *(tokenizer.encode(t, bos=False, eos=False, allowed_special="all")[0]
                                for t in ("<|eot_id|>",))}
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for row in rows:
        prompt, _ = render(template, row["messages"][:1], add_generation_prompt=True)
        ids, _ = encode_with_offsets(tokenizer, prompt)
        by_length.setdefault(len(ids), []).append((ids, row["messages"][1]["content"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the jobs run (conftest.train_in_process): a loaded machine's threads wait on each other
    try:
        right = _greedy_right(model, tokenizer, by_length, stop, max_new_tokens)
    finally:
        torch.set_num_threads(threads)
    return right / len(rows)


def _greedy_right(model, tokenizer, by_length, stop, max_new_tokens: int) -> int:
    """How many of the groups' rows get their answer exactly (exact_match's decoding)."""
    import torch

    from titanlike.models.outputs import logits_of

    right = 0
    with torch.no_grad():
        for group in by_length.values():
            tokens = torch.tensor([ids for ids, _ in group])
            new: list[list[int]] = [[] for _ in group]
            done = [False] * len(group)
            for _ in range(max_new_tokens):
                next_ids = logits_of(model(tokens))[:, -1].argmax(dim=-1)
                for i, next_id in enumerate(next_ids.tolist()):
                    if not done[i]:
                        done[i] = next_id in stop
                        if not done[i]:
                            new[i].append(next_id)
                            # A row whose answer so far no continuation can turn into the expected one is
                            # wrong already: decoding it on changes nothing but the cost (an untrained
                            # model's rows run to max_new_tokens). Its text is kept, so it still counts wrong.
                            done[i] = _cannot_match(tokenizer.decode(new[i]), group[i][1])
                if all(done):
                    break
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            right += sum(tokenizer.decode(ids).strip() == answer for ids, (_, answer) in zip(new, group))
    return right


def _cannot_match(text: str, answer: str) -> bool:
    """Whether no continuation of text can strip to answer (exact_match compares stripped answers). Only
    sure verdicts: a prefix ending in an incomplete character (U+FFFD) may still become anything."""
    if "\ufffd" in text:
        return False
    return not answer.startswith(text.strip())
