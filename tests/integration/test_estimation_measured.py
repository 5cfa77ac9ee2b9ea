"""Memory estimates against steps measured on this machine: scripts/measure_memory.py runs every family's
debug preset in one subprocess, pipeline ranks under torchrun, and compiled blocks, the optimizer step and
LoRA in one more subprocess. The estimator's other checks, in this process: tests/unit/test_estimation.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimation.layout import estimate
from estimation.options import prepare_job
from estimation.probe import probe
from estimation_checks import FAMILY_PRESETS, estimate_job, preset_argv
from titanlike.config import load_job_config

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


# Against steps measured on this machine ---------------------------------------------------------

_MEASURE_ALL = """
import contextlib, io, json, sys
sys.path.insert(0, {repo!r} + "/scripts")
from measure_memory import main
for i, argv in enumerate(json.loads(sys.argv[1])):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--job.dump_folder", f"{{sys.argv[2]}}/{{i}}"])
    print(out.getvalue().strip().splitlines()[-1], flush=True)
"""


# LLaVA's debugmodel with its tower a fifth of the step's peak (64 x 64 images, 4 tower layers; the job's
# tokenizer named, so that the estimate sizes the vocabulary as train.py does): an estimate missing the
# encoder's parameters, optimizer state or activations over the image patches would be off by more than 10%.
LLAVA = ["--model.name", "llava", "--model.flavor", "debugmodel", "--model.args.vision.image_size", "64",
         "--model.args.vision.n_layers", "4", "--training.seq_len", "80", "--training.local_batch_size", "8",
         "--training.mixed_precision_param", "float32", "--model.tokenizer_path",
         str(REPO / "titanlike" / "data" / "assets" / "debug_tokenizer.tiktoken"), "--metrics.no_enable_tensorboard"]


def test_every_family_debug_preset_is_within_2_percent_of_a_measured_cpu_step(tmp_path):
    """One real training step of each family's debug preset (and LLaVA's, above) on CPU, measured by
    scripts/measure_memory.py (allocator events, independent of the probe's storage count): the estimate
    counting torch's CPU kernels and exact bytes is within 2% (measured: within 0.13% for all eleven,
    LLaVA +1.0%)."""
    names, jobs = [*FAMILY_PRESETS, "llava"], [*(preset_argv(name) for name in FAMILY_PRESETS), LLAVA]
    proc = subprocess.run([sys.executable, "-c", _MEASURE_ALL.format(repo=str(REPO)), json.dumps(jobs), str(tmp_path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = [json.loads(line)["peak_bytes"] for line in proc.stdout.splitlines() if line.startswith("{")]
    for name, argv, m in zip(names, jobs, measured, strict=True):
        e = max(r.peak_bytes for r in estimate_job(*argv, world=1, device="cpu", granularity=1))
        assert abs(e - m) <= 0.02 * m, (name, e, m)


def test_pipeline_ranks_are_within_2_percent_of_measured_cpu_steps(tmp_path):
    """PP 2 (1F1B, 4 microbatches) on 2 gloo ranks: each rank's peak, from torch's own schedule, within
    2% of its measured step (measured: -0.3% and 0.0%)."""
    argv = [*preset_argv("debug_model"), "--training.seq_len", "256", "--training.local_batch_size", "8",
            "--training.mixed_precision_param", "float32", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_microbatch_size", "2"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "scripts" / "measure_memory.py"), *argv, "--job.dump_folder",
                           str(tmp_path / "dump"), "--measure.out", str(tmp_path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["peak_bytes"]
                for p in tmp_path.glob("rank*.json")}
    for r in estimate_job(*argv, world=2, device="cpu", granularity=1):
        assert abs(r.peak_bytes - measured[r.rank]) <= 0.02 * measured[r.rank], (r.rank, r.peak_bytes, measured)


# Compiled blocks, the optimizer step's peak and LoRA, against steps measured on this machine: one
# subprocess measures them all (the compiled ones last: inductor on CPU takes a minute or two).
MEASURED_JOBS = {
    "optimizer step": [*preset_argv("debug_model"), "--training.seq_len", "32", "--training.local_batch_size", "1",
                       "--optimizer.implementation", "foreach"],
    # The job's own [lora] (not the defaults): rank 16 on the MLP too.
    "lora": [*preset_argv("lora_debug"), "--lora.rank", "16", "--lora.target_modules", "q_proj,v_proj,gate_proj,down_proj"],
    "compiled": [*preset_argv("debug_model"), "--training.seq_len", "512", "--training.local_batch_size", "4",
                 "--compile.enable"],
    "compiled, op-level checkpointing": [
        *preset_argv("debug_model"), "--training.seq_len", "512", "--training.local_batch_size", "4", "--compile.enable",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
}


@pytest.fixture(scope="module")
def measured_jobs(tmp_path_factory) -> dict[str, int]:
    jobs = list(MEASURED_JOBS.values())
    proc = subprocess.run([sys.executable, "-c", _MEASURE_ALL.format(repo=str(REPO)), json.dumps(jobs),
                           str(tmp_path_factory.mktemp("measured"))],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [json.loads(line)["peak_bytes"] for line in proc.stdout.splitlines() if line.startswith("{")]
    return dict(zip(MEASURED_JOBS, peaks, strict=True))


def _cpu_estimate(name: str, *more: str):
    (r,) = estimate_job(*MEASURED_JOBS[name], *more, world=1, device="cpu", granularity=1)
    return r


def test_compiled_blocks_and_loss_are_within_2_percent_of_a_measured_compiled_cpu_step(measured_jobs):
    """A step whose blocks and loss inductor really compiles on CPU: the estimate (AOT autograd, inductor's
    partitioner, fusion's buffers) within 2% of it (measured: 0.01%); the eager estimate of the same
    job is not (it keeps every intermediate the compiled graphs recompute or fuse away: +28%)."""
    m = measured_jobs["compiled"]
    compiled = _cpu_estimate("compiled").peak_bytes
    assert abs(compiled - m) <= 0.02 * m, (compiled, m)
    eager = _cpu_estimate("compiled", "--compile.no_enable").peak_bytes
    assert eager > 1.15 * m, (eager, m)
    # Op-level checkpointing's policy reaches the partitioner through dynamo: within 7% (measured: -4.9%).
    m = measured_jobs["compiled, op-level checkpointing"]
    op = _cpu_estimate("compiled, op-level checkpointing").peak_bytes
    assert abs(op - m) <= 0.07 * m, (op, m)


def test_the_optimizer_steps_peak_is_within_2_percent_of_a_measured_cpu_step(measured_jobs):
    """Short sequences and foreach AdamW (its temporaries span every parameter at once): the peak is the
    optimizer step, with the gradients held, both in the estimate and on this machine, within 2% (measured: 0.0%)."""
    r, m = _cpu_estimate("optimizer step"), measured_jobs["optimizer step"]
    assert r.peak_phase == "optimizer step" and r.peak.gradients > 0, r.peak_phase
    assert abs(r.peak_bytes - m) <= 0.02 * m, (r.peak_bytes, m)


def test_lora_holds_gradients_and_optimizer_state_for_adapters_only(measured_jobs):
    """The LoRA preset at the job's own rank and targets: the frozen base has no gradient and no AdamW
    state, the adapters have both (their element count from the model itself), and the step is within 2%
    of the measured one (measured: 0.07%)."""
    from titanlike.models.converters import build_model_converters

    prep = prepare_job(load_job_config(MEASURED_JOBS["lora"]), 1)
    model = prep.plan.spec.model_cls(prep.plan.model_args)
    cfg = prep.plan.cfg
    build_model_converters(cfg.model.converters, cfg).convert(model)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < adapters < sum(p.numel() for p in model.parameters()) // 10
    pr = probe(prep.plan, device="cpu", granularity=1)
    held = [pr.static[k] for k in pr.kinds] + [pr.static[e] for e in ("input", "output", "shared")]
    grads, state = sum(s.grads for s in held) - pr.static["tied"].grads, sum(s.optimizer for s in held)
    steps = 4 * sum(1 for p in model.parameters() if p.requires_grad)  # AdamW's fp32 step per parameter
    assert grads == 4 * adapters and state == 2 * 4 * adapters + steps, (grads, state, adapters)
    (r,) = estimate(prep.plan, pr)
    m = measured_jobs["lora"]
    assert abs(r.peak_bytes - m) <= 0.02 * m, (r.peak_bytes, m)
