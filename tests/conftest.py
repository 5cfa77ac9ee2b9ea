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

import toy_family  # noqa: F401  (registers the test-only toy family: every family-wide check sees it)

import torch

# One intra-op thread for everything the suite computes, here and in what it starts (OMP_NUM_THREADS,
# unless the caller set it): every launched rank and in-process job ran on one already. The models
# are tiny, so a second thread buys little even on an idle machine, and on the shared 2-core CI
# machine a busy second core leaves the first spinning at OpenMP barriers: the conformance file took
# 347 s with torch's default 2 threads and 33 s with 1, back to back under the same load.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]

# A small but real job: the 8-layer debug model on the embedded corpus, fp32 so that
# layouts are comparable to rounding error. 4 steps: a layout that differs shows in the first
# step's gradients and the second step's loss; the tests that assert that the loss falls run 10.
TINY_JOB = [
    "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
    "--training.seq_len", "64",
    "--training.steps", "4",
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


def saving_every_2_steps(name: str) -> tuple:
    """Options of a pooled job that saves every 2 steps into the pool's folder `name` (a function of
    the pool's scratch folder: see train_run), where a job declared `after` it loads from."""
    return ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
            "--checkpoint.folder", lambda root: root / name)


def read_metrics(dump_folder: Path) -> list[dict]:
    with open(dump_folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_metrics(tmp_path: Path, name: str, *extra: str, nproc: int = 1) -> list[dict]:
    """Run the tiny job with overrides; return one metrics record per step. One process runs inside
    this one (train.main, as tests/run_jobs.py runs pooled jobs): no interpreter and torch import to
    pay; a layout of several ranks goes through torchrun."""
    dump = tmp_path / name
    argv = [*TINY_JOB, "--job.dump_folder", str(dump), *map(str, extra)]
    if nproc == 1:
        train_in_process(argv)
    else:
        launch(argv, nproc=nproc)
    return read_metrics(dump)


# The pre-flight checks the test jobs run: none. train.py's one check, the estimator's memory check
# (estimation/fits.py, 0.6 s per job on 2 cores), has its own tests: its verdicts
# (tests/unit/test_config.py), train.py refusing a job in one sentence (tests/unit/test_data_errors_cli.py)
# and train.py passing it (tests/integration/test_torchtitan_habits.py). The pooled jobs of several
# ranks skip it anyway (a process group exists already); tests/run_jobs.py passes the same list.
TEST_JOB_CHECKS: list = []


def train_in_process(argv: list[str]) -> None:
    """train.py's main(argv) in this process on one thread, as a launched rank runs (OMP_NUM_THREADS=1),
    with TEST_JOB_CHECKS for its pre-flight checks."""
    import torch

    from titanlike.cli.train import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A job sets process-wide variables for the process group it creates (the flight recorder's, in
    # titanlike/parallel/timeouts.py, naming its own dump folder): a launched rank gets a fresh
    # environment, so must the processes this test process starts after the job.
    environ = dict(os.environ)
    try:
        rc = main(argv, "train.py", checks=TEST_JOB_CHECKS)
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    if rc != 0:
        raise AssertionError(f"train.main({argv}) returned {rc} (its log is in the captured output)")


@contextlib.contextmanager
def captured_output(stdout=None):
    """What the block prints (stdout and stderr) and logs at INFO (titanlike's logger, as rank 0 of a
    launched job logs) into one StringIO, which the block yields; stdout: a StringIO of its own for
    what is printed to stdout, kept apart (a script's answer)."""
    import io
    import logging

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root, titanlike_log = logging.getLogger(), logging.getLogger("titanlike")
    level = titanlike_log.level
    root.addHandler(handler)
    titanlike_log.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out if stdout is None else stdout), contextlib.redirect_stderr(out):
            yield out
    finally:
        root.removeHandler(handler)
        titanlike_log.setLevel(level)


@dataclass
class InProcessRun:
    """A command's main() run in this process, read as a launched process's result: its exit code,
    everything it printed and logged (stdout, stderr and logs in one text, as `stderr`), and for a
    script (script_here) what it printed to stdout alone."""
    returncode: int
    stderr: str
    stdout: str = ""


def train_here(argv: list[str], checks: list | None = TEST_JOB_CHECKS) -> InProcessRun:
    """train.py argv in this process (train_in_process's thread and environment handling) where a test
    reads its exit code and what it said, as of a launch; an exception it raises is the test's failure
    (a launched train.py would have printed a traceback). checks: the pre-flight checks (None: those
    installed packages register, as train.py runs them)."""
    from titanlike.cli.train import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    environ = dict(os.environ)
    try:
        with captured_output() as out:
            rc = main(argv, "train.py", checks=checks)
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    return InProcessRun(rc, out.getvalue())


def script_here(name: str, *args: str) -> InProcessRun:
    """scripts/<name> run in this process (its main(argv)), read as train_here's result."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{Path(name).stem}", REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import io

    stdout = io.StringIO()
    with captured_output(stdout) as out:
        rc = module.main([str(a) for a in args])
    return InProcessRun(rc, out.getvalue(), stdout.getvalue())


# The folders whose tests start processes (torchrun launches, spawned gloo worlds, scripts run as programs):
# every test in them is `slow`. Elsewhere a test that starts one says so with its own `slow` mark, and the
# fast lane (`pytest -m "not slow" tests`) refuses one that does not (no_process_in_the_fast_lane).
SLOW_FOLDERS = ("distributed", "integration", "layouts")


# The suite runs on both cores of a CI machine (`-n 2`, pytest-xdist, `--dist loadgroup`). Each test file
# is one group, so its module-scoped fixtures are built once; the tests that share launched worlds (the
# train_run pool, the single-process reference, the layouts suite's worlds) form one group, so that every
# world is launched once, as in a serial run.
WORLD_FIXTURES = {"train_job_pool", "train_run", "train_runs", "single_process_reference"}
WORLD_FOLDERS = ("layouts",)


# xdist hands out groups in order of their number of tests, so a file of two long tests (GRPO's learning runs:
# four minutes) came last and ran alone on one worker while the other had finished. The groups that take
# longest (seconds of a clean-clone CI run on two workers, 2026-11-29) start first instead, longest first,
# and the many short groups fill in behind them (longest-processing-time-first scheduling).
LONG_GROUPS = (
    "worlds",  # 561 s in the clean-clone run of 2026-11-29 (18 min 19 s in all)
    "tests/integration/test_grpo.py",  # 310 s
    "tests/integration/test_presets.py",  # 175 s
    "tests/integration/test_checkpoint_faults.py",
    "tests/distributed/test_checkpoint.py",
    "tests/unit/test_estimation.py",
    "tests/integration/test_estimation_measured.py",
    "tests/integration/test_sft.py",
    "tests/integration/test_torchtitan_habits.py",
    "tests/unit/test_grpo_objective.py",
    "tests/integration/test_hostile_inputs.py",
    "tests/distributed/test_preemption.py",
)


def _xdist_group(item, tests: Path) -> str:
    folder = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
    if folder in WORLD_FOLDERS or WORLD_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "worlds"
    return str(item.path.relative_to(REPO)) if item.path.is_relative_to(REPO) else str(item.path)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    tests = REPO / "tests"
    grouped = config is not None and config.pluginmanager.hasplugin("xdist")
    groups = {}
    for item in items:
        if item.path.is_relative_to(tests) and item.path.relative_to(tests).parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
        if grouped:
            groups[item.nodeid] = _xdist_group(item, tests)
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if grouped:  # the long groups first (a stable sort: each group's tests keep their order)
        first = {group: rank for rank, group in enumerate(LONG_GROUPS)}
        items.sort(key=lambda item: first.get(groups[item.nodeid], len(LONG_GROUPS)))


def _refuse_process(name: str, what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} starts a process ({what}) but is not marked slow: mark it "
                             "@pytest.mark.slow or move it to a slow folder (tests/conftest.py SLOW_FOLDERS)")
    return refuse


@contextlib.contextmanager
def no_process_in_the_fast_lane(item):
    """A test not marked slow runs in this process only: starting a subprocess, a multiprocessing process
    (a Pool's workers too) or torch.multiprocessing.spawn fails it, naming it, so that the fast lane stays
    fast and a process-starting test cannot hide in a fast folder. Applied around each phase of the test
    (the hooks below) rather than in an autouse fixture, which would miss what its module- and
    session-scoped fixtures start: pytest sets those up before any function-scoped fixture."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    import multiprocessing.process

    import torch.multiprocessing

    with pytest.MonkeyPatch.context() as patch:
        name = item.nodeid
        patch.setattr(subprocess.Popen, "_execute_child", _refuse_process(name, "subprocess.Popen"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse_process(name, "multiprocessing"))
        patch.setattr(torch.multiprocessing, "spawn", _refuse_process(name, "torch.multiprocessing.spawn"))
        patch.setattr(torch.multiprocessing, "start_processes",
                      _refuse_process(name, "torch.multiprocessing.start_processes"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with no_process_in_the_fast_lane(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with no_process_in_the_fast_lane(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with no_process_in_the_fast_lane(item):
        yield


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        # The controller hands the groups out in the workers' collection order (LONG_GROUPS first), not
        # by their number of tests (xdist's default, which runs on the controller, where this is read).
        config.option.loadscopereorder = False
    config.addinivalue_line(
        "markers", "train_run(*extra, nproc=1, name='run', after=None): a train.py job (the tiny job plus extra) "
        "that the test reads through the train_run / train_runs fixtures; jobs of one world size run in one "
        "launch. An extra may be a function of a scratch folder that returns a path (data the test writes "
        "there, a checkpoint folder two jobs share). after: the name of another job of the same test that must "
        "have finished first (a resume of its checkpoint), of any world size.")


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
    after: tuple[str, str] | None  # the key of the job this one resumes


class TrainJobPool:
    """The train.py jobs the selected tests declare with `train_run` marks. A single-process job runs in
    the test process when a test asks for it; jobs of several ranks run in batches: the first test that
    asks for one launches every pending job of the same world size through tests/run_jobs.py, so process
    start-up and the gloo rendezvous are paid once per world size. A job
    declared `after` another runs in a later batch than that one, or after it in the same batch (a
    failed job stops its batch, so what comes after it never runs)."""

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
                after = mark.kwargs.get("after")
                self.jobs[key] = _Job(name, mark.kwargs.get("nproc", 1), argv, folder,
                                      (item.nodeid, after) if after is not None else None)
        # Which test declared each numbered job (the batch logs and dump folders are named by number).
        (root / "jobs.txt").write_text("".join(f"{j.name} nproc={j.nproc} {test} {name}\n"
                                               for (test, name), j in self.jobs.items()))
        for key, job in self.jobs.items():
            if job.after is not None and job.after not in self.jobs:
                raise ValueError(f"{key[0]}: train_run {key[1]!r} comes after {job.after[1]!r}, "
                                 "which the test does not declare")

    def get(self, nodeid: str, name: str = "run") -> TrainRun:
        job = self.jobs[(nodeid, name)]
        self._run(job)
        output = self.outputs[job.name]
        rc_file = self.root / f"{job.name}.rc"
        rc = rc_file.read_text() if rc_file.exists() else "never finished"
        if rc != "0":
            raise AssertionError(f"train.py {' '.join(map(str, job.argv))} failed ({rc}); its batch printed:\n"
                                 f"{output[-12000:]}")
        return TrainRun(job.folder, output)

    def _run(self, job: _Job) -> None:
        """Run job unless it ran, the job it comes after first: a single-process job in this process, a
        job of several ranks in a launch of every pending job of its world size whose predecessor has run
        or comes earlier in the batch."""
        if job.name in self.outputs:
            return
        if job.after is not None:
            self._run(self.jobs[job.after])
            if job.name in self.outputs:  # it ran in the same batch, after its predecessor
                return
        if job.nproc == 1:
            self._run_here(job)
            return
        for j in list(self.jobs.values()):  # single-process jobs that jobs of this batch come after: first
            before = self.jobs[j.after] if j.after is not None else None
            if (j.nproc == job.nproc and j.name not in self.outputs and before is not None and before.nproc == 1
                    and (before.after is None or self.jobs[before.after].name in self.outputs)):
                self._run(before)
        batch: list[_Job] = []
        added = True
        while added:  # in declaration order, each job after the one it resumes
            added = False
            for j in self.jobs.values():
                if j.nproc != job.nproc or j.name in self.outputs or j in batch:
                    continue
                before = self.jobs[j.after] if j.after is not None else None
                if before is None or before.name in self.outputs or before in batch:
                    batch.append(j)
                    added = True
        self._launch(batch)

    def _argv(self, job: _Job) -> list[str]:
        # An argument may be a function of a scratch folder that returns a path (data a test makes).
        return [str(a(self.root)) if callable(a) else str(a) for a in job.argv]

    def _run_here(self, job: _Job) -> None:
        """A single-process job inside this process (train_in_process), what it prints and logs kept as
        its output; its exit code, or the exception it raised, in `<name>.rc`."""
        import traceback

        rc = "0"
        try:
            with captured_output() as out:
                train_in_process(self._argv(job))
        except Exception:
            rc = f"raised:\n{traceback.format_exc()}"
        (self.root / f"{job.name}.rc").write_text(rc)
        self.outputs[job.name] = out.getvalue()

    def _launch(self, batch: list[_Job]) -> None:
        jobs_file = self.root / f"batch_{batch[0].name}.json"
        jobs_file.write_text(json.dumps([{"name": j.name, "argv": self._argv(j)} for j in batch]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={batch[0].nproc}",
               str(REPO / "tests" / "run_jobs.py")]
        proc = subprocess.run([*cmd, str(jobs_file)], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=300 * len(batch))
        output = f"{proc.stdout}\n{proc.stderr}"
        (self.root / f"batch_{batch[0].name}.log").write_text(output)  # whole, with each job's seconds
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
