"""scripts/bench_compaction.py runs as a user runs it, small: both engines draw the same tokens (the
script asserts it), and compaction decodes fewer rows than the engine that keeps every row."""

from __future__ import annotations

import importlib.util
import re

from conftest import REPO


def test_bench_compaction_prints_fewer_rows_decoded_with_compaction(capsys):
    spec = importlib.util.spec_from_file_location("bench_compaction", REPO / "scripts" / "bench_compaction.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--rows", "16", "--prompts", "2", "--new-tokens", "24", "--mean-length", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    rows = {name: int(n) for name, n in re.findall(r"round 1 (compact|every row)\s.* (\d+) rows decoded", out)}
    assert set(rows) == {"compact", "every row"}, out
    assert rows["compact"] < rows["every row"], out
    assert re.search(r"compact / every row: [\d.]+x; median", out), out
