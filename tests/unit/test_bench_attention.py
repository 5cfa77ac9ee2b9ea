"""scripts/bench_attention.py, ready for a GPU: its CPU run (--quick, eager) checks every variant against the
float32 reference and prints finite figures, and the check fails a variant that computes the wrong thing."""

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_attention", REPO / "scripts" / "bench_attention.py")
BENCH = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = BENCH  # its dataclasses look their module up while the script runs
_spec.loader.exec_module(BENCH)


@pytest.fixture
def bench(monkeypatch):
    # Eager FlexAttention warns once per process; this test's record of it is dropped after
    # (test_document_mask.py expects the warning).
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set())
    return BENCH


ROW = re.compile(r"^  \((?P<key>[a-g])\) .{26}\s+(?P<fwd>\S+)\s+(?P<fwd_x>\S+)\s+(?P<bwd>\S+)\s+(?P<bwd_x>\S+)\s+"
                 r"(?P<peak>\S+)\s+(?P<out>\S+) / (?P<grad>\S+)")


def _rows(text: str) -> dict[str, dict]:
    return {m["key"]: m.groupdict() for m in map(ROW.match, text.splitlines()) if m}


def test_the_quick_cpu_run_checks_then_times_every_variant(bench, capsys):
    # ~1 s: gpt-oss's debug layer (window 16 and sinks, so every default variant runs) at 64 tokens.
    assert bench.main(["--quick", "--device", "cpu", "--no-compile", "--models", "gpt_oss:debugmodel",
                       "--seq-lens", "64", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 query / 2 key-value heads of 32, window 16, sinks" in out
    assert "the window covers 43.5% of full causal attention's (query, key) pairs" in out
    rows = _rows(out)
    assert set(rows) == set("abcde"), out
    for key, row in rows.items():
        assert math.isfinite(float(row["fwd"])) and float(row["fwd"]) > 0, out
        assert float(row["out"]) <= 1e-3, out  # the check ran and passed
        if key in "bc":  # FlexAttention has no backward on CPU: said, not timed
            assert row["bwd"] == "-" and row["grad"] == "-"
        else:
            assert math.isfinite(float(row["bwd"])) and float(row["grad"]) <= 1e-3, out
    assert rows["a"]["fwd_x"] == "1.00"
    assert "no backward: FlexAttention on CPU" in out and "MISMATCH" not in out


def test_a_variant_that_computes_the_wrong_attention_fails_the_run(bench, capsys, monkeypatch):
    # The mutant: the "window" variant attends to the whole causal past (the window forgotten).
    wrong = bench.Variant("(d) window, SDPA dense mask", bench.full_sdpa, True, False, False)
    monkeypatch.setitem(bench.VARIANTS, "window_sdpa", wrong)
    assert bench.main(["--quick", "--device", "cpu", "--no-compile", "--models", "gemma3:debugmodel",
                       "--seq-lens", "64", "--rounds", "1", "--variants", "sdpa,window_sdpa"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\(d\) window, SDPA dense mask .* MISMATCH", out), out
    assert "FAILED" in out


def test_the_checker_measures_a_perturbed_tensor():
    bench = BENCH
    want = torch.randn(2, 4, 8, 16)
    assert bench.max_difference(want.clone(), want) == 0
    for dtype, tol in bench.TOLERANCE.items():
        assert bench.max_difference(want.to(dtype), want) <= tol  # the dtype's own rounding passes
        assert bench.max_difference(want * 1.1, want) > tol  # a 10% error fails
    assert bench.window_work_fraction(8, 16) == 1.0
    assert bench.window_work_fraction(4, 2) == pytest.approx(7 / 10)  # 1 + 2 + 2 + 2 of 1 + 2 + 3 + 4 pairs


def test_a_model_without_a_sliding_layer_is_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as e:
        BENCH.parse_args(["--device", "cpu", "--models", "llama3:debugmodel"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --models llama3:debugmodel: the model has no sliding-window attention layer" in err


def test_a_variant_that_raises_is_a_row_of_the_table_and_the_others_still_run(bench, capsys, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this shape\nmore detail")

    monkeypatch.setitem(bench.VARIANTS, "window_sdpa", bench.Variant("(d) window, SDPA dense mask", broken,
                                                                     True, False, False))
    assert bench.main(["--quick", "--device", "cpu", "--no-compile", "--models", "gemma3:debugmodel",
                       "--seq-lens", "64", "--rounds", "1", "--variants", "sdpa,window_sdpa"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("  (d)"))
    assert row.endswith("(check: ERROR RuntimeError: no kernel for this shape)") and "MISMATCH" not in row, out
    assert math.isfinite(float(_rows(out)["a"]["bwd"]))
