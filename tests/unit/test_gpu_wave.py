"""scripts/gpu_wave.py: the lent GPU's commands are checked here, and its runner keeps logs and time limits."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wave():
    spec = importlib.util.spec_from_file_location("gpu_wave", REPO / "scripts" / "gpu_wave.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_wave"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_wave"]


def test_every_prepared_command_parses_and_plans(wave, tmp_path):
    assert wave.check(wave.pieces(tmp_path)) == []


def test_a_renamed_option_or_an_impossible_job_is_found(wave):
    Step = wave.Step
    broken = {"p": ("", [
        Step("bench_option", ["scripts/bench.py", "--bench-stepz", "3"], 1),
        Step("job_value", ["scripts/bench.py", "--optimizer.state_dtype", "bf17"], 1),
        Step("layout", ["train.py", "--parallelism.tensor_parallel_degree", "2"], 1),
        Step("data", ["train.py", "--training.dataset", "default", "--training.dataset_path", "x"], 1),
        Step("choice", ["scripts/bench_torchtitan.py", "--only", "neither"], 1),
        Step("tests", ["-m", "pytest", "tests/unit/no_such_test.py"], 1),
        Step("shell", ["scripts/no_such_script.sh"], 1),
    ])}
    problems = wave.check(broken)
    assert [p.split(":")[0] for p in problems] == [f"p.{s.name}" for s in broken["p"][1]]


@pytest.mark.slow  # four short processes, ~3 s
def test_the_runner_logs_each_step_and_keeps_to_the_budget(wave, tmp_path, capsys):
    Step = wave.Step
    steps = [
        Step("ok", ["-c", "print('figure 42')"], 0),
        Step("fails", ["-c", "import sys; print('partial'); sys.exit(3)"], 0),
        Step("too_long", ["-c", "print('never')"], 600),
    ]
    verdicts = {name: verdict for name, verdict, _ in wave.run_piece("p", steps, tmp_path, budget_s=300)}
    assert verdicts == {"ok": "ok", "fails": "failed (exit 3)", "too_long": verdicts["too_long"]}
    assert verdicts["too_long"].startswith("skipped")
    began = time.monotonic()
    hang = Step("hangs", ["-c", "import time; print('started', flush=True); time.sleep(60)"], 0)
    assert wave.run_piece("p", [hang], tmp_path, budget_s=2.0)[0][1] == "out of time"
    assert time.monotonic() - began < 15  # the silent process was cut off at the budget
    assert "figure 42" in (tmp_path / "p.ok.log").read_text()
    assert "partial" in (tmp_path / "p.fails.log").read_text()
    assert "started" in (tmp_path / "p.hangs.log").read_text()  # what a cut-off step printed is kept
    assert not (tmp_path / "p.too_long.log").exists()
    assert "figure 42" in capsys.readouterr().out  # streamed through for the device call's tail


def test_list_and_extra_wheels(wave, capsys):
    assert wave.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("smoke", "optim", "8b", "mamba"))
    assert wave.main(["--extra-wheels"]) == 0
    assert "flash-linear-attention" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        wave.main(["no_such_piece"])
