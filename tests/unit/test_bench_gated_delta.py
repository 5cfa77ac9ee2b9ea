"""scripts/bench_gated_delta.py, ready for a GPU: its CPU run (--quick) checks every function against our
chunked form and prints finite figures, says why the FLA column is absent, and its check fails a function
that gets a convention wrong."""

import importlib.util
import math
import re
import sys
from pathlib import Path

import torch

from titanlike.models.common.gated_delta import chunk_gated_delta_rule

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gated_delta", REPO / "scripts" / "bench_gated_delta.py")
BENCH = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = BENCH
_spec.loader.exec_module(BENCH)

ROW = re.compile(r"^  (?P<name>ours chunked|ours recurrent|transformers chunked)\s+(?P<ms>\S+)\s+(?P<x>\S+)\s+"
                 r"(?P<diff>\S+)$")


def test_the_quick_cpu_run_checks_then_times_every_function(capsys):
    # ~1 s (transformers' module already imported by the suite's other files; ~3 s alone).
    assert BENCH.main(["--quick", "--device", "cpu", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "fla: not run: its Triton kernels need CUDA" in out
    tables = out.split("batch 1, seq 96")[1:]
    shape = ", 2 key / 4 value heads of 32, float32, cpu"
    assert [t.split(" (check")[0] for t in tables] == [f"{shape}, forward", f"{shape}, forward + backward"]
    for table in tables:
        rows = {m["name"]: m for m in map(ROW.match, table.splitlines()) if m}
        assert set(rows) == {"ours chunked", "ours recurrent", "transformers chunked"}, table
        for row in rows.values():
            assert math.isfinite(float(row["ms"])) and float(row["ms"]) > 0
            assert float(row["diff"]) <= 1e-3  # checked (outputs; gradients too in the second table)
        assert rows["ours chunked"]["x"] == "1.00"
    assert "MISMATCH" not in out


def test_the_check_fails_a_function_with_a_wrong_convention():
    torch.manual_seed(0)
    inputs = BENCH.make_inputs(1, 40, 2, 4, 16, "cpu", torch.float32)

    def ours(*x):
        return chunk_gated_delta_rule(*x, chunk_size=16)[0]

    def tiled_heads(q, k, v, g, beta):  # key head h serving value heads h, h + 2 (tiled), not 2h, 2h + 1
        return chunk_gated_delta_rule(q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1), v, g, beta, chunk_size=16)[0]

    def decay_not_log(q, k, v, g, beta):  # g given as the decay exp(g) rather than its log
        return chunk_gated_delta_rule(q, k, v, g.exp() - 1, beta, chunk_size=16)[0]

    functions = {BENCH.REFERENCE: ours, "same": lambda *x: ours(*x), "tiled": tiled_heads, "decay": decay_not_log}
    for backward in (False, True):
        diffs = BENCH.check(functions, inputs, backward=backward)
        assert diffs[BENCH.REFERENCE] == 0 and diffs["same"] == 0
        assert diffs["tiled"] > BENCH.TOLERANCE[torch.bfloat16] and diffs["decay"] > BENCH.TOLERANCE[torch.bfloat16]
    assert BENCH.max_difference(inputs[2] * 1.1, inputs[2]) > BENCH.TOLERANCE[torch.bfloat16]


def test_fla_is_left_out_with_a_reason_off_cuda():
    kernel, why = BENCH.fla_kernel(torch.device("cpu"))
    assert kernel is None and why == "its Triton kernels need CUDA"


def test_a_function_that_raises_is_a_row_of_the_table_not_the_end_of_the_run():
    inputs = BENCH.make_inputs(1, 32, 2, 4, 16, "cpu", torch.float32)

    def broken(*x):
        raise RuntimeError("no kernel for this shape\nmore detail")

    functions = {BENCH.REFERENCE: lambda *x: chunk_gated_delta_rule(*x, chunk_size=16)[0], "broken": broken}
    errors = {}
    diffs = BENCH.check(functions, inputs, backward=True, errors=errors)
    assert set(diffs) == {BENCH.REFERENCE} and errors == {"broken": "ERROR RuntimeError: no kernel for this shape"}
    seconds = BENCH.bench(functions, inputs, backward=True, rounds=1, timer=BENCH.Timer(torch.device("cpu")),
                          errors=errors)
    table = BENCH.format_table("title", seconds, diffs, errors, 1e-3)
    assert set(seconds) == {BENCH.REFERENCE}
    assert table.splitlines()[-1].split() == ["broken", "-", "-", "ERROR", "RuntimeError:", "no", "kernel", "for",
                                              "this", "shape"]
