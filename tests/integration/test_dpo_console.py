"""The console line of a DPO run shows its main metrics, reward accuracy and margin (the objective's
reported terms, all shown on the console), beside the loss (issue 45)."""

from __future__ import annotations

import re

from conftest import REPO, train_here


def test_the_dpo_console_line_shows_reward_accuracy_and_margin(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the preset's data path is relative to the repository
    run = train_here(["--job.config_file", "train_configs/dpo_debug.toml", "--training.steps", "2",
                      "--metrics.log_freq", "1", "--metrics.no_enable_tensorboard", "--checkpoint.no_enable",
                      "--job.dump_folder", str(tmp_path / "dpo")])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if re.search(r"step:\s+\d+/2\s+loss:", line)]
    assert len(lines) == 2, run.stderr[-3000:]
    for line in lines:
        assert re.search(r"loss:\s+\S+\s.*reward_margin:\s+-?[\d.]+\s+reward_accuracy:\s+[\d.]+\s+grad_norm", line), line
