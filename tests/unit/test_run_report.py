"""What a user watches: the progress line (step of total, ETA), the end-of-run summary, and the
W&B mode a job picks. The whole run through train.py: tests/integration/test_watch_run.py."""

import logging
import time

import pytest
import torch

from titanlike.observe import wandb_run
from titanlike.observe.metrics import MetricsLogger, format_eta
from titanlike.observe.summary import RunSummary


def test_format_eta():
    assert format_eta(0) == "0:00:00"
    assert format_eta(3723.4) == "1:02:03"
    assert format_eta(2 * 86400 + 5) == "2 days, 0:00:05"
    assert format_eta(float("inf")) == "?"


def test_progress_line_has_step_of_total_eta_and_memory(caplog):
    metrics = MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step_per_device=64,
                            log_freq=5, is_writer=True, total_steps=50)
    metrics._last_time = time.perf_counter() - 10.0  # 5 steps in 10 s: 2 s per step
    for _ in range(5):
        metrics.step_done()
    with caplog.at_level(logging.INFO, logger="titanlike"):
        record = metrics.log(5, loss=2.5, grad_norm=1.0, lr=1e-3)
    line = caplog.records[-1].getMessage()
    assert "step:     5/50" in line and "max_rss:" in line
    assert line.endswith("eta: 0:01:30")  # 45 steps left at 2 s
    assert record["tps"] == pytest.approx(32.0, rel=0.01) and metrics.last_loss == 2.5
    metrics.log_validation(5, 2.7, 100)
    assert metrics.validations == [(5, 2.7)]


def test_summary_lines():
    summary = RunSummary(first_step=11, last_step=200, seconds=192.0, final_loss=4.121,
                         validations=[(100, 4.4), (150, 4.2871), (200, 4.3003)], checkpoints="out/checkpoint",
                         latest_checkpoint="step-200", tensorboard="out/tb", metrics_jsonl="out/metrics.jsonl",
                         wandb="out/wandb/offline-run-x")
    assert summary.lines() == [
        "run summary: 190 step(s) (11 -> 200) in 0:03:12; final loss 4.1210",
        "  validation loss: final 4.3003 (step 200), best 4.2871 (step 150)",
        "  checkpoints:     out/checkpoint (latest: step-200)",
        "  tensorboard:     tensorboard --logdir out/tb",
        "  metrics:         out/metrics.jsonl (plot: python scripts/plot_metrics.py out/metrics.jsonl)",
        "  wandb:           out/wandb/offline-run-x",
    ]
    # A model that generates no text (a reward model: JobPlan.generates) is offered no sampling command.
    reward = RunSummary(first_step=1, last_step=2, seconds=1.0, checkpoints="out/checkpoint",
                        latest_checkpoint="step-2", latest_contents="model_only", generates=False)
    assert reward.lines()[1] == "  checkpoints:     out/checkpoint (latest: step-2, the model only)"
    reward.generates = True
    assert reward.lines()[1].endswith("the model only; sample: python scripts/generate.py out/checkpoint)")
    # Only what the run wrote is listed.
    assert RunSummary(first_step=1, last_step=0, seconds=1.0).lines() == ["run summary: no step trained in 0:00:01"]


def test_wandb_mode_is_offline_unless_wandb_can_log_in(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    assert wandb_run.resolve_mode("auto") == "offline"
    assert wandb_run.resolve_mode("online") == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k" + "0" * 39 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_run.resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_run.resolve_mode("auto") == "offline"
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_run.resolve_mode("auto") == "online"
    assert wandb_run.resolve_mode("offline") == "offline"


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    from titanlike.config import ConfigError, load_job_config
    from titanlike.train.plan import plan_job

    find_spec = wandb_run.importlib.util.find_spec
    monkeypatch.setattr(wandb_run.importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else find_spec(name, *args))
    cfg = load_job_config(["--metrics.enable_wandb", "--training.seq_len", "64"])
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb needs the wandb package: pip install"):
        plan_job(cfg, world_size=1)
