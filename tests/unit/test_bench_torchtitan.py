"""scripts/bench_torchtitan.py: its torchtitan-free helpers behave. Without torchtitan the program stops
with one sentence: tests/integration/test_bench_torchtitan_program.py."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_torchtitan.py"


def test_paired_rounds_alternate_on_the_same_batches():
    spec = importlib.util.spec_from_file_location("bench_torchtitan", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls = []
    fetched = iter(range(10**6))
    step_fns = {name: (lambda batch, name=name: calls.append((name, batch))) for name in ("a", "b")}
    times = bench.paired_rounds(step_fns, lambda n: [next(fetched) for _ in range(n)], warmup=1, steps=2, rounds=3)
    assert {name: len(samples) for name, samples in times.items()} == {"a": 3, "b": 3}
    order = [name for name, _ in calls]
    assert order == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    # In a round both loops step through the same batches, each batch once.
    assert [batch for name, batch in calls if name == "a"] == [batch for name, batch in calls if name == "b"]
    assert len({batch for name, batch in calls if name == "a"}) == 1 + 3 * 2
