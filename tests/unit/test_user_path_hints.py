"""What the post-training path tells a user to run next (issue 45): a chat-trained run's summary
suggests generate.py --chat, and the README's commands ask for no option --help says is ignored."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from titanlike.config import load_job_config
from titanlike.observe.summary import RunSummary
from titanlike.train.plan import plan_job


@pytest.mark.parametrize("preset, chat", [("sft_debug", True), ("dpo_debug", True), ("debug_model", False)])
def test_a_chat_trained_run_suggests_sampling_it_with_chat(preset, chat, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = plan_job(load_job_config(["--job.config_file", f"train_configs/{preset}.toml"]), world_size=1)
    assert (plan.objective.generation == "chat") is chat
    summary = RunSummary(first_step=1, last_step=2, seconds=1.0, checkpoints="out/checkpoint",
                         latest_checkpoint="step-2", latest_contents="model_only", generates=plan.generates,
                         chat=plan.objective.generation == "chat")
    line = summary.lines()[1]
    assert line.endswith("sample: python scripts/generate.py out/checkpoint --chat)" if chat else
                         "sample: python scripts/generate.py out/checkpoint)"), line


def test_readme_commands_loading_a_hugging_face_folder_name_no_flavor():
    """model.flavor is not used when checkpoint.initial_load_in_hf gives the folder (its --help says so)."""
    readme = (REPO / "README.md").read_text().replace("\\\n", " ")  # continued lines joined
    commands = re.findall(r"^(?:python3|torchrun) .*$", readme, re.M)
    loading = [c for c in commands if "--checkpoint.initial_load_in_hf" in c and "hf_assets_path" in c]
    assert loading, "the README shows a command starting from a Hugging Face folder"
    for command in loading:
        assert "--model.flavor" not in command, command
