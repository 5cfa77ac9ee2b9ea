"""What a post-training run hands on (issue 45 items 3, 9, 10 and 16), checked with transformers as the
reference: an SFT or DPO export chats as training rendered (tokenizer_config.json's chat_template, the
end-of-turn ids among generation_config.json's eos_token_id); training.split holds conversations and
pairs out only for validation; the start-up log describes the run from its plan and names the chat
template; a reward model's export pads with a token no scored sequence ends with, and a
...ForSequenceClassification folder (ours or one transformers saved) loads as a reward model.

The jobs run inside the test process (conftest.train_in_process), one or two steps each."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from conftest import REPO, train_in_process
from sft_assets import TAGGED, tokenizer_folder

transformers = pytest.importorskip("transformers")

SFT_PRESET = ["--job.config_file", str(REPO / "train_configs" / "sft_debug.toml"), "--metrics.no_enable_tensorboard"]
DPO_PRESET = ["--job.config_file", str(REPO / "train_configs" / "dpo_debug.toml"), "--metrics.no_enable_tensorboard"]
REWARD_PRESET = ["--job.config_file", str(REPO / "train_configs" / "reward_debug.toml"),
                 "--metrics.no_enable_tensorboard"]
SFT_DATA = REPO / "tests" / "assets" / "sft" / "reverse_words.jsonl"
PAIRS = REPO / "tests" / "assets" / "dpo" / "prefer_reverse.jsonl"
CONVERSATIONS = [
    [{"role": "user", "content": "reverse: king fish"}, {"role": "assistant", "content": "fish king"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "reverse: sun moon"},
     {"role": "assistant", "content": "moon sun"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "sun moon"}],
]


def ids_of(encoded) -> list[int]:
    """apply_chat_template's ids (transformers 5 answers a BatchEncoding, 4.x a list)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def check_chat_export(folder: Path, template, tokenizer) -> None:
    """transformers' tokenizer renders what training rendered, and its generate stops at the end of the turn."""
    from titanlike.data.chat_template import chat_prompt_ids, end_of_turn_ids, tokenize_conversation

    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template.source
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for conversation in CONVERSATIONS:
        trained, _ = tokenize_conversation(template, tokenizer, conversation)
        assert ids_of(theirs.apply_chat_template(conversation, tokenize=True)) == trained
        assert ids_of(theirs.apply_chat_template(conversation[:-1], tokenize=True, add_generation_prompt=True)) == \
            chat_prompt_ids(template, tokenizer, conversation[:-1])
    stops = transformers.GenerationConfig.from_pretrained(str(folder)).eos_token_id
    turn = sorted(end_of_turn_ids(template, tokenizer) - {tokenizer.eos_id})
    assert turn and stops == [tokenizer.eos_id, *turn], stops


def test_an_sft_export_carries_the_builtin_template_and_stops_at_the_end_of_the_turn(tmp_path, caplog):
    """sft_debug (the debug tokenizer has no template: titanlike's llama3 renders) -> a DCP checkpoint ->
    titanlike-convert: the checkpoint remembers the template, and the export chats with it. The start-up log
    names the template and warns that it is the fallback."""
    from titanlike.cli.convert import main
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.chat_template import LLAMA3_TEMPLATE, load_chat_template

    with caplog.at_level(logging.INFO, logger="titanlike"):
        train_in_process([*SFT_PRESET, "--training.steps", "1", "--training.dataset_path", str(SFT_DATA),
                          "--job.dump_folder", str(tmp_path / "sft")])
    sidecar = json.loads((tmp_path / "sft" / "checkpoint" / "step-1" / "titanlike.json").read_text())
    assert sidecar["tokenizer"]["chat_template"] == LLAMA3_TEMPLATE
    assert "chat template: titanlike's llama3 template" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sft.chat_template auto" in w and "titanlike's llama3 template" in w for w in warnings), warnings

    assert main(["to-hf", str(tmp_path / "sft" / "checkpoint"), str(tmp_path / "hf")]) == 0
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    check_chat_export(tmp_path / "hf", load_chat_template("llama3", tokenizer), tokenizer)

    # Our own processor (titanlike-generate, titanlike-serve) reads the export's template and stops alike.
    from titanlike.inference.loading import load_for_inference
    from titanlike.inference.processor import Processor

    model, exported = load_for_inference(str(tmp_path / "hf"))
    processor = Processor.for_model(model, exported, checkpoint=str(tmp_path / "hf"), chat_template="tokenizer")
    assert processor.stop_ids(chat=True) == frozenset({tokenizer.eos_id, tokenizer.eot_id})


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_dpo_export_carries_a_jinja_file_or_the_folders_template(where, tmp_path, caplog):
    """dpo_debug with a tokenizer folder of its own (ChatML tokens) and the ChatML template as a Jinja file
    (dpo.chat_template) or in the folder's tokenizer_config.json (auto): the Hugging Face export the run
    writes (checkpoint.last_save_in_hf) carries that template and stops at <|im_end|>; no fallback warning."""
    from titanlike.data import build_tokenizer
    from titanlike.data.chat_template import load_chat_template

    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(TAGGED["chatml"])
    folder = tokenizer_folder(tmp_path / "tok", TAGGED["chatml"] if where == "folder" else None)
    choice = str(jinja) if where == "file" else "auto"
    with caplog.at_level(logging.INFO, logger="titanlike"):
        train_in_process([*DPO_PRESET, "--training.steps", "1", "--training.dataset_path", str(PAIRS),
                          "--training.seq_len", "128", "--model.hf_assets_path", str(folder),
                          "--dpo.chat_template", choice,
                          "--checkpoint.last_save_in_hf", "--job.dump_folder", str(tmp_path / "dpo")])
    tokenizer = build_tokenizer(str(folder))
    template = load_chat_template(choice, tokenizer)
    check_chat_export(tmp_path / "dpo" / "checkpoint" / "step-1", template, tokenizer)
    assert f"chat template: {jinja if where == 'file' else f'the chat_template of {folder}'}" in caplog.text
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "chat_template" in r.getMessage()]


def _rows(objective_args: list[str], tmp_path: Path, caplog) -> int:
    """The number of conversations or pairs the plan's objective trains on (and its log lines in caplog)."""
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    cfg = load_job_config([*objective_args, "--job.dump_folder", str(tmp_path / "out")])
    plan = plan_job(cfg, 1)
    t = cfg.training
    with caplog.at_level(logging.INFO, logger="titanlike"):
        samples = plan.objective.samples(t.dataset, dataset_path=t.dataset_path, tokenizer=plan.tokenizer,
                                         seq_len=t.seq_len, seed=0, split=t.split, split_name="train")
    return len(samples.source.data)


@pytest.mark.parametrize("preset,data,rows,what", [(SFT_PRESET, SFT_DATA, 1000, "conversations"),
                                                   (DPO_PRESET, PAIRS, 500, "pairs")])
def test_training_split_holds_rows_out_only_for_validation(preset, data, rows, what, tmp_path, caplog):
    """training.split (default 969,30,1) leaves nothing out with validation off; with validation reading the
    held-out split, its 'valid' and 'test' parts are left out and the log says how many."""
    base = [*preset, "--training.dataset_path", str(data)]
    assert _rows(base, tmp_path, caplog) == rows
    assert "out of training" not in caplog.text
    caplog.clear()
    kept = _rows([*base, "--validation.enable", "--training.split", "90,10"], tmp_path, caplog)
    assert kept == rows * 9 // 10
    assert f"holds {rows // 10} of the {rows} {what} out of training (train {kept}, valid {rows // 10})" in caplog.text


def test_the_start_up_log_describes_the_run_from_its_plan(tmp_path, caplog):
    """The Llama preset's description on a Qwen3 run: the log says what runs (family, flavor, size,
    objective, data), the preset's words beside it."""
    with caplog.at_level(logging.INFO, logger="titanlike"):
        train_in_process(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                          "--metrics.no_enable_tensorboard", "--model.name", "qwen3", "--model.flavor", "debugmodel",
                          "--training.steps", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
                          "--checkpoint.no_enable", "--job.dump_folder", str(tmp_path / "qwen")])
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run: "))
    assert line.startswith("run: qwen3 debugmodel (") and "M parameters), objective causal_lm, data " in line, line
    assert line.endswith("; job.description: Llama 3 debug model on the embedded corpus"), line


# Reward models ---------------------------------------------------------------------------------------------


def no_pad_tokenizer(folder: Path) -> Path:
    """The debug tokenizer as a Llama 3 Instruct-like folder: EOS is <|eot_id|> and there is no pad token
    (its <|finetune_right_pad_id|> slot renamed)."""
    src = REPO / "tests" / "assets" / "tokenizer"
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (src / name).read_text().replace("<|finetune_right_pad_id|>", "<|reserved_pad_slot|>")
        config = json.loads(text)
        if name == "tokenizer_config.json":
            config.pop("pad_token", None)
            config["eos_token"] = "<|eot_id|>"
        (folder / name).write_text(json.dumps(config))
    return folder


def test_a_reward_model_scores_as_transformers_both_ways(tmp_path):
    """A reward model trained with a tokenizer without a pad token whose EOS ends every turn: its export
    (titanlike-convert) names a pad token that no scored sequence ends with, so transformers'
    LlamaForSequenceClassification scores the token ours scores (1e-5, fp32); that folder and one
    transformers saved load as reward models (titanlike.load_model, titanlike-convert from-hf, and a reward
    job's initial load)."""
    import titanlike
    from titanlike.cli.convert import main
    from titanlike.data import build_tokenizer
    from titanlike.data.chat_template import load_chat_template, tokenize_conversation

    folder = no_pad_tokenizer(tmp_path / "tok")
    train_in_process([*REWARD_PRESET, "--training.steps", "1", "--training.dataset_path", str(PAIRS),
                      "--model.hf_assets_path", str(folder), "--job.dump_folder", str(tmp_path / "rm")])
    assert main(["to-hf", str(tmp_path / "rm" / "checkpoint"), str(tmp_path / "hf")]) == 0
    tokenizer = build_tokenizer(str(folder))
    template = load_chat_template("auto", tokenizer)
    rows = [tokenize_conversation(template, tokenizer, c)[0] for c in CONVERSATIONS]
    assert all(r[-1] == tokenizer.eos_id for r in rows)  # every sequence ends with <|eot_id|>, the EOS

    ours = titanlike.load_model(tmp_path / "rm" / "checkpoint")
    with torch.no_grad():
        want = torch.stack([ours(torch.tensor([r]))[0, -1, 0] for r in rows])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"),
                                                                         dtype=torch.float32).eval()
    pad = hf.config.pad_token_id
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0]
    torch.testing.assert_close(theirs, want, rtol=0, atol=1e-5)
    # The exported tokenizer pads with that token too (TRL's RewardTrainer pads with the tokenizer's).
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tokenizer.pad_token_id == pad != tokenizer.eos_id
    assert torch.equal(hf_tokenizer.pad({"input_ids": rows}, return_tensors="pt")["input_ids"], ids)

    hf.save_pretrained(tmp_path / "saved")
    assert main(["from-hf", str(tmp_path / "saved"), str(tmp_path / "dcp")]) == 0  # and on to a DCP checkpoint
    for path in (tmp_path / "hf", tmp_path / "saved", tmp_path / "dcp"):
        back = titanlike.load_model(path)
        with torch.no_grad():
            got = torch.stack([back(torch.tensor([r]))[0, -1, 0] for r in rows])
        torch.testing.assert_close(got, theirs, rtol=0, atol=1e-5)

    # A reward job starting from the folder transformers saved keeps its score head (not a fresh one).
    train_in_process([*REWARD_PRESET, "--training.steps", "1", "--optimizer.lr", "1e-10", "--training.dataset_path",
                      str(PAIRS), "--model.hf_assets_path", str(folder), "--checkpoint.initial_load_path",
                      str(tmp_path / "saved"), "--checkpoint.initial_load_in_hf", "--job.dump_folder",
                      str(tmp_path / "again")])
    again = dict(titanlike.load_model(tmp_path / "again" / "checkpoint").named_parameters())
    torch.testing.assert_close(again["output.weight"], hf.score.weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_sequence_classification_folders_load_as_reward_models(family, tmp_path):
    """Every family with a ...ForSequenceClassification class: our export and the folder transformers saves
    from it load back (titanlike.load_model) with transformers' scores (1e-5, fp32); a folder of two labels
    is refused in one sentence."""
    import dataclasses

    import titanlike
    from titanlike.checkpoint import CheckpointError
    from titanlike.checkpoint.hf import write_hf
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(family)
    flavor = spec.flavors["debugmodel_tiny" if family == "llama3" else "debugmodel"]
    args = dataclasses.replace(flavor, n_layers=2, vocab_size=64, max_seq_len=64).with_score_head()
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=4)
    write_hf(dict(model.state_dict()), spec, args, str(tmp_path / "ours"), context_len=64, bos_id=0, eos_id=1, pad_id=2)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "ours"),
                                                                         dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "saved")
    tokens = torch.randint(3, 64, (3, 9))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits[:, 0]
        for path in ("ours", "saved"):
            ours = titanlike.load_model(tmp_path / path)(tokens)[:, -1, 0]
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has 2 labels, and a reward model scores with one") as e:
        titanlike.load_model(tmp_path / "saved")
    assert "\n" not in str(e.value)
