"""Gemma 3's published chat template (titanlike/data/assets/chat_templates/gemma3.jinja, issue 43 item 3),
chosen by name: the prompt processor's ids equal transformers' apply_chat_template with that template, the
assistant's tokens SFT trains are those TRL's training variant of it marks, and a Gemma 3 SFT export chats
with it and stops at <end_of_turn>. The tokenizer is the debug one with Gemma's turn markers added as
special tokens (tests/sft_assets.py): the published 262k-token sentencepiece model is not shipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, train_in_process
from sft_assets import tokenizer_folder
from titanlike.data import build_tokenizer
from titanlike.data.chat_template import load_chat_template, published_template_names, tokenize_conversation
from titanlike.inference.processor import Processor

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    # The system message joins the first user turn; contents are trimmed.
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two and two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three and three?"},
     {"role": "assistant", "content": " Six, of course.  "}],
    [{"role": "user", "content": "reverse: king fish"}, {"role": "assistant", "content": "fish king"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "king fish"}],
]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture
def gemma(tmp_path):
    """(our tokenizer, transformers' of the same folder, the gemma3 template): a folder without a template."""
    folder = tokenizer_folder(tmp_path / "tok")
    tok = build_tokenizer(str(folder))
    return tok, transformers.AutoTokenizer.from_pretrained(str(folder)), load_chat_template("gemma3", tok)


def test_the_processor_renders_gemma3_as_transformers(gemma):
    tok, theirs, template = gemma
    assert "gemma3" in published_template_names() and template.origin == "the published gemma3 template"
    trl = pytest.importorskip("trl")
    assert template.source == (Path(trl.__file__).parent / "chat_templates" / "gemma3.jinja").read_text()
    processor = Processor(tok, template=template)
    for conversation in CONVERSATIONS:
        prompt = conversation[:-1]
        want = theirs.apply_chat_template(prompt, chat_template=template.source, add_generation_prompt=True,
                                          tokenize=True)
        assert processor.encode(prompt) == _ids(want)
        full = theirs.apply_chat_template(conversation, chat_template=template.source, tokenize=True)
        assert tokenize_conversation(template, tok, conversation)[0] == _ids(full)
    text = tok.decode(processor.encode(CONVERSATIONS[1][:2]))
    assert text == (f"{tok.decode([tok.bos_id])}<start_of_turn>user\nAnswer briefly.\n\nWhat is two and two?"
                    "<end_of_turn>\n<start_of_turn>model\n")
    end_of_turn = tok.encode("<end_of_turn>", bos=False, eos=False, allowed_special="all")
    assert len(end_of_turn) == 1
    assert processor.stop_ids(chat=True) == frozenset({tok.eos_id, end_of_turn[0]})


def test_sft_trains_the_tokens_trls_gemma3_variant_marks(gemma):
    """The published template has no generation tags and rewrites no turn: SFT finds the answers by
    re-rendering prefixes, and trains what TRL's SFTTrainer trains (its gemma3_training variant's mask:
    each answer, its <end_of_turn> and the newline after it)."""
    tok, theirs, template = gemma
    trl = pytest.importorskip("trl")
    variant = (Path(trl.__file__).parent / "chat_templates" / "gemma3_training.jinja").read_text()
    for conversation in CONVERSATIONS:
        ids, mask = tokenize_conversation(template, tok, conversation)
        want = theirs.apply_chat_template(conversation, chat_template=variant, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"])
        assert [int(m) for m in mask] == list(want["assistant_masks"]) and any(mask)


def test_a_gemma3_sft_export_carries_the_template_and_stops_at_end_of_turn(tmp_path):
    """Gemma 3's debug model fine-tuned one step with sft.chat_template gemma3: the Hugging Face export
    (checkpoint.last_save_in_hf) holds the template as tokenizer_config.json's chat_template, renders
    what training rendered under transformers, and its generation_config.json stops at EOS and
    <end_of_turn>, as google/gemma-3-*-it's does; our processor reads the same back from the export."""
    from titanlike.inference.loading import load_for_inference

    folder = tokenizer_folder(tmp_path / "tok")
    train_in_process(["--job.config_file", str(REPO / "train_configs" / "sft_debug.toml"),
                      "--metrics.no_enable_tensorboard", "--model.name", "gemma3", "--model.flavor", "debugmodel",
                      "--model.hf_assets_path", str(folder), "--sft.chat_template", "gemma3",
                      "--training.steps", "1", "--training.local_batch_size", "2", "--training.seq_len", "64",
                      "--training.dataset_path", str(REPO / "tests" / "assets" / "sft" / "reverse_words.jsonl"),
                      "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path / "sft")])
    export = tmp_path / "sft" / "checkpoint" / "step-1"
    tok = build_tokenizer(str(folder))
    template = load_chat_template("gemma3", tok)
    assert json.loads((export / "config.json").read_text())["model_type"] == "gemma3_text"
    assert json.loads((export / "tokenizer_config.json").read_text())["chat_template"] == template.source
    theirs = transformers.AutoTokenizer.from_pretrained(str(export))
    for conversation in CONVERSATIONS:
        assert _ids(theirs.apply_chat_template(conversation, tokenize=True)) == \
            tokenize_conversation(template, tok, conversation)[0]
    end_of_turn = tok.encode("<end_of_turn>", bos=False, eos=False, allowed_special="all")[0]
    assert transformers.GenerationConfig.from_pretrained(str(export)).eos_token_id == [tok.eos_id, end_of_turn]

    model, exported = load_for_inference(str(export))
    processor = Processor.for_model(model, exported, checkpoint=str(export), chat_template="tokenizer")
    assert processor.template.source == template.source
    assert processor.stop_ids(chat=True) == frozenset({tok.eos_id, end_of_turn})
