"""Shared test helpers: launch train.py (one process or torchrun on gloo) and read its metrics."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A small but real job: the 8-layer debug model on the embedded corpus, fp32 so that
# layouts are comparable to rounding error.
TINY_JOB = [
    "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_jsonl",
    "--metrics.no_enable_tensorboard",
    "--checkpoint.no_enable",  # the demo preset saves its final model; the tests that save say so
]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # Each rank gets one thread: ranks share 2 cores, and oversubscription makes gloo crawl.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(args: list[str], *, nproc: int = 1, timeout: float = 600, check: bool = True):
    """Run train.py with args; nproc > 1 goes through torchrun (gloo on CPU)."""
    if nproc == 1:
        cmd = [sys.executable, str(REPO / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(REPO / "train.py"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def read_metrics(dump_folder: Path) -> list[dict]:
    with open(dump_folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_metrics(tmp_path: Path, name: str, *extra: str, nproc: int = 1) -> list[dict]:
    """Run the tiny job with overrides; return one metrics record per step."""
    dump = tmp_path / name
    launch([*TINY_JOB, "--job.dump_folder", str(dump), *extra], nproc=nproc)
    return read_metrics(dump)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "train_run(*extra, nproc=1, name='run'): a train.py job (the tiny job plus extra) that the "
        "test reads through the train_run / train_runs fixtures; jobs of one world size run in one launch. An "
        "extra may be a function of a scratch folder that returns a path (data the test writes there).")


@dataclass
class TrainRun:
    """One finished job of the pool: its dump folder, its metrics.jsonl records and what its batch printed."""
    folder: Path
    output: str

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.folder)


@dataclass
class _Job:
    name: str
    nproc: int
    argv: list[str]
    folder: Path


class TrainJobPool:
    """The train.py jobs the selected tests declare with `train_run` marks, run in batches: the first
    test that asks for a job launches every pending job of the same world size through
    tests/run_jobs.py, so process start-up and the gloo rendezvous are paid once per world size."""

    def __init__(self, root: Path, items):
        self.root = root
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.outputs: dict[str, str] = {}  # job name -> the output of its batch
        for item in items:
            for mark in item.iter_markers("train_run"):
                key = (item.nodeid, mark.kwargs.get("name", "run"))
                if key in self.jobs:
                    raise ValueError(f"{item.nodeid}: two train_run marks named {key[1]!r}")
                name = f"{len(self.jobs):03d}"
                folder = root / name
                argv = [*TINY_JOB, "--job.dump_folder", str(folder), *mark.args]
                self.jobs[key] = _Job(name, mark.kwargs.get("nproc", 1), argv, folder)

    def get(self, nodeid: str, name: str = "run") -> TrainRun:
        job = self.jobs[(nodeid, name)]
        if job.name not in self.outputs:
            self._launch([j for j in self.jobs.values() if j.nproc == job.nproc and j.name not in self.outputs])
        output = self.outputs[job.name]
        rc_file = self.root / f"{job.name}.rc"
        rc = rc_file.read_text() if rc_file.exists() else "never finished"
        if rc != "0":
            raise AssertionError(f"train.py {' '.join(map(str, job.argv))} failed ({rc}); its batch printed:\n"
                                 f"{output[-12000:]}")
        return TrainRun(job.folder, output)

    def _launch(self, batch: list[_Job]) -> None:
        jobs_file = self.root / f"batch_{batch[0].name}.json"
        # An argument may be a function of a scratch folder that returns a path (data a test makes).
        argv = {j.name: [str(a(self.root)) if callable(a) else str(a) for a in j.argv] for j in batch}
        jobs_file.write_text(json.dumps([{"name": j.name, "argv": argv[j.name]} for j in batch]))
        nproc = batch[0].nproc
        runner = str(REPO / "tests" / "run_jobs.py")
        cmd = ([sys.executable, runner] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", runner])
        proc = subprocess.run([*cmd, str(jobs_file)], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=300 * len(batch))
        output = f"{proc.stdout}\n{proc.stderr}"
        for job in batch:
            self.outputs[job.name] = output


@pytest.fixture(scope="session")
def train_job_pool(request, tmp_path_factory) -> TrainJobPool:
    return TrainJobPool(tmp_path_factory.mktemp("pool"), request.session.items)


@pytest.fixture
def train_run(request, train_job_pool) -> TrainRun:
    """The job the test declared with its (one, unnamed) `train_run` mark."""
    return train_job_pool.get(request.node.nodeid)


@pytest.fixture
def train_runs(request, train_job_pool) -> dict[str, TrainRun]:
    """The jobs the test declared with several named `train_run` marks, by name."""
    names = [m.kwargs.get("name", "run") for m in request.node.iter_markers("train_run")]
    return {name: train_job_pool.get(request.node.nodeid, name) for name in names}


@pytest.fixture(scope="session", autouse=True)
def token_cache_folder(tmp_path_factory) -> None:
    """Tokenized corpora (titanlike/data/token_cache.py) go to a folder of this session, shared by
    all its train.py launches, never to the user's cache, unless TITANLIKE_CACHE_DIR names one."""
    if not os.environ.get("TITANLIKE_CACHE_DIR"):
        os.environ["TITANLIKE_CACHE_DIR"] = str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture(scope="session")
def single_process_reference(tmp_path_factory):
    """The single-process run every layout must reproduce: global batch 8 in one microbatch."""
    return train_metrics(tmp_path_factory.mktemp("ref"), "single", "--training.local_batch_size", "8")


def sharp_llama(seq: int, vocab: int):
    """A 2-layer tiny Llama whose attention is sharp (wq, wk scaled by 8), initialized on CPU.

    At init attention is nearly uniform, so wrong positions or masks barely move the output;
    sharpened, they move logits by 1e-2 or more while a correct computation stays at rounding.
    """
    import dataclasses

    import torch

    from titanlike.models.llama3 import Transformer, llama3_flavors

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=vocab, max_seq_len=seq)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
    return model



def descendants(pid: int) -> list[int]:
    """Every process below pid (children, grandchildren, ...), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_for(predicate, proc, what: str, timeout: float = 300) -> None:
    """Poll predicate until it holds; fail if proc ends first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def hf_warnings():
    """Collect what transformers warns about inside the block: its logger's warnings (it does not
    propagate them to the root logger, so pytest's caplog never sees them) and Python warnings.
    Yields the list of messages, filled when the block ends."""
    import logging
    import warnings

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.addHandler(handler)
    hf_logger.setLevel(logging.WARNING)  # whatever TRANSFORMERS_VERBOSITY says
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        hf_logger.removeHandler(handler)
        hf_logger.setLevel(level)
    messages.extend(f"{w.category.__name__}: {w.message}" for w in caught)
