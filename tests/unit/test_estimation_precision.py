"""The estimator knows float16 training, FSDP CPU offload and batch ramp-up (estimation/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from estimation.layout import estimate
from estimation.options import EstimateOptions, prepare_job
from estimation.probe import probe
from estimation.estimate import format_report, run_estimate
from titanlike.config import ConfigError, load_job_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_tiny",
        "--training.seq_len", "64", "--training.local_batch_size", "4"]


def _top(*overrides: str, world: int):
    prep = prepare_job(load_job_config([*TINY, *overrides]), world)
    return max(estimate(prep.plan, probe(prep.plan)), key=lambda r: r.peak_bytes)


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
@pytest.mark.parametrize("world", [1, 2])  # autocast without FSDP; FSDP's mixed precision
def test_float16_takes_the_bytes_of_bfloat16(world):
    half, bf16, fp32 = (_top("--training.mixed_precision_param", dtype, world=world)
                        for dtype in ("float16", "bfloat16", "float32"))
    # float16 adds only the loss scale's scalars (a 512-byte block each).
    assert abs(half.peak_bytes - bf16.peak_bytes) <= 4096 and half.peak_bytes < fp32.peak_bytes


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_cpu_offload_moves_parameters_gradients_and_optimizer_state_to_the_host():
    accumulate = ["--training.global_batch_size", "16"]  # sharded gradients held across microbatches
    plain, off = _top(*accumulate, world=2), _top(*accumulate, "--training.enable_cpu_offload", world=2)
    assert plain.host == 0 and off.host > 0
    assert off.peak.parameters == off.peak.optimizer_state == off.peak.gradients == 0
    assert off.peak_bytes < plain.peak_bytes
    result = run_estimate(load_job_config([*TINY, "--training.enable_cpu_offload"]), EstimateOptions(world_size=2))
    assert any(n.startswith("CPU offload:") for n in result["notes"]) and "host memory" in format_report(result)
    with pytest.raises(ConfigError, match="enable_cpu_offload offloads FSDP's shards, so it needs"):
        prepare_job(load_job_config([*TINY, "--training.enable_cpu_offload"]), 1)


@pytest.mark.slow  # starts no process, but among the heaviest (1.5 s or more): kept out of the fast lane's 2 minutes
def test_ramp_up_is_estimated_at_its_final_batch():
    full = ["--training.global_batch_size", "32"]
    plain, ramped = _top(*full, world=2), _top(*full, "--training.rampup_batch_size", "8,8,64", world=2)
    assert ramped.peak == plain.peak
    result = run_estimate(load_job_config([*TINY, *full, "--training.rampup_batch_size", "8,8,64"]),
                          EstimateOptions(world_size=2))
    assert any(n.startswith("batch ramp-up") for n in result["notes"])
