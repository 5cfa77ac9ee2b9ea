"""Checkpoint and resume through train.py (one process inside the test's, several ranks under torchrun on
gloo; the chains of layouts are pooled jobs, each declared after the one whose checkpoint it loads).

* Resume is exact: 10 steps straight equal 5 steps + resume 5, loss and grad norm, bit for bit; and for
  Gemma 3, Qwen3-Next and gpt-oss, 4 steps equal 2 + 2, the final parameters too.
* A run killed with SIGKILL (every process at once, mid-training, possibly mid-save) resumes
  from its last published checkpoint; the steps it re-runs reproduce the killed run's bit
  for bit.
* Layout changes at resume (FSDP2 -> one process, HSDP 2x2 -> FSDP2) reproduce the straight
  run within the parity tolerance of tests/distributed/test_fsdp_parity.py.
* Both async modes are used (thread; checkpoint process with staging), a save that never
  finished (a leftover step-N.tmp) is ignored, and a damaged checkpoint stops every rank
  with a message naming the file instead of hanging or starting over.

The learning rate is constant after warm-up (decay_ratio 0) so that a 5-step run and a
10-step run share a schedule.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_JOB, _env, descendants, launch, read_metrics, train_in_process

pytestmark = pytest.mark.distributed

RTOL = 2e-5  # as in test_fsdp_parity.py: layouts differ from one process in summation order only
JOB = [*TINY_JOB, "--training.steps", "10", "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable"]
FSDP2 = ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]
HSDP = ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2"]


def by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of every step (a resumed run appends the steps it re-runs)."""
    return {r["step"]: r for r in records}


def run(dump: Path, *extra: str, nproc: int = 1, steps: int = 10, new_process: bool = False) -> dict[int, dict]:
    """The job; one process runs inside this one unless new_process (tests/conftest.py: train_in_process)."""
    argv = [*JOB, "--job.dump_folder", str(dump), "--training.steps", str(steps), *extra]
    if nproc == 1 and not new_process:
        train_in_process(argv)
    else:
        launch(argv, nproc=nproc)
    return by_step(read_metrics(dump))


def pooled(folder: str, *extra: str, steps: int = 10) -> tuple:
    """A train_run mark's options: the job of run() saving into (or loading from) the pool's `folder`."""
    return (*JOB[len(TINY_JOB):], "--training.steps", str(steps), "--checkpoint.folder", lambda root: root / folder,
            *extra)


def published(folder: Path) -> list[int]:
    from titanlike.checkpoint import published_steps

    return published_steps(str(folder))


def assert_close_curve(got: dict[int, dict], ref: dict[int, dict], steps=range(1, 11)):
    for s in steps:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=RTOL), (s, got[s], ref[s])
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=RTOL * 10), (s, got[s], ref[s])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 steps in one process, a full checkpoint at step 5 saved in the background (thread
    mode), and the model exported in bfloat16 at the end."""
    dump = tmp_path_factory.mktemp("straight")
    metrics = run(dump, "--checkpoint.async_mode", "async", "--checkpoint.interval", "5",
                  "--checkpoint.export_dtype", "bfloat16")
    return dump, metrics


def test_straight_run_saves_a_full_checkpoint_and_exports_the_model(straight):
    from titanlike.checkpoint.format import read_dcp_metadata

    dump, metrics = straight
    assert sorted(metrics) == list(range(1, 11))
    folder = dump / "checkpoint"
    assert sorted(set(os.listdir(folder)) - {".titanlike.lock"}) == ["step-10", "step-5"]
    info = json.loads((folder / "step-10" / "titanlike.json").read_text())
    assert info["contents"] == "model_only" and info["model"]["name"] == "llama3"
    dtypes = {md.properties.dtype for md in read_dcp_metadata(str(folder / "step-10")).state_dict_metadata.values()}
    assert [str(d) for d in dtypes] == ["torch.bfloat16"]
    assert json.loads((folder / "step-5" / "titanlike.json").read_text())["contents"] == "full"


def test_resume_is_exact(tmp_path, straight):
    """5 steps (the straight run's checkpoint) + 5 resumed steps in a new process = 10 straight."""
    dump, ref = straight
    shutil.copytree(dump / "checkpoint", tmp_path / "ckpt")
    got = run(tmp_path / "resumed", "--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.interval", "5",
              "--checkpoint.load_step", "5", new_process=True)
    assert sorted(got) == [6, 7, 8, 9, 10]
    for s in range(6, 11):
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s


def _last_logged_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """FSDP2 on 2 ranks, saving every 2 steps with async_with_pinned_mem (staging thread +
    checkpoint process per rank), SIGKILLed after step 4 is published; then resumed on 2 ranks
    with thread-mode async saves, keeping full checkpoints to the end."""
    root = tmp_path_factory.mktemp("killed")
    dump = root / "run"
    args = [*JOB, "--job.dump_folder", str(dump), "--training.steps", "10", *FSDP2,
            "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_with_pinned_mem"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "train.py"), *args]
    with open(root / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        # Kill once step 4 is published and training has moved past it, so some steps re-run.
        while proc.poll() is None and time.monotonic() < deadline:
            if 4 in published(dump / "checkpoint") and _last_logged_step(dump / "metrics.jsonl") >= 5:
                break
            time.sleep(0.02)
    finally:
        # Every process at once, like a node failure: torchrun, its workers (each in its own
        # session) and their checkpoint processes.
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    log = (root / "killed.log").read_text()
    killed = by_step(read_metrics(dump))
    last_kept = published(dump / "checkpoint")[-1]
    resumed = run(dump, "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
                  "--checkpoint.no_last_save_model_only", *FSDP2, nproc=2)
    return dict(returncode=proc.returncode, log=log, killed=killed, last_kept=last_kept, resumed=resumed, dump=dump)


def test_sigkill_after_a_checkpoint_then_resume(killed_and_resumed, straight):
    k = killed_and_resumed
    assert k["returncode"] == -signal.SIGKILL, (k["returncode"], k["log"][-3000:])
    killed, last_kept = k["killed"], k["last_kept"]
    assert 4 <= last_kept < 10 and max(killed) < 10
    assert_close_curve(k["resumed"], straight[1])
    # Steps after the last checkpoint ran twice, in the same layout: identical results.
    rerun = [s for s in killed if s > last_kept]
    assert rerun, "the kill left no step to re-run"
    with open(k["dump"] / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    second_run = by_step(records[len(killed):])
    for s in rerun:
        assert (killed[s]["loss"], killed[s]["grad_norm"]) == (second_run[s]["loss"], second_run[s]["grad_norm"]), s


def test_fsdp2_checkpoint_resumes_in_one_process(tmp_path, killed_and_resumed, straight):
    folder = killed_and_resumed["dump"] / "checkpoint"
    assert published(folder) == [2, 4, 6, 8, 10]
    # A save of step 7 that was killed half way: must be ignored (and cleaned up), not loaded.
    (folder / "step-7.tmp").mkdir()
    (folder / "step-7.tmp" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    got = run(tmp_path / "single", "--checkpoint.folder", str(folder), "--checkpoint.interval", "2",
              "--checkpoint.load_step", "6")
    assert sorted(got) == [7, 8, 9, 10]
    assert not (folder / "step-7.tmp").exists()
    assert_close_curve(got, straight[1], steps=range(7, 11))
    # The re-saved steps replaced the old ones; step 10 is now this run's model-only export.
    assert published(folder) == [2, 4, 6, 8, 10]
    assert json.loads((folder / "step-10" / "titanlike.json").read_text())["contents"] == "model_only"


# The layout-change chains stop at step 5 of the straight run (the learning rate is constant after
# warm-up, so a 5-step job follows the 10-step one): a resume at step 3 then compares steps 4-5.
@pytest.mark.train_run(*pooled("ckpt_hsdp", *HSDP, "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only",
                              steps=3), name="hsdp", nproc=4)
@pytest.mark.train_run(*pooled("ckpt_hsdp", *FSDP2, "--checkpoint.interval", "5", steps=5), name="fsdp2", nproc=2,
                       after="hsdp")
def test_hsdp_checkpoint_resumes_under_fsdp2(train_runs, straight):
    _, ref = straight
    first, second = by_step(train_runs["hsdp"].metrics), by_step(train_runs["fsdp2"].metrics)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5]
    assert_close_curve({**first, **second}, ref, steps=range(1, 6))


def test_damaged_checkpoint_stops_every_rank_with_the_file_name(tmp_path, straight):
    dump, _ = straight
    folder = tmp_path / "ckpt"
    shutil.copytree(dump / "checkpoint" / "step-5", folder / "step-5")
    data = folder / "step-5" / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 10)
    proc = launch([*JOB, "--job.dump_folder", str(tmp_path / "run"), *FSDP2, "--checkpoint.folder", str(folder),
                   "--checkpoint.load_step", "5"], nproc=2, check=False, timeout=300)
    assert proc.returncode != 0
    assert f"checkpoint file {data} is truncated" in proc.stderr
    assert read_metrics(tmp_path / "run") == []  # no step ran: no silent fresh start


def test_fsdp2_checkpoint_resumes_under_tp2(tmp_path, killed_and_resumed, straight):
    # Parameters saved as FSDP shards (dim-0 over 2 ranks) load as TP shards (column/row splits).
    folder = tmp_path / "ckpt"
    shutil.copytree(killed_and_resumed["dump"] / "checkpoint" / "step-6", folder / "step-6")
    got = run(tmp_path / "tp2", "--checkpoint.folder", str(folder), "--checkpoint.interval", "100",
              "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2", nproc=2)
    assert sorted(got) == [7, 8, 9, 10]
    assert_close_curve(got, straight[1], steps=range(7, 11))


# Pipeline stages save disjoint parameters under their unchanged names; FSDP2 loads them whole.
@pytest.mark.train_run(*pooled("ckpt_pp2", "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree",
                              "2", "--parallelism.pipeline_parallel_schedule", "1F1B", "--checkpoint.interval", "3",
                              "--checkpoint.no_last_save_model_only", steps=3), name="pp2", nproc=2)
@pytest.mark.train_run(*pooled("ckpt_pp2", *FSDP2, "--checkpoint.interval", "100", steps=5), name="fsdp2", nproc=2,
                       after="pp2")
def test_pp2_checkpoint_resumes_under_fsdp2(train_runs, straight):
    _, ref = straight
    first, second = by_step(train_runs["pp2"].metrics), by_step(train_runs["fsdp2"].metrics)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5]
    assert_close_curve({**first, **second}, ref, steps=range(1, 6))


GPT2 = ("--model.name", "gpt2", "--model.flavor", "debugmodel", "--training.local_batch_size", "8")
GPT2_PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")


# GPT-2 ties its output projection to the token table; under PP2 the last stage holds its own
# synchronised copy. Checkpoints store the weight (and its optimizer state) once under the
# owner's name, so one process -> PP2 -> one process resumes at parity with the straight run.
@pytest.mark.train_run(*pooled("ckpt_gpt2_straight", *GPT2, "--checkpoint.interval", "100", steps=6), name="straight")
@pytest.mark.train_run(*pooled("ckpt_gpt2", *GPT2, "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only",
                              steps=2), name="one")
@pytest.mark.train_run(*pooled("ckpt_gpt2", *GPT2, *GPT2_PP2, "--checkpoint.interval", "4",
                              "--checkpoint.no_last_save_model_only", steps=4), name="pp2", nproc=2, after="one")
@pytest.mark.train_run(*pooled("ckpt_gpt2", *GPT2, "--checkpoint.interval", "100", steps=6), name="again", after="pp2")
def test_tied_model_checkpoints_cross_pipeline_stages_both_ways(train_runs):
    straight, first, second, third = (by_step(train_runs[name].metrics) for name in ("straight", "one", "pp2", "again"))
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4] and sorted(third) == [5, 6]
    assert_close_curve({**first, **second, **third}, straight, steps=range(1, 7))


# The families of issue 43, each through its own state: Gemma 3's sliding-window and global layers,
# Qwen3-Next's Gated DeltaNet (conv, decay and gate parameters) beside gated attention, dense then MoE
# with a shared expert (debugmodel_tiny), gpt-oss's sinks, biased experts and YaRN tables. One process
# each, in the test process as the pooled single-process resumes run (2-5 s a family on 2 cores, 10 s the three).
NEW_FAMILIES = [("gemma3", "debugmodel"), ("qwen3_next", "debugmodel_tiny"), ("gpt_oss", "debugmodel")]


@pytest.mark.parametrize("family,flavor", NEW_FAMILIES, ids=[f for f, _ in NEW_FAMILIES])
def test_new_families_resume_exactly(tmp_path, family, flavor):
    """4 steps straight = 2 steps + a resume from step 2's full checkpoint to 4: the losses, the grad norms
    and the final parameters bit for bit, as test_resume_is_exact asks of Llama."""
    from titanlike.checkpoint.format import read_dcp_model

    job = ("--model.name", family, "--model.flavor", flavor, "--training.local_batch_size", "2",
           "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
    ref = run(tmp_path / "straight", *job, steps=4)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-2", tmp_path / "ckpt" / "step-2")
    got = run(tmp_path / "resumed", *job, "--checkpoint.folder", str(tmp_path / "ckpt"), steps=4)
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s
    want = read_dcp_model(str(tmp_path / "straight" / "checkpoint" / "step-4"))
    final = read_dcp_model(str(tmp_path / "ckpt" / "step-4"))
    assert final.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(final[name], value), name
