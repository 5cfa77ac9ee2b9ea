"""scripts/bench_serve.py --quick: the benchmark's own path (a model saved by transformers, titanlike-serve
in a process of its own, streamed openai clients, a warm-up request through the aiohttp client too, the
table) on a tiny model, so the script cannot rot.
transformers serve is left out here (it needs fastapi and uvicorn, and minutes); the full comparison's
figures are in docs/performance.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_serve_quick_prints_its_table():
    pytest.importorskip("openai")
    pytest.importorskip("psutil")
    pytest.importorskip("aiohttp")  # --client async (installed with datasets' fsspec[http])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_serve.py"), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:2] in (["1", "titanlike"],
                                                                                      ["2", "titanlike"])]
    assert len(rows) == 2 and all(float(row[2]) > 0 for row in rows), proc.stdout
    assert "peak resident memory: titanlike" in proc.stdout
