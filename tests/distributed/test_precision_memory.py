"""Precision and memory options through train.py, each against its plain counterpart (item 5 of #19).

* Loss scaling with fp32 compute (a scale that grows, never overflows) and CPU offload, under
  FSDP2 on 2 ranks, reproduce the plain single-process run (the shared reference of
  test_fsdp_parity.py) within that file's tolerances: scaling and the folded unscaling only round
  differently, and offload only moves shards (on a CPU-only machine its host copies are no-ops;
  tests/distributed/test_cpu_offload.py checks the policy is applied). One job checks both.
* An inf planted in one rank's gradient shard (float16, FSDP2, 2 ranks): every rank skips the
  step with its parameters unchanged, the learning rate is held, the scale backs off, the run
  goes on.
* A float16 run (one process, real overflows possible) trains, its scale follows Megatron's rule
  on the overflows it met, and a resume from its checkpoint reproduces it bit for bit.
* Batch ramp-up: 2 ranks (FSDP2) reproduce the single-process ramped run, and a resume from a
  checkpoint taken mid-ramp reproduces it bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import REPO, TINY_JOB, _env, read_metrics, train_in_process

pytestmark = pytest.mark.distributed

RTOL, GRAD_RTOL = 2e-5, 5e-4  # as in test_fsdp_parity.py, where they are measured and explained
FSDP2 = ["--training.local_batch_size", "4"]  # 2 ranks x 4 = the reference's global batch of 8


def assert_same_curve(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=GRAD_RTOL), (g, r)


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


@pytest.mark.train_run(*FSDP2, "--training.enable_cpu_offload", "--loss_scaling.mode", "dynamic",
                       "--loss_scaling.initial_scale", "1024", "--loss_scaling.window", "3", nproc=2)
def test_loss_scaling_and_cpu_offload_under_fsdp2_equal_the_plain_run(train_run, single_process_reference):
    """One 2-rank job for both (each changes only where bytes live or how values round): FSDP2
    with CPU offload and a loss scale that grows without overflowing (fp32 compute) against the
    plain single-process run."""
    got = train_run.metrics
    assert_same_curve(got, single_process_reference)
    # No overflow in fp32: the scale doubles every 3 steps.
    assert [r["loss_scale"] for r in got] == [1024.0 * 2 ** (s // 3) for s in range(1, 5)]
    assert all(r["overflow_skipped_steps"] == 0 for r in got)


FLOAT16 = [*TINY_JOB, "--training.steps", "10", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
           "--training.mixed_precision_param", "float16", "--optimizer.lr", "3e-3"]


def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    import subprocess
    import sys

    dump = tmp_path / "inf"
    env = _env()
    env["TITANLIKE_FAULT"] = json.dumps({"kind": "inf_grad", "step": 2, "rank": 1})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "faults.py"), *FLOAT16, "--training.steps", "4", "--training.local_batch_size", "4",
           "--loss_scaling.hysteresis", "1", "--job.dump_folder", str(dump)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # Both ranks ran step 2 to its end with their parameter shards untouched (the two ranks share
    # stdout, so their lines may come in either order or run together).
    kept = re.findall(r"INF_GRAD_STEP_KEPT_PARAMETERS (\d) (True|False)", proc.stdout)
    assert sorted(kept) == [("0", "True"), ("1", "True")], proc.stdout[-3000:]
    assert "skipped step 2: gradients overflowed at loss scale 65536 (norm inf)" in proc.stderr
    r = by_step(read_metrics(dump))
    assert sorted(r) == [1, 2, 3, 4]
    assert r[2]["grad_norm"] == float("inf") and r[2]["overflow_skipped_steps"] == 1
    assert [r[s]["loss_scale"] for s in (1, 2, 3, 4)] == [65536.0, 32768.0, 32768.0, 32768.0]
    assert r[3]["lr"] == r[2]["lr"] < r[4]["lr"]  # the skipped step did not advance the schedule (warm-up)
    assert all(r[s]["grad_norm"] < 10 for s in (3, 4))  # training went on


@pytest.fixture(scope="module")
def float16_run(tmp_path_factory):
    """10 float16 steps in one process, a full checkpoint at step 5; the scale starts near where
    the tiny model's gradients overflow, so it grows and may back off during the run."""
    dump = tmp_path_factory.mktemp("fp16")
    args = [*FLOAT16, "--training.local_batch_size", "8", "--loss_scaling.initial_scale", "262144",
            "--loss_scaling.window", "3", "--loss_scaling.hysteresis", "1", "--checkpoint.enable",
            "--checkpoint.interval", "5"]
    train_in_process([*args, "--job.dump_folder", str(dump)])
    return args, dump, by_step(read_metrics(dump))


def test_float16_run_trains_and_scales_by_megatrons_rule(float16_run):
    from titanlike.train.loss_scaling import LossScaler

    _, _, r = float16_run
    losses = [r[s]["loss"] for s in range(1, 11)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.15, losses
    # Replaying the overflows the run met (non-finite gradient norms) through the rule gives its scales.
    scaler = LossScaler(initial_scale=262144, window=3, hysteresis=1)
    for s in range(1, 11):
        scaler.update(overflow=r[s]["grad_norm"] == float("inf") or r[s]["grad_norm"] != r[s]["grad_norm"])
        assert r[s]["loss_scale"] == scaler.scale and r[s]["overflow_skipped_steps"] == scaler.skipped_steps, s


def test_float16_resume_is_exact(tmp_path, float16_run):
    args, dump, straight = float16_run
    shutil.copytree(dump / "checkpoint", tmp_path / "ckpt")
    train_in_process([*args, "--job.dump_folder", str(tmp_path / "resumed"), "--checkpoint.folder",
                      str(tmp_path / "ckpt"), "--checkpoint.load_step", "5"])
    got = by_step(read_metrics(tmp_path / "resumed"))
    assert sorted(got) == [6, 7, 8, 9, 10]
    for s in got:
        keys = ("loss", "grad_norm", "lr", "loss_scale", "overflow_skipped_steps")
        assert [got[s][k] for k in keys] == [straight[s][k] for k in keys], s


# Batch ramp-up: global batch 12 reached after 24 samples from 4 in steps of 4, so the steps take
# 4, 4, 4, 8, 8, 12, 12, 12 samples; the checkpoint at step 4 is taken mid-ramp.
RAMP = [*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.steps", "8",
        "--training.global_batch_size", "12",
        "--training.rampup_batch_size", "4,4,24", "--checkpoint.enable", "--checkpoint.interval", "4"]
RAMP_BATCHES = [4, 4, 4, 8, 8, 12, 12, 12]


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ramp")
    train_in_process([*RAMP, "--training.local_batch_size", "4", "--job.dump_folder", str(dump)])
    return dump, read_metrics(dump)


@pytest.mark.train_run(*RAMP[len(TINY_JOB):], "--training.local_batch_size", "2", nproc=2)
def test_ramped_fsdp2_equals_the_ramped_single_process_run(train_run, ramped):
    _, ref = ramped
    got = train_run.metrics
    assert_same_curve(got, ref)
    assert [r["global_batch_size"] for r in ref] == [r["global_batch_size"] for r in got] == RAMP_BATCHES
    assert all(r["tps"] > 0 for r in got)


def test_resume_mid_ramp_is_exact(tmp_path, ramped):
    dump, ref = ramped
    shutil.copytree(dump / "checkpoint", tmp_path / "ckpt")
    train_in_process([*RAMP, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "resumed"),
                      "--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.load_step", "4"])
    got = by_step(read_metrics(tmp_path / "resumed"))
    straight = by_step(ref)
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        keys = ("loss", "grad_norm", "lr", "global_batch_size")
        assert [got[s][k] for k in keys] == [straight[s][k] for k in keys], s
