"""scripts/bench_torchtitan.py: torchtitan is not a dependency, so without it the script stops with
one sentence (before importing torch), and its torchtitan-free helpers behave."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_torchtitan.py"


@pytest.mark.slow  # starts processes: the fast lane refuses it (tests/conftest.py)
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan is installed here")
def test_without_torchtitan_it_says_so_in_one_sentence(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--torchtitan-path", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("torchtitan is not importable") and proc.stderr.count("\n") <= 1, proc.stderr


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
