"""scripts/bench_optimizers.py --quick: one short train.py run per optimizer (AdamW, Muon) on one
thread, reported paired by seed; the full run's figures are in docs/optimizers.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_reports_both_optimizers_paired(tmp_path):
    plot = tmp_path / "curves.png"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_optimizers.py"), "--quick", "--plot",
                          str(plot)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 0 |")]
    assert len(rows) == 1, run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    adamw, muon = float(cells[1]), float(cells[2])
    assert 0 < adamw < 9 and 0 < muon < 9  # ln(2,048 ids) is 7.6: a first few steps' loss near it
    assert "AdamW: " in run.stdout and "Muon: " in run.stdout  # CPU seconds per run
    assert "kept: AdamW lr 0.001, Muon lr 0.002" in run.stdout
    assert plot.stat().st_size > 0
