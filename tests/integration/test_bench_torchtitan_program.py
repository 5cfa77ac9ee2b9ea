"""scripts/bench_torchtitan.py run as a program: torchtitan is not a dependency, so without it the script
stops with one sentence (before importing torch). Its torchtitan-free helpers: tests/unit/test_bench_torchtitan.py."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_torchtitan.py"


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan is installed here")
def test_without_torchtitan_it_says_so_in_one_sentence(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--torchtitan-path", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("torchtitan is not importable") and proc.stderr.count("\n") <= 1, proc.stderr
