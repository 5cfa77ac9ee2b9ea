"""Faults in one process: a non-finite gradient never reaches the parameters or a checkpoint
(training.skip_nonfinite_steps), a finished run relaunched says what to do, SIGUSR1 saves and
exits 0, and two jobs cannot share a dump folder."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_JOB, _env, read_metrics, train_here, wait_for

POISONED = "layers.1.feed_forward.w1.weight"


def _trainer(dump, *extra):
    from titanlike.config import load_job_config
    from titanlike.train.trainer import Trainer
    from titanlike.train.plan import plan_job

    cfg = load_job_config([*TINY_JOB, "--training.local_batch_size", "2", "--job.dump_folder", str(dump),
                           "--checkpoint.enable", *extra])
    return Trainer(plan_job(cfg, 1))


def _poison(trainer, steps):
    """Test-only fault: the gradient of one parameter becomes inf during backward at `steps`."""
    param = dict(trainer.model_parts[0].named_parameters())[POISONED]

    def hook(p):
        if trainer.step in steps:
            p.grad.fill_(math.inf)

    param.register_post_accumulate_grad_hook(hook)


def _train_until_refused(tmp_path, caplog, poisoned: set[int], *extra):
    """Train with the gradient poisoned at those steps until the job refuses; (trainer, its error)."""
    from titanlike.train.trainer import TrainingError

    trainer = _trainer(tmp_path, *extra)
    _poison(trainer, poisoned)
    try:
        with caplog.at_level("WARNING", logger="titanlike"), pytest.raises(TrainingError) as e:
            trainer.train()
    finally:
        trainer.close()
    return trainer, str(e.value)


def _model(folder, step):
    from titanlike.checkpoint.format import read_dcp_model

    return read_dcp_model(os.path.join(folder, f"step-{step}"))


def test_non_finite_gradient_stops_before_the_optimizer_step(tmp_path):
    from titanlike.checkpoint import published_steps
    from titanlike.train.trainer import TrainingError

    trainer = _trainer(tmp_path, "--training.steps", "4", "--checkpoint.interval", "1")
    _poison(trainer, {2})
    try:
        with pytest.raises(TrainingError) as e:
            trainer.train()
        assert str(e.value) == (
            f"the gradient norm is inf at step 2 (first non-finite gradient: {POISONED}); stopped before the "
            "optimizer step, nothing was updated or saved")
        assert all(torch.isfinite(p).all() for p in trainer.model_parts[0].parameters())
        # The parameters are those of step 1: the step-2 update never happened.
        saved = _model(tmp_path / "checkpoint", 1)
        for name, p in trainer.model_parts[0].named_parameters():
            assert torch.equal(p.detach(), saved[name]), name
    finally:
        trainer.close()
    assert published_steps(str(tmp_path / "checkpoint")) == [1]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_skip_nonfinite_steps_skips_counts_and_logs_then_stops_when_spent(tmp_path, caplog):
    from titanlike.checkpoint import published_steps

    trainer, error = _train_until_refused(tmp_path, caplog, {2, 4}, "--training.steps", "5",
                                          "--checkpoint.interval", "1", "--training.skip_nonfinite_steps", "1")
    assert trainer.skipped_steps == 1
    assert error.startswith(f"the gradient norm is inf at step 4 (first non-finite gradient: {POISONED}); "
                                   "stopped before the optimizer step, nothing was updated or saved")
    assert "training.skip_nonfinite_steps allows" in error
    assert (f"skipped step 2: the gradient norm is inf at step 2 (first non-finite gradient: {POISONED}); no "
            "parameter was updated (1 of training.skip_nonfinite_steps 1 used)") in caplog.text
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(records) == [1, 2, 3]  # training went on after the skipped step
    assert records[2]["grad_norm"] == math.inf and math.isfinite(records[2]["loss"])
    assert "skipped_steps" not in records[1] and records[2]["skipped_steps"] == records[3]["skipped_steps"] == 1
    assert math.isfinite(records[3]["grad_norm"])
    # The schedule advanced through the skipped step: step 3 has its own learning rate.
    assert records[3]["lr"] != records[2]["lr"]
    folder = tmp_path / "checkpoint"
    assert published_steps(str(folder)) == [1, 2, 3]
    one, two, three = (_model(folder, s) for s in (1, 2, 3))
    assert all(torch.equal(one[k], two[k]) for k in one)  # the skipped step changed nothing
    assert not all(torch.equal(two[k], three[k]) for k in two)
    assert all(torch.isfinite(v).all() for v in three.values())


def test_a_step_the_host_reads_late_is_still_skipped_counted_and_logged(tmp_path, caplog):
    """Step 2 neither logs nor saves, so the host reads its verdict after step 3 is queued: the device
    skipped it all the same, and the count, the warning and its metrics record follow one step later."""

    trainer, error = _train_until_refused(tmp_path, caplog, {2, 5}, "--training.steps", "6", "--checkpoint.interval",
                                          "6", "--metrics.log_freq", "4", "--training.skip_nonfinite_steps", "1")
    assert trainer.skipped_steps == 1
    assert (f"skipped step 2: the gradient norm is inf at step 2 (first non-finite gradient: {POISONED}); no "
            "parameter was updated (1 of training.skip_nonfinite_steps 1 used)") in caplog.text
    # Step 5 is read after step 6 is queued (the last step: read at once, then step 5's late verdict).
    assert error == (
        f"the gradient norm is inf at step 5 (first non-finite gradient: {POISONED}); its update was skipped and "
        "training stopped after step 6, nothing was saved after it (the 1 step(s) training.skip_nonfinite_steps "
        "allows were already skipped)")
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(records) == [1, 2, 4]  # step 2 is logged because it was skipped
    assert records[2]["grad_norm"] == math.inf and records[4]["skipped_steps"] == 1


def test_a_stop_signal_between_log_steps_stops_every_rank_one_step_later(tmp_path, caplog):
    """A signal seen at step 2 rides in that step's sum over ranks; the host reads it after step 3 is
    queued, then saves step 3 and stops."""
    from titanlike.checkpoint import published_steps

    trainer = _trainer(tmp_path, "--training.steps", "8", "--checkpoint.interval", "100", "--metrics.log_freq", "4")
    run_step = trainer._run_step

    def signal_at_step_2(data):
        if trainer.step == 2:
            trainer.stop.code = int(signal.SIGUSR1)
        return run_step(data)

    trainer._run_step = signal_at_step_2
    try:
        with caplog.at_level("INFO", logger="titanlike"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.step == 3
    assert f"received SIGUSR1: saved step 3 to {tmp_path / 'checkpoint' / 'step-3'}" in caplog.text
    assert published_steps(str(tmp_path / "checkpoint")) == [3]


def test_relaunching_a_finished_run_says_what_to_pass(tmp_path, caplog, capsys):
    import train

    args = [*TINY_JOB, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path),
            "--checkpoint.enable", "--checkpoint.interval", "1"]
    folder = tmp_path / "checkpoint"
    trainer = _trainer(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    try:
        trainer.train()
    finally:
        trainer.close()
    # Step 2 is the model-only final export, step 1 the last full checkpoint.
    with caplog.at_level("INFO", logger="titanlike"):
        assert train.main([*args, "--training.steps", "2"]) == 0
    assert (f"the checkpoint in {folder} is at step 2 >= training.steps 2: nothing to train; step 2 is a "
            "model-only final export (checkpoint.last_save_model_only): to extend the run, relaunch with "
            "--training.steps > 2 --checkpoint.load_step 1 (its last full checkpoint; step 2 is trained again)"
            ) in caplog.text
    assert "training 2 steps" not in caplog.text  # nothing loaded, nothing trained

    capsys.readouterr()
    assert train.main([*args, "--training.steps", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"training error: the latest checkpoint in {folder}, step 2, is a model-only final export "
                   "(checkpoint.last_save_model_only) that training cannot resume from; to extend the run, "
                   "relaunch with --checkpoint.load_step 1 (its last full checkpoint; step 2 is trained again)")

    # Doing as told extends the run; a resumable last save makes the next relaunch say "raise steps".
    assert train.main([*args, "--training.steps", "3", "--checkpoint.load_step", "1",
                       "--checkpoint.no_last_save_model_only"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path)][-2:] == [2, 3]
    caplog.clear()
    with caplog.at_level("INFO", logger="titanlike"):
        assert train.main([*args, "--training.steps", "3"]) == 0
    assert (f"the checkpoint in {folder} is at step 3 >= training.steps 3: nothing to train; raise "
            "--training.steps to continue") in caplog.text


def _popen(args, log):
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, text=True)



def _logged_steps(dump):
    try:
        return [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()
                if line.endswith("}")]
    except FileNotFoundError:
        return []


def test_sigusr1_saves_the_current_step_and_exits_0(tmp_path):
    from titanlike.checkpoint import published_steps

    dump = tmp_path / "run"
    args = [*TINY_JOB, "--training.local_batch_size", "2", "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.interval", "100", "--training.steps", "50"]
    with open(tmp_path / "log", "w") as log:
        proc = _popen(args, log)
    try:
        wait_for(lambda: len(_logged_steps(dump)) >= 2, proc, "step 2")
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "log").read_text()
    steps = _logged_steps(dump)
    stop = steps[-1]
    assert 2 <= stop < 50, out[-3000:]
    assert f"received SIGUSR1: saved step {stop} to {dump / 'checkpoint' / f'step-{stop}'} in " in out
    assert published_steps(str(dump / "checkpoint")) == [stop]
    info = json.loads((dump / "checkpoint" / f"step-{stop}" / "titanlike.json").read_text())
    assert info["contents"] == "full"


def test_second_job_on_a_dump_folder_is_refused_until_the_first_is_gone(tmp_path):
    dump = tmp_path / "run"
    args = [*TINY_JOB, "--training.local_batch_size", "2", "--job.dump_folder", str(dump)]
    lock = dump / ".titanlike.lock"
    with open(tmp_path / "first.log", "w") as log:
        first = _popen([*args, "--training.steps", "1000"], log)
    try:
        wait_for(lambda: lock.exists() and lock.stat().st_size > 0, first, "the lock")
        holder = json.loads(lock.read_text())
        assert holder["pid"] == first.pid
        # The second and third jobs in this process (conftest.train_here): the lock is the first's process's.
        second = train_here([*args, "--training.steps", "1"])
        assert second.returncode == 1
        lines = [line for line in second.stderr.splitlines() if line.strip() and "Warning" not in line]
        assert lines[-1] == (
            f"training error: job.dump_folder {dump} is in use by another titanlike job (pid {first.pid} on "
            f"{holder['host']} since {holder['since']}: Llama 3 debug model on the embedded corpus); use another "
            "dump_folder or stop that job"), second.stderr[-3000:]
        assert "Traceback" not in second.stderr
    finally:
        first.kill()  # SIGKILL: no clean release, the kernel drops the flock
        first.wait()
    third = train_here([*args, "--training.steps", "1"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert (f"job.dump_folder {dump}: taking over the lock of a titanlike job that is gone (pid {first.pid} on "
            f"{holder['host']} since {holder['since']}") in third.stderr
    assert lock.read_text() == ""  # a clean exit leaves the lock file empty


def test_resume_verdict_when_no_full_checkpoint_is_left(tmp_path):
    from titanlike.checkpoint.resume import resume_verdict

    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "titanlike.json").write_text(json.dumps({"contents": "model_only", "step": 5}))
    kind, message = resume_verdict(str(tmp_path), -1, 5)
    assert kind == "done" and message == (
        f"the checkpoint in {tmp_path} is at step 5 >= training.steps 5: nothing to train; step 5 is a model-only "
        "final export (checkpoint.last_save_model_only): no full checkpoint is left to extend the run from; start a "
        f"new run from it with --checkpoint.initial_load_path {tmp_path / 'step-5'} "
        "(checkpoint.no_last_save_model_only keeps the last save resumable)")
    kind, message = resume_verdict(str(tmp_path), -1, 8)
    assert kind == "error" and message.startswith(f"the latest checkpoint in {tmp_path}, step 5, is a model-only")
    assert resume_verdict(str(tmp_path / "none"), -1, 8) is None  # no checkpoint: a fresh start
