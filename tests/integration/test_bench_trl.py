"""scripts/bench_trl.py --quick: the benchmark's own path (the model exported for TRL, a titanlike process and a
TRL process each running SFT, LoRA and DPO, the table) on the tiny model, so the script cannot rot. About 20 s
on a quiet machine (two processes, two timed steps each, sequences of 128); the full comparison's figures are in
docs/performance.md."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_trl_quick_prints_its_table():
    pytest.importorskip("trl")  # peft and datasets come with it in the dev extras (pyproject.toml)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_trl.py"), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {(line.split()[0], line.split()[1]): line.split()[2:5] for line in proc.stdout.splitlines()
            if line.split()[:1] in (["sft"], ["lora"], ["dpo"])}
    assert set(rows) == {("sft", "trained_tokens/s"), ("lora", "trained_tokens/s"), ("dpo", "pairs/s"),
                         ("dpo", "step_s")}, proc.stdout
    for titanlike, trl, ratio in rows.values():
        figures = [float(titanlike), float(trl), float(ratio.rstrip("x"))]
        assert all(math.isfinite(f) and f > 0 for f in figures), proc.stdout
