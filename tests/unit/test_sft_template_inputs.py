"""SFT rows as TRL's SFTTrainer renders them, and preference pairs as its DPOTrainer and RewardTrainer
do (issue 45.17): a row's `tools` and `chat_template_kwargs` reach the template as transformers'
apply_chat_template passes them, and published templates that rewrite earlier turns (Qwen3,
DeepSeek-R1-Distill, gpt-oss, Phi-3) are rendered with TRL's training variant of them in SFT, token
ids and assistant masks equal to transformers' with TRL's own choice."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from sft_assets import TEMPLATES, tokenizer_folder
from titanlike.data import DataError, build_tokenizer
from titanlike.data.chat_template import TRAINING_VARIANTS, load_chat_template
from titanlike.data.conversations import tokenize_conversations

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SEQ = 4096

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 * 3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "name": "multiply", "content": "6"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "The tool said 6."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "<think>\nok\n</think>\n\nYou are welcome."}]


def _ours(rows, template, tok, **kw) -> tuple[list[int], list[int]]:
    """(ids, trained mask) of one row through the trainer's tokenization, ids put back from the
    shifted inputs and targets."""
    data = tokenize_conversations([("row", r) for r in rows], template, tok, seq_len=SEQ, **kw)
    ids = [int(t) for t in data.inputs] + [int(data.labels[-1]) if data.labels[-1] >= 0 else None]
    return ids, [0] + [int(t >= 0) for t in data.labels]


def _theirs(hf_tok, conversation, **kw) -> tuple[list[int], list[int]]:
    out = hf_tok.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     **kw)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("name", TRAINING_VARIANTS)
def test_templates_that_rewrite_turns_train_with_trls_variant(tmp_path, name, caplog):
    """What TRL's SFTTrainer does with assistant_only_loss: the template its get_training_chat_template
    picks, rendered by transformers with the row's tools; ours gives the same ids and trained tokens,
    and says so in the log."""
    from trl.chat_template_utils import get_training_chat_template

    folder = tokenizer_folder(tmp_path / name, (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = build_tokenizer(str(folder))
    template = load_chat_template("tokenizer", tok)
    trl_template = get_training_chat_template(hf_tok)
    assert trl_template is not None
    for tools in (None, TOOLS):
        row = {"messages": TOOL_CONVERSATION} | ({"tools": json.dumps(tools)} if tools else {})
        want_ids, want_mask = _theirs(hf_tok, TOOL_CONVERSATION, tools=tools, chat_template=trl_template)
        with caplog.at_level(logging.INFO, logger="titanlike"):
            ids, mask = _ours([row], template, tok)
        assert ids[:-1] == want_ids[:-1]
        # The last token is an input of no position, so only its target says what it was.
        assert mask[1:] == want_mask[1:] and sum(mask) > 0
    assert f"TRL's {name}_training variant" in caplog.text
    # A loss on every token needs no turns: the published template renders the conversation as it is.
    ids, mask = _ours([{"messages": TOOL_CONVERSATION}], template, tok, assistant_only_loss=False)
    want = hf_tok.apply_chat_template(TOOL_CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(want) and all(mask[1:])


def test_tools_reach_a_template_split_by_re_rendering(tmp_path):
    """Qwen2.5's template (no generation tags, every turn kept) writes the tool schemas into the
    system turn: the row's tools count, and the assistant's tokens are those transformers' renderings
    of each prefix find."""
    folder = tokenizer_folder(tmp_path / "qwen2_5", (TRL_TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = build_tokenizer(str(folder))
    template = load_chat_template("tokenizer", tok)
    conversation = TOOL_CONVERSATION[:5]
    without, _ = _ours([{"messages": conversation}], template, tok)
    for tools in (TOOLS, json.dumps(TOOLS)):  # a list, or its JSON text (Parquet and datasets columns)
        ids, mask = _ours([{"messages": conversation, "tools": tools}], template, tok)
        want = list(hf_tok.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"])
        assert ids == want and len(ids) > len(without) + 50
        want_mask = [0] * len(want)
        for k, message in enumerate(conversation):
            if message["role"] == "assistant":
                prompt = hf_tok.apply_chat_template(conversation[:k], tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
                upto = hf_tok.apply_chat_template(conversation[: k + 1], tools=TOOLS, tokenize=True,
                                                  return_dict=True)["input_ids"]
                want_mask[len(prompt): len(upto)] = [1] * (len(upto) - len(prompt))
        assert mask[1:] == want_mask[1:]


def test_chat_template_kwargs_are_template_variables(tmp_path):
    """A row's chat_template_kwargs are what apply_chat_template's **kwargs are (Qwen3's
    enable_thinking, a template's own switches), row by row."""
    source = ("{% if persona is defined %}{{ '<|im_start|>system\n' + persona + '<|im_end|>\n' }}{% endif %}"
              + TEMPLATES["chatml"])
    folder = tokenizer_folder(tmp_path / "kw", source)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = build_tokenizer(str(folder))
    template = load_chat_template("tokenizer", tok)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for kwargs in ({}, {"persona": "You are terse."}):
        ids, _ = _ours([{"messages": conversation, "chat_template_kwargs": kwargs}], template, tok)
        want = hf_tok.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)["input_ids"]
        assert ids == list(want)
    # Qwen3's switch, with a loss on every token (the published template, as transformers renders it).
    folder = tokenizer_folder(tmp_path / "qwen3", (TRL_TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = build_tokenizer(str(folder))
    qwen3 = load_chat_template("tokenizer", tok)
    for flag in (True, False):
        row = {"messages": conversation, "chat_template_kwargs": {"enable_thinking": flag}}
        want = hf_tok.apply_chat_template(conversation, tokenize=True, return_dict=True, enable_thinking=flag)
        assert _ours([row], qwen3, tok, assistant_only_loss=False)[0] == list(want["input_ids"])


def test_bad_tools_and_kwargs_are_refused_in_one_sentence(tmp_path):
    tok = build_tokenizer(str(tokenizer_folder(tmp_path / "c", TEMPLATES["chatml"])))
    template = load_chat_template("tokenizer", tok)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    cases = [({"tools": "{not json"}, "'tools' is a string but not JSON"),
             ({"tools": {"name": "f"}}, "'tools' is dict, not a list of tool schemas"),
             ({"chat_template_kwargs": ["enable_thinking"]}, "'chat_template_kwargs' is list"),
             ({"chat_template_kwargs": {"messages": []}}, "sets 'messages', which the renderer sets itself")]
    for extra, words in cases:
        with pytest.raises(DataError) as e:
            tokenize_conversations([("conv.jsonl line 1", {"messages": conversation, **extra})], template, tok,
                                   seq_len=64)
        text = " ".join(str(e.value).split())
        assert words in text and text.startswith("conv.jsonl line 1") and text.count(". ") == 0


@pytest.mark.parametrize("end_id", [None, 0], ids=["dpo", "reward"])
def test_preference_pairs_pass_tools_and_kwargs_as_trl(tmp_path, end_id):
    """DPO and reward pairs read the same columns: each side's ids are transformers' rendering of
    prompt + answer with the row's tools and chat_template_kwargs (TRL's DPOTrainer and RewardTrainer
    pass both to apply_chat_template), and its trained tokens start where TRL's DPOTrainer starts the
    completion, past the prompt rendered with the generation prompt. end_id: the reward model's token
    after each side (data/preferences.py render_pair)."""
    from titanlike.data.preferences import tokenize_pairs

    persona = "{% if persona is defined %}{{ '<|im_start|>system\n' + persona + '<|im_end|>\n' }}{% endif %}"
    source = persona + (TRL_TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
    folder = tokenizer_folder(tmp_path / "qwen2_5", source)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = build_tokenizer(str(folder))
    template = load_chat_template("tokenizer", tok)
    prompt = TOOL_CONVERSATION[:4]
    answers = {"chosen": [{"role": "assistant", "content": "It is 6."}],
               "rejected": [{"role": "assistant", "content": "It is 7, I would say."}]}
    kwargs = {"persona": "You are terse."}
    for extra in ({}, {"tools": json.dumps(TOOLS), "chat_template_kwargs": kwargs}):
        pairs = tokenize_pairs([("pairs.jsonl line 1", {"prompt": prompt, **answers, **extra})], template, tok,
                               seq_len=SEQ, end_id=end_id)
        theirs = {"tools": TOOLS, **kwargs} if extra else {}
        prompt_ids = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **theirs)["input_ids"]
        for d, side in enumerate(("chosen", "rejected")):
            want = list(hf_tok.apply_chat_template(prompt + answers[side], tokenize=True, return_dict=True,
                                                   **theirs)["input_ids"])
            b0, b1 = pairs.bounds[d], pairs.bounds[d + 1]
            ids = [int(t) for t in pairs.inputs[b0:b1]] + [int(pairs.labels[b1 - 1])]
            assert ids == (want if end_id is None else [*want, end_id])
            trained = np.flatnonzero(pairs.labels[b0:b1] != -100) + 1  # positions of trained tokens in ids
            start = len(os.path.commonprefix([list(prompt_ids), want]))  # TRL's prompt_len
            assert trained[0] == start and trained[-1] < len(ids)
        if extra:  # the tool schemas and the persona are in the prompt, so in both sides
            assert "multiply" in tok.decode(ids) and "You are terse." in tok.decode(ids)
