"""The [profiling] options: torch.profiler traces of one step in every profile_freq, per rank, and
memory snapshots (every profile_freq steps and on out-of-memory; on CPU a JSON of process and
tensor memory)."""

import json
import os

import pytest
import torch

from titanlike.observe.memory import MemorySnapshot, is_out_of_memory, process_memory, tensor_footprint
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


def _model_and_optimizer():
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # creates the two Adam moments per parameter
    return model, optimizer


def test_cpu_memory_snapshot_every_freq_steps_holds_process_and_tensor_memory(tmp_path):
    model, optimizer = _model_and_optimizer()
    folder = tmp_path / "memory_snapshot"
    with MemorySnapshot(enabled=True, freq=2, folder=str(folder), rank=3,
                        footprint=lambda: tensor_footprint([model], optimizer)) as snapshots:
        for step in range(1, 6):
            snapshots.step(step)
    assert _iterations(folder) == [2, 4]
    record = json.loads((folder / "iteration_4" / "rank3_memory.json").read_text())
    assert record["step"] == 4 and record["rank"] == 3
    assert 0 < record["rss_gib"] <= record["peak_rss_gib"]
    weights = (64 * 32 + 32) * 4
    assert record["parameters_bytes"] == weights
    assert record["gradients_bytes"] == weights  # zero_grad was not called
    assert record["optimizer_states_bytes"] == 2 * weights + 2 * 4  # exp_avg, exp_avg_sq, two scalar steps
    assert snapshots.written == [str(folder / f"iteration_{s}" / "rank3_memory.json") for s in (2, 4)]


def test_out_of_memory_writes_an_exit_snapshot_and_the_error_goes_on(tmp_path):
    folder = tmp_path / "memory_snapshot"
    with pytest.raises(RuntimeError, match="can't allocate memory") as error:
        with MemorySnapshot(enabled=True, freq=10, folder=str(folder)) as snapshots:
            snapshots.step(1)
            snapshots.step(2)
            torch.empty(2**62, dtype=torch.uint8)  # step 3 runs out of host memory
    assert is_out_of_memory(error.value)
    assert os.listdir(folder) == ["iteration_3_exit"]
    assert json.loads((folder / "iteration_3_exit" / "rank0_memory.json").read_text())["step"] == 2
    # Any other error writes nothing.
    with pytest.raises(ValueError):
        with MemorySnapshot(enabled=True, freq=10, folder=str(tmp_path / "other")):
            raise ValueError("not memory")
    assert not (tmp_path / "other").exists()
    assert not is_out_of_memory(RuntimeError("shapes do not match"))


def test_disabled_memory_snapshot_writes_nothing_and_process_memory_reads_proc(tmp_path):
    with MemorySnapshot(enabled=False, freq=1, folder=str(tmp_path / "m")) as snapshots:
        snapshots.step(1)
    assert not (tmp_path / "m").exists()
    memory = process_memory()
    # A process holding a 256 MiB tensor resides in at least that much.
    big = torch.ones(2**26)
    assert process_memory()["rss_gib"] >= memory["rss_gib"] + 0.2 and big.sum() > 0
