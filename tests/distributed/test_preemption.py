"""Stopping a torchrun job from outside (2 ranks, FSDP2 on gloo), through train.py:

* SIGTERM reaching one rank only: both ranks stop after the same step, save it, exit 0; the
  relaunched command resumes and the whole loss curve equals an uninterrupted run bit for bit.
* torchrun SIGKILLed: its ranks get SIGTERM from the kernel (PR_SET_PDEATHSIG), save and exit
  within seconds instead of training on as orphans.
* scripts/slurm_train.sbatch with stand-ins for srun/scancel/scontrol: SLURM's SIGUSR1 to the
  batch shell makes every rank save and exit 0, torchrun exits 0, and the job is requeued.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_JOB, _env, descendants, launch, read_metrics, wait_for

pytestmark = pytest.mark.distributed

JOB = [*TINY_JOB, "--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "100",
       "--training.local_batch_size", "4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(REPO / "train.py")]


def _rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the train.py processes under a launcher."""
    ranks = {}
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"train.py" not in cmdline or b"torch.distributed.run" in cmdline:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _logged_steps(dump: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()
                if line.endswith("}")]
    except FileNotFoundError:
        return []


def _published(dump: Path) -> list[int]:
    from titanlike.checkpoint import published_steps

    return published_steps(str(dump / "checkpoint"))


def _by_step(records):
    return {r["step"]: r for r in records}


def _kill_tree(proc):
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("straight")
    launch([*JOB, "--job.dump_folder", str(dump)], nproc=2)
    return _by_step(read_metrics(dump))


def test_sigterm_to_one_rank_stops_all_after_the_same_step_and_resumes_exactly(tmp_path, reference):
    dump = tmp_path / "run"
    args = [*JOB, "--job.dump_folder", str(dump)]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([*TORCHRUN, *args], cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(_logged_steps(dump)) >= 3, proc, "step 3")
        # Only rank 1 hears it (torchrun's own forwarding reaches ranks at different instants too).
        os.kill(_rank_pids(proc.pid)[1], signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, (tmp_path / "log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    out = (tmp_path / "log").read_text()
    stop = _logged_steps(dump)[-1]
    assert 3 <= stop < 10, out[-4000:]
    assert f"received SIGTERM: saved step {stop} to {dump / 'checkpoint' / f'step-{stop}'} in " in out
    assert _published(dump) == [stop]

    launch(args, nproc=2)  # the same command again
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 11))
    got = _by_step(records)
    for s in range(1, 11):
        assert (got[s]["loss"], got[s]["grad_norm"]) == (reference[s]["loss"], reference[s]["grad_norm"]), s


def test_ranks_of_a_sigkilled_torchrun_save_and_exit(tmp_path):
    dump = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([*TORCHRUN, *JOB, "--job.dump_folder", str(dump), "--training.steps", "1000"],
                                cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    ranks: dict[int, int] = {}
    try:
        wait_for(lambda: len(_logged_steps(dump)) >= 2, proc, "step 2")
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in ranks.values()) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
        for pid in ranks.values():  # orphans, if the test failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    out = (tmp_path / "log").read_text()
    assert not any(_alive(pid) for pid in ranks.values()), f"orphaned ranks still alive after 60 s:\n{out[-3000:]}"
    stop = _logged_steps(dump)[-1]
    assert f"received SIGTERM: saved step {stop} to" in out, out[-3000:]
    assert _published(dump) == [stop]
    assert gone_after < 30, gone_after
    print(f"ranks gone {gone_after:.1f} s after torchrun was SIGKILLed")


SHIMS = {
    # One task, here: srun's options dropped; its pid is the step's.
    "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\necho $$ > "$SHIM_DIR/step.pid"\n'
            'exec "$@"\n',
    # scancel --signal=SIG JOB: like proctrack/cgroup, every process of the step gets the signal.
    "scancel": f"#!{sys.executable}\n" + '''import os, signal, sys
sig = getattr(signal, "SIG" + sys.argv[1].split("=", 1)[1])
root = int(open(os.path.join(os.environ["SHIM_DIR"], "step.pid")).read())
children = {}
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            ppid = int(open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
todo, tree = [root], [root]
while todo:
    for c in children.get(todo.pop(), []):
        tree.append(c)
        todo.append(c)
for pid in tree:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
''',
    "scontrol": '#!/usr/bin/env bash\necho "$@" >> "$SHIM_DIR/scontrol.log"\n',
}


def test_slurm_time_limit_signal_saves_and_requeues(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    dump = tmp_path / "run"
    env = dict(_env(), PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", SHIM_DIR=str(shims), SLURM_JOB_ID="4242",
               NNODES="1", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"localhost:{port}", JOB_ID=f"test-{os.getpid()}")
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(["bash", str(REPO / "scripts" / "slurm_train.sbatch"), *JOB, "--job.dump_folder",
                                 str(dump), "--training.steps", "1000"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(_logged_steps(dump)) >= 2, proc, "step 2")
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
        assert proc.wait(timeout=180) == 0, (tmp_path / "log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    out = (tmp_path / "log").read_text()
    stop = _logged_steps(dump)[-1]
    assert f"received SIGUSR1: saved step {stop} to" in out, out[-4000:]
    assert "requeueing job 4242 (training step exited with 0)" in out
    assert (shims / "scontrol.log").read_text() == "requeue 4242\n"
    assert _published(dump) == [stop]
    assert "forcefully" not in out and "Traceback" not in out
