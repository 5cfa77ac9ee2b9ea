"""scripts/plot_metrics.py draws each objective's own metrics, and the post-training presets write
TensorBoard events as the README says presets do (issue 45)."""

import glob
import importlib.util
import json
import struct

import pytest

from conftest import REPO
from titanlike.config import load_job_config


def _script():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DPO = {"rewards_chosen": 0.1, "rewards_rejected": -0.1, "reward_margin": 0.2, "reward_accuracy": 0.75}
DISTILL = {"distill_kl": 0.3, "hard_loss": 2.0}


@pytest.mark.parametrize("terms, height", [(DPO, 2000), (DISTILL, 1600), ({}, 1200)])
def test_every_series_beyond_the_four_panels_gets_its_own(tmp_path, terms, height):
    plot = _script()
    records = [{"step": s, "loss": 1.0 / s, "grad_norm": 1.0, "lr": 1e-3, "tps": 100.0, "max_rss": 0.5,
                "moe/layer0/load": 1.0, "moe/layer1/load": 1.2, **terms} for s in range(1, 6)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    panels = plot.other_panels(records)
    assert panels == {"moe": ["moe/layer0/load", "moe/layer1/load"], **{k: [k] for k in terms}}
    assert plot.main([str(path)]) == 0
    png = (tmp_path / "metrics.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (1200, height)  # 4 + 1 (moe/) + one per term, two a row


@pytest.mark.parametrize("preset", sorted(p for pattern in ("sft_*", "dpo_*", "reward_*", "distill_*")
                                          for p in glob.glob(str(REPO / "train_configs" / f"{pattern}.toml"))))
def test_post_training_presets_write_tensorboard_events(preset):
    assert load_job_config(["--job.config_file", preset]).metrics.enable_tensorboard
