"""What tests/unit/test_estimation.py and tests/integration/test_estimation_measured.py both use, written once
(imported like tests/family_checks.py): a job's estimate by the probe, and each family's debug preset."""

from __future__ import annotations

from conftest import REPO
from estimation.layout import estimate
from estimation.options import prepare_job
from estimation.probe import probe
from titanlike.config import load_job_config

FAMILY_PRESETS = ["debug_model", "gpt2_debug", "qwen3_debug_moe", "mixtral_debug", "deepseek_v3_debug",
                  "hybrid_debug", "bert_debug", "t5_debug", "gpt_oss_debug", "gemma3_debug", "qwen3_next_debug"]


def estimate_job(*overrides: str, world: int, device: str = "cuda", granularity: int = 512):
    """Every pipeline rank's estimate of the job the overrides describe on `world` ranks."""
    prep = prepare_job(load_job_config(list(overrides)), world)
    return estimate(prep.plan, probe(prep.plan, device=device, granularity=granularity))


def preset_argv(name: str) -> list[str]:
    return ["--job.config_file", str(REPO / "train_configs" / f"{name}.toml"), "--metrics.no_enable_tensorboard"]
