"""scripts/multinode_train.sh (what scripts/slurm_train.sbatch runs on every node): two "nodes"
on this machine meet through torchrun's c10d rendezvous and train exactly like one 2-process
torchrun (FSDP over both)."""

import os
import socket
import subprocess

import pytest

from conftest import REPO, TINY_JOB, _env, read_metrics

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.train_run("--training.steps", "3", "--training.local_batch_size", "4", nproc=2)
def test_two_nodes_equal_one_two_process_job(tmp_path, train_run):
    args = [*TINY_JOB, "--training.steps", "3", "--training.local_batch_size", "4", "--job.dump_folder",
            str(tmp_path / "nodes")]
    env = dict(_env(), NNODES="2", NPROC_PER_NODE="1", RDZV_ENDPOINT=f"localhost:{_free_port()}",
               JOB_ID=f"test-{os.getpid()}")
    nodes = [subprocess.Popen(["bash", str(REPO / "scripts" / "multinode_train.sh"), *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-4000:]
    two_nodes = read_metrics(tmp_path / "nodes")
    one_node = train_run.metrics  # the same job on 2 ranks of one launch (the pool's)
    assert [r["loss"] for r in two_nodes] == pytest.approx([r["loss"] for r in one_node], rel=1e-6)
    assert [r["step"] for r in two_nodes] == [1, 2, 3]
