"""The [profiling] options: torch.profiler traces of one step in every profile_freq, per rank."""

import json
import os

import torch

from titanlike.observe.profiler import Profiler


def _steps(profiler: Profiler, n: int) -> None:
    x = torch.randn(32, 32)
    for _ in range(n):
        (x @ x).relu_().sum()
        profiler.step()


def _iterations(folder) -> list[int]:
    return sorted(int(name.removeprefix("iteration_")) for name in os.listdir(folder))


def test_one_trace_every_freq_steps_is_chrome_json(tmp_path):
    folder = tmp_path / "profile_traces"
    with Profiler(enabled=True, freq=3, folder=str(folder), rank=1) as profiler:
        _steps(profiler, 7)
    assert _iterations(folder) == [3, 6]
    for step in (3, 6):
        files = os.listdir(folder / f"iteration_{step}")
        assert files == ["rank1_trace.json"]
        with open(folder / f"iteration_{step}" / "rank1_trace.json") as f:
            trace = json.load(f)
        assert trace["traceEvents"]
        # The recorded window holds the step's work.
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert len(profiler.traces) == 2


def test_resumed_job_keeps_the_step_numbers_and_freq_one_records_every_step(tmp_path):
    with Profiler(enabled=True, freq=4, folder=str(tmp_path / "a"), start_step=5) as profiler:
        _steps(profiler, 6)  # steps 6..11
    assert _iterations(tmp_path / "a") == [8]
    with Profiler(enabled=True, freq=1, folder=str(tmp_path / "b")) as profiler:
        _steps(profiler, 2)
    assert _iterations(tmp_path / "b") == [1, 2]


def test_disabled_profiler_writes_nothing(tmp_path):
    with Profiler(enabled=False, freq=2, folder=str(tmp_path / "t")) as profiler:
        _steps(profiler, 4)
    assert not (tmp_path / "t").exists() and profiler.traces == []
