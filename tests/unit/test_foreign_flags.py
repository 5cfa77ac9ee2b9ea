"""Habits of Megatron-LM, Hugging Face and TRL users (issue 45, item 8): their flags name the titanlike
option they are (titanlike/config/compat.py FOREIGN_FLAGS, README.md's table generated from it), every
argument train.py cannot take is reported in one message, and a Hub id given where a folder is expected
says how to download it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from titanlike.config import ConfigError, load_job_config
from titanlike.config.compat import FOREIGN_FLAGS, foreign_flags_markdown, hub_id_hint
from titanlike.config.loader import _resolve

REPO = Path(__file__).resolve().parents[2]

# The flags users of Megatron's pretrain_gpt.py type daily, and of Hugging Face's Trainer / TRL's scripts.
MEGATRON_DAILY = ["--data-path", "--lr", "--save", "--load", "--tensor-model-parallel-size",
                  "--pipeline-model-parallel-size", "--bf16", "--split", "--tokenizer-type", "--micro-batch-size",
                  "--global-batch-size", "--seq-length", "--train-iters", "--lr-decay-style", "--min-lr",
                  "--weight-decay", "--clip-grad", "--save-interval", "--eval-interval", "--num-layers",
                  "--hidden-size", "--num-attention-heads", "--lr-warmup-iters", "--log-interval", "--eval-iters",
                  "--tokenizer-model", "--context-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
                  "--recompute-activations", "--adam-beta1", "--adam-beta2", "--seed"]
HF_DAILY = ["--model_name_or_path", "--output_dir", "--learning_rate", "--max_steps", "--per_device_train_batch_size",
            "--dataset_name", "--gradient_accumulation_steps", "--num_train_epochs", "--warmup_steps",
            "--logging_steps", "--save_steps", "--bf16", "--weight_decay", "--lr_scheduler_type", "--max_grad_norm",
            "--gradient_checkpointing", "--max_length", "--use_peft", "--lora_r", "--beta"]


@pytest.mark.parametrize("flag", MEGATRON_DAILY + HF_DAILY)
def test_a_daily_flag_names_its_option(flag):
    entry = FOREIGN_FLAGS[flag]
    argv = [flag] if entry.switch else [flag, "8"]
    with pytest.raises(ConfigError) as err:
        load_job_config(argv)
    message = str(err.value)
    assert message.startswith(f"unexpected argument '{flag}': ")
    assert f"{flag} is {entry.instead} here" in message or "has no counterpart here" in message
    assert "\n" not in message


def test_every_option_the_table_names_exists():
    named = {word for e in FOREIGN_FLAGS.values() for word in e.instead.split() if word.startswith("--")}
    missing = [name for name in sorted(named)
               if _resolve(name[2:]) is None and not name.startswith("--model.args.")]
    assert not missing, f"FOREIGN_FLAGS names options the schema does not hold: {missing}"
    assert all(e.instead == "nothing" or e.instead.startswith("--") for e in FOREIGN_FLAGS.values())
    assert all(e.instead != "nothing" or e.note for e in FOREIGN_FLAGS.values())  # says why


def test_every_bare_argument_is_reported_in_one_message():
    argv = ["--lr", "3e-4", "--save", "ckpt", "--bf16", "stray", "--learning_rate=1e-5", "--training.stepz", "3",
            "--training.steps", "2"]
    with pytest.raises(ConfigError) as err:
        load_job_config(argv)
    message = str(err.value)
    assert message.startswith("5 unexpected arguments: '--lr' (Megatron's --lr is --optimizer.lr here), '--save' ")
    for fragment in ("'--bf16' (Megatron's and Hugging Face's --bf16 is --training.mixed_precision_param bfloat16",
                     "'stray', '--learning_rate=1e-5' (Hugging Face's --learning_rate is --optimizer.lr here)",
                     "unknown config key 'training.stepz'; did you mean 'training.steps'?"):
        assert fragment in message
    # A flag's value is not an argument of its own ('3e-4', 'ckpt'); a switch takes none ('stray' is reported).
    assert "'3e-4'" not in message and "'ckpt'" not in message
    assert "\n" not in message
    # Megatron's --data-path takes a blend of several words.
    with pytest.raises(ConfigError, match=r"^2 unexpected arguments: '--data-path' \(.*\), '--split' \("):
        load_job_config(["--data-path", "0.7", "a", "0.3", "b", "--split", "949,50,1"])
    # Hugging Face's booleans take an optional true/false.
    with pytest.raises(ConfigError, match=r"^2 unexpected arguments: '--bf16' \(.*\), '--gradient_checkpointing' "):
        load_job_config(["--bf16", "True", "--gradient_checkpointing", "true"])


def test_the_readme_table_is_generated_from_the_code():
    readme = (REPO / "README.md").read_text()
    match = re.search(r"<!-- foreign flags: generated from titanlike/config/compat.py -->\n(.*?)\n"
                      r"<!-- end of foreign flags -->", readme, re.S)
    assert match, "README.md has no generated table of foreign flags"
    assert match.group(1) == foreign_flags_markdown(), (
        "README.md's table of foreign flags is stale: paste titanlike.config.compat.foreign_flags_markdown()")
    assert len(FOREIGN_FLAGS) == match.group(1).count("\n| `--")


HUB_ID = "HuggingFaceTB/SmolLM2-135M"
DOWNLOAD = (f"download it with `titanlike-download-hf-assets --repo_id {HUB_ID} --assets tokenizer config "
            "safetensors index` (into assets/hf/SmolLM2-135M)")


@pytest.mark.parametrize("argv, option", [
    (["--model.hf_assets_path", HUB_ID], "model.hf_assets_path"),
    (["--checkpoint.enable", "--checkpoint.initial_load_path", HUB_ID, "--checkpoint.initial_load_in_hf"],
     "checkpoint.initial_load_path"),
    (["--training.objective", "distill", "--distill.teacher", HUB_ID], None),
])
def test_a_hub_id_where_a_folder_is_expected_gives_the_download_command(argv, option, tmp_path, monkeypatch):
    from titanlike.train.plan import plan_job

    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config(argv), 1)
    message = str(err.value)
    assert f"it looks like a Hugging Face Hub id (titanlike reads local folders only): {DOWNLOAD}" in message
    assert message.endswith(f"pass --{option} assets/hf/SmolLM2-135M" if option else
                            "give assets/hf/SmolLM2-135M instead")
    assert "\n" not in message


def test_a_folder_or_a_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_id_hint("org/model", "model.hf_assets_path") == ""  # it exists
    assert hub_id_hint("org/modle", "model.hf_assets_path") == ""  # a typo in a folder that exists
    for path in ("./org/name", "/abs/name", "a/b/c", "name", ""):
        assert hub_id_hint(path, "x") == ""
