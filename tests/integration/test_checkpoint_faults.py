"""Checkpoint faults through train.py and the scripts: one sentence, exit 1, nothing executed,
nothing left behind.

* A crafted index (.metadata) or pickled state entry: train.py (resume), convert_dcp_to_hf.py,
  generate.py and load_model refuse it, and its payload (`touch MARKER`) never runs.
* Two flipped bytes in the latest checkpoint: the relaunch stops naming the file and the
  checkpoint that verifies; with --checkpoint.fallback_on_corruption it resumes from that one.
* A full disk while saving: "no space left on device", the partial save removed, the previous
  checkpoint kept; the relaunch removes a leftover step-N.tmp before its metrics writers start.
* A NaN in one rank's parameter shard (2 ranks): no checkpoint is published, both ranks stop.
* kill -9 in the post-training loops (SFT, SFT with LoRA, DPO): killed half way through a save, then
  in the middle of a step after resuming (in a fork of the test process); the re-run steps' losses are
  the uninterrupted run's, bit for bit.

Faults are injected by tests/faults.py around train.main() (no disk is filled for real), in a launched
process; the other runs, relaunches and scripts run in the test process (conftest.train_here,
script_here: their exit code and what they said, no interpreter and torch import to pay per run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_JOB, _env, launch, read_metrics, script_here, train_here, train_in_process
from faults import flip_two_bytes, poison_entry, poison_index

from titanlike.checkpoint import CheckpointError, load_model, published_steps

# decay_ratio 0: the schedule does not depend on training.steps, so a relaunch with more steps
# reproduces the first run's steps exactly.
JOB = [*TINY_JOB, "--training.steps", "6", "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable",
       "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only"]
FSDP2 = ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


def with_fault(args: list[str], fault: dict, *, nproc: int = 1, timeout: float = 300):
    """train.py args with a fault of tests/faults.py installed (every rank)."""
    env = _env()
    env["TITANLIKE_FAULT"] = json.dumps(fault)
    script = str(REPO / "tests" / "faults.py")
    cmd = [sys.executable, script, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps, full checkpoints at steps 3 and 6."""
    dump = tmp_path_factory.mktemp("trained")
    train_in_process([*JOB, "--job.dump_folder", str(dump)])
    return dump, by_step(read_metrics(dump))


@pytest.fixture
def folder(trained, tmp_path) -> Path:
    """A copy of the trained run's checkpoint folder."""
    shutil.copytree(trained[0] / "checkpoint", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def relaunch(tmp_path: Path, folder: Path, *extra: str, name: str = "run"):
    """The job extended to 9 steps, resuming from folder."""
    return train_here([*JOB, "--training.steps", "9", "--job.dump_folder", str(tmp_path / name),
                       "--checkpoint.folder", str(folder), *extra])


def training_error(proc) -> str:
    """The one line train.py printed for the error (exit 1)."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("training error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0].removeprefix("training error: ")


# ------------------------------------------------------------------ untrusted checkpoints


def test_crafted_index_is_refused_by_train_py_the_scripts_and_load_model(tmp_path, folder):
    marker = tmp_path / "pwned"
    latest = folder / "step-6"
    poison_index(str(latest), marker)
    refusal = (f"checkpoint index {latest}/.metadata refers to posix.system, which a DCP index never holds; "
               "refusing to unpickle it (a crafted or foreign file?)")
    assert training_error(relaunch(tmp_path, folder)).startswith(refusal + "; the newest checkpoint that verifies is")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_metrics(tmp_path / "run") == []
    proc = script_here("convert_dcp_to_hf.py", str(latest), str(tmp_path / "hf"))
    assert proc.returncode == 1 and f"convert_dcp_to_hf: {refusal}" in proc.stderr, proc.stderr[-2000:]
    proc = script_here("generate.py", str(folder), "--max-new-tokens", "2")
    assert proc.returncode == 1 and f"error: {refusal}" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        load_model(latest)
    assert not marker.exists()


def test_pickled_state_entry_is_refused_on_resume(tmp_path, folder):
    marker = tmp_path / "pwned"
    latest = folder / "step-6"
    poison_entry(str(latest), "rng.rank_0", marker)
    assert training_error(relaunch(tmp_path, folder)) == (
        f"checkpoint {latest} holds pickled state (rng), as an older titanlike wrote it, and titanlike never "
        "unpickles checkpoint entries; resume with --checkpoint.exclude_from_loading rng or re-save it")
    assert not marker.exists()


# ------------------------------------------------------------------ silent corruption


def test_flipped_bytes_stop_the_relaunch_or_fall_back(tmp_path, folder, trained):
    file = flip_two_bytes(str(folder / "step-6"))
    message = training_error(relaunch(tmp_path, folder))
    assert message.startswith(f"checkpoint file {file} is corrupt: its CRC-32 is "), message
    assert message.endswith(f"; the newest checkpoint that verifies is {folder}/step-3: resume from it with "
                            "--checkpoint.load_step 3 or --checkpoint.fallback_on_corruption"), message
    proc = script_here("convert_dcp_to_hf.py", str(folder / "step-6"), str(tmp_path / "hf"))
    assert proc.returncode == 1 and f"checkpoint file {file} is corrupt" in proc.stderr, proc.stderr[-2000:]

    proc = relaunch(tmp_path, folder, "--checkpoint.fallback_on_corruption", name="fallback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {folder}/step-3 instead, the newest checkpoint that verifies" in proc.stderr
    got, ref = by_step(read_metrics(tmp_path / "fallback")), trained[1]
    assert sorted(got) == [4, 5, 6, 7, 8, 9]
    for s in (4, 5, 6):  # an exact resume from step 3
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s
    # Step 6 was saved again, whole.
    assert published_steps(str(folder)) == [3, 6, 9]
    load_model(folder / "step-6")


# ------------------------------------------------------------------ a full disk


def test_disk_full_while_saving_then_the_relaunch_cleans_up_first(tmp_path):
    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    args = [*JOB, "--job.dump_folder", str(dump)]
    proc = with_fault(args, {"kind": "disk_full", "where": "step-6.tmp", "budget": 1_000_000})
    assert training_error(proc) == (
        f"no space left on device while saving step 6 to {folder}/step-6; removed the partial save, "
        f"{folder}/step-3 stays the latest checkpoint")
    assert sorted(set(os.listdir(folder)) - {".titanlike.lock"}) == ["step-3"]
    # A save killed half way (SIGKILL) filled the disk: until it is removed, nothing can be
    # written, and the metrics writers are built before training starts.
    (folder / "step-6.tmp").mkdir()
    (folder / "step-6.tmp" / "__0_0.distcp").write_bytes(b"\0" * 4096)
    proc = with_fault(args, {"kind": "full_while_tmp", "folder": str(folder)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removing {folder}/step-6.tmp" in proc.stderr
    assert sorted(set(os.listdir(folder)) - {".titanlike.lock"}) == ["step-3", "step-6"]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4, 5, 6, 4, 5, 6]


# ------------------------------------------------------------------ 2 ranks


@pytest.mark.distributed
def test_two_ranks_refuse_non_finite_parameters_and_a_corrupt_checkpoint_together(tmp_path):
    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    args = [*JOB, *FSDP2, "--job.dump_folder", str(dump)]
    # Rank 1 alone holds the NaN (in its shard); rank 0, which prints, names it all the same.
    proc = with_fault(args, {"kind": "nan_param", "step": 6, "rank": 1}, nproc=2)
    assert proc.returncode != 0
    assert "training error: step 6 has non-finite parameters (first: tok_embeddings.weight); not saving it" \
        in proc.stderr, proc.stderr[-3000:]
    assert sorted(set(os.listdir(folder)) - {".titanlike.lock"}) == ["step-3"]
    # Rank 1's file of step 3 corrupt: every rank stops with the sentence, none hangs.
    file = flip_two_bytes(str(folder / "step-3"), "model.tok_embeddings.weight")
    proc = launch([*args, "--job.dump_folder", str(tmp_path / "again"), "--checkpoint.folder", str(folder)],
                  nproc=2, check=False, timeout=300)
    assert proc.returncode != 0
    assert f"training error: checkpoint file {file} is corrupt" in proc.stderr, proc.stderr[-3000:]
    assert f"; no older checkpoint in {folder} verifies" in proc.stderr


# ------------------------------------------------------------------ kill -9 in the post-training loops

SFT = ("--training.objective", "sft", "--training.dataset", "text", "--training.local_batch_size", "4",
       "--training.dataset_path", str(REPO / "tests" / "assets" / "sft" / "reverse_words.jsonl"))
OBJECTIVES = {
    "sft": SFT,
    "lora": (*SFT, "--model.converters", "lora"),
    "dpo": ("--training.objective", "dpo", "--training.dataset", "text", "--training.local_batch_size", "4",
            "--training.dataset_path", str(REPO / "tests" / "assets" / "dpo" / "prefer_reverse.jsonl")),
    # Two optimizer steps per rollout batch, generated one step ahead, and a frozen reference: the kill at
    # step 4 falls inside a batch made before step 2's update, which the resume from step 2 cannot make again
    # (those weights are gone): the checkpoint's rollouts in flight bring it back (train/companions.py InFlight).
    "grpo": ("--training.objective", "grpo", "--training.dataset", "text", "--training.local_batch_size", "2",
             "--training.dataset_path", str(REPO / "tests" / "assets" / "grpo" / "addition.jsonl"),
             "--grpo.num_generations", "2", "--grpo.max_completion_length", "4", "--grpo.num_iterations", "2",
             "--grpo.max_offpolicy_steps", "1", "--grpo.beta", "0.1", "--grpo.reward_funcs", "exact_answer"),
}
KILLED = [*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "4", "--checkpoint.enable",
          "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]


def killed_in_a_fork(args: list[str], fault: dict, log: Path) -> int:
    """train.py args in a fork of this process with a fault of tests/faults.py installed (one that kills
    it): its exit code as subprocess reports one (-9 for SIGKILL), what it printed and logged in `log`.
    A fork has torch and titanlike imported already: the 5 s a launched train.py spends importing them
    on a busy 2-core machine, 6 times per test, were most of its cost. This process runs torch on one
    thread (conftest), so no OpenMP pool is forked half alive."""
    import logging
    import traceback

    from faults import install

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 97
        try:
            out = open(log, "w", buffering=1)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout = sys.stderr = out
            logging.basicConfig(force=True, stream=out, level=logging.INFO, format="[titanlike] %(message)s")
            install(fault)
            from titanlike.cli.train import main

            code = main(args, "train.py", checks=[])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_kill_9_while_saving_and_mid_step_then_the_resume_is_the_uninterrupted_run(tmp_path, objective):
    """SIGKILL half way through the save of step 4 (step-4.tmp left, step 2 the latest: the run had logged
    steps 1-4 uninterrupted); relaunched, SIGKILL again after step 4's optimizer step (before it is logged
    or saved); the second relaunch finishes. Each re-run step equals the uninterrupted one, loss and grad
    norm bit for bit: the samples, the adapters, the optimizer, the DPO and GRPO references and GRPO's
    rollouts are resumed or rebuilt exactly."""
    dump = tmp_path / "killed"
    folder, args = dump / "checkpoint", [*KILLED, *OBJECTIVES[objective], "--job.dump_folder", str(dump)]
    log = tmp_path / "killed.log"
    code = killed_in_a_fork(args, {"kind": "kill_while_saving", "where": "step-4.tmp", "budget": 10_000}, log)
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    assert published_steps(str(folder)) == [2] and (folder / "step-4.tmp").is_dir()
    straight = by_step(read_metrics(dump))
    assert sorted(straight) == [1, 2, 3, 4]
    code = killed_in_a_fork(args, {"kind": "kill_at_step", "step": 4}, log)
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    assert f"removing {folder}/step-4.tmp" in log.read_text() and published_steps(str(folder)) == [2]
    train_in_process(args)
    records = read_metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 3, 3, 4]
    for r in records:
        want = straight[r["step"]]
        assert (r["loss"], r["grad_norm"]) == (want["loss"], want["grad_norm"]), (objective, r["step"])
    assert published_steps(str(folder)) == [2, 4]
