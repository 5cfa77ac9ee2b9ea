"""The estimator knows float16 training, FSDP CPU offload and batch ramp-up (estimation/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from estimation.analytic import bytes_per_parameter, estimate_analytic
from estimation.options import EstimateOptions, prepare_job
from estimation.report import format_report, run_estimate
from titanlike.config import load_job_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_tiny",
        "--training.seq_len", "64", "--training.local_batch_size", "4"]


def _analytic(*overrides: str, world: int):
    prep = prepare_job(load_job_config([*TINY, *overrides]), world)
    estimates, details = estimate_analytic(prep)
    return prep, estimates[0], details[0]


@pytest.mark.parametrize("layout, world", [([], 2), (["--parallelism.tensor_parallel_degree", "2"], 2), ([], 1)])
def test_float16_takes_the_bytes_of_bfloat16(layout, world):
    """fp32 masters either way, 2-byte compute copies and activations (autocast without FSDP)."""
    _, half, _ = _analytic("--training.mixed_precision_param", "float16", *layout, world=world)
    _, bf16, _ = _analytic("--training.mixed_precision_param", "bfloat16", *layout, world=world)
    _, fp32, _ = _analytic("--training.mixed_precision_param", "float32", *layout, world=world)
    assert half.peak == bf16.peak and half.peak_bytes < fp32.peak_bytes


def test_float16_autocast_trace_equals_the_bfloat16_one():
    """Without FSDP the trace runs the trainer's autocast, now in float16 (one process)."""
    from estimation.traced import estimate_traced

    def traced(dtype):
        prep = prepare_job(load_job_config([*TINY, "--training.seq_len", "32", "--training.local_batch_size", "2",
                                            "--training.mixed_precision_param", dtype]), 1)
        return estimate_traced(prep)[0][0].phases["forward/backward of microbatch 0"]

    # Without autocast in float16 the trace would keep fp32 activations and differ from bfloat16's.
    assert traced("float16") == traced("bfloat16")


def test_cpu_offload_moves_parameters_gradients_and_optimizer_state_to_the_host():
    overrides = ["--training.global_batch_size", "16"]  # accumulation: sharded gradients held across microbatches
    prep, plain, d_plain = _analytic(*overrides, world=2)
    _, off, d_off = _analytic(*overrides, "--training.enable_cpu_offload", world=2)
    moved = plain.phases["optimizer step"]
    # What moved: sharded parameters (buffers stay), their gradients, the AdamW state.
    assert off.peak.optimizer_state == 0 and d_plain.host_bytes == 0
    assert d_off.host_bytes == moved.parameters - off.peak.parameters + moved.gradients + moved.optimizer_state
    assert 0 < off.peak.parameters < plain.peak.parameters  # the RoPE buffer stays on the device
    assert off.peak.gathered_parameters == plain.peak.gathered_parameters
    assert off.peak.activations == plain.peak.activations
    assert off.phases["optimizer step"].transient == 0  # the step runs on the host
    assert off.peak_bytes < plain.peak_bytes - d_off.host_bytes // 2
    assert bytes_per_parameter(prep)["host_memory"] is False


def test_cpu_offload_report_names_the_host_bytes_and_skips_the_trace():
    cfg = load_job_config([*TINY, "--training.enable_cpu_offload"])
    result = run_estimate(cfg, EstimateOptions(world_size=2))
    assert result["source"] == "analytic" and "traced" not in result
    assert result["analytic"]["host_bytes"] > 0
    notes = " ".join(result["notes"])
    assert "no traced estimate: the traced estimate does not model FSDP CPU offload" in notes
    assert "CPU offload:" in notes and "in host memory" in format_report(result)


def test_cpu_offload_needs_fsdp():
    from titanlike.config import ConfigError

    with pytest.raises(ConfigError, match="training.enable_cpu_offload offloads FSDP's shards, so it needs "
                                          "data_parallel_shard_degree > 1"):
        prepare_job(load_job_config([*TINY, "--training.enable_cpu_offload"]), 1)


def test_ramp_up_is_estimated_at_its_final_batch():
    full = ["--training.global_batch_size", "32"]
    _, plain, _ = _analytic(*full, world=2)
    _, ramped, _ = _analytic(*full, "--training.rampup_batch_size", "8,8,64", world=2)
    _, first, _ = _analytic("--training.global_batch_size", "8", world=2)
    assert ramped.peak == plain.peak and ramped.peak_bytes > first.peak_bytes
    result = run_estimate(load_job_config([*TINY, *full, "--training.rampup_batch_size", "8,8,64"]),
                          EstimateOptions(world_size=2, mode="analytic"))
    assert any(n.startswith("batch ramp-up: estimated at the final global batch") for n in result["notes"])
